"""The listing's math in one product, for small weights: output and weights together.

Up to `small_weights` scores (B * Hq * L * S: short texts, decode steps; see
sdpa.settings) the scores fit in cache and torch's fused kernel saves nothing over

    p = softmax(scale * q k^T + mask)        out = p v

so this backend computes that, with grouped-query heads folded into rows (no copy of k
or v), and hands p to AttentionWeights: every row and statistic of these weights is then
a read of p, and `w.full()` hands p out (a copy where another handle or a graph
holds it). The LSE is not computed (AttentionWeights computes it if asked).
Differentiable through torch's own matmul and softmax. Rows that see no key give
output 0 and weights 0, as in the reference backend.
"""

from __future__ import annotations

import torch

from sdpa import masks, settings, tile
from sdpa.backends.base import Backend
from sdpa.inputs import Inputs, known

# The thresholds are sdpa.settings' small_weights, small_head, small_causal and
# one_product_weights: past the first two torch's fused kernel is faster (measured on
# CPU by benchmarks/bench_decode.py: (8, 12, 128, 128) 0.8x the fused time,
# (1, 8, 256, 256) 1.0x, (1, 8, 512, 512) 3.9x; on CUDA the fused op is one launch).


def fits(inputs: Inputs) -> bool:
    """Whether this backend should run `inputs`, from shapes alone: more than one query
    (a decode step's single row is faster in the fused kernel, and its weights cost one
    product when asked) and scores small enough."""
    B, Hq, L, _ = inputs.query.size()
    if L == 1 if L.__class__ is int else known(L == 1):  # (first: decoding reads no more)
        return False
    S = inputs.key.shape[2]
    s = settings.get()
    if not known(B * Hq * L * S <= s.small_weights) or not known(L * S <= s.small_head):
        return False
    return known(L * S <= s.small_causal) or inputs.structured is None


def one_product(inputs: Inputs) -> bool:
    """Whether lazy weights of `inputs` are best computed whole (up to the settings'
    one_product_weights scores)."""
    if torch.compiler.is_compiling():  # (first: the settings' ContextVar would break a graph)
        return False
    B, Hq, L, _ = inputs.query.shape
    return (
        known(B * Hq * L * inputs.key.shape[2] <= settings.get().one_product_weights)
        and inputs.softcap is None
        and inputs.sinks is None
    )


def probabilities(inputs: Inputs) -> torch.Tensor:
    """The weights p = softmax(scale * q k^T + mask), (B, Hq, L, S) in the compute dtype,
    by the tile rule; rows that see no key are 0."""
    return _attend(inputs, None)[1]


def probabilities_and_output(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, L, Ev) in the input dtype, p (B, Hq, L, S) in the compute dtype)."""
    return _attend(inputs, inputs.value)


def _attend(inputs: Inputs, v: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """tile.attend on the whole call, its window in additive form: top-left causality
    from the cached causal bias, a bool mask converted once (cached), both added (a
    broadcast masked_fill_ is ~8x slower on CPU)."""
    q, k = inputs.query, inputs.key
    L, S = q.shape[2], k.shape[2]
    mask, causal = masks.causal_flag(inputs.mask, L, S)
    cd = inputs.compute_dtype
    if mask is not None and not isinstance(mask, torch.Tensor):  # a structured mask
        mask = tile.window(mask, L, S, device=q.device)  # (Bm, 1, L, S) bool
    window = tile.additive(mask, cd)
    if causal:  # top-left
        window = masks.combine(tile.causal_bias(L, S, cd, q.device), window)
    live = None if mask is None else _live_rows(inputs, L, q.device)  # (B, 1, L, 1) bool
    if live is not None:  # declared padded queries: scored as if open, then zeroed (a
        # product, where the rows of -inf would take the dead-row repair's passes)
        window = window.masked_fill(~live, 0.0)
    # no mask (or top-left causal only): every row sees a key, known without a look
    out, _, p = tile.attend(
        q, k, v, window, tile.Scoring.of(inputs), lse=False, every_row_sees_a_key=mask is None
    )
    if live is not None:
        out, p = (None if out is None else out * live), p * live
    return out, p


def _live_rows(inputs: Inputs, L: int, device: torch.device) -> torch.Tensor | None:
    """(B, 1, L, 1) bool: the rows the mask lets see a key where it declares padded
    queries (masks.query_spans, from the host), else None."""
    spans = masks.query_spans(inputs.mask, inputs.query.shape[0], L)
    if spans is None:
        return None
    return masks.rows_within(spans, L, device)[:, None, :, None]


def _over_limits(inputs: Inputs) -> str:
    """The settings limit these inputs are over, in words."""
    s = settings.get()
    B, Hq, L, _ = inputs.query.shape
    S = inputs.key.shape[2]
    if B * Hq * L * S > s.small_weights:
        over = f"B*Hq*L*S = {B * Hq * L * S} scores, over small_weights = {s.small_weights}"
    elif L * S > s.small_head:
        over = f"L*S = {L * S} scores per head, over small_head = {s.small_head}"
    else:
        over = (
            f"L*S = {L * S} scores per head under "
            f"structured masking (causal=True among them), over small_causal = "
            f"{s.small_causal}"
        )
    return f"{over} (sdpa.settings): the fused kernel is faster there"


class Small(Backend):
    name = "small"
    summary = "the listing's math in one product, the weights kept"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        device = inputs.query.device.type
        if device != "cpu":
            reasons.append(f"inputs on {device} (on CUDA the fused kernel is one launch)")
        if inputs.dropout_p > 0:
            reasons.append(f"dropout_p={inputs.dropout_p} > 0 (the reference backend applies it)")
        if inputs.softcap is not None or inputs.sinks is not None:
            reasons.append("a softcap or sinks (the chunked and fused backends apply them)")
        L = inputs.query.shape[2]
        if torch.compiler.is_compiling():
            reasons.append("torch.compile is tracing (the fused kernel serves compiled graphs)")
        elif inputs.no_work:
            reasons.append("no score to compute (0 heads, queries or keys)")
        elif L == 1:
            reasons.append("one query (the fused kernel is faster; the weights cost one product)")
        elif not fits(inputs):
            reasons.append(_over_limits(inputs))
        return reasons

    def run(self, inputs: Inputs) -> tuple[torch.Tensor, None, torch.Tensor]:
        """(out, no LSE, the weights): the weights stay in the autograd graph (reads of
        them are differentiated by torch; AttentionWeights hands out copies only)."""
        out, p = probabilities_and_output(inputs)
        return out, None, p
