"""Compile times of training steps that read the weights, this tree against a base commit.

Each case is a step `out.sum() + read(w)` (w: the call's weights) compiled with
torch.compile (backend "aot_eager": inductor's front end, no C++ build) and run once
forward and backward; its time is that first call's, a fresh dynamo each time. Reads:
entropy, KL to a teacher, a key column, u @ w; masks: none, a float mask, causal; sizes:
(1, 2, 64, 16) with the small backend (weights held) and (1, 2, 512, 16) on the tile
engine. The compiled step's loss and gradients are checked against the same step run
eagerly.

Each side runs in its own fresh process (its `src` first on the path), alternating
base, head, base, head ... for --rounds rounds; the table gives each case's median
compile time per side and their quotient (head / base; the issue "The weights are a
tensor" asks at most 1.2).

    python scripts/compile_times.py --base 702ddac [--rounds 3] [--json FILE]
    python scripts/compile_times.py --child     # one side's times, as JSON on stdout
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READS = ("entropy", "kl", "column", "rmatmul")
MASKS = ("none", "float", "causal")
SIZES = {"held": 64, "engine": 512}


def _case(read: str, mask_kind: str, size: str) -> dict:
    """Compile and run one step; its first call's seconds and its largest difference
    from the eager step (loss and the gradients of q, k and v)."""
    import torch

    import sdpa

    torch._dynamo.reset()
    L = SIZES[size]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 16, generator=g).requires_grad_() for _ in range(3))
    mask = {
        "none": None,
        "float": torch.randn(1, 1, L, L, generator=g),
        "causal": sdpa.masks.causal(),
    }[mask_kind]
    with torch.no_grad():
        teacher = sdpa.attention(torch.randn(1, 2, L, 16, generator=g), k.detach(), v.detach(),
                                 mask).weights  # fmt: skip
    u = torch.randn(L, generator=g)
    read_of = {
        "entropy": lambda w: w.entropy().square().sum(),
        "kl": lambda w: w.kl(teacher).sum(),
        "column": lambda w: w[..., 5].square().sum(),
        "rmatmul": lambda w: (u @ w).square().sum(),
    }[read]

    def step(q, k, v):
        out, w = sdpa.attention(q, k, v, mask)
        return out.sum() + read_of(w)

    def run(fn):
        for t in (q, k, v):
            t.grad = None
        loss = fn(q, k, v)
        loss.backward()
        return [loss.detach(), *(t.grad.clone() for t in (q, k, v))]

    small = size == "held"
    with contextlib.ExitStack() as stack:
        if not small:  # (the tile engine: nothing held)
            stack.enter_context(sdpa.settings.override(small_weights=0, one_product_weights=0))
        want = run(step)
        compiled = torch.compile(step, backend="aot_eager")
        start = time.perf_counter()
        got = run(compiled)
        seconds = time.perf_counter() - start
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    return {"case": f"{read} {mask_kind} {size}", "seconds": seconds, "diff": diff}


def child() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("SDPA_BENCH_THREADS", "2")))
    out = [_case(r, m, s) for r in READS for m in MASKS for s in SIZES]
    print(json.dumps(out))


def _side(src: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run([sys.executable, __file__, "--child"], capture_output=True,
                          text=True, env=env, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"a run under {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return 0
    if not args.base:
        parser.error("--base is required")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "src"],
                                 capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        sides = {"base": Path(tmp) / "src", "head": ROOT / "src"}
        runs: dict[str, list[list[dict]]] = {"base": [], "head": []}
        for i in range(args.rounds):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            for name in order:
                runs[name].append(_side(sides[name]))
    rows, worst = [], 0.0
    print(f"{'case':28} {'base s':>8} {'head s':>8} {'head/base':>9} {'max diff':>9}")
    for i, first in enumerate(runs["head"][0]):
        med = {n: statistics.median(r[i]["seconds"] for r in runs[n]) for n in runs}
        diff = max(r[i]["diff"] for r in runs["head"])
        q = med["head"] / med["base"]
        worst = max(worst, q)
        rows.append({"case": first["case"], **{f"{n}_s": med[n] for n in med}, "quotient": q,
                     "head_max_diff": diff})  # fmt: skip
        print(f"{first['case']:28} {med['base']:8.2f} {med['head']:8.2f} {q:9.2f} {diff:9.1e}")
    print(f"worst quotient {worst:.2f} (target <= 1.2), {args.rounds} rounds against {args.base}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "rows": rows}, indent=1))
    return 0 if worst <= 1.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
