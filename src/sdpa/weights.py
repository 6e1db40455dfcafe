"""AttentionWeights: the attention probabilities, rebuilt on demand from the LSE.

A fused kernel returns the output and, per query row, the log-sum-exp of its scores.
Any weight is then p_ij = exp(s_ij - lse_i) with s_ij = scale * q_i . k_j + bias_ij:
one GEMM and one exp, no second softmax, and nothing L x S is kept between calls.
"""

from __future__ import annotations

import math

import torch

from sdpa.inputs import Inputs, no_autocast

LOG2E = 1.0 / math.log(2.0)
# Rows whose |lse| exceeds this are recomputed as a plain softmax of their scores: there a
# float32 LSE has lost digits (rows masked with a large finite bias such as -1e9 or
# torch.finfo(dtype).min, or scores in the hundreds), so exp(s - lse) would be off.
EXACT_LSE_LIMIT = 32.0


class StaleWeightsError(RuntimeError):
    """q, k or the mask changed in place after the attention call."""


def _version(t: torch.Tensor | None) -> int | None:
    # inference tensors carry no version counter: they cannot be checked
    return None if t is None or t.is_inference() else t._version


class AttentionWeights:
    """Lazy view of the attention weights, shape (*lead, L, S) (query heads for GQA).

    Shapes: query (..., L, E), key (..., S, E) -> weights (..., L, S); with heads,
    (..., Hq, L, S). Values are the softmax probabilities *before* dropout, in float32
    for 16-bit inputs. Rows that see no key are all 0.

    The handle keeps q, k and the mask by reference, not by copy: if any of them is
    modified in place after the call, every access raises StaleWeightsError rather than
    answer for other inputs (tensors made under torch.inference_mode cannot be checked).
    """

    __slots__ = ("_inputs", "_lse", "_versions")

    def __init__(self, inputs: Inputs, lse: torch.Tensor):
        self._inputs = inputs
        self._lse = lse.detach()  # (B, Hq, L)
        self._versions = (
            _version(inputs.query),
            _version(inputs.key),
            _version(inputs.mask),
        )

    @property
    def shape(self) -> torch.Size:
        """Shape of the full weights, (*lead, L, S)."""
        return torch.Size(self._inputs.shape)

    @property
    def dtype(self) -> torch.dtype:
        """float32 for 16-bit inputs, else the inputs' dtype."""
        return self._inputs.compute_dtype

    @property
    def device(self) -> torch.device:
        return self._inputs.query.device

    @property
    def lse(self) -> torch.Tensor:
        """Log-sum-exp of each query row's scores, (*lead, L); 0 for rows that see no key."""
        self._check_fresh()
        return self._lse.reshape(self.shape[:-1])

    def __repr__(self) -> str:
        return f"AttentionWeights(shape={tuple(self.shape)}, dtype={self.dtype}, lazy)"

    def _check_fresh(self) -> None:
        i = self._inputs
        now = (_version(i.query), _version(i.key), _version(i.mask))
        if now != self._versions:
            changed = [
                n
                for n, a, b in zip(("query", "key", "mask"), self._versions, now, strict=True)
                if a != b
            ]
            raise StaleWeightsError(
                f"{' and '.join(changed)} changed in place after the attention call, so these "
                f"weights would describe other inputs; read the weights before the update "
                f"(e.g. before a KV-cache write or an optimizer step), or pass a clone"
            )

    def full(self) -> torch.Tensor:
        """The dense weights, (*lead, L, S): exp(scores - lse) in one GEMM-and-exp pass."""
        return self[...]

    def __getitem__(self, index: object) -> torch.Tensor:
        """Only the selected rows, computed from the LSE: ints and slices address the
        leading dims and the query dim, e.g. w[0, :, 5] -> (H, S), w[0, 1, 10:20] ->
        (10, S); an index for the key dim applies to the computed rows."""
        self._check_fresh()
        i = self._inputs
        lead, L = i.lead, i.query.shape[-2]
        *lead_idx, q_idx, k_idx = _normalize_index(index, self.shape)
        has_heads = len(lead) >= 2  # 4-D+ inputs: lead is (*batch, Hq)
        batch, batch_idx = (lead[:-1], lead_idx[:-1]) if has_heads else (lead, lead_idx)
        head_idx = lead_idx[-1] if has_heads else slice(None)
        sizes = [
            len(range(*_as_slice(j).indices(n))) for j, n in zip(batch_idx, batch, strict=True)
        ]

        def pick(t: torch.Tensor, heads: slice | None, rows: slice | None) -> torch.Tensor:
            """(B|1, H|1, L, ...) -> the selected (B', H', n, ...), as a view."""
            t = t.expand(math.prod(batch), *t.shape[1:])  # (B, H|1, L, ...)
            t = t.reshape(*batch, *t.shape[1:])[tuple(_as_slice(j) for j in batch_idx)]
            t = t.reshape(math.prod(sizes), *t.shape[len(batch) :])  # (B', H|1, L, ...)
            if heads is not None and t.shape[1] != 1:
                t = t[:, heads]
            return t if rows is None else t[:, :, rows]

        with torch.no_grad(), no_autocast(self.device.type):
            heads, rows = _as_slice(head_idx), _as_slice(q_idx)
            q = pick(i.query, heads, rows)  # (B', H', n, E)
            lse = pick(self._lse[..., None], heads, rows)[..., 0]  # (B', H', n)
            mask = None if i.mask is None else pick(i.mask, heads, rows)  # (B'|1, H'|1, n, S)
            k = pick(i.key, None, None)  # (B', Hkv, S, E)
            group = i.query.shape[1] // i.key.shape[1]
            if heads != slice(None) and group > 1:  # query head h uses key head h // group
                k = k[:, torch.arange(i.query.shape[1])[heads] // group]  # (B', H', S, E)
            elif heads != slice(None):
                k = k[:, heads]
            positions = torch.arange(L, device=q.device)[rows] if i.causal else None
            p = _probabilities(q, k, lse, mask, positions, i.scale, i.compute_dtype)
        # int indices drop their dim, as in torch
        p = p.reshape(*sizes, *p.shape[1:])  # (*batch', H', n, S)
        drop = [*batch_idx, head_idx, q_idx] if has_heads else [*batch_idx, 0, q_idx]
        p = p[tuple(0 if isinstance(d, int) else slice(None) for d in drop)]
        return p[..., k_idx]


def _as_slice(index: int | slice) -> slice:
    return slice(index, index + 1) if isinstance(index, int) else index


def _normalize_index(index: object, shape: torch.Size) -> list[int | slice]:
    """One int (non-negative, in range) or slice (positive step) per dim of `shape`."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise IndexError(f"too many indices for weights of shape {tuple(shape)}: got {len(items)}")
    items += [slice(None)] * (len(shape) - len(items))
    out: list[int | slice] = []
    for dim, (item, size) in enumerate(zip(items, shape, strict=True)):
        if isinstance(item, bool) or not isinstance(item, int | slice):
            raise TypeError(
                f"AttentionWeights takes ints, slices and '...' as indices (they choose which "
                f"rows to compute), got {type(item).__name__} for dim {dim}; index the "
                f"resulting tensor for anything else"
            )
        if isinstance(item, int):
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of bounds for dim {dim} with size {size}")
            item %= size
        elif item.step is not None and item.step <= 0:
            raise ValueError(f"slice step must be positive, got {item.step} for dim {dim}")
        out.append(item)
    return out


def _probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    scale: float,
    cd: torch.dtype,
) -> torch.Tensor:
    """Weights (B, Hq, n, S) of query rows q (B, Hq, n, E) against k (B, Hkv, S, E).

    lse (B, Hq, n); mask (B|1, Hq|1, n, S) or None; positions (n,): the rows' query
    positions when causal (top-left), else None. Rows with |lse| > EXACT_LSE_LIMIT
    are recomputed by a plain softmax of their scores.
    """
    w = _from_lse(q, k, lse, mask, positions, scale, cd)
    inexact = lse.abs() > EXACT_LSE_LIMIT  # (B, Hq, n)
    if inexact.any():
        exact = _by_softmax(q, k, mask, positions, scale, cd)
        w = torch.where(inexact[..., None], exact, w)
    return w


def _from_lse(q, k, lse, mask, positions, scale, cd) -> torch.Tensor:
    """exp(s - lse) with the LSE folded into the GEMM, in base 2 (exp2 runs ~3x faster
    than exp on CPU): [c*scale*q_i, -c*lse_i] . [k_j, 1] = c*(s_ij - lse_i), c = log2(e)."""
    k = k.to(cd)
    q_aug = torch.cat([q.to(cd) * (scale * LOG2E), lse[..., None].to(cd) * -LOG2E], dim=-1)
    k_aug = torch.cat([k, k.new_ones(*k.shape[:-1], 1)], dim=-1)  # (B, Hkv, S, E+1)
    w = _grouped_scores(q_aug, k_aug)  # (B, Hq, n, S)
    if mask is not None and mask.dtype != torch.bool:
        w.add_(mask, alpha=LOG2E)
    w.exp2_()
    return _keep_only(w, mask, positions, fill=0.0)


def _by_softmax(q, k, mask, positions, scale, cd) -> torch.Tensor:
    """A plain softmax of the scores: exact where the LSE is not."""
    s = _grouped_scores(q.to(cd), k.to(cd)).mul_(scale)
    if mask is not None and mask.dtype != torch.bool:
        s.add_(mask)
    s = _keep_only(s, mask, positions, fill=-torch.inf)
    return torch.softmax(s, dim=-1).nan_to_num_(0.0)  # rows that see no key: 0


def _keep_only(w, mask, positions, fill: float) -> torch.Tensor:
    """Write `fill` in place where causality or a bool mask excludes a key."""
    if positions is not None:  # top-left causal: the query at position r sees keys j <= r
        w.masked_fill_(torch.arange(w.shape[-1], device=w.device) > positions[:, None], fill)
    if mask is not None and mask.dtype == torch.bool:
        w.masked_fill_(~mask, fill)
    return w


def _grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (B, Hq, n, D) @ k (B, Hkv, S, D)^T -> (B, Hq, n, S) with query head h on key head
    h // (Hq // Hkv): the heads sharing a key head are folded into rows, no copy of k."""
    B, Hq, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    w = torch.matmul(q.reshape(B, Hkv, Hq // Hkv * n, D), k.transpose(-2, -1))
    return w.view(B, Hq, n, S)
