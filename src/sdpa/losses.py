"""Attention-distillation losses in O(L + S) memory, with their gradients.

What the distillation papers compare, without the (B, H, L, S) tensors they write:

    attention_kl   MiniLM (Wang et al. 2020), attention transfer:
                   mean over heads a and real tokens t of KL(A^T_a,t || A^S_a,t)
    relation_kl    MiniLM's value relation and MiniLMv2's (Wang et al. 2021) Q-Q, K-K and
                   V-V relations: R = softmax(X X^T / sqrt(d_r)) per relation head, X
                   the layer's queries, keys or values split into A_r heads of d_r, the
                   same mean of KL(R^T || R^S)
    score_mse      TinyBERT (Jiao et al. 2020): MSE between the pre-softmax scores
                   (scale q k^T, masked entries 0), as F.mse_loss takes it

The weights come from sdpa (a call's `.weights`, a capture's handles); teacher and
student may differ in head count (relation heads; head_map for the others) and in
depth (the caller pairs layers). Every loss reads the weights tile by tile: never
L x S, gradients to the student's (and, if it requires grad, the teacher's) q and k.

    with capture(student, layers=[2]) as s:
        out = student(**batch)
    with torch.no_grad(), capture(teacher, layers=[5]) as t:
        teacher(**batch)
    ws, wt = s.weights[0], t.weights[0]
    loss = sum(
        losses.relation_kl(getattr(ws, x), getattr(wt, x), heads=48,
                           attention_mask=batch["attention_mask"])
        for x in ("query", "key", "value")
    )

Shapes: B batch, H heads, L queries, S keys; attention_mask (B, L), 1 (or True) for a
token, 0 for padding, as transformers' tokenizers give it.
"""

from __future__ import annotations

import torch

from sdpa.errors import SdpaTypeError, SdpaValueError
from sdpa.functional import attention
from sdpa.weights import AttentionWeights

REDUCTIONS = ("mean", "sum", "none")


def attention_kl(
    student: AttentionWeights,
    teacher: AttentionWeights,
    attention_mask: torch.Tensor | None = None,
    *,
    head_map: object = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """KL(teacher || student) of two attentions' weights per query row, reduced.

    student, teacher: AttentionWeights (B, H, L, S) over the same batch, queries and
    keys (head_map: which teacher head each student head is compared with, as in
    AttentionWeights.kl). reduction: "mean" over heads and real query rows (those
    attention_mask marks; every row without one), "sum" over them, "none" the (B, H, L)
    rows with padding rows 0."""
    _check_reduction(reduction)
    _check_weights(student, "student")
    _check_weights(teacher, "teacher")
    shape = student._inputs.shape  # (*lead, L, S), read without torch's dispatch
    if attention_mask is not None and len(shape) != 4:
        raise SdpaValueError(
            f"attention_mask (B, L) goes with weights (B, H, L, S), got weights of "
            f"{len(shape)} dims"
        )
    keep = _keep(attention_mask, shape[0], shape[-2])
    # (the padded rows weigh nothing here: the KL read skips them)
    per_row = student._kl(teacher, head_map=head_map, real=keep)  # (*lead, L)
    return _reduce_rows(per_row, keep, reduction)


def relation_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    heads: int | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    reduction: str = "mean",
) -> torch.Tensor:
    """KL(R_teacher || R_student) of the self-relations R = softmax(X X^T / sqrt(d_r)) of
    two models' queries, keys or values, per relation head and token, reduced.

    student, teacher: (B, H, L, D) with heads split (a capture's `w.query`, `w.key`,
    `w.value`) or (B, L, d) hidden states; the two may differ in heads and width.
    heads: the relation heads A_r each side is split into (MiniLMv2: the hidden width
    regrouped, d_r = H * D / A_r per side); None keeps the inputs' own heads (MiniLM's
    value relation: both sides need the same count). attention_mask (B, L): padded keys
    take no part in a relation, padded query rows count for nothing. reduction as in
    attention_kl, over relation heads. Each relation is one sdpa.attention call, its
    KL read tile by tile."""
    _check_reduction(reduction)
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise SdpaValueError(f"heads must be a positive int or None, got {heads!r}")
    xs = _relation_heads(student, heads, "student")
    xt = _relation_heads(teacher, heads, "teacher")
    if xs.shape[:3] != xt.shape[:3]:
        raise SdpaValueError(
            f"student and teacher must give the same (B, relation heads, L), got "
            f"{tuple(xs.shape[:3])} and {tuple(xt.shape[:3])}"
            + ("; pass heads= to regroup both into as many relation heads" if heads is None else "")
        )
    keep = _keep(attention_mask, xs.shape[0], xs.shape[2])
    mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, L) key padding
    ws = attention(xs, xs, xs, mask).weights  # (B, A, L, L)
    wt = attention(xt, xt, xt, mask).weights
    return _reduce_rows(ws._kl(wt, real=keep), keep, reduction)  # (padded rows skipped)


def score_mse(
    student: AttentionWeights,
    teacher: AttentionWeights,
    *,
    head_map: object = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """TinyBERT's attention loss: the mean squared difference of two attentions'
    pre-softmax scores (scale q k^T, softcap and a float mask as each call applies
    them; 0 where a call's mask excludes the key, so padding both exclude adds 0), over
    all B x H x L x S entries as F.mse_loss counts them ("mean"), or their sum ("sum").

    student, teacher: AttentionWeights (B, H, L, S) over the same batch, queries and
    keys; head_map as in AttentionWeights.kl. O(L + S) memory: the squared errors are
    summed per row tile by tile (AttentionWeights.score_errors)."""
    _check_weights(student, "student")
    _check_weights(teacher, "teacher")
    if reduction not in ("mean", "sum"):
        raise SdpaValueError(
            f"reduction must be 'mean' or 'sum', got {reduction!r} ('none' would be the "
            f"(B, H, L, S) errors, L x S: student.score_errors(teacher) gives them summed "
            f"per query row)"
        )
    per_row = student.score_errors(teacher, head_map=head_map)  # (*lead, L)
    total = per_row.sum()
    return total / (per_row.numel() * student.key.shape[2]) if reduction == "mean" else total


def _check_reduction(reduction: object) -> None:
    if reduction not in REDUCTIONS:
        raise SdpaValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_weights(w: object, name: str) -> None:
    if not isinstance(w, AttentionWeights):
        raise SdpaTypeError(
            f"{name} must be AttentionWeights (a call's .weights, a capture's handles), got "
            f"{type(w).__name__}"
        )


def _relation_heads(x: object, heads: int | None, name: str) -> torch.Tensor:
    """x as (B, A, L, d_r): its own heads, or its hidden width regrouped into `heads`."""
    if not isinstance(x, torch.Tensor) or x.ndim not in (3, 4) or not x.is_floating_point():
        seen = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise SdpaTypeError(
            f"{name} must be a floating tensor (B, H, L, D) with heads split or (B, L, d), "
            f"got {seen}"
        )
    if x.ndim == 4:
        B, H, L, D = x.shape
        if heads is None or heads == H:
            return x
        x = x.transpose(1, 2).reshape(B, L, H * D)  # (B, L, d)
    elif heads is None:
        raise SdpaValueError(
            f"{name} is (B, L, d) = {tuple(x.shape)}: pass heads=, the relation heads to "
            f"split d into"
        )
    B, L, d = x.shape
    if d % heads:
        raise SdpaValueError(
            f"{name}'s width {d} does not split into heads={heads} relation heads; pick a "
            f"divisor of {d}"
        )
    return x.view(B, L, heads, d // heads).transpose(1, 2)  # (B, A, L, d_r)


def _keep(attention_mask: object, B: int, L: int) -> torch.Tensor | None:
    """attention_mask (B, L) as bool (True: a token), or None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, L):
        seen = (
            tuple(attention_mask.shape)
            if isinstance(attention_mask, torch.Tensor)
            else type(attention_mask).__name__
        )
        raise SdpaValueError(
            f"attention_mask must be a (B, L) = {(B, L)} tensor, 1 for a token and 0 for "
            f"padding (a tokenizer's attention_mask), got {seen}"
        )
    if attention_mask.is_floating_point():
        raise SdpaTypeError(
            f"attention_mask marks tokens with 1 / True and padding with 0 / False: an int "
            f"or bool tensor, got {attention_mask.dtype}"
        )
    return attention_mask.bool()


def _reduce_rows(per_row: torch.Tensor, keep: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """Per-row losses (B, H, L), the padded rows (keep (B, L) False) set to 0, reduced:
    the mean over heads and real rows, their sum, or the rows."""
    if keep is not None:
        per_row = per_row.masked_fill(~keep[:, None, :], 0.0)
    if reduction == "none":
        return per_row
    total = per_row.sum()
    if reduction == "sum":
        return total
    rows = per_row.numel() if keep is None else per_row.shape[1] * keep.sum()
    return total / rows
