"""Attention sinks and softcap: what they cost, against the eager code models run today.

float32, no autograd, GQA 8 query heads on 2 key/value heads, head size 64. Peers: the
eager attention of gpt-oss (sinks as an extra softmax column) and of Gemma 2 (tanh on
the materialised scores), as transformers runs them, and F.scaled_dot_product_attention
without the modification (the fused kernel's own speed: what sinks cost on top of it,
and what a softcap costs by having to leave it for the chunked path).

    python benchmarks/bench_score_mods.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa
from sdpa.benchmark import Comparison, main

H, HKV, E = 8, 2, 64
CAP = 50.0  # Gemma 2's attention softcap


def inputs(L: int, S: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, E, generator=g)
    k, v = torch.randn(1, HKV, S, E, generator=g), torch.randn(1, HKV, S, E, generator=g)
    return q, k, v, torch.randn(H, generator=g), torch.ones(L, S, dtype=torch.bool).tril(S - L)


def repeat_kv(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(H // HKV, dim=1)  # (1, H, S, E)


def ours_sinks(L, S):
    def setup():
        q, k, v, z, _ = inputs(L, S)
        mask = sdpa.masks.sinks(z.reshape(H, 1, 1), sdpa.masks.causal())
        return lambda: sdpa.attention(q, k, v, mask).output

    return "sdpa.attention, masks.sinks(causal)", setup


def eager_sinks(L, S):
    """gpt-oss's eager_attention_forward: the sink as one more softmax column."""

    def setup():
        q, k, v, z, keep = inputs(L, S)
        bias = torch.zeros(L, S).masked_fill(~keep, torch.finfo(torch.float32).min)

        def run():
            scores = q @ repeat_kv(k).mT * E**-0.5 + bias  # (1, H, L, S)
            column = z.reshape(1, H, 1, 1).expand(1, H, L, 1)
            logits = torch.cat([scores, column], dim=-1)
            logits = logits - logits.amax(dim=-1, keepdim=True)
            return torch.softmax(logits, dim=-1)[..., :-1] @ repeat_kv(v)

        return run

    return "eager (gpt-oss)", setup


def ours_softcap(L, S):
    def setup():
        q, k, v, _, _ = inputs(L, S)
        mask = sdpa.masks.softcap(CAP, sdpa.masks.causal())
        return lambda: sdpa.attention(q, k, v, mask).output

    return "sdpa.attention, masks.softcap(causal)", setup


def eager_softcap(L, S):
    """Gemma 2's eager_attention_forward: tanh on the materialised scores."""

    def setup():
        q, k, v, _, keep = inputs(L, S)
        bias = torch.zeros(L, S).masked_fill(~keep, torch.finfo(torch.float32).min)

        def run():
            scores = q @ repeat_kv(k).mT * E**-0.5
            scores = torch.tanh(scores / CAP) * CAP + bias
            return torch.softmax(scores, dim=-1) @ repeat_kv(v)

        return run

    return "eager (Gemma 2)", setup


def plain_kernel(L, S):
    def setup():
        q, k, v, _, keep = inputs(L, S)
        mask = None if L == S else keep
        causal = L == S
        return lambda: F.scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, enable_gqa=True
        )

    return "F.sdpa, no sinks / softcap", setup


def comparisons() -> list[Comparison]:
    out = []
    for L, S, what in ((2048, 2048, "prefill"), (1, 4096, "decode"), (16, 16, "short")):
        shape = f"(1, {H}/{HKV}, {L}, {E}), S={S}, causal"
        calls = 1 if L * S >= 2**20 else 20
        out += [
            Comparison(f"sinks {what} vs eager", shape, "float32", ours_sinks(L, S),
                       eager_sinks(L, S), calls_per_rep=calls),
            Comparison(f"sinks {what} vs plain kernel", shape, "float32", ours_sinks(L, S),
                       plain_kernel(L, S), calls_per_rep=calls),
            Comparison(f"softcap {what} vs eager", shape, "float32", ours_softcap(L, S),
                       eager_softcap(L, S), calls_per_rep=calls),
            Comparison(f"softcap {what} vs plain kernel", shape, "float32",
                       ours_softcap(L, S), plain_kernel(L, S), calls_per_rep=calls),
        ]  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
