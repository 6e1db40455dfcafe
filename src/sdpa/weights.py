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
        """Weights of query rows [start, stop): (B, Hq, stop - start, S), compute dtype.

        The LSE is folded into the GEMM, in base 2 (exp2 runs ~3x faster than exp on CPU):
        [c*scale*q_i, -c*lse_i] . [k_j, 1] = c*(s_ij - lse_i), c = log2(e).
        """
        i = self._inputs
        q, k, cd = i.query, i.key, i.compute_dtype
        B, Hq, _, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        n, group = stop - start, Hq // Hkv
        q_aug = torch.cat(
            [
                q[:, :, start:stop].to(cd) * (i.scale * LOG2E),
                self._lse[:, :, start:stop, None].to(cd) * -LOG2E,
            ],
            dim=-1,
        )  # (B, Hq, n, E+1)
        k_aug = torch.cat([k.to(cd), k.new_ones(B, Hkv, S, 1, dtype=cd)], dim=-1)  # (B,Hkv,S,E+1)
        # query heads h*group .. h*group+group-1 share key head h: fold them into rows
        w = torch.matmul(q_aug.reshape(B, Hkv, group * n, E + 1), k_aug.transpose(-2, -1))
        w = w.view(B, Hq, n, S)  # (B, Hq, n, S)
        mask = None if i.mask is None else i.mask[:, :, start:stop]  # (B|1, Hq|1, n, S)
        if mask is not None and mask.dtype != torch.bool:
            w.add_(mask, alpha=LOG2E)
        w.exp2_()
        if i.causal:  # top-left: row r sees keys j <= r
            rows = torch.arange(start, stop, device=w.device)[:, None]
            w.masked_fill_(torch.arange(S, device=w.device) > rows, 0.0)
        if mask is not None and mask.dtype == torch.bool:
            w.masked_fill_(~mask, 0.0)
        return w
