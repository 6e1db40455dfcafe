"""Every transformers architecture, tiny, on sdpa against eager: the long sweep.

    HF_HUB_OFFLINE=1 .venv/bin/python tests/model_zoo.py --json zoo.json
    HF_HUB_OFFLINE=1 .venv/bin/python tests/model_zoo.py --only llama,gpt2 --tokens 8

Runs tests/zoo.py's comparison for each model type in worker processes (one crash or
hang costs one model type, not the sweep), writes every result and the counts per
status to --json, and prints a table of counts and the list of non-matching types.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def worker(tokens: int) -> None:
    """Read model types from stdin, one per line; write one JSON result per line."""
    import dataclasses

    import torch

    import zoo

    torch.set_num_threads(1)
    name = zoo.register()
    for line in sys.stdin:
        model_type = line.strip()
        if not model_type:
            continue
        res = zoo.run(model_type, name, new_tokens=tokens)
        print(json.dumps(dataclasses.asdict(res)), flush=True)


def _drive(types: queue.Queue, results: list, args) -> None:
    """One worker slot: feed model types to a worker process, restart it after a crash
    or a hang (the model type in flight is marked cannot apply)."""
    cmd = [sys.executable, __file__, "--worker", "--tokens", str(args.tokens)]
    proc = None
    while True:
        try:
            model_type = types.get_nowait()
        except queue.Empty:
            break
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                cwd=ROOT,
            )
        proc.stdin.write(model_type + "\n")
        proc.stdin.flush()
        start = time.perf_counter()
        ready, _, _ = select.select([proc.stdout], [], [], args.timeout)
        line = proc.stdout.readline() if ready else ""
        if line:
            res = json.loads(line)
        else:
            why = "timed out" if not ready else f"worker died (exit {proc.poll()})"
            proc.kill()
            proc.wait()
            proc = None
            res = {
                "model_type": model_type,
                "status": "cannot apply",
                "detail": f"harness: {why} after {time.perf_counter() - start:.0f} s",
            }
        results.append(res)
        print(
            f"{len(results):4d} {res['model_type']:<36} {res.get('seconds', 0):6.1f} s "
            f"{res['status']:<18} {res.get('detail', '')[:100]}",
            flush=True,
        )
    if proc is not None:
        proc.stdin.close()
        proc.wait()


def _drift(results: list[dict], status: str, listed, now: str) -> dict[str, list[str]]:
    """The model types with `status` that the reviewed list lacks, and the listed ones
    whose status is no longer that (entries to add to or drop from tests/zoo.py)."""
    return {
        f"{status}, not listed": sorted(
            r["model_type"]
            for r in results
            if r["status"] == status and r["model_type"] not in listed
        ),
        f"listed {status}, {now}": sorted(
            r["model_type"] for r in results if r["status"] != status and r["model_type"] in listed
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--only", help="comma-separated model types (default: all)")
    p.add_argument("--tokens", type=int, default=8, help="new tokens for generate")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--timeout", type=float, default=300, help="seconds per model type")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.tokens)

    import transformers

    import zoo

    wanted = [t for t in args.only.split(",") if t] if args.only else list(zoo.architectures())
    types: queue.Queue = queue.Queue()
    for t in wanted:
        types.put(t)
    results: list = []
    start = time.perf_counter()
    threads = [
        threading.Thread(target=_drive, args=(types, results, args)) for _ in range(args.jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: r["model_type"])
    counts = Counter(r["status"] for r in results)
    applicable = sum(counts[s] for s in zoo.STATUSES if s not in ("not routed", "cannot apply"))
    summary = {
        "architectures": len(results),
        "applicable": applicable,
        **{s: counts[s] for s in zoo.STATUSES},
    }
    # the reviewed lists in tests/zoo.py against what ran: entries to add or drop
    drift = {
        **_drift(results, "cannot apply", zoo.CANNOT_APPLY, "runs now"),
        **_drift(results, "not routed", zoo.NOT_ROUTED, "routed now"),
    }
    print()
    for k, v in summary.items():
        print(f"  {k:<20} {v:5d}")
    print()
    for r in results:
        if r["status"] not in ("match", "not routed", "cannot apply"):
            print(f"  {r['model_type']:<36} {r['status']:<18} {r.get('detail', '')}")
    for k, v in drift.items():
        if v:
            print(f"\n  {k}: {', '.join(v)}")
    if args.json:
        import torch

        args.json.write_text(
            json.dumps(
                {
                    "summary": summary,
                    "drift": drift,
                    "new_tokens": args.tokens,
                    "seconds": round(time.perf_counter() - start, 1),
                    "environment": {
                        "python": platform.python_version(),
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "machine": platform.machine(),
                    },
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
