"""A/B a benchmark between a base commit and this tree: alternating subprocesses
(A B A B ...), medians, a verdict.

Each round runs `benchmarks/NAME.py --no-memory --json OUT` once in a checkout of the
base commit and once in this tree (each its own benchmark file, with its own `src` first
on the path), in alternating order, so drift hits both alike. For every case it prints
the median ratio to the peer under each, and their quotient (this tree's ratio over the
base's), then the quotient of each side's own median time ("own": where the ratio moved
and our own time did not, the peer's time moved; the peer runs the same code on both
sides). It is a check on the ratios: the exit status is 1 when a case's quotient is above
--threshold (default 1.05: more than 5% worse, flagged WORSE) or when a case was
measured on one side only (listed: a case renamed, added or lost is never compared
silently); 2 when a run could not be made (the other benchmarks are still compared).

    python benchmarks/ab_bench.py --base 0bc6774 --rounds 3 bench_decode bench_weights
    python benchmarks/ab_bench.py --base 0bc6774 --only "decode float32" bench_decode
    python benchmarks/ab_bench.py --base 702ddac --quick --only text bench_core
    python benchmarks/ab_bench.py --base 702ddac --rounds 5 --only "dense, 2 ranks" bench_ring
    python benchmarks/ab_bench.py --base 702ddac --rounds 3 --reps 3 bench_train

--reps passes the benchmark's own --reps (each side's repetitions in one run, default 15)
for cases that take seconds a call; the median of each run is then of that many.

NAME is a benchmark built on sdpa.benchmark (its JSON rows carry case, peer and ratio);
benchmarks/NAME.py exists under that name in the base too (commits from before this file
moved here, when it was scripts/ab_bench.py, have the same benchmarks/ folder). The base
checkout is a git worktree in a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("base", "head")


class Sample(NamedTuple):
    """One case of one run: our time over the peer's, and our own median time (ms; None
    where the benchmark's rows do not give it)."""

    ratio: float
    ms: float | None = None

    @classmethod
    def of(cls, value: Sample | float) -> Sample:
        return value if isinstance(value, Sample) else cls(float(value))


class RunError(Exception):
    """A run that could not be made: exit status 2, with this message."""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}


def _check_import(tree: Path) -> None:
    """The tree's own sdpa is the one its runs import (PYTHONPATH before an installed
    copy), else the A/B would time one tree twice."""
    done = subprocess.run([sys.executable, "-c", "import sdpa; print(sdpa.__file__)"],
                          cwd=tree, env=_env(tree), capture_output=True, text=True)  # fmt: skip
    where = Path(done.stdout.strip() or ".").resolve()
    if done.returncode != 0 or not where.is_relative_to((tree / "src").resolve()):
        raise RunError(
            f"{tree}: `import sdpa` with PYTHONPATH={tree / 'src'} gives "
            f"{done.stdout.strip() or done.stderr.strip()[-300:]}, not that tree's src/sdpa"
        )


# bench_ring is not built on sdpa.benchmark: its rows are (impl, mode, ranks, seconds),
# every run measures its ranks' memory, and it takes no --quick; a case is "MODE, R ranks"
# (ring_attention) or "MODE, R ranks, SCHEME" (its other schemes: ulysses, hybrid), its
# ratio the scheme's seconds over the whole sequence's on one process in the same mode
# (its peer, the row with impl WHOLE). Its --only is a mode or a whole case id, run as the
# benchmark's own --modes (and --ranks, --schemes): the other cases are not measured.
RING = "bench_ring"
WHOLE = "sdpa.attention (whole sequence)"


def _ring_selection(only: str) -> list[str]:
    """bench_ring's arguments for --only: "MODE", "MODE, R ranks" or "MODE, R ranks, SCHEME"."""
    mode, _, rest = only.partition(", ")
    ranks, _, scheme = rest.partition(", ")
    count = ranks.removesuffix(" ranks")
    if (
        not mode
        or (ranks and not (ranks.endswith(" ranks") and count.isdigit()))
        or (scheme and not (ranks and scheme.isidentifier()))
    ):
        raise RunError(
            f"{RING} --only takes a mode or a case id such as 'causal zigzag, 2 ranks', "
            f"not {only!r}"
        )
    return (
        ["--modes", mode]
        + (["--ranks", count] if ranks else [])
        + (["--schemes", scheme] if scheme else [])
    )


def _ring_ratios(results: object) -> list[dict] | None:
    """bench_ring's rows as (case, peer, ratio) rows, or None where they are not its."""
    keys = {"impl", "mode", "ranks", "seconds"}
    if not isinstance(results, list) or not all(
        isinstance(r, dict) and keys <= set(r) for r in results
    ):
        return None
    whole = {r["mode"]: r["seconds"] for r in results if r["impl"] == WHOLE}
    return [
        {
            "case": f"{r['mode']}, {r['ranks']} ranks"
            + ("" if r.get("scheme", "ring") in ("ring", None) else f", {r['scheme']}"),
            "peer": WHOLE,
            "ratio": r["seconds"] / whole[r["mode"]],
            "median_ms": r["seconds"] * 1e3,
        }
        for r in results
        if r["impl"] != WHOLE and r["mode"] in whole
    ]


def _command(
    script: Path, bench: str, out: str, only: str | None, quick: bool, reps: int | None
) -> list[str]:
    """The command line of one run of `script` writing its JSON to `out`."""
    if bench == RING and (quick or reps):
        raise RunError(f"{bench} takes no --quick or --reps (its cases are its sizes)")
    cmd = [sys.executable, str(script), "--json", out]
    if bench != RING:
        cmd.append("--no-memory")
    if only:
        cmd += _ring_selection(only) if bench == RING else ["--only", only]
    if quick:
        cmd.append("--quick")
    if reps:
        cmd += ["--reps", str(reps)]
    return cmd


def _run(
    tree: Path, bench: str, only: str | None, quick: bool, reps: int | None = None
) -> dict[str, Sample]:
    """{case: (ours / peer, our median ms)} of one run of benchmarks/`bench`.py in `tree`."""
    script = tree / "benchmarks" / f"{bench}.py"
    if not script.is_file():
        raise RunError(f"{script.relative_to(tree)} does not exist in {tree}")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = _command(script, bench, out.name, only, quick, reps)
        done = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True)
        if done.returncode != 0:
            raise RunError(
                f"{bench} in {tree} exited with status {done.returncode}:\n"
                + (done.stderr or done.stdout)[-2000:]
            )
        results = json.loads(Path(out.name).read_text()).get("results")
    results = _ring_ratios(results) if bench == RING else results
    if not isinstance(results, list) or not all(
        isinstance(r, dict) and {"case", "peer", "ratio"} <= set(r) for r in results
    ):
        raise RunError(
            f"{bench} writes no comparison rows (case, peer, ratio): ab_bench compares the "
            f"benchmarks built on sdpa.benchmark"
        )
    return {
        r["case"]: Sample(r["ratio"], r.get("median_ms")) for r in results if r["peer"] is not None
    }


@dataclass
class Report:
    """Every case of one benchmark: its medians (`cases`: case -> base, head, head/base of
    the ratios, and "own": head/base of our own median times where both sides give them),
    the cases whose ratios' quotient is over the threshold, and the cases some run of a
    side did not measure."""

    threshold: float
    cases: dict[str, dict[str, float]] = field(default_factory=dict)
    worse: list[str] = field(default_factory=list)
    one_sided: dict[str, str] = field(default_factory=dict)  # case -> which side lacks it

    @property
    def ok(self) -> bool:
        return not self.worse and not self.one_sided


def compare(runs: dict[str, list[dict[str, Sample | float]]], threshold: float) -> Report:
    """Medians per side of each case measured in every run of both sides (a run's value
    is a Sample or a bare ratio); a case missing from any run of a side is one-sided (a
    failure, never dropped from the report)."""
    report = Report(threshold)
    every = sorted(set().union(*(set(d) for side in SIDES for d in runs[side])))
    for case in every:
        lacking = {side: sum(case not in d for d in runs[side]) for side in SIDES}
        if any(lacking.values()):
            report.one_sided[case] = ", ".join(
                f"not in {n} of {len(runs[side])} {side} runs" for side, n in lacking.items() if n
            )
            continue
        samples = {side: [Sample.of(d[case]) for d in runs[side]] for side in SIDES}
        a, b = (statistics.median(x.ratio for x in samples[side]) for side in SIDES)
        report.cases[case] = {"base": a, "head": b, "head/base": b / a}
        if all(x.ms is not None for side in SIDES for x in samples[side]):
            own_a, own_b = (statistics.median(x.ms for x in samples[side]) for side in SIDES)
            report.cases[case]["own"] = own_b / own_a
        if b / a > threshold:
            report.worse.append(case)
    return report


@contextlib.contextmanager
def base_tree(commit: str) -> Iterator[Path]:
    """A detached worktree of `commit` in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        done = subprocess.run(["git", "worktree", "add", "--detach", str(base), commit],
                              cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RunError(f"git worktree add {commit}: {done.stderr.strip()}")
        try:
            yield base
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)  # fmt: skip


def _print(bench: str, report: Report) -> None:
    for case, row in report.cases.items():
        flag = "  WORSE" if case in report.worse else ""
        own = f"  own {row['own']:5.2f}" if "own" in row else ""
        print(f"{bench:14s} {case:48s} base {row['base']:7.3f}  head {row['head']:7.3f}  "
              f"{row['head/base']:5.2f}{own}{flag}")  # fmt: skip
    for case, why in report.one_sided.items():
        print(f"{bench:14s} {case:48s} ONE SIDE ONLY: {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benches", nargs="+", help="benchmark names, e.g. bench_decode")
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="only the cases whose id contains this")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int,
                        help="each run's repetitions of a side (the benchmarks' own --reps; "
                             "default theirs, 15): for cases of seconds a call")  # fmt: skip
    parser.add_argument("--threshold", type=float, default=1.05,
                        help="head/base above this fails (default 1.05: 5%% worse)")  # fmt: skip
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not args.threshold > 0 or (args.reps is not None and args.reps < 1):
        parser.error("--rounds and --reps must be at least 1 and --threshold above 0")
    benches = [Path(b).name.removesuffix(".py") for b in args.benches]
    reports: dict[str, Report] = {}
    failed: dict[str, str] = {}  # bench -> why no comparison was made (the others go on)
    try:
        with base_tree(args.base) as base:
            trees = {"base": base, "head": ROOT}
            for tree in trees.values():
                _check_import(tree)
            for bench in benches:
                runs: dict[str, list[dict[str, Sample]]] = {side: [] for side in SIDES}
                try:
                    for r in range(args.rounds):
                        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                            runs[side].append(
                                _run(trees[side], bench, args.only, args.quick, args.reps)
                            )
                except RunError as e:
                    failed[bench] = str(e)
                    print(f"ab_bench: error: {e}", file=sys.stderr, flush=True)
                    continue
                reports[bench] = compare(runs, args.threshold)
                _print(bench, reports[bench])
    except RunError as e:
        print(f"ab_bench: error: {e}", file=sys.stderr)
        return 2
    worse = [f"{b}: {c}" for b, rep in reports.items() for c in rep.worse]
    one_sided = [f"{b}: {c}" for b, rep in reports.items() for c in rep.one_sided]
    compared = sum(len(rep.cases) for rep in reports.values())
    print(f"\n{compared} cases compared against {args.base}: {len(worse)} worse than "
          f"{args.threshold:g}x, {len(one_sided)} on one side only")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({
            "base": args.base, "threshold": args.threshold,
            "cases": {f"{b}: {c}": row for b, rep in reports.items()
                      for c, row in rep.cases.items()},
            "worse": worse,
            "one_sided": {f"{b}: {c}": why for b, rep in reports.items()
                          for c, why in rep.one_sided.items()},
            "failed": failed,
        }, indent=1))  # fmt: skip
    if failed:
        print(f"ab_bench: no comparison for {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0 if not worse and not one_sided else 1


if __name__ == "__main__":
    sys.exit(main())
