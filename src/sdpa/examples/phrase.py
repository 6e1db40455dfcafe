"""The textbook passage's "How are you?" walk-through with sdpa's modules.

Four tokens as (1, 4, 256) embeddings plus sinusoidal positional encoding, learned
256x256 Q/K/V projections, 8 heads of 32 joined back to 256; each head's 4x4 weights
from sdpa beside the same head's weights from the passage's Listing 9.1, and their
largest difference.

    python examples/phrase.py
"""

from __future__ import annotations

import torch
from torch import nn

import sdpa
from sdpa import listing

TOKENS = ["How", "are", "you", "?"]


def weights_table(title: str, labels: list[str], p: torch.Tensor) -> list[str]:
    """A query-by-key table of weights (L, S) with token labels, as lines of text; the
    columns line up whatever the lengths of the title and the labels."""
    first = max(len(title), *(len(t) for t in labels))
    width = max(6, *(len(t) for t in labels))
    head = f"{title:<{first}}" + "".join(f"{t:>{width + 1}}" for t in labels)
    rows = [
        f"{q:<{first}}" + "".join(f"{x:>{width + 1}.3f}" for x in row.tolist())
        for q, row in zip(labels, p, strict=True)
    ]
    return [head, *rows]


def main(seed: int = 0) -> list[str]:
    torch.manual_seed(seed)
    d_model, heads = 256, 8
    embed = nn.Embedding(len(TOKENS), d_model)
    encode = sdpa.PositionalEncoding(d_model)
    mha = sdpa.MultiHeadAttention(d_model, heads).eval()
    with torch.no_grad():
        x = encode(embed(torch.arange(len(TOKENS)))[None])  # (1, 4, 256)
        out, w = mha(x)  # out (1, 4, 256); w lazy (1, 8, 4, 4)
        p = w.full()[0]  # (8, 4, 4)
        # the same heads through the passage's Listing 9.1
        q, k, v = (
            proj(x).view(1, len(TOKENS), heads, d_model // heads).transpose(1, 2)
            for proj in (mha.q_proj, mha.k_proj, mha.v_proj)
        )  # (1, 8, 4, 32) each
        _, p_listing = listing.attention(q, k, v)
    diff = (p - p_listing[0]).abs().amax(dim=(-2, -1))  # (8,): per head
    lines = [
        f'"{" ".join(TOKENS)}": embeddings + positional encoding {tuple(x.shape)} -> '
        f"Q, K, V {tuple(q.shape)} (8 heads of 32) -> output {tuple(out.shape)}",
        f"weights {tuple(w.shape)} from the fused kernel's log-sum-exp, beside Listing 9.1's "
        f"p_attn; Listing 9.1 agrees to {diff.max().item():.1e} (largest difference, all heads)",
        "",
    ]
    for h in range(heads):
        ours = weights_table(f"head {h}", TOKENS, p[h])
        theirs = weights_table("Listing 9.1", TOKENS, p_listing[0, h])
        lines += [f"{a}   |   {b}" for a, b in zip(ours, theirs, strict=True)]
        lines += [f"head {h}: sdpa (left) and Listing 9.1 (right) differ by at most "
                  f"{diff[h].item():.1e}", ""]  # fmt: skip
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
