"""Core benchmark: sdpa.attention against its peers, side by side in one process.

Each comparison pairs our call with a peer's and times them interleaved (A B A B ...)
so drift hits both alike; it reports medians, the ratio ours / peer, GFLOP/s
(forward 4*B*H*L*S*E) and the peak memory of one call, measured in a fresh
subprocess per case (the rise of ru_maxrss over a baseline taken after the inputs
exist). No autograd.

    python benchmarks/bench_core.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import sdpa
from sdpa import listing

SHAPES = {"text": (1, 8, 4, 32), "unet": (1, 4, 4096, 32)}  # (B, H, L, E), from the seed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ours_forward(q, k, v):
    return sdpa.attention(q, k, v).output


def _ours_with_weights(q, k, v):
    out, w = sdpa.attention(q, k, v)
    return out, w.full()


IMPLS = {
    "sdpa.attention": _ours_forward,
    "F.scaled_dot_product_attention": F.scaled_dot_product_attention,
    "sdpa.attention + weights.full()": _ours_with_weights,
    "listing (output + p_attn)": listing.attention,
}
# (ours, peer, target ratio per shape): what the issue asks of each comparison
COMPARISONS = [
    ("sdpa.attention", "F.scaled_dot_product_attention", {"text": 3.0, "unet": 1.05}),
    ("sdpa.attention + weights.full()", "listing (output + p_attn)", {"unet": 0.6}),
]


def make_inputs(shape, dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(3)]


def time_once(fn, args, inner):
    start = time.perf_counter()
    for _ in range(inner):
        fn(*args)
    return (time.perf_counter() - start) / inner


def peak_mib(case: str, dtype: str, impl: str) -> float:
    """Peak memory of one call, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, __file__, "--peak", case, dtype, impl],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def _peak_rss_kib() -> int:
    """Peak resident set of this process, KiB. Linux carries ru_maxrss across fork and
    exec (a child starts at its parent's size), so read this process's own VmHWM."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _measure_peak(case: str, dtype: str, impl: str) -> None:
    args = make_inputs(SHAPES[case], DTYPES[dtype])
    before = _peak_rss_kib()
    with torch.no_grad():
        IMPLS[impl](*args)
    print((_peak_rss_kib() - before) / 1024)


def run(quick: bool, memory: bool) -> list[dict]:
    results = []
    for case, shape in SHAPES.items():
        B, H, L, E = shape
        flop = 4 * B * H * L * L * E
        small = L * L < 10_000
        inner = 200 if small else 1
        reps = (30 if small else 5) if quick else (100 if small else 15)
        for dname, dtype in DTYPES.items():
            args = make_inputs(shape, dtype)
            for ours, peer, targets in COMPARISONS:
                if case not in targets:
                    continue
                times = {ours: [], peer: []}
                with torch.no_grad():
                    for name in times:  # warm up
                        time_once(IMPLS[name], args, inner)
                    for _ in range(reps):
                        for name in times:
                            times[name].append(time_once(IMPLS[name], args, inner))
                med = {n: statistics.median(t) for n, t in times.items()}
                for name in (ours, peer):
                    row = {
                        "case": case,
                        "shape": list(shape),
                        "dtype": dname,
                        "impl": name,
                        "peer": peer if name == ours else None,
                        "median_ms": med[name] * 1e3,
                        "gflops": flop / med[name] / 1e9,
                        "ratio": med[name] / med[peer],
                        "target": targets[case] if name == ours else None,
                        "reps": reps,
                        "calls_per_rep": inner,
                        "peak_mib": peak_mib(case, dname, name) if memory else None,
                    }
                    results.append(row)
                    print(_format(row), flush=True)
    return results


def _format(row: dict) -> str:
    target = "" if row["target"] is None else f"  target <= {row['target']}x"
    verdict = (
        "" if row["target"] is None else ("  met" if row["ratio"] <= row["target"] else "  MISSED")
    )
    mem = "" if row["peak_mib"] is None else f"{row['peak_mib']:8.1f} MiB"
    return (
        f"{row['case']:5} {row['dtype']:9} {row['impl']:32} {row['median_ms']:9.3f} ms "
        f"{row['gflops']:7.1f} GFLOP/s  {mem}  x{row['ratio']:.3f}{target}{verdict}"
    )


def markdown(results: list[dict]) -> str:
    """The README's table: one line per comparison (ours beside its peer)."""
    peers = {(r["case"], r["dtype"], r["impl"]): r for r in results if r["peer"] is None}
    lines = [
        "| case (B, H, L, E) | dtype | ours | peer | ours ms | peer ms | ratio | target "
        "| peak MiB ours / peer |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["peer"] is None:
            continue
        p = peers[(r["case"], r["dtype"], r["peer"])]
        missed = "" if r["ratio"] <= r["target"] else " (missed)"
        mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f} / {p['peak_mib']:.0f}"
        lines.append(
            f"| {r['case']} {tuple(r['shape'])} | {r['dtype']} | `{r['impl']}` | `{r['peer']}` "
            f"| {r['median_ms']:.3g} | {p['median_ms']:.3g} | {r['ratio']:.3f} "
            f"| <= {r['target']}{missed} | {mem} |"
        )
    return "\n".join(lines)


def environment() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sdpa": sdpa.__version__,
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    parser.add_argument("--json", help="write results and environment here")
    parser.add_argument("--markdown", help="print the table of an earlier --json run and exit")
    parser.add_argument(
        "--peak", nargs=3, metavar=("CASE", "DTYPE", "IMPL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.peak:
        _measure_peak(*args.peak)
        return 0
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)["results"]))
        return 0
    env = environment()
    print(f"environment: {env}")
    results = run(args.quick, memory=not args.no_memory)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
