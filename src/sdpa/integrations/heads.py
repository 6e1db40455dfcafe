"""Head fingerprints as gathers: previous-token, duplicate-token and induction scores
(TransformerLens' `detect_head` definitions), attention to the first token and span
mass, from a call's lazy weights in O(L + marked pairs) per head.

    import sdpa.integrations.heads as heads
    scores = heads.detect_head(bridge, text, "induction_head")   # (n_layers, n_heads)
    heads.score(cache["pattern", 3], tokens, "previous_token_head")   # (B, H)

A detection pattern D (L, L) marks (query, key) pairs: previous token (i, i - 1);
duplicate token (i, j) with j < i and token j == token i; induction (i, j) with
1 <= j <= i and token j - 1 == token i (the duplicate pattern shifted one key right).
With P a head's pattern, error_measure "mul" scores sum(P * D) / sum(P) and "abs"
1 - round(sum |P - D| / L, 3), after exclude_bos (P[:, 0] = 0) and
exclude_current_token (the diagonal 0), as detect_head does. Both need only P at the
marked pairs, in column 0 and on the diagonal (w.pairs, w[..., 0], w.diagonal(0, -2, -1)),
and sum(P) = L (every query row sums to 1: self-attention with every query seeing a
key, no attention sinks). Shapes: tokens (L,) or (B, L); weights (B, H, L, L).

Normalisation: detect_head's sums run over every query, also those D marks no key for
(the first copy of a repeated sequence, for induction), so a perfect induction head on
[BOS, x, x] scores |x| / (2|x| + 1), about 1/2. score(..., normalize="marked_queries")
takes both sums over the queries D marks a key for only: the textbook induction score,
the mean over the second copy of the weight on the token after the earlier copy (1 for
a perfect head).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sdpa.errors import SdpaTypeError, SdpaValueError
from sdpa.integrations.deferred import Deferred, weights_of
from sdpa.weights import AttentionWeights

HEAD_NAMES = ("previous_token_head", "duplicate_token_head", "induction_head")
MEASURES = ("mul", "abs")
NORMALIZATIONS = ("detect_head", "marked_queries")

__all__ = [
    "HEAD_NAMES",
    "detect_head",
    "first_token_mass",
    "marked_pairs",
    "score",
    "span_mass",
]


def _weights(w: object) -> AttentionWeights:
    """An AttentionWeights handle from a handle or a LazyPattern (weights_of)."""
    if isinstance(w, AttentionWeights):
        return w
    if isinstance(w, Deferred):
        return weights_of(w)
    raise SdpaTypeError(
        f"expected sdpa AttentionWeights or a LazyPattern (cache['pattern', layer] of a "
        f"bridge on sdpa), got {type(w).__name__}; a dense pattern has no lazy reads: use "
        f"transformer_lens.head_detector.detect_head for it"
    )


def marked_pairs(kind: str, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, key) pairs detection pattern `kind` marks for tokens (L,): (q_index,
    k_index), int64 (P,) each, in O(L + P) (the duplicate pairs from one sort)."""
    if kind not in HEAD_NAMES:
        raise SdpaValueError(f"kind must be one of {HEAD_NAMES}, got {kind!r}")
    tokens = torch.as_tensor(tokens).reshape(-1).cpu()
    L = tokens.numel()
    if kind == "previous_token_head":
        i = torch.arange(1, L)
        return i, i - 1
    order = torch.sort(tokens, stable=True).indices  # by token, then position
    sorted_tokens = tokens[order]
    first = torch.ones(L, dtype=torch.bool)
    first[1:] = sorted_tokens[1:] != sorted_tokens[:-1]
    starts = first.nonzero()[:, 0]
    start_of = starts[torch.cumsum(first.long(), 0) - 1]  # (L,) group start, sorted order
    rank = torch.arange(L) - start_of  # earlier positions with the same token
    src = torch.repeat_interleave(torch.arange(L), rank)
    offsets = torch.arange(src.numel()) - torch.repeat_interleave(
        torch.cumsum(rank, 0) - rank, rank
    )
    q_index, k_index = order[src], order[start_of[src] + offsets]  # k < q, same token
    if kind == "duplicate_token_head":
        return q_index, k_index
    keep = k_index + 1 <= q_index  # induction: the key after the earlier copy, if seen
    return q_index[keep], k_index[keep] + 1


def score(
    weights: object,
    tokens: torch.Tensor,
    kind: str,
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: str = "mul",
    normalize: str = "detect_head",
) -> torch.Tensor:
    """detect_head's score of every head for one layer: weights (B, H, L, L) (sdpa
    AttentionWeights, or a LazyPattern), tokens (L,) or (B, L) -> (B, H) float32.
    O(L + marked pairs) per head.

    normalize: which queries the sums run over. "detect_head" (TransformerLens'): every
    query, "mul" = sum(P * D) / sum(P) over all L rows, "abs" divides by L; queries D
    marks no key for count with weight 0 on marked keys, so a perfect induction head on
    a repeated sequence scores about 1/2. "marked_queries": only the rows D marks a key
    for (the second copy, for induction), "abs" divided by their number: the textbook
    mean over those queries of the weight on their marked keys, 1 for a perfect head;
    NaN where D marks nothing. Exclusions apply before either."""
    if error_measure not in MEASURES:
        raise SdpaValueError(f"error_measure must be one of {MEASURES}, got {error_measure!r}")
    if normalize not in NORMALIZATIONS:
        raise SdpaValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    w = _weights(weights)
    if len(w.shape) != 4 or w.shape[-2] != w.shape[-1]:
        raise SdpaValueError(
            f"head scores need self-attention weights (B, H, L, L), got {tuple(w.shape)}"
        )
    B, H, L, _ = w.shape
    tokens = torch.as_tensor(tokens)
    tokens = tokens.reshape(1, -1).expand(B, -1) if tokens.ndim == 1 else tokens
    if tuple(tokens.shape) != (B, L):
        raise SdpaValueError(
            f"tokens must be (L,) or (B, L) = ({B}, {L}) for weights {tuple(w.shape)}, got "
            f"{tuple(tokens.shape)}"
        )
    if L < 2:
        raise SdpaValueError(f"head scores need at least 2 tokens, got L={L}")
    pairs = [marked_pairs(kind, tokens[b]) for b in range(B)]
    q_index, k_index, valid = _padded(pairs, exclude_bos, exclude_current_token)
    if B == 1:
        q_index, k_index, valid = q_index[0], k_index[0], valid[0]
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32
    marked = w.pairs(q_index.to(w.device), k_index.to(w.device)).to(dt)  # (B, H, P)
    if B == 1:
        marked, valid = marked.reshape(B, H, -1), valid[None]
    valid = valid.to(w.device)[:, None, :]  # (B, 1, P)
    hit = (marked * valid).sum(-1)  # (B, H): sum of P over the marked pairs left
    count = valid.sum(-1).to(dt)  # (B, 1)
    rows = torch.ones(B, 1, L, dtype=dt, device=w.device)  # (B, 1, L): the rows summed
    if normalize == "marked_queries":
        pairs_in = torch.zeros(B, L, dtype=dt).scatter_add_(
            1, q_index.reshape(B, -1), valid.reshape(B, -1).to("cpu", dt)
        )  # (B, L): the marked pairs left in each row
        rows = (pairs_in > 0).to(w.device, dt)[:, None, :]
    col0 = w[..., 0].to(dt) * rows  # (B, H, L): P[i, 0] of the rows summed
    diag = w.diagonal(0, -2, -1).to(dt) * rows  # (B, H, L): P[i, i]
    corner = col0[..., 0]  # P[0, 0], in both
    n_rows = rows.sum(-1)  # (B, 1): L, or the marked rows
    total = n_rows.expand(B, H).clone()  # every row sums to 1
    if exclude_bos:
        total = total - col0.sum(-1)
    if exclude_current_token:
        total = total - diag.sum(-1)
    if exclude_bos and exclude_current_token:
        total = total + corner
    if error_measure == "mul":
        return (hit / total).float()
    # sum |P - D| = sum P + #marked - 2 sum_marked P, over the entries left
    abs_sum = total + count - 2 * hit
    return (1 - torch.round(abs_sum / n_rows, decimals=3)).float()


def _padded(pairs, exclude_bos: bool, exclude_current: bool):
    """Per-batch pairs (after the exclusions) as (B, P) tensors padded with (0, 0), and
    which entries are real."""
    kept = []
    for q_index, k_index in pairs:
        keep = torch.ones_like(q_index, dtype=torch.bool)
        if exclude_bos:
            keep &= k_index != 0
        if exclude_current:
            keep &= k_index != q_index
        kept.append((q_index[keep], k_index[keep]))
    P = max(1, max(q.numel() for q, _ in kept))
    B = len(kept)
    q_out = torch.zeros(B, P, dtype=torch.long)
    k_out = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for b, (q_index, k_index) in enumerate(kept):
        n = q_index.numel()
        q_out[b, :n], k_out[b, :n], valid[b, :n] = q_index, k_index, True
    return q_out, k_out, valid


def first_token_mass(weights: object) -> torch.Tensor:
    """Attention to the first token (BOS, or a sink), averaged over the queries:
    mean_i P[i, 0], (B, H). O(L) per head (one key column)."""
    w = _weights(weights)
    return w[..., 0].mean(-1)


def span_mass(weights: object, span: slice | Sequence[int] | torch.Tensor, query: int = -1):
    """The weight one query (default the last) puts on a span of keys: sum over j in
    span of P[query, j], (B, H). O(S) per head (one row)."""
    w = _weights(weights)
    if isinstance(span, slice):
        return w[..., query, span].sum(-1)
    return w[..., query, :][..., torch.as_tensor(span, dtype=torch.long)].sum(-1)


def detect_head(
    model,
    seq: str | list[str],
    detection_pattern: str,
    heads: list[tuple[int, int]] | dict[int, list[int]] | None = None,
    cache=None,
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: str = "mul",
    normalize: str = "detect_head",
) -> torch.Tensor:
    """TransformerLens' detect_head for a bridge on sdpa (use_sdpa), from lazy patterns:
    (n_layers, n_heads), -1 for heads not asked for; a list of prompts averages their
    scores. No context-length assert (TransformerLens asserts L < n_ctx to hold the
    dense cache). cache: a run_with_cache result of this prompt on the bridge (its
    patterns, LazyPattern). normalize: as in score ("detect_head", TransformerLens'
    default here; "marked_queries" for the textbook mean over the marked queries)."""
    if detection_pattern not in HEAD_NAMES:
        raise SdpaValueError(
            f"detection_pattern must be one of {HEAD_NAMES} here (a tensor pattern needs the "
            f"dense pattern: use transformer_lens' detect_head), got {detection_pattern!r}"
        )
    if isinstance(seq, list):
        if cache is not None:
            raise SdpaValueError("cache serves one prompt; pass one prompt, or omit cache")
        each = [
            detect_head(model, s, detection_pattern, heads, exclude_bos=exclude_bos,
                        exclude_current_token=exclude_current_token, error_measure=error_measure,
                        normalize=normalize)
            for s in seq
        ]  # fmt: skip
        return torch.stack(each).mean(0)
    cfg = model.cfg
    tokens = model.to_tokens(seq).to(cfg.device)
    if cache is None:
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    layer2heads = _layer_heads(heads, cfg.n_layers, cfg.n_heads)
    matches = -torch.ones(cfg.n_layers, cfg.n_heads, dtype=cfg.dtype)
    for layer, wanted in layer2heads.items():
        pattern = cache["pattern", layer, "attn"]
        got = score(
            pattern,
            tokens[0],
            detection_pattern,
            exclude_bos=exclude_bos,
            exclude_current_token=exclude_current_token,
            error_measure=error_measure,
            normalize=normalize,
        )
        matches[layer, wanted] = got[0, wanted].to(matches.dtype)  # fmt: skip
    return matches


def _layer_heads(heads, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    if heads is None:
        return {layer: list(range(n_heads)) for layer in range(n_layers)}
    if isinstance(heads, dict):
        return heads
    out: dict[int, list[int]] = {}
    for layer, head in heads:
        out.setdefault(layer, []).append(head)
    return out
