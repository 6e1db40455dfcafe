"""The listing's math in one product, for small weights: output and weights together.

Up to `small_weights` scores (B * Hq * L * S: short texts, decode steps; see
sdpa.settings) the scores fit in cache and torch's fused kernel saves nothing over

    p = softmax(scale * q k^T + mask)        out = p v

so this backend computes that, with grouped-query heads folded into rows (no copy of k
or v), and hands p to AttentionWeights: every row and statistic of these weights is then
a read of p, and `w.full()` costs nothing more. The LSE is not computed (AttentionWeights
computes it if asked). Differentiable through torch's own matmul and softmax. Rows that
see no key give output 0 and weights 0, as in the reference backend.
"""

from __future__ import annotations

import torch

from sdpa import masks, settings
from sdpa.backends.base import Backend
from sdpa.backends.blocks import additive, causal_bias, distinct
from sdpa.backends.reference import Reference
from sdpa.inputs import Inputs, compute_dtype, known

# The thresholds are sdpa.settings' small_weights, small_head, small_causal and
# one_product_weights: past the first two torch's fused kernel is faster (measured on
# CPU by benchmarks/bench_decode.py: (8, 12, 128, 128) 0.8x the fused time,
# (1, 8, 256, 256) 1.0x, (1, 8, 512, 512) 3.9x; on CUDA the fused op is one launch).
_REFERENCE = Reference()
_ZERO = {d: torch.zeros((), dtype=d) for d in (torch.float32, torch.float64)}  # baddbmm's C


def fits(inputs: Inputs) -> bool:
    """Whether this backend should run `inputs`, from shapes alone: more than one query
    (a decode step's single row is faster in the fused kernel, and its weights cost one
    product when asked) and scores small enough."""
    B, Hq, L, _ = inputs.query.shape
    if known(L == 1):  # (first: decoding reads nothing more)
        return False
    S = inputs.key.shape[2]
    s = settings.get()
    if not known(B * Hq * L * S <= s.small_weights) or not known(L * S <= s.small_head):
        return False
    return known(L * S <= s.small_causal) or not (
        inputs.causal or isinstance(inputs.mask, masks.Mask)
    )


def one_product(inputs: Inputs) -> bool:
    """Whether lazy weights of `inputs` are best computed whole (up to the settings'
    one_product_weights scores)."""
    B, Hq, L, _ = inputs.query.shape
    return (
        known(B * Hq * L * inputs.key.shape[2] <= settings.get().one_product_weights)
        and inputs.softcap is None
        and inputs.sinks is None
        and not torch.compiler.is_compiling()
    )


def probabilities(inputs: Inputs) -> torch.Tensor:
    """The weights p = softmax(scale * q k^T + mask), (B, Hq, L, S) in the compute dtype;
    rows that see no key are 0."""
    q, k, mask = inputs.query, inputs.key, inputs.mask
    B, Hq, L, E = q.shape
    _, Hkv, S, _ = k.shape
    cd = compute_dtype(q.dtype)  # softmax statistics in float32 for 16-bit inputs
    if cd is not q.dtype:
        q, k = q.to(cd), k.to(cd)
    folded = q.reshape(B * Hkv, Hq // Hkv * L, E)  # query heads of a key head as rows
    zero = _ZERO.get(q.dtype) if q.is_cpu else None
    if zero is None:
        zero = q.new_zeros(())
    scores = torch.baddbmm(
        zero, folded, k.reshape(B * Hkv, S, E).mT, beta=0.0, alpha=inputs.scale
    ).view(B, Hq, L, S)
    causal = inputs.causal
    if mask is not None and mask.__class__ is not torch.Tensor:  # a structured mask
        if inputs.causal_only:
            mask, causal = None, True
        else:
            mask = mask.materialize(L, S, scores.device, max_bytes=None)  # (L, S) | (B, 1, L, S)
    # masks are added (0 / -inf): a broadcast masked_fill_ is ~8x slower on CPU
    if causal:  # top-left: query i sees keys j <= i, so no row is left without a key
        scores.add_(causal_bias(L, S, scores.dtype, scores.device))
    if mask is None:
        return torch.softmax(scores, dim=-1)
    base = distinct(mask)  # the entries a broadcast mask repeats (key padding: B x S)
    if mask.dtype == torch.bool:
        scores.add_(additive(mask, scores.dtype))  # converted once per mask (cached)
        dead = base.any(dim=-1, keepdim=True).logical_not_()  # rows that see no key
    else:
        scores.add_(mask)
        dead = torch.isneginf(base).all(dim=-1, keepdim=True)
    if causal:  # a row can lose its last keys to both: read the scores
        dead = torch.isneginf(scores.amax(dim=-1, keepdim=True))
    if not dead.any():  # (CPU: no sync to speak of) the common case, no pass over p
        return torch.softmax(scores, dim=-1)
    scores.masked_fill_(dead, 0.0)  # keeps softmax and its gradient finite
    p = torch.softmax(scores, dim=-1)
    if torch.is_grad_enabled() and p.requires_grad:  # softmax's backward reads p
        return p.masked_fill(dead, 0.0)
    return p.masked_fill_(dead, 0.0)


def probabilities_and_output(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, L, Ev) in the input dtype, p (B, Hq, L, S) in the compute dtype)."""
    p = probabilities(inputs)
    v, dtype = inputs.value, inputs.query.dtype
    if dtype is not p.dtype:
        v = v.to(p.dtype)
    B, Hq, L, S = p.shape
    Hkv, Ev = v.shape[1], v.shape[3]
    if Hkv == Hq:
        out = torch.matmul(p, v)  # (B, Hq, L, Ev)
    else:  # query heads of a key head as rows
        out = torch.bmm(p.view(B * Hkv, Hq // Hkv * L, S), v.reshape(B * Hkv, S, Ev))
        out = out.view(B, Hq, L, Ev)
    return (out if dtype is p.dtype else out.to(dtype)), p


class Small(Backend):
    name = "small"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        device = inputs.query.device.type
        if device != "cpu":
            reasons.append(f"inputs on {device} (on CUDA the fused kernel is one launch)")
        if inputs.dropout_p > 0:
            reasons.append(f"dropout_p={inputs.dropout_p} > 0 (the reference backend applies it)")
        if inputs.softcap is not None or inputs.sinks is not None:
            reasons.append("a softcap or sinks (the chunked and fused backends apply them)")
        B, Hq, L, _ = inputs.query.shape
        if torch.compiler.is_compiling():
            reasons.append("torch.compile is tracing (the fused kernel serves compiled graphs)")
        elif inputs.no_work:
            reasons.append("no score to compute (0 heads, queries or keys)")
        elif L == 1:
            reasons.append("one query (the fused kernel is faster; the weights cost one product)")
        elif not fits(inputs):
            s = settings.get()
            reasons.append(
                f"B*Hq*L*S = {B * Hq * L * inputs.key.shape[2]} scores (over small_weights = "
                f"{s.small_weights}), or L*S = {L * inputs.key.shape[2]} per head (over "
                f"small_head = {s.small_head}, or small_causal = {s.small_causal} with causal "
                f"or structured masking; see sdpa.settings): the fused kernel is faster there"
            )
        return reasons

    def run(self, inputs: Inputs) -> tuple[torch.Tensor, None, torch.Tensor]:
        out, p = probabilities_and_output(inputs)
        return out, None, (p.detach() if p.requires_grad else p)

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = probabilities_and_output(inputs)
        with torch.no_grad():
            lse = _REFERENCE.forward(inputs)[1]
        return out, lse
