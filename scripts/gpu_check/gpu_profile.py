"""Where the host time of one small attention call goes: the first step of gpu_check.

    PYTHONPATH=src python3 scripts/gpu_check/gpu_profile.py [--device cuda] [--calls 1000]
        [--json out]

At the seed's text shape (1, 8, 4, 32) bf16 the GPU work is a few microseconds, so a
call costs what Python and torch's dispatch spend preparing it. This times `calls`
back-to-back calls of sdpa.attention and of torch's F.scaled_dot_product_attention
(one synchronize at the end: host time per call, while the host is the bottleneck),
then runs cProfile over the same calls of sdpa.attention and prints its top entries
by own time, and torch.profiler over a few calls for the ops and kernels each launches.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch
import torch.nn.functional as F

SHAPE = (1, 8, 4, 32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn, calls: int, device: torch.device) -> float:
    """Microseconds per call of `calls` back-to-back calls, synchronised once."""
    for _ in range(20):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def top_entries(fn, calls: int, limit: int) -> list[dict]:
    """cProfile's top `limit` functions by own time over `calls` calls of fn."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = path.split("/site-packages/")[-1].split("/src/")[-1]
        rows.append(
            {
                "function": f"{where}:{line}({name})",
                "calls_per_call": ncalls / calls,
                "own_us_per_call": tottime / calls * 1e6,
                "cum_us_per_call": cumtime / calls * 1e6,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_call"])
    return rows[:limit]


def torch_ops(fn, calls: int, device: torch.device, limit: int) -> list[dict]:
    """torch.profiler's ops (and kernels on CUDA) per call, by host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    rows = []
    for e in prof.key_averages():
        rows.append(
            {
                "op": e.key,
                "count_per_call": e.count / calls,
                "host_us_per_call": e.self_cpu_time_total / calls,
                "device_us_per_call": getattr(e, "self_device_time_total", 0.0) / calls,
            }
        )
    rows.sort(key=lambda r: -r["host_us_per_call"])
    return rows[:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (dry run)")
    parser.add_argument("--calls", type=int, default=1000, help="calls timed and profiled")
    parser.add_argument("--top", type=int, default=12, help="entries printed")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_profile.py --device cuda: torch.cuda.is_available() is False here")
    import sdpa

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(SHAPE, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3)
    )
    ours = lambda: sdpa.attention(q, k, v).output  # noqa: E731
    theirs = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    times = {
        "ours_us": host_us(ours, args.calls, device),
        "torch_us": host_us(theirs, args.calls, device),
    }
    times["ratio"] = times["ours_us"] / times["torch_us"]
    top = top_entries(ours, args.calls, args.top)
    ops = torch_ops(ours, max(1, args.calls // 50), device, args.top)
    print(
        f"profile: sdpa.attention at {SHAPE} bf16 on {device}: {times['ours_us']:.1f} us per "
        f"call, torch F.sdpa {times['torch_us']:.1f} us ({times['ratio']:.2f}x)"
    )
    print(f"  cProfile over {args.calls} calls, top by own time (us per call):")
    for r in top:
        print(
            f"  {r['own_us_per_call']:8.2f} own {r['cum_us_per_call']:8.2f} cum "
            f"{r['calls_per_call']:5.1f}x  {r['function']}"
        )
    print("  torch.profiler ops per call (host us, device us):")
    for r in ops:
        print(
            f"  {r['host_us_per_call']:8.2f} {r['device_us_per_call']:8.2f} "
            f"{r['count_per_call']:5.1f}x  {r['op']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "shape": SHAPE,
                    "device": str(device),
                    **times,
                    "cprofile_top": top,
                    "torch_ops": ops,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
