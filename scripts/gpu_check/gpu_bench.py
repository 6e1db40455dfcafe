"""GPU benchmark: sdpa against torch's SDPA, the op torch picks and what its LSE costs,
and the single-pass statistics kernels against our forward, as one table.

    PYTHONPATH=src python3 scripts/gpu_check/gpu_bench.py [--reps 15] [--flex] [--json out.json]
    PYTHONPATH=src TRITON_INTERPRET=1 python3 scripts/gpu_check/gpu_bench.py --dry-run   # CPU

bf16, the seed's shapes (1, 8, 4, 32) text and (1, 4, 4096, 32) U-Net and
(8, 16, 8192, 128), dense and causal. Each case times its contenders interleaved
(A B C A B C ...), each call between CUDA events, and reports medians and ratios:
- forward: ours / F.scaled_dot_product_attention (torch's default backend), optionally
  ours / compiled flex_attention, against the issue's targets;
- torch's op: which one torch._fused_sdp_choice picks, and that op returning its LSE
  against F.sdpa (the LSE's cost: what our forward pays for the weights);
- statistics at (8, 16, 8192, 128): entropy + max, received per key and max logits
  (sdpa.kernels) against our forward (target <= 0.85) and our Triton forward (<= 0.6),
  with the kernel they replace (forward_stats, statistics only) for comparison, each
  checked against an independent answer (the chunked engine; torch for max logits).
--dry-run: the same steps on CPU at tiny sizes (host timers; kernels interpreted when
TRITON_INTERPRET=1), to check the script runs; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [
    ("text (1, 8, 4, 32)", (1, 8, 4, 32), 1.5),
    ("U-Net (1, 4, 4096, 32)", (1, 4, 4096, 32), 1.15),
    ("(8, 16, 8192, 128)", (8, 16, 8192, 128), 1.05),
]
STATS_SHAPE = (8, 16, 8192, 128)
DRY_SHAPES = [
    ("text (1, 8, 4, 32)", (1, 8, 4, 32), 1.5),
    ("dry (1, 1, 40, 32)", (1, 1, 40, 32), 1.15),
]
DRY_STATS_SHAPE = (1, 1, 40, 32)
STATS_TARGET = {"ours forward": 0.85, "triton forward": 0.6}
NEW = ("entropy_and_max", "received", "max_logits")


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, device: torch.device
) -> dict[str, float]:
    """Median ms of each callable, timed A B C A B C ... so drift hits all alike."""
    for fn in fns.values():
        for _ in range(min(3, reps)):  # warm-up: compiles, caches
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(time_ms(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def flex_runner(q, k, v, causal: bool) -> tuple[Callable[[], object] | None, str]:
    """Compiled flex_attention for these inputs, or (None, why not)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if causal:
            L, S = q.shape[-2], k.shape[-2]
            block_mask = create_block_mask(
                lambda b, h, qi, kj: qi >= kj, None, None, L, S, device=q.device
            )
        fn = lambda: flex(q, k, v, block_mask=block_mask)  # noqa: E731
        fn()  # compile now, so a failure is reported here
        return fn, ""
    except Exception as e:  # any failure to compile or run: report it, keep going
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def _by_name(op, **kwargs):
    """Call an aten op with the keyword arguments its schema has (they vary by version)."""
    names = {a.name for a in op.default._schema.arguments}
    return op.default(**{n: x for n, x in kwargs.items() if n in names})


def torch_op(q, k, v, causal: bool) -> tuple[str, Callable[[], object] | None]:
    """(name of the op torch's SDPA picks, a call of that op that returns the LSE)."""
    SDP = torch.nn.attention.SDPBackend
    try:
        picked = SDP(int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))).name
    except Exception as e:  # a torch without the private chooser: say so
        return f"unknown ({type(e).__name__})", None
    aten = torch.ops.aten
    common = {"query": q, "key": k, "value": v, "dropout_p": 0.0, "is_causal": causal}
    if q.device.type == "cpu":
        return picked, lambda: aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal
        )
    if picked == "FLASH_ATTENTION":  # the flash op always writes its LSE
        return picked, lambda: _by_name(
            aten._scaled_dot_product_flash_attention, return_debug_mask=False, **common
        )
    if picked == "CUDNN_ATTENTION":
        return picked, lambda: _by_name(
            aten._scaled_dot_product_cudnn_attention,
            attn_bias=None,
            compute_log_sumexp=True,
            return_debug_mask=False,
            **common,
        )
    if picked == "EFFICIENT_ATTENTION":
        return picked, lambda: _by_name(
            aten._scaled_dot_product_efficient_attention,
            attn_bias=None,
            compute_log_sumexp=True,
            **common,
        )
    return picked, None


def forward_rows(shapes, reps: int, use_flex: bool, device: torch.device, rows: list[dict]) -> None:
    """Append one row per shape and mask to `rows` (kept if interrupted)."""
    import sdpa

    for label, shape, target in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3)
        )
        for causal in (False, True):
            fns = {
                "ours": lambda: sdpa.attention(q, k, v, causal=causal).output,  # noqa: B023
                "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),  # noqa: B023
            }
            picked, with_lse = torch_op(q, k, v, causal)
            if with_lse is not None:
                fns["torch op + LSE"] = with_lse
            flex, why = flex_runner(q, k, v, causal) if use_flex else (None, "not asked (--flex)")
            if flex is not None:
                fns["flex"] = flex
            err = (fns["ours"]() - fns["torch"]()).abs().max().item()
            ms = interleaved(fns, reps, device)
            rows.append(
                {
                    "shape": label,
                    "mask": "causal" if causal else "dense",
                    **ms,
                    "ours/torch": ms["ours"] / ms["torch"],
                    "target": target,
                    "torch_op": picked,
                    "lse_cost": ms["torch op + LSE"] / ms["torch"] if with_lse else None,
                    "flex_note": why,
                    "max_abs_diff": err,
                }
            )
            print(f"done: {rows[-1]}", flush=True)  # a timeout still leaves what was measured


def _other_loop(kernel: str, q: torch.Tensor):
    """The config `kernel` launches with here, with the other form of its unmasked loop."""
    from sdpa.kernels import configs
    from sdpa.kernels.launch import block, interpreting

    cfg = configs.pick(kernel.split("_")[0], q.dtype, block(q.shape[-1]), interpreting())
    return cfg._replace(pipelined=not cfg.pipelined)


def _under(cfg, fn, *args, **kwargs):
    from sdpa.kernels import configs

    with configs.use(cfg):
        return fn(*args, **kwargs)


def _chunked(fn):
    from sdpa import weights

    with weights.chunked_engine():
        return fn()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def stats_rows(shape, reps: int, device: torch.device, rows: list[dict], checks: list[dict]
               ) -> None:  # fmt: skip
    """Append the timings and checks of the statistics kernels at `shape`, dense and
    causal, to `rows` and `checks` (kept if interrupted)."""
    from sdpa import kernels

    why = kernels.unsupported(torch.empty(1, 1, 1, 16, device=device), torch.empty(1, 1, 1, 16))
    if why is None and device.type == "cpu":
        from sdpa.kernels.launch import interpreting

        why = None if interpreting() else "on CPU the kernels need TRITON_INTERPRET=1"
    if why is not None:
        rows.append({"what": f"Triton statistics not timed: {why}"})
        return
    import sdpa
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received
    from sdpa.kernels.stats import forward_stats

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3)
    )
    scale = shape[-1] ** -0.5
    for causal in (False, True):
        mask = "causal" if causal else "dense"
        w = sdpa.attention(q, k, v, causal=causal).weights
        lse = w.lse
        kw = {"causal": causal, "scale": scale}
        fns = {
            "ours forward": lambda: sdpa.attention(q, k, v, causal=causal).output,  # noqa: B023
            "triton forward": lambda: forward_stats(q, k, v, stats=False, **kw),  # noqa: B023
            "before: forward_stats entropy + max": lambda: forward_stats(q, k, None, **kw),  # noqa: B023
            "entropy_and_max": lambda: entropy_and_max(q, k, lse, **kw),  # noqa: B023
            "received": lambda: received(q, k, lse, **kw),  # noqa: B023
            "max_logits": lambda: max_logits(q, k, **kw),  # noqa: B023
        }
        for name, fn in (("entropy_and_max", entropy_and_max), ("received", received)):
            # the pinned config's other loop form, for comparison (the pin stays)
            alt = _other_loop(name, q)
            label = f"{name} ({'pipelined' if alt.pipelined else 'not pipelined'})"
            fns[label] = functools.partial(_under, alt, fn, q, k, lse, **kw)
        ms = interleaved(fns, reps, device)
        print(f"done: statistics {mask} {ms}", flush=True)
        for name, t in ms.items():
            rows.append(
                {
                    "what": name,
                    "mask": mask,
                    "ms": t,
                    "vs_ours_forward": t / ms["ours forward"],
                    "vs_triton_forward": t / ms["triton forward"],
                }
            )
        # each new kernel against an independent answer
        ent, top = entropy_and_max(q, k, lse, **kw)
        ref_ent, ref_top, ref_sum = _chunked(lambda: (w.entropy(), w.amax(-1), w.sum(dim=-2)))  # noqa: B023
        rows_max, _ = max_logits(q, k, **kw)
        s = q[0].float() @ k[0].float().mT * scale  # (H, L, S) of batch 0
        if causal:
            s = s.masked_fill(
                ~torch.ones(s.shape[-2:], dtype=torch.bool, device=device).tril(), -torch.inf
            )
        new = [
            {
                "what": "entropy_and_max: entropy",
                "mask": mask,
                "vs": "chunked engine",
                "max_abs_err": _max_err(ent, ref_ent),
                "tol": 1e-3,
            },
            {
                "what": "entropy_and_max: max",
                "mask": mask,
                "vs": "chunked engine",
                "max_abs_err": _max_err(top, ref_top),
                "tol": 1e-4,
            },
            {
                "what": "received",
                "mask": mask,
                "vs": "chunked engine",
                "max_abs_err": _max_err(received(q, k, lse, **kw), ref_sum),
                "tol": 1e-3 * max(1.0, ref_sum.abs().max().item()),
            },
            {
                "what": "max_logits",
                "mask": mask,
                "vs": "torch, batch 0",
                "max_abs_err": _max_err(rows_max[0], s.amax(-1)),
                "tol": 1e-3,
            },
        ]
        checks.extend({**c, "ok": c["max_abs_err"] <= c["tol"]} for c in new)
        del s


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def table(fwd: list[dict], stats: list[dict], checks: list[dict], stats_shape) -> str:
    lines = [
        f"{'bf16 forward':<28} {'mask':<7} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} "
        f"{'target':>7} {'torch op':<20} {'LSE cost':>8}"
    ]
    for r in fwd:
        lse = f"{r['lse_cost']:.3f}x" if r["lse_cost"] is not None else "n/a"
        ok = "ok" if r["ours/torch"] <= r["target"] else "OVER"
        lines.append(
            f"{r['shape']:<28} {r['mask']:<7} {r['ours']:>9.3f} {r['torch']:>9.3f} "
            f"{r['ours/torch']:>10.3f} {r['target']:>5.2f} {ok:<4} {r['torch_op']:<16} {lse:>8}"
            + (f"  flex {r['ours'] / r['flex']:.3f}x" if r.get("flex") else "")
        )
    lines.append("")
    lines.append(
        f"{'statistics, bf16 ' + 'x'.join(map(str, stats_shape)):<38} {'mask':<7} {'ms':>9} "
        f"{'/ours fwd':>10} {'/triton fwd':>11}"
    )
    for r in stats:
        if "ms" not in r:
            lines.append(r["what"])
            continue
        ok = ""
        if r["what"] in NEW:
            good = (
                r["vs_ours_forward"] <= STATS_TARGET["ours forward"]
                and r["vs_triton_forward"] <= STATS_TARGET["triton forward"]
            )
            ok = "ok" if good else "OVER"
        lines.append(
            f"{r['what']:<38} {r['mask']:<7} {r['ms']:>9.3f} {r['vs_ours_forward']:>10.3f} "
            f"{r['vs_triton_forward']:>11.3f} {ok}"
        )
    lines.append("targets: each statistic <= 0.85 x ours forward and <= 0.6 x triton forward")
    for c in checks:
        lines.append(
            f"check {c['what']:<28} {c['mask']:<7} vs {c['vs']:<16} "
            f"max err {c['max_abs_err']:.2e} (tol {c['tol']:.0e}) "
            f"{'ok' if c['ok'] else 'FAIL'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed calls per contender")
    parser.add_argument("--flex", action="store_true", help="also time compiled flex_attention")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny sizes: runs, means nothing"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(
            "gpu_bench.py needs a CUDA device and torch.cuda.is_available() is False here; "
            "run it on the GPU machine (scripts/gpu_check.sh), or pass --dry-run"
        )
    shapes, stats_shape = (DRY_SHAPES, DRY_STATS_SHAPE) if args.dry_run else (SHAPES, STATS_SHAPE)
    reps = 1 if args.dry_run else args.reps
    env = environment(device)
    out = {"env": env, "dry_run": args.dry_run}

    def save():  # after each part: a timeout keeps what was measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    out["forward"], out["statistics"], out["checks"] = [], [], []
    try:
        forward_rows(shapes, reps, args.flex, device, out["forward"])
        save()
        stats_rows(stats_shape, reps, device, out["statistics"], out["checks"])
    except KeyboardInterrupt:  # gpu_check's time limit: keep and print what was measured
        out["interrupted"] = True
        print("interrupted: the rows measured so far follow", flush=True)
    save()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(table(out["forward"], out["statistics"], out["checks"], stats_shape))
    return 0 if all(c["ok"] for c in out["checks"]) and not out.get("interrupted") else 1


if __name__ == "__main__":
    sys.exit(main())
