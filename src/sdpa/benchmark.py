"""Side-by-side timing: ours against a peer, interleaved, medians, ratios, JSON.

Used by `sdpa bench` and the scripts in benchmarks/. A benchmark lists `Comparison`s
and calls `main(comparisons, script, doc)`. Each side is a
setup function that builds its inputs (and modules) and returns the call to time, so
the same setup serves the timing loop and the peak-memory subprocess: the script runs
itself with `--peak CASE SIDE`, which sets up, takes the baseline, calls once, and
prints the rise of the peak resident set. Timings interleave A B A B ... so drift hits
both alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import sdpa
from sdpa.measure import peak_mib_in_subprocess, peak_mib_of

Setup = Callable[[], Callable[[], object]]


@dataclass(frozen=True)
class Comparison:
    """One line of the table: `ours` against `peer` on one case."""

    case: str  # unique id, e.g. "unet fp32 weights"
    shape: str  # what the case is, for the table
    dtype: str
    ours: tuple[str, Setup]  # (name, setup)
    peer: tuple[str, Setup]
    target: float | None = None  # the ratio ours / peer to stay under
    flop: float | None = None  # per call, for GFLOP/s
    calls_per_rep: int = 1  # >1 for calls too short to time one by one
    grad: bool = False  # time with autograd on (the call runs its own backward)
    max_peak_mib: float | None = None  # what ours may add to the peak resident set
    memory: bool = True  # measure peak memory (False where setup itself is heavy: compiling)
    length: int | None = None  # sequence length, for plots of time against length


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _measure_peak(c: Comparison, side: str) -> None:
    fn = (c.ours if side == "ours" else c.peer)[1]()
    with torch.set_grad_enabled(c.grad):
        print(peak_mib_of(fn))


def run(
    comparisons: list[Comparison],
    quick: bool,
    memory: bool,
    script: list[str],
    reps: int | None = None,
) -> list[dict]:
    """Time every comparison; script: how to start this benchmark in a fresh process
    (argv after the interpreter) for the peak-memory runs; reps: the repetitions of
    each side (default 15, 5 with quick; six times that for cases of several calls)."""
    results = []
    widths = column_widths(comparisons)
    for c in comparisons:
        names = {"ours": c.ours[0], "peer": c.peer[0]}
        fns = {"ours": c.ours[1](), "peer": c.peer[1]()}
        per = reps or (5 if quick else 15)
        count = max(1 if reps else 3, per * (1 if c.calls_per_rep == 1 else 6))
        times: dict[str, list[float]] = {"ours": [], "peer": []}
        with torch.set_grad_enabled(c.grad):
            for side in fns:  # warm up
                _time(fns[side], c.calls_per_rep)
            for _ in range(count):
                for side in fns:
                    times[side].append(_time(fns[side], c.calls_per_rep))
        del fns
        med = {side: statistics.median(t) for side, t in times.items()}
        for side in ("ours", "peer"):
            row = {
                "case": c.case,
                "shape": c.shape,
                "dtype": c.dtype,
                "impl": names[side],
                "peer": names["peer"] if side == "ours" else None,
                "median_ms": med[side] * 1e3,
                "gflops": None if c.flop is None else c.flop / med[side] / 1e9,
                "ratio": med[side] / med["peer"],
                "target": c.target if side == "ours" else None,
                "met": met_target(med["ours"] / med["peer"], c.target) if side == "ours" else None,
                "reps": count,
                "calls_per_rep": c.calls_per_rep,
                "grad": c.grad,
                "length": c.length,
                "max_peak_mib": c.max_peak_mib if side == "ours" else None,
                "peak_mib": (
                    peak_mib_in_subprocess([*script, "--peak", c.case, side])
                    if memory and c.memory
                    else None
                ),
            }
            results.append(row)
            print(_line(row, widths), flush=True)
    return results


def met_target(ratio: float, target: float | None) -> bool | None:
    """Whether a ratio ours / peer meets its target (at most it); None without one."""
    return None if target is None else ratio <= target


def column_widths(comparisons: list[Comparison]) -> tuple[int, int]:
    """Widths of the case and implementation columns, from every comparison up front, so
    the lines printed while the benchmark runs line up however long the names are."""
    cases = max((len(c.case) for c in comparisons), default=0)
    impls = max((len(n) for c in comparisons for n in (c.ours[0], c.peer[0])), default=0)
    return cases, impls


def _line(row: dict, widths: tuple[int, int]) -> str:
    """One measured side as a fixed-width line; a field that was not measured is blank at
    its width, so later columns stay in place."""
    ms = f"{row['median_ms']:11.3f} ms"
    flops = "" if row["gflops"] is None else f"{row['gflops']:.1f} GFLOP/s"
    mem = "" if row["peak_mib"] is None else f"{row['peak_mib']:.1f} MiB"
    verdict = ""
    if row["target"] is not None:
        met = "met" if met_target(row["ratio"], row["target"]) else "MISSED"
        verdict = f"  target <= {row['target']}x {met}"
    return (
        f"{row['case']:<{widths[0]}}  {row['impl']:<{widths[1]}}  {ms}  {flops:>15}  {mem:>12}"
        f"  x{row['ratio']:.3f}{verdict}"
    )


def _ms(ms: float) -> str:
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def markdown(results: list[dict]) -> str:
    """The README's table: one line per comparison (ours beside its peer)."""
    peers = {(r["case"], r["impl"]): r for r in results if r["peer"] is None}
    lines = [
        "| case | dtype | ours | peer | ours ms | peer ms | ratio | target "
        "| peak MiB ours / peer |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["peer"] is None:
            continue
        p = peers[(r["case"], r["peer"])]
        target = "-" if r["target"] is None else f"<= {r['target']}"
        if met_target(r["ratio"], r["target"]) is False:
            target += " (missed)"
        mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f} / {p['peak_mib']:.0f}"
        if r["peak_mib"] is not None and p["peak_mib"] is None:
            mem = f"{r['peak_mib']:.0f} / -"
        limit = r.get("max_peak_mib")
        if limit is not None and r["peak_mib"] is not None:
            mem += f" (<= {limit:.0f}{'' if r['peak_mib'] <= limit else ', missed'})"
        lines.append(
            f"| {r['shape']} | {r['dtype']} | `{r['impl']}` | `{r['peer']}` "
            f"| {_ms(r['median_ms'])} | {_ms(p['median_ms'])} | {r['ratio']:.3f} | {target} "
            f"| {mem} |"
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


def main(
    comparisons: list[Comparison], script: str, doc: str, argv: list[str] | None = None
) -> int:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    parser.add_argument("--json", help="write results and environment here")
    parser.add_argument("--markdown", help="print the table of an earlier --json run and exit")
    parser.add_argument("--only", help="run only the cases whose id contains this")
    parser.add_argument(
        "--reps", type=int, help="repetitions of each side (default 15; --quick 5): long cases"
    )
    parser.add_argument("--peak", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    by_case = {c.case: c for c in comparisons}
    if args.peak:
        _measure_peak(by_case[args.peak[0]], args.peak[1])
        return 0
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)["results"]))
        return 0
    chosen = [c for c in comparisons if args.only is None or args.only in c.case]
    env = environment()
    print(f"environment: {env}")
    results = run(chosen, args.quick, memory=not args.no_memory, script=[script], reps=args.reps)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


# -- `sdpa bench`: the textbook passage's shapes against every peer, and a length sweep

SEED_TEXT, SEED_UNET = (1, 8, 4, 32), (1, 4, 4096, 32)  # (B, H, L, E)
SWEEP = (256, 1024, 4096)


def _qkv(shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(3)]


def _side(name, fn, shape):
    def setup():
        q, k, v = _qkv(shape)
        return lambda: fn(q, k, v)

    return name, setup


def _torch_math(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _ours_with_weights(q, k, v):
    out, w = sdpa.attention(q, k, v)
    return out, w.full()


def _mha_side(ours: bool, need_weights: bool, L: int):
    def setup():
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
        mine = sdpa.MultiHeadAttention.from_torch(ref).eval()
        x = torch.randn(1, L, 256)
        if ours:
            return (lambda: mine(x).weights.full()) if need_weights else (lambda: mine(x).output)
        return lambda: ref(x, x, x, need_weights=need_weights, average_attn_weights=False)

    name = "sdpa.MultiHeadAttention" if ours else "nn.MultiheadAttention"
    return f"{name}{' + weights' if need_weights else ''}", setup


def seed_comparisons(quick: bool = False, max_length: int = 4096) -> list[Comparison]:
    """The seed's text and U-Net shapes against every peer; MultiHeadAttention at the
    seed's 8 heads of 32 over 256; a length sweep for the plot. Cases longer than
    max_length are left out."""
    from sdpa import listing

    ours = ("sdpa.attention", lambda q, k, v: sdpa.attention(q, k, v).output)
    peers = {
        "F.sdpa (default)": torch.nn.functional.scaled_dot_product_attention,
        "F.sdpa (MATH)": _torch_math,
        "listing (output + p_attn)": listing.attention,
    }
    out = []
    for case, shape in (("text", SEED_TEXT), ("unet", SEED_UNET)):
        B, H, L, E = shape
        for peer, fn in peers.items():
            out.append(Comparison(
                f"{case} vs {peer}", f"{case} {shape}", "float32", _side(*ours, shape),
                _side(peer, fn, shape), flop=4 * B * H * L * L * E,
                calls_per_rep=200 if L < 100 else 1, memory=case == "unet" or not quick,
            ))  # fmt: skip
    out.append(Comparison(
        "unet weights", f"unet {SEED_UNET}", "float32",
        _side("sdpa.attention + weights.full()", _ours_with_weights, SEED_UNET),
        _side("listing (output + p_attn)", listing.attention, SEED_UNET),
    ))  # fmt: skip
    for need_weights in (False, True):
        out.append(Comparison(
            f"mha{' weights' if need_weights else ''}", "MHA 8 heads of 32 over 256, (1, 1024)",
            "float32", _mha_side(True, need_weights, 1024), _mha_side(False, need_weights, 1024),
            memory=not quick,
        ))  # fmt: skip
    out = [c for c in out if _length(c) <= max_length]
    for L in (n for n in SWEEP if n <= max_length):
        shape = (1, 4, L, 32)
        for peer in ("F.sdpa (default)", "listing (output + p_attn)"):
            out.append(Comparison(
                f"sweep {L} vs {peer}", f"sweep {shape}", "float32", _side(*ours, shape),
                _side(peer, peers[peer], shape), flop=4 * 4 * L * L * 32, memory=False, length=L,
            ))  # fmt: skip
    return out


def _length(c: Comparison) -> int:
    return 1024 if c.case.startswith("mha") else SEED_TEXT[2] if c.case.startswith("text") else 4096


def seed_bench(quick: bool, max_length: int = 4096, json_path: str | None = None) -> list[dict]:
    """`sdpa bench`: run, print the table, write JSON; returns the result rows."""
    comparisons = seed_comparisons(quick, max_length)
    env = environment()
    print(f"environment: {env}")
    results = run(comparisons, quick, memory=True, script=["-m", "sdpa.benchmark"])
    print(markdown(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
        print(f"wrote {json_path}")
    return results


if __name__ == "__main__":  # the peak-memory runs of `sdpa bench` start here
    raise SystemExit(main(seed_comparisons(), ["-m", "sdpa.benchmark"], __doc__))
