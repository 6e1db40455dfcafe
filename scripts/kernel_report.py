"""Compile the statistics kernels for sm90 here (no GPU needed) and report what each
launch config costs: shared memory, registers, spills, programs per SM, and the
instructions of one iteration of the unmasked inner loop, with a static floor.

    PYTHONPATH=src python scripts/kernel_report.py [--json out.json] [--sweep]

Triton's own ptxas and nvdisasm (shipped in its wheel) build and disassemble the
kernels for an H100 / H200 target: a stand-in driver answers "sm90" instead of a GPU.
The floor per score tile and SM is the largest of its tensor-core time (2 BM BN E
bf16 FLOP at 4096 per clock), its exp2 time (16 per clock) and its issue time (4
schedulers, one instruction per clock); the whole-shape floor multiplies it by the
tiles per SM of (8, 16, 8192, 128) dense at 1.98 GHz. A floor, not a prediction: it
ignores latency, memory and how well the tiles' stages overlap (the device measures
that: scripts/gpu_check/gpu_bench.py).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (before triton imports)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from sdpa.kernels import configs

SHAPE = (8, 16, 8192, 128)  # the acceptance shape: tiles per SM from it
SMS, CLOCK_HZ = 132, 1.98e9  # an H200 SXM as KINDS.md read it
SMEM_PER_SM, REGS_PER_SM, WARPS_PER_SM = 228 * 1024, 65536, 64
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ALU = ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FCHK")


class _Sm90:
    """The stand-in driver: every question about the device answers an sm90 GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compiled(jit_fn, call: Callable[[], object]):
    """Run `call` (a public wrapper on CPU tensors) with `jit_fn` compiled, not launched;
    returns the compiled kernel. The wrappers' checks pass CPU tensors here as they do
    under the interpreter (nothing runs on them)."""
    import sdpa.kernels.launch as launch

    got = []
    real_run, real_checked = jit_fn.run, launch.checked

    def run(*args, grid, warmup, **kwargs):
        got.append(real_run(*args, grid=grid, warmup=True, **kwargs))
        return got[-1]

    def checked(*args, **kwargs):
        with mock.patch.object(launch, "interpreting", lambda: True):
            return real_checked(*args, **kwargs)

    jit_fn.run = run
    module = sys.modules[jit_fn.fn.__module__]
    try:
        with mock.patch.object(module, "checked", checked, create=True):
            call()
    finally:
        jit_fn.run = real_run
    return got[0]


def _tool(name: str, *args: str) -> str:
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True).stdout


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (a label up to a branch back to it), in order."""
    lines = sass.splitlines()
    labels = {
        m.group(1): n for n, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))
    }
    found = []
    for n, line in enumerate(lines):
        m = re.search(r"BRA `?\(?(\.L_x_\d+)\)?", line)
        if m and m.group(1) in labels and labels[m.group(1)] < n:
            body = lines[labels[m.group(1)] : n + 1]
            ops = re.findall(
                r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", "\n".join(body), re.M
            )
            found.append(collections.Counter(ops))
    return found


def report(name: str, kernel, cfg: configs.Config, head: int, causal: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = _tool("cuobjdump", "--dump-resource-usage", str(cubin))
        sass = _tool("nvdisasm", "-c", str(cubin))
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    spill = int(re.search(r"LOCAL:(\d+)", usage).group(1)) + int(
        re.search(r"STACK:(\d+)", usage).group(1)
    )
    shared = kernel.metadata.shared
    warps = kernel.metadata.num_warps
    threads = 32 * warps
    per_sm = min(
        SMEM_PER_SM // (shared + 1024),
        REGS_PER_SM // (((regs + 7) // 8 * 8) * threads),
        WARPS_PER_SM // warps,
        32,
    )
    # the unmasked loop: of the loops with a matrix product, the one with least work
    body = [b for b in loops(sass) if any(k.startswith("HGMMA") for k in b)]
    hot = min(body, key=lambda b: sum(b.values())) if body else collections.Counter()
    count = lambda *names: sum(v for k, v in hot.items() if k.startswith(names))  # noqa: E731
    tile = cfg.block_m * cfg.block_n
    instr = sum(hot.values())
    tensor_clk = 2 * tile * head / 4096
    exp_clk = count("MUFU.EX2") * threads / 16
    issue_clk = instr * warps / 4
    floor = max(tensor_clk, exp_clk, issue_clk)
    B, H, L, _ = SHAPE
    tiles = B * H * L * L / tile / (2 if causal else 1)
    return {
        "kernel": name,
        "causal": causal,
        "config": cfg._asdict(),
        "shared_bytes": shared,
        "registers": regs,
        "spill_bytes": spill,
        "programs_per_sm": per_sm,
        "loop_instructions_per_thread": instr,
        "loop_hgmma": count("HGMMA"),
        "loop_exp2": count("MUFU.EX2"),
        "loop_fp32_alu": count(*ALU),
        "loop_shuffles": count("SHFL"),
        "loop_barriers": count("BAR"),
        "alu_per_score": round(count(*ALU) * threads / tile, 2),
        "clk_per_tile": {"tensor": tensor_clk, "exp2": exp_clk, "issue": issue_clk},
        "floor_ms_big_shape": round(tiles / SMS * floor / CLOCK_HZ * 1e3, 3),
    }


def kernels_to_compile(sweep: bool) -> list[tuple[str, object, Callable, list]]:
    """(name, jit function, call(cfg, causal), configs) for each kernel."""
    from sdpa.kernels import entropy, logits, received, stats

    B, H, L, E = 1, 1, SHAPE[2], SHAPE[3]
    q = torch.randn(B, H, L, E, dtype=torch.bfloat16)
    k = torch.randn(B, H, L, E, dtype=torch.bfloat16)
    lse = torch.zeros(B, H, L)

    def under(cfg, fn):
        with configs.use(cfg):
            return fn()

    alternatives = [
        configs.Config(*c)
        for c in (
            (128, 64, 4, 3),
            (128, 64, 4, 3, True),
            (128, 128, 8, 3),
            (128, 128, 8, 3, True),
            (64, 128, 4, 3),
            (64, 128, 4, 3, True),
            (128, 64, 8, 3),
            (128, 32, 4, 4),
        )
    ]
    pinned = lambda name: configs.SM90[name][0]  # noqa: E731
    todo = [
        (
            "entropy_and_max",
            entropy._entropy_and_max,
            lambda c, causal: under(
                c, lambda: entropy.entropy_and_max(q, k, lse, causal=causal, scale=0.1)
            ),
            "entropy",
        ),
        (
            "received",
            received._received,
            lambda c, causal: under(
                c, lambda: received.received(q, k, lse, causal=causal, scale=0.1)
            ),
            "received",
        ),
        (
            "max_logits",
            logits._max_logits,
            lambda c, causal: under(c, lambda: logits.max_logits(q, k, causal=causal, scale=0.1)),
            "max_logits",
        ),
    ]
    out = []
    for name, fn, call, key in todo:
        cfgs = [pinned(key)] + ([c for c in alternatives if c != pinned(key)] if sweep else [])
        out.append((name, fn, call, cfgs))
    # the kernel these replace, at its own config, for comparison
    old = stats._config(q, E)
    out.append(
        (
            "forward_stats (stats only, before)",
            stats._forward_stats,
            lambda c, causal: stats.forward_stats(q, k, None, causal=causal, scale=0.1),
            [configs.Config(*old)],
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--sweep", action="store_true", help="also compile alternative tiles")
    args = parser.parse_args(argv)
    driver.set_active(_Sm90())
    rows = []
    for name, fn, call, cfgs in kernels_to_compile(args.sweep):
        for cfg in cfgs:
            for causal in (False, True):
                try:
                    kernel = compiled(fn, functools.partial(call, cfg, causal))
                    rows.append(report(name, kernel, cfg, SHAPE[3], causal))
                except Exception as e:  # a config that does not compile: say so, go on
                    rows.append(
                        {
                            "kernel": name,
                            "causal": causal,
                            "config": cfg._asdict(),
                            "error": f"{type(e).__name__}: {str(e)[:200]}",
                        }
                    )
    print(
        f"sm90 builds (triton {triton.__version__}), head {SHAPE[3]}, bf16; floor at "
        f"{SHAPE} on {SMS} SMs at {CLOCK_HZ / 1e9} GHz"
    )
    print(
        f"{'kernel':<36} {'mask':<6} {'BMxBN/w/st':<14} {'smem KiB':>8} {'regs':>5} "
        f"{'spill':>5} {'prog/SM':>7} {'alu/score':>9} {'exp2':>5} {'floor ms':>8}"
    )
    for r in rows:
        c = r["config"]
        tile = f"{c['block_m']}x{c['block_n']}/{c['warps']}/{c['stages']}"
        tile += "/p" if c.get("pipelined") else ""
        mask = "causal" if r["causal"] else "dense"
        if "error" in r:
            print(f"{r['kernel']:<36} {mask:<6} {tile:<14} {r['error']}")
            continue
        print(
            f"{r['kernel']:<36} {mask:<6} {tile:<14} {r['shared_bytes'] / 1024:>8.0f} "
            f"{r['registers']:>5} {r['spill_bytes']:>5} {r['programs_per_sm']:>7} "
            f"{r['alu_per_score']:>9} {r['loop_exp2']:>5} {r['floor_ms_big_shape']:>8}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"triton": triton.__version__, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
