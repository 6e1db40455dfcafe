"""The one table of scripts/gpu_check.sh: every step's results from its run folder,
printed together and written as one JSON.

    python3 scripts/gpu_check/gpu_report.py RUN_DIR --out benchmarks/results/gpu_check.json

RUN_DIR holds what the steps wrote: profile.json, pytest.xml, bench.json,
integrations.json and steps.tsv (step, exit status, seconds). A step that wrote nothing
(it failed or ran out of time) shows as such. Exit status 0 when every step ran and
every check passed; targets missed are reported, not failed (they are the device
figures the issue asks for).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pytest(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites
        for c in s
        if c.find("failure") is not None or c.find("error") is not None
    ]
    count["passed"] = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return {**count, "failed": failed}


def rows_of(run: Path) -> tuple[list[tuple[str, str, str, str]], dict, bool]:
    """(section, item, value, status) rows, the merged results, and whether all passed."""
    steps = {}
    for line in (
        (run / "steps.tsv").read_text().splitlines() if (run / "steps.tsv").exists() else []
    ):
        name, rc, seconds = line.split("\t")
        steps[name] = {"rc": int(rc), "seconds": float(seconds)}
    merged = {"steps": steps}
    rows, ok = [], True
    for name, s in steps.items():
        status = "ok" if s["rc"] == 0 else ("TIMEOUT" if s["rc"] == 124 else f"rc {s['rc']}")
        ok &= s["rc"] == 0
        rows.append(("step", name, f"{s['seconds']:.0f} s", status))

    prof = _load(run / "profile.json")
    merged["profile"] = prof
    if prof:
        rows.append(
            (
                "profile",
                f"sdpa.attention {tuple(prof['shape'])} host time",
                f"{prof['ours_us']:.1f} us vs torch {prof['torch_us']:.1f} us",
                f"{prof['ratio']:.2f}x",
            )
        )
        for r in prof["cprofile_top"][:5]:
            rows.append(
                (
                    "profile",
                    r["function"][-60:],
                    f"{r['own_us_per_call']:.1f} us own",
                    f"{r['calls_per_call']:.0f}x",
                )
            )

    tests = _pytest(run / "pytest.xml")
    merged["cuda_tests"] = tests
    if tests:
        rows.append(
            (
                "cuda tests",
                "pytest -m cuda",
                f"{tests['passed']} passed, "
                f"{tests['skipped']} skipped, {tests['failures'] + tests['errors']} failed",
                "ok" if not tests["failed"] else "FAIL",
            )
        )
        rows += [("cuda tests", f[-70:], "", "FAIL") for f in tests["failed"][:10]]
        ok &= not tests["failed"]

    bench = _load(run / "bench.json")
    merged["bench"] = bench
    if bench:
        merged["env"] = bench.get("env")
        for r in bench.get("forward", []):
            lse = "" if r["lse_cost"] is None else f", LSE {r['lse_cost']:.2f}x"
            rows.append(
                (
                    "forward bf16",
                    f"{r['shape']} {r['mask']}",
                    f"{r['ours']:.3f} vs {r['torch']:.3f} ms = {r['ours/torch']:.3f}x "
                    f"(<= {r['target']}); torch: {r['torch_op']}{lse}",
                    "ok" if r["ours/torch"] <= r["target"] else "over",
                )
            )
        for r in bench.get("statistics", []):
            if "ms" not in r:
                rows.append(("statistics", r["what"], "", "skip"))
                continue
            new = r["what"] in ("entropy_and_max", "received", "max_logits")
            good = r["vs_ours_forward"] <= 0.85 and r["vs_triton_forward"] <= 0.6
            rows.append(
                (
                    "statistics",
                    f"{r['what']} {r['mask']}",
                    f"{r['ms']:.3f} ms = {r['vs_ours_forward']:.3f}x ours fwd, "
                    f"{r['vs_triton_forward']:.3f}x triton fwd",
                    ("ok" if good else "over") if new else "",
                )
            )
        for c in bench.get("checks", []):
            rows.append(
                (
                    "statistics",
                    f"check {c['what']} {c['mask']}",
                    f"err {c['max_abs_err']:.1e} vs {c['vs']} (tol {c['tol']:.0e})",
                    "ok" if c["ok"] else "FAIL",
                )
            )
            ok &= c["ok"]

    integ = _load(run / "integrations.json")
    merged["integrations"] = integ
    if integ:
        for c in integ["checks"]:
            value = c.get("detail", "")
            if "ours_err" in c:
                value = f"err {c['ours_err']:.1e}" + (
                    f" vs eager {c['eager_err']:.1e}" if "eager_err" in c else ""
                )
            status = "skip" if c["ok"] is None else ("ok" if c["ok"] else "FAIL")
            rows.append(("integrations", c["what"], value, status))
            if status == "skip":
                rows.append(("integrations", "", c.get("detail", ""), ""))
            ok &= c["ok"] is not False
    return rows, merged, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the run folder the steps wrote into")
    parser.add_argument("--out", required=True, help="the merged JSON")
    parser.add_argument("--title", default="gpu_check", help="the table's first line")
    args = parser.parse_args(argv)
    run = Path(args.run)
    rows, merged, ok = rows_of(run)
    env = merged.get("env") or {}
    print(f"{args.title}: " + " ".join(f"{k}={v}" for k, v in env.items()))
    width = max([len(r[1]) for r in rows] + [10])
    section = None
    for sec, item, value, status in rows:
        head = sec if sec != section else ""
        section = sec
        print(f"{head:<13} {item:<{width}} {value:<64} {status}".rstrip())
    merged["all_passed"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(merged, indent=1))
    print(
        f"{args.title}: {'every step ran and every check passed' if ok else 'FAILURES above'}"
        f"; results in {args.out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
