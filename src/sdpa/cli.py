"""The `sdpa` command. `sdpa demo` is the main job (`make demo` runs it)."""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import sdpa
from sdpa import listing

PHRASE = ["How", "are", "you", "?"]


def _table(title: str, labels: list[str], p: torch.Tensor) -> list[str]:
    """A query-by-key table of weights with token labels, as lines of text."""
    width = max(6, *(len(t) for t in labels))
    head = f"{title:<{width}}" + "".join(f"{t:>{width + 1}}" for t in labels)
    rows = [
        f"{q:<{width}}" + "".join(f"{x:>{width + 1}.3f}" for x in row.tolist())
        for q, row in zip(labels, p, strict=True)
    ]
    return [head, *rows]


def phrase_demo(seed: int = 0) -> list[str]:
    """The seed's walk-through: "How are you?" as (4, 256) embeddings plus sinusoidal
    positions, 256x256 Q/K/V projections, 8 heads of 32; each head's 4x4 weights."""
    torch.manual_seed(seed)
    d_model, heads = 256, 8
    embed = nn.Embedding(len(PHRASE), d_model)
    project = nn.ModuleDict({n: nn.Linear(d_model, d_model) for n in "qkv"})
    with torch.no_grad():
        x = sdpa.PositionalEncoding(d_model)(embed(torch.arange(len(PHRASE))))  # (4, 256)
        q, k, v = (  # (8, 4, 32): 8 heads of 32
            project[n](x).view(len(PHRASE), heads, d_model // heads).transpose(0, 1) for n in "qkv"
        )
        out, w = sdpa.attention(q, k, v)
        joined = out.transpose(0, 1).reshape(len(PHRASE), d_model)  # (4, 256)
        p = w.full()  # (8, 4, 4)
        out_listing, p_listing = listing.attention(q, k, v)
    lines = [
        f'"{" ".join(PHRASE)}": x {tuple(x.shape)} = embeddings + positional encoding; '
        f"Q, K, V {tuple(q.shape)} = 8 heads of 32; output joined back to {tuple(joined.shape)}",
        f"weights {tuple(w.shape)}, computed from the fused kernel's log-sum-exp "
        f"(rows: queries, columns: keys; each row sums to 1)",
        f"the seed's listing gives the same: max |weights - p_attn| = "
        f"{(p - p_listing).abs().max().item():.1e}, max |output - listing| = "
        f"{(out - out_listing).abs().max().item():.1e}",
        "",
    ]
    for h in range(heads):
        lines += [*_table(f"head {h}", PHRASE, p[h]), ""]
    return lines


def cmd_demo(args: argparse.Namespace) -> int:
    for line in phrase_demo(args.seed):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdpa", description="Scaled dot-product attention that shows its work."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the seed's examples, end to end")
    demo.add_argument("--seed", type=int, default=0, help="seed for the random projections")
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
