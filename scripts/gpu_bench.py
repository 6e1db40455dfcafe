"""GPU benchmark: sdpa's fused CUDA path against torch's SDPA and FlexAttention, and
the cost of the Triton statistics, printed as one table last.

    PYTHONPATH=src python3 scripts/gpu_bench.py [--reps 20] [--no-flex] [--json out.json]

bf16, (B, H, L, E) = (8, 16, 8192, 128) and the seed's shapes (1, 8, 4, 32) text and
(1, 4, 4096, 32) U-Net, dense and causal. Each case times its contenders interleaved
(A B C A B C ...), each call between CUDA events, and reports medians and ratios:
ours / F.scaled_dot_product_attention (torch's default backend) and ours / compiled
flex_attention. The statistics rows time the Triton kernels on the big shape: the
forward with entropy and row max against the same forward without them, and received
attention per key against our forward.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [("(8, 16, 8192, 128)", (8, 16, 8192, 128)), ("seed text (1, 8, 4, 32)", (1, 8, 4, 32)),
          ("seed U-Net (1, 4, 4096, 32)", (1, 4, 4096, 32))]  # fmt: skip
STATS_SHAPE = (8, 16, 8192, 128)


def time_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 3) -> dict:
    """Median ms of each callable, timed A B C A B C ... so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(time_ms(fn))
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


def _forward_fns(q, k, v, causal: bool) -> dict[str, Callable[[], object]]:
    import sdpa

    return {
        "ours": lambda: sdpa.attention(q, k, v, causal=causal).output,
        "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }


def forward_rows(reps: int, use_flex: bool) -> list[dict]:
    rows = []
    for label, shape in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)
        )
        for causal in (False, True):
            fns = _forward_fns(q, k, v, causal)
            flex, why = flex_runner(q, k, v, causal) if use_flex else (None, "--no-flex")
            if flex is not None:
                fns["flex"] = flex
            err = (fns["ours"]() - fns["torch"]()).abs().max().item()
            ms = interleaved(fns, reps)
            mask = "causal" if causal else "dense"
            rows.append({"shape": label, "mask": mask, **ms, "flex_note": why, "max_abs_diff": err})
            print(f"done: {rows[-1]}", flush=True)  # a timeout still leaves what was measured
    return rows


def _stats_fns(q, k, v, causal: bool) -> dict[str, Callable[[], object]]:
    import sdpa
    from sdpa.kernels.received import received
    from sdpa.kernels.stats import forward_stats

    scale = q.shape[-1] ** -0.5
    lse = sdpa.attention(q, k, v, causal=causal).weights.lse
    kw = {"causal": causal, "scale": scale}
    return {
        "ours forward": lambda: sdpa.attention(q, k, v, causal=causal).output,
        "triton forward": lambda: forward_stats(q, k, v, stats=False, **kw),
        "triton forward + entropy + max": lambda: forward_stats(q, k, v, **kw),
        "triton entropy + max only": lambda: forward_stats(q, k, None, **kw),
        "triton received per key": lambda: received(q, k, lse, **kw),
    }


def _chunked_fns(q, k, v, causal: bool) -> dict[str, Callable[[], object]]:
    import sdpa

    w = sdpa.attention(q, k, v, causal=causal).weights
    return {
        "entropy without Triton (P.K call)": lambda: _chunked(w.entropy),
        "received without Triton (chunked)": lambda: _chunked(lambda: w.sum(dim=-2)),
    }


def stats_rows(reps: int) -> list[dict]:
    from sdpa import kernels

    why = kernels.unavailable()
    if why is not None:
        return [{"what": f"Triton statistics not timed: {why}"}]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(STATS_SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    rows = []
    for causal in (False, True):
        ms = interleaved(_stats_fns(q, k, v, causal), reps)
        ms.update(interleaved(_chunked_fns(q, k, v, causal), reps=3, warmup=1))
        mask = "causal" if causal else "dense"
        print(f"done: statistics {mask} {ms}", flush=True)
        for name, t in ms.items():
            rows.append(
                {
                    "what": name,
                    "mask": mask,
                    "ms": t,
                    "vs_triton_forward": t / ms["triton forward"],
                    "vs_ours_forward": t / ms["ours forward"],
                }
            )
    return rows


def _chunked(fn):
    from sdpa import weights

    with weights.chunked_engine():
        return fn()


def table(fwd: list[dict], stats: list[dict]) -> str:
    lines = [
        f"{'bf16 forward':<30} {'mask':<7} {'ours ms':>9} {'torch ms':>9} {'flex ms':>9} "
        f"{'ours/torch':>10} {'ours/flex':>10}"
    ]
    for r in fwd:
        flex = r.get("flex")
        lines.append(
            f"{r['shape']:<30} {r['mask']:<7} {r['ours']:>9.3f} {r['torch']:>9.3f} "
            + (f"{flex:>9.3f} " if flex else f"{'n/a':>9} ")
            + f"{r['ours'] / r['torch']:>10.3f} "
            + (f"{r['ours'] / flex:>10.3f}" if flex else f"{'n/a':>10}")
        )
    notes = {r["flex_note"] for r in fwd if r.get("flex_note")}
    lines += [f"  flex n/a: {n}" for n in sorted(notes)]
    lines.append("")
    lines.append(
        f"{'statistics, bf16 ' + 'x'.join(map(str, STATS_SHAPE)):<34} {'mask':<7} {'ms':>9} "
        f"{'/triton fwd':>11} {'/ours fwd':>10}"
    )
    for r in stats:
        if "ms" not in r:
            lines.append(r["what"])
            continue
        lines.append(
            f"{r['what']:<34} {r['mask']:<7} {r['ms']:>9.3f} {r['vs_triton_forward']:>11.3f} "
            f"{r['vs_ours_forward']:>10.3f}"
        )
    lines.append(
        "targets: ours/torch <= 1.03 on the big shape; forward + entropy + max <= 1.15 x "
        "forward; received <= 1.3 x forward"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed calls per contender")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(
            "gpu_bench.py needs a CUDA device and torch.cuda.is_available() is False here; "
            "run it on the GPU machine (scripts/gpu_check.sh)"
        )
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    fwd = forward_rows(args.reps, not args.no_flex)
    if args.json:  # written after each part: a timeout keeps the forward rows
        with open(args.json, "w") as f:
            json.dump({"env": env, "forward": fwd}, f, indent=1)
    stats = stats_rows(args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "forward": fwd, "statistics": stats}, f, indent=1)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(table(fwd, stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
