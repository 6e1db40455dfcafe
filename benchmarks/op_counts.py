"""The aten ops of one distillation step, sdpa against eager (issue 36, item 2).

Each op torch runs is a parallel region that waits for every thread; on a busy machine
the small ones stretch most (a 0.06 ms GEMM took 2.4 ms under two spinners). This counts
the ops of one `forward_backward` of bench_distill's step (both forwards, the losses,
the backward; not AdamW's update), per side, from torch's profiler: the top-level aten
ops (an op called inside another is the caller's, except the per-batch GEMMs a
`baddbmm_` into a strided tensor runs, counted apart as `addmm_`), split at LARGE
elements of their largest input (torch's grain for a parallel loop), views and
allocations left out.

    python benchmarks/op_counts.py [--sizes 8x512,8x128] [--quick] [--json FILE]

--quick counts 2 x 32 tokens and writes no JSON unless --json is given.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_distill as distill  # (the step, its models and batches)
from sdpa.benchmark import environment

LARGE = 32768  # elements: torch's grain size, from which an elementwise op runs in parallel
FREE = {  # views, allocations and host reads: no pass over memory, no parallel region
    "aten::" + name
    for name in (
        "as_strided", "slice", "select", "view", "transpose", "expand", "reshape",
        "_reshape_alias", "unsqueeze", "squeeze", "t", "mT", "narrow", "alias", "unbind",
        "permute", "detach", "empty", "empty_strided", "empty_like", "to", "_to_copy",
        "resolve_conj", "resolve_neg", "item", "_local_scalar_dense", "is_nonzero",
        "lift_fresh", "result_type", "_unsafe_view", "split", "split_with_sizes",
    )
}  # fmt: skip
RESULTS = Path(__file__).parent / "results" / "op_counts.json"
THREADS = distill.THREADS


def count(fn) -> dict:
    """{"large": n, "small": n, "per_head_gemms": n, "large_by_op": {op: n}} of the
    top-level aten ops fn() runs."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    large, small = collections.Counter(), collections.Counter()
    gemms = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in FREE:
            continue
        parent = e.cpu_parent
        if e.name == "aten::addmm_" and parent is not None and parent.name == "aten::baddbmm_":
            gemms += 1
            continue
        if parent is not None and parent.name.startswith("aten::"):
            continue  # (part of its caller's op)
        n = max((math.prod(s) for s in e.input_shapes if s), default=0)
        (large if n >= LARGE else small)[e.name] += 1
    return {
        "large": sum(large.values()), "small": sum(small.values()), "per_head_gemms": gemms,
        "large_by_op": dict(large.most_common()),
    }  # fmt: skip


def row(size: str, tokenizer, config, state) -> dict:
    case = distill.make_case(size, tokenizer, config, state)
    out = {"size": size}
    for impl in ("ours", "eager"):
        side = distill.build_side(case, impl)
        side.step()  # (warm: first-call work is not the step's)
        out[impl] = count(side.forward_backward)
    return out


def line(r: dict) -> str:
    o, e = r["ours"], r["eager"]
    return (
        f"{r['size']:>7} {o['large']:>8} {o['small']:>8} {o['per_head_gemms']:>6} "
        f"{e['large']:>8} {e['small']:>8} {o['large'] / max(1, e['large']):>7.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help="comma-separated BATCHxTOKENS (default 8x512,8x128)")
    parser.add_argument("--quick", action="store_true", help="2 x 32 tokens: a check")
    parser.add_argument("--json", help=f"where the JSON goes (default {RESULTS.name})")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",") if args.sizes else ["2x32"] if args.quick else ["8x512", "8x128"]
    for size in sizes:
        distill.parse_size(size)
    torch.set_num_threads(THREADS)
    tokenizer = distill.load_tokenizer()
    config, state = distill.initial_student(max(distill.parse_size(s)[1] for s in sizes))
    print("ops of one step (forwards, losses, backward); large: >= 32768 elements")
    print("   size  ours lg  ours sm  gemms  eager lg eager sm   ratio")
    rows = []
    for size in sizes:
        rows.append(row(size.strip().lower(), tokenizer, config, state))
        print(line(rows[-1]), flush=True)
    path = args.json or (None if args.quick else str(RESULTS))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        env = {**environment(), "threads": THREADS}
        with open(path, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
