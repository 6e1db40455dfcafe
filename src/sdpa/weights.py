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
        self._check_fresh()
        with torch.no_grad(), no_autocast(self.device.type):
            return self._rows(0, self._inputs.query.shape[-2]).reshape(self.shape)

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        """Weights of query rows [start, stop): (B, Hq, stop - start, S), compute dtype."""
        w = self._rows_from_lse(start, stop)
        inexact = self._lse[:, :, start:stop].abs() > EXACT_LSE_LIMIT  # (B, Hq, n)
        if inexact.any():
            w = torch.where(inexact[..., None], self._rows_by_softmax(start, stop), w)
        return w

    def _rows_from_lse(self, start: int, stop: int) -> torch.Tensor:
        """exp(s - lse) with the LSE folded into the GEMM, in base 2 (exp2 runs ~3x faster
        than exp on CPU): [c*scale*q_i, -c*lse_i] . [k_j, 1] = c*(s_ij - lse_i), c = log2(e).
        """
        i = self._inputs
        cd = i.compute_dtype
        k = i.key.to(cd)
        q_aug = torch.cat(
            [
                i.query[:, :, start:stop].to(cd) * (i.scale * LOG2E),
                self._lse[:, :, start:stop, None].to(cd) * -LOG2E,
            ],
            dim=-1,
        )  # (B, Hq, n, E+1)
        k_aug = torch.cat([k, k.new_ones(*k.shape[:-1], 1)], dim=-1)  # (B, Hkv, S, E+1)
        w = _grouped_scores(q_aug, k_aug)  # (B, Hq, n, S)
        mask = self._mask_rows(start, stop)
        if mask is not None and mask.dtype != torch.bool:
            w.add_(mask, alpha=LOG2E)
        w.exp2_()
        return self._keep_only(w, mask, start, fill=0.0)

    def _rows_by_softmax(self, start: int, stop: int) -> torch.Tensor:
        """A plain float softmax of the scores: exact where the LSE is not."""
        i = self._inputs
        cd = i.compute_dtype
        s = _grouped_scores(i.query[:, :, start:stop].to(cd), i.key.to(cd)).mul_(i.scale)
        mask = self._mask_rows(start, stop)
        if mask is not None and mask.dtype != torch.bool:
            s.add_(mask)
        s = self._keep_only(s, mask, start, fill=-torch.inf)
        return torch.softmax(s, dim=-1).nan_to_num_(0.0)  # rows that see no key: 0

    def _mask_rows(self, start: int, stop: int) -> torch.Tensor | None:
        mask = self._inputs.mask
        return None if mask is None else mask[:, :, start:stop]  # (B|1, Hq|1, n, S)

    def _keep_only(
        self, w: torch.Tensor, mask: torch.Tensor | None, start: int, fill: float
    ) -> torch.Tensor:
        """Write `fill` where causality or a bool mask excludes a key, in place."""
        n, S = w.shape[-2:]
        if self._inputs.causal:  # top-left: row r sees keys j <= r
            rows = torch.arange(start, start + n, device=w.device)[:, None]
            w.masked_fill_(torch.arange(S, device=w.device) > rows, fill)
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
