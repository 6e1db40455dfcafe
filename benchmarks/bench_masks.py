"""Masks with structure: block skipping against torch given the same dense bool mask.

(1, 8, 4096, 64) float32, no autograd. Ours takes the structured mask (or, where
named, the dense bool tensor itself); torch's SDPA takes the dense bool mask. Also
against the strongest hand-written alternative (torch's is_causal; one torch call per
sequence on its own keys) and FlexAttention compiled on CPU with the equivalent block
mask (reported, no target; its compile time is not counted).

    python benchmarks/bench_masks.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa
from sdpa import masks
from sdpa.benchmark import Comparison, main

B, H, L, E = 1, 8, 4096, 64
LENGTHS = [4096, 2048]


def qkv(batch: int = B):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, H, L, E, generator=g) for _ in range(3)]


def window() -> masks.Mask:
    return masks.sliding_window(512)


def docs() -> masks.Mask:
    return masks.documents(torch.arange(L) // 1024)  # 4 documents of 1024


def random_keep() -> torch.Tensor:
    return torch.rand(L, L, generator=torch.Generator().manual_seed(1)) < 0.5


def ours(make_mask, batch=B, dense=False):
    name = "sdpa.attention, dense bool tensor" if dense else "sdpa.attention, sdpa.masks"

    def setup():
        q, k, v = qkv(batch)
        m = make_mask()
        if dense and isinstance(m, masks.Mask):
            m = m.materialize(L, L)
        return lambda: sdpa.attention(q, k, v, m).output

    return name, setup


def torch_dense(make_mask, batch=B):
    def setup():
        q, k, v = qkv(batch)
        m = make_mask()
        dense = m.materialize(L, L) if isinstance(m, masks.Mask) else m
        return lambda: F.scaled_dot_product_attention(q, k, v, dense)

    return "F.sdpa, dense bool mask", setup


def torch_is_causal():
    def setup():
        q, k, v = qkv()
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return "F.sdpa(is_causal=True)", setup


def torch_per_sequence():
    def setup():
        q, k, v = qkv(len(LENGTHS))
        return lambda: [
            F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
            for b, n in enumerate(LENGTHS)
        ]

    return "F.sdpa per sequence, sliced keys", setup


def flex(mask_mod_name: str):
    def setup():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        ids = torch.arange(L) // 1024
        mods = {
            "window": lambda b, h, i, j: (j <= i) & (j > i - 512),
            "documents": lambda b, h, i, j: ids[i] == ids[j],
            "causal": lambda b, h, i, j: j <= i,
        }
        block_mask = create_block_mask(mods[mask_mod_name], None, None, L, L, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        q, k, v = qkv()
        return lambda: compiled(q, k, v, block_mask=block_mask)

    return "FlexAttention (compiled, CPU)", setup


def comparisons() -> list[Comparison]:
    shape = f"({B}, {H}, {L}, {E})"
    padded = f"(2, {H}, {L}, {E}), lengths {tuple(LENGTHS)}"
    c = [
        Comparison("window", f"{shape} sliding window 512", "float32", ours(window),
                   torch_dense(window), target=0.35),
        Comparison("documents", f"{shape} 4 documents of 1024", "float32", ours(docs),
                   torch_dense(docs), target=0.4),
        Comparison("padding", padded, "float32", ours(lambda: masks.padding(LENGTHS), 2),
                   torch_dense(lambda: masks.padding(LENGTHS), 2), target=0.8),
        Comparison("causal tensor", f"{shape} causal, as a dense bool tensor", "float32",
                   ours(masks.causal, dense=True), torch_dense(masks.causal), target=0.65),
        Comparison("random tensor", f"{shape} random bool tensor, no structure", "float32",
                   ours(random_keep, dense=True), torch_dense(random_keep), target=1.1),
        Comparison("causal", f"{shape} causal", "float32", ours(masks.causal),
                   torch_is_causal(), target=1.05),
        Comparison("padding per sequence", padded, "float32",
                   ours(lambda: masks.padding(LENGTHS), 2), torch_per_sequence(), target=1.1),
    ]  # fmt: skip
    for name, make in (("window", window), ("documents", docs), ("causal", masks.causal)):
        c.append(Comparison(f"flex {name}", f"{shape} {name}", "float32", ours(make),
                            flex(name), memory=False))  # fmt: skip
    return c


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
