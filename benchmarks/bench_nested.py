"""Nested (jagged) inputs: sdpa's drop-in against torch's own SDPA on the same NJTs.

query/key/value are (B, H, j, E) NJTs, made (B, j, H, E) and transposed, float32, H=8,
E=64, sequence lengths drawn uniformly (fixed seed). Ours is sdpa.nested.nested_attention
with the drop-in as its dense call (what sdpa.scaled_dot_product_attention runs on
nested inputs), choosing per-sequence calls or one packed call from sizes alone; the
"rule" cases time the two ways against each other on both sides of the rule's threshold.

    python benchmarks/bench_nested.py [--quick] [--no-memory] [--json FILE] [--only CASE]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa
from sdpa import nested
from sdpa.benchmark import Comparison, main

H, E = 8, 64


def lengths(B: int, lo: int, hi: int, seed: int) -> list[int]:
    return torch.randint(lo, hi + 1, (B,), generator=torch.Generator().manual_seed(seed)).tolist()


def njts(lq: list[int], lk: list[int], grad: bool):
    g = torch.Generator().manual_seed(0)

    def njt(ls):
        values = torch.randn(sum(ls), H, E, generator=g).requires_grad_(grad)  # (nnz, H, E)
        offsets = torch.tensor([0, *ls]).cumsum(0)
        return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)

    return njt(lq), njt(lk), njt(lk)  # (B, H, j, E)


def call(fn, lq, lk, grad):
    def setup():
        q, k, v = njts(lq, lk, grad)
        if not grad:
            return lambda: fn(q, k, v)
        return lambda: fn(q, k, v).values().sum().backward()

    return setup


def ours(q, k, v):
    return nested.nested_attention(
        q, k, v, None, 0.0, False, None, False, sdpa.scaled_dot_product_attention
    )


def forced(pack: bool):
    def fn(q, k, v):
        saved = nested._pack
        nested._pack = lambda lq, lk, is_causal: pack
        try:
            return ours(q, k, v)
        finally:
            nested._pack = saved

    return fn


CASES = {  # case: (query lengths, key lengths)
    "B=8 L=S 50..500": (lengths(8, 50, 500, 1),) * 2,
    "B=32 L=S 5..40": (lengths(32, 5, 40, 2),) * 2,
    "B=64 L=S 1..16": (lengths(64, 1, 16, 3),) * 2,
    "B=8 cross L 50..500 S 20..100": (lengths(8, 50, 500, 4), lengths(8, 20, 100, 5)),
}


def comparisons() -> list[Comparison]:
    c = []
    for case, (lq, lk) in CASES.items():
        shape = f"({len(lq)}, {H}, j, {E}) {case}"
        c.append(
            Comparison(case, shape, "float32", ("sdpa drop-in, nested", call(ours, lq, lk, False)),
                       ("F.sdpa on the NJTs", call(F.scaled_dot_product_attention, lq, lk, False)))
        )  # fmt: skip
    lq, lk = CASES["B=32 L=S 5..40"]
    c.append(
        Comparison("B=32 L=S 5..40 grad", f"({len(lq)}, {H}, j, {E}) fwd+bwd", "float32",
                   ("sdpa drop-in, nested", call(ours, lq, lk, True)),
                   ("F.sdpa on the NJTs", call(F.scaled_dot_product_attention, lq, lk, True)),
                   grad=True)
    )  # fmt: skip
    for case in ("B=64 L=S 1..16", "B=32 L=S 5..40", "B=8 L=S 50..500"):
        lq, lk = CASES[case]
        c.append(
            Comparison(f"rule {case}", f"({len(lq)}, {H}, j, {E}) {case}", "float32",
                       ("packed, one call", call(forced(True), lq, lk, False)),
                       ("one call per sequence", call(forced(False), lq, lk, False)))
        )  # fmt: skip
    return c


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
