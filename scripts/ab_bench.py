"""A/B a benchmark between two commits: alternating subprocesses (A B A B ...), medians.

Each round runs `benchmarks/NAME.py --no-memory --json OUT` once in a checkout of the
base commit and once in this tree (each with its own `src` first on the path), in
alternating order, so drift hits both alike. For every case both trees measured, it
prints the median ratio to the peer under each, and their quotient (this tree's ratio
over the base's: above 1.10 is more than 10% worse).

    python scripts/ab_bench.py --base 0bc6774 --rounds 3 bench_decode bench_weights
    python scripts/ab_bench.py --base 0bc6774 --only "decode float32" bench_decode

The base checkout is a git worktree in a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tree: Path, bench: str, only: str | None, quick: bool) -> dict[str, float]:
    """{case: ours / peer} of one run of `bench` in `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(tree / "benchmarks" / f"{bench}.py"), "--no-memory",
               "--json", out.name]  # fmt: skip
        if only:
            cmd += ["--only", only]
        if quick:
            cmd.append("--quick")
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
        results = json.loads(Path(out.name).read_text())["results"]
    return {r["case"]: r["ratio"] for r in results if r.get("target") is not None or
            r["ratio"] != 1.0}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benches", nargs="+", help="benchmark names, e.g. bench_decode")
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="only the cases whose id contains this")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base],
                       cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        try:
            for bench in args.benches:
                runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
                for r in range(args.rounds):
                    order = [("base", base), ("head", ROOT)]
                    for name, tree in order if r % 2 == 0 else order[::-1]:
                        runs[name].append(_run(tree, bench, args.only, args.quick))
                cases = sorted(set.intersection(*(set(d) for d in runs["base"] + runs["head"])))
                for case in cases:
                    a = statistics.median(d[case] for d in runs["base"])
                    b = statistics.median(d[case] for d in runs["head"])
                    report[f"{bench}: {case}"] = {"base": a, "head": b, "head/base": b / a}
                    flag = "  WORSE" if b / a > 1.10 else ""
                    print(
                        f"{bench:14s} {case:48s} base {a:7.3f}  head {b:7.3f}  {b / a:5.2f}{flag}"
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
