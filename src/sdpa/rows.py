"""The chunked engine behind AttentionWeights: query rows rebuilt from the LSE.

For query row i, with s_ij = scale * q_i . k_j + bias_ij and the row's log-sum-exp,
    log p_ij = s_ij - lse_i        p_ij = exp(s_ij - lse_i)
so any row costs one GEMM and one exp. `Rows` is a selection of rows laid out
(B, H, n, ...); the work is cut into tiles of at most `chunk_bytes` (sdpa.settings): a
whole batch element when it fits, else row chunks of one head, so no statistic
allocates L x S. The LSE limits below are the settings' fold_lse_limit and
exact_lse_limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from sdpa import masks, settings
from sdpa.inputs import sink_rows

LOG2E = 1.0 / math.log(2.0)


class Rows(NamedTuple):
    """Query rows of the weights, with what it takes to rebuild them.

    q (B, H, n, E); k (B, Hkv, S, E), query head h on key head h // (H // Hkv);
    lse (B, H, n); mask (B|1, H|1, n, S) bool (True = takes part) or float (added), a
    structured mask (batch dim B, if any), or None; q_pos (n,): the rows' query
    positions among the L of the attention; causal: top-left causal masking on top.
    softcap and sinks as in sdpa.masks.ScoreMod (lse includes the sinks).
    A selection of keys (reads over the key dim, w[..., J]): k (B, Hkv, m, E) holds
    them, k_pos (m,) their positions among the S keys of the attention, the tensor mask
    its m columns; rows then cost O(n x m). Exact rows (|lse| > exact_lse_limit)
    need every key: such a selection is refused (callers read whole rows instead).
    """

    q: torch.Tensor
    k: torch.Tensor
    lse: torch.Tensor
    mask: torch.Tensor | masks.Mask | None
    q_pos: torch.Tensor
    causal: bool
    L: int
    scale: float
    dtype: torch.dtype  # compute dtype: float32 for 16-bit inputs
    softcap: float | None = None  # scores s -> softcap * tanh(s / softcap) before the mask
    sinks: torch.Tensor | None = None  # (B, H, n|1) sink logits, already inside lse
    k_pos: torch.Tensor | None = None  # (m,) positions of the keys in k; None: 0..S-1
    S: int | None = None  # the attention's key count when k holds a selection

    @property
    def key_count(self) -> int:
        """S of the attention (not of the selection k holds)."""
        return self.k.shape[2] if self.S is None else self.S

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, n, S)"""
        B, H, n, _ = self.q.shape
        return B, H, n, self.k.shape[2]

    def tiles(self, budget: int) -> Iterator[tuple[int, slice, slice]]:
        """(b, heads, rows) pieces of at most `budget` bytes of weights: whole batch
        elements when one fits, else row chunks of one head at a time."""
        B, H, n, S = self.shape
        item = torch.finfo(self.dtype).bits // 8
        if H * n * S * item <= budget:
            for b in range(B):
                yield b, slice(0, H), slice(0, n)
            return
        step = max(1, budget // max(1, S * item))
        for b in range(B):
            for h in range(H):
                for r0 in range(0, n, step):
                    yield b, slice(h, h + 1), slice(r0, min(n, r0 + step))

    def tile(self, b: int, heads: slice, rows: slice) -> Rows:
        """The sub-selection of batch element b, a head range and a row range."""
        H, Hkv = self.q.shape[1], self.k.shape[1]
        if heads != slice(0, H):  # one head: its key head
            kv = heads.start // (H // Hkv)
            k = self.k[b : b + 1, kv : kv + 1]
        else:
            k = self.k[b : b + 1]
        mask = self.mask
        if isinstance(mask, masks.Mask):
            keep = mask.keep(self.q_pos[rows], _key_positions(self), self.L, self.key_count)
            mask = keep[b if keep.shape[0] > 1 else 0][None, None]  # (1, 1, r, S)
        elif mask is not None:
            mb = slice(b, b + 1) if mask.shape[0] > 1 else slice(0, 1)
            mask = mask[mb, heads if mask.shape[1] > 1 else slice(0, 1), rows]
        return self._replace(
            q=self.q[b : b + 1, heads, rows],
            k=k,
            lse=self.lse[b : b + 1, heads, rows],
            mask=mask,
            q_pos=self.q_pos[rows],
            sinks=None if self.sinks is None else sink_rows(self.sinks[b : b + 1, heads], rows),
        )

    def with_tensor_mask(self) -> Rows:
        """A structured mask materialised for these rows: (B|1, 1, n, S) bool."""
        if not isinstance(self.mask, masks.Mask):
            return self
        keep = self.mask.keep(self.q_pos, _key_positions(self), self.L, self.key_count)
        return self._replace(mask=keep[:, None])


def _key_positions(r: Rows) -> torch.Tensor:
    """(m,) positions among the attention's S of the keys k holds."""
    return torch.arange(r.k.shape[2], device=r.k.device) if r.k_pos is None else r.k_pos


def log2_probabilities(r: Rows, out: torch.Tensor | None = None) -> torch.Tensor:
    """log2 of the weights, (B, H, n, S): -inf where a key is excluded.

    Two ways to the same numbers, both ending in exp2 (~3x faster than exp on CPU):
    - fold: the LSE folded into one GEMM, [c*scale*q_i, -c*lse_i] . [k_j, 1] =
      c*(s_ij - lse_i), c = log2(e). Fastest; its rounding grows like eps * |lse|, so it
      serves tiles whose |lse| <= fold_lse_limit, without a softcap.
    - mirror: the scores rounded as the fused kernel rounds the ones its LSE sums,
      s = fl(q.k * scale) + bias, then s - lse first (exact near the large weights,
      where s ~ lse), then * c: the kernel's own precision, for three more passes.
    Rows with |lse| > exact_lse_limit are recomputed as log_softmax of their scores
    (with the sink in the denominator). (Limits: sdpa.settings.)
    """
    r = r.with_tensor_mask()
    additive = r.mask is not None and r.mask.dtype != torch.bool
    tuning = settings.get()
    if r.softcap is None and not (r.lse.abs() > tuning.fold_lse_limit).any():
        cd = r.dtype
        k = r.k.to(cd)
        q_aug = torch.cat(
            [r.q.to(cd) * (r.scale * LOG2E), r.lse[..., None].to(cd) * -LOG2E], dim=-1
        )  # (B, H, n, E+1)
        k_aug = torch.cat([k, k.new_ones(*k.shape[:-1], 1)], dim=-1)  # (B, Hkv, S, E+1)
        t = _grouped_scores(q_aug, k_aug, out)  # (B, H, n, S)
        if additive:
            t.add_(r.mask, alpha=LOG2E)
        return _exclude(t, r)
    t = _grouped_scores(r.q.to(r.dtype), r.k.to(r.dtype), out).mul_(r.scale)  # (B, H, n, S)
    if r.softcap is not None:
        t.div_(r.softcap).tanh_().mul_(r.softcap)
    if additive:
        t.add_(r.mask)
    inexact = r.lse.abs() > tuning.exact_lse_limit  # (B, H, n)
    exact = None
    if inexact.any():
        if r.k_pos is not None:  # see needs_every_key
            raise ValueError("rows with |lse| > exact_lse_limit need every key, not a selection")
        exact = _exclude(t.clone(), r)
        if r.sinks is not None:  # the sink's column in the denominator
            column = r.sinks[..., None].to(exact.dtype).expand(*exact.shape[:-1], 1)
            exact = torch.log_softmax(torch.cat([exact, column], dim=-1), dim=-1)[..., :-1]
        else:  # (log_softmax subtracts the row max first: exact where s ~ big bias)
            exact = torch.log_softmax(exact, dim=-1)
        exact.mul_(LOG2E).nan_to_num_(nan=-torch.inf)  # rows that see no key
    t.sub_(r.lse[..., None].to(r.dtype)).mul_(LOG2E)
    _exclude(t, r)
    if exact is not None:
        torch.where(inexact[..., None], exact, t, out=t)
    return t


def needs_every_key(lse: torch.Tensor) -> bool:
    """Whether rows with this LSE are recomputed exactly (log_softmax over all their
    keys), so a selection of keys cannot serve them."""
    return bool((lse.abs() > settings.get().exact_lse_limit).any())


def probabilities(r: Rows, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weights, (B, H, n, S), written into `out` when given."""
    return log2_probabilities(r, out).exp2_()


def dense(r: Rows) -> torch.Tensor:
    """The weights (B, H, n, S), tile by tile into one output."""
    if 0 in r.shape:
        return r.q.new_zeros(r.shape, dtype=r.dtype)
    tiles = list(r.tiles(settings.get().chunk_bytes))
    if len(tiles) == 1:
        return probabilities(r)
    out = torch.empty(r.shape, dtype=r.dtype, device=r.q.device)
    for b, heads, rows in tiles:
        probabilities(r.tile(b, heads, rows), out=out[b : b + 1, heads, rows])
    return out


def _scratch(r: Rows, budget: int) -> torch.Tensor:
    """One reusable buffer for the largest tile (fresh pages fault on every allocation)."""
    _, H, n, S = r.shape
    item = torch.finfo(r.dtype).bits // 8
    size = H * n * S if H * n * S * item <= budget else min(n, max(1, budget // (S * item))) * S
    return torch.empty(size, dtype=r.dtype, device=r.q.device)


def _each_tile(r: Rows) -> Iterator[tuple[int, slice, slice, torch.Tensor]]:
    """(b, heads, rows, log2 weights of the tile), reusing one buffer."""
    budget = settings.get().chunk_bytes
    scratch = _scratch(r, budget)
    if 0 in r.shape:
        return
    for b, heads, rows in r.tiles(budget):
        tile = r.tile(b, heads, rows)
        shape = tile.shape
        yield b, heads, rows, log2_probabilities(tile, out=scratch[: math.prod(shape)].view(shape))


def key_sums(r: Rows) -> torch.Tensor:
    """sum over the rows of the weights: the attention each key receives, (B, H, S)."""
    B, H, _, S = r.shape
    out = torch.zeros(B, H, S, dtype=r.dtype, device=r.q.device)
    for b, heads, _, t in _each_tile(r):
        out[b : b + 1, heads] += t.exp2_().sum(dim=-2)
    return out


def entropy(r: Rows) -> torch.Tensor:
    """-sum_j p_ij ln p_ij per row, (B, H, n), in nats; 0 for rows that see no key."""
    B, H, n, _ = r.shape
    out = torch.zeros(B, H, n, dtype=r.dtype, device=r.q.device)
    for b, heads, rows, t in _each_tile(r):
        p_log2p = t.exp2().mul_(t).nan_to_num_(nan=0.0)  # 0 * -inf -> 0 where excluded
        out[b : b + 1, heads, rows] = p_log2p.sum(dim=-1).mul_(-1.0 / LOG2E)
    return out


def topk(r: Rows, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest weights of each row and their key indices, each (B, H, n, k). Top-k
    of p is top-k of log p: only the k winners are exponentiated."""
    B, H, n, _ = r.shape
    values = torch.empty(B, H, n, k, dtype=r.dtype, device=r.q.device)
    indices = torch.empty(B, H, n, k, dtype=torch.long, device=r.q.device)
    for b, heads, rows, t in _each_tile(r):
        top, idx = t.topk(k, dim=-1)
        values[b : b + 1, heads, rows] = top.exp2_()
        indices[b : b + 1, heads, rows] = idx
    return values, indices


def _exclude(t: torch.Tensor, r: Rows) -> torch.Tensor:
    """-inf, in place, where causality or a bool mask excludes a key."""
    if r.causal:  # top-left
        t.masked_fill_(masks.visible_grid(r.q_pos, _key_positions(r)).logical_not_(), -torch.inf)
    if r.mask is not None and r.mask.dtype == torch.bool:
        t.masked_fill_(~r.mask, -torch.inf)
    return t


def _grouped_scores(
    q: torch.Tensor, k: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q (B, H, n, D) @ k (B, Hkv, S, D)^T -> (B, H, n, S) with query head h on key head
    h // (H // Hkv): the heads sharing a key head are folded into rows, no copy of k."""
    B, H, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    folded = q.reshape(B, Hkv, H // Hkv * n, D)
    if out is None:
        return torch.matmul(folded, k.transpose(-2, -1)).view(B, H, n, S)
    torch.matmul(folded, k.transpose(-2, -1), out=out.view(B, Hkv, H // Hkv * n, S))
    return out


def pair_probabilities(r: Rows, qi: torch.Tensor, kj: torch.Tensor) -> torch.Tensor:
    """The weights at P (query, key) pairs, (B, H, P): qi, kj (1|B, P) positions among
    the rows' queries and the attention's keys (r holds every query row and key)."""
    B, H, _, E = r.q.shape
    Hkv, P = r.k.shape[1], qi.shape[-1]
    cd = r.dtype
    q = r.q.to(cd).gather(2, qi[:, None, :, None].expand(B, H, P, E))  # (B, H, P, E)
    k = r.k.to(cd).gather(2, kj[:, None, :, None].expand(B, Hkv, P, E))  # (B, Hkv, P, E)
    s = (q.view(B, Hkv, H // Hkv, P, E) * k[:, :, None]).sum(-1).view(B, H, P) * r.scale
    if r.softcap is not None:
        s = torch.tanh(s / r.softcap) * r.softcap
    mask = r.mask
    if isinstance(mask, masks.Mask):
        if qi.shape[0] == 1:  # pairs shared by every batch element
            keep = mask.keep_pairs(qi[0], kj[0], r.L, r.key_count)  # (Bm, P)
        else:
            keep = torch.stack(
                [
                    mask.keep_pairs(qi[b], kj[b], r.L, r.key_count)[b if mask.batch else 0]
                    for b in range(qi.shape[0])
                ]
            )  # (B, P)
        s = s.masked_fill(~keep[:, None], -torch.inf)
    elif mask is not None:
        Bm = max(mask.shape[0], qi.shape[0])
        b = torch.arange(Bm, device=qi.device)[:, None]
        picked = mask.expand(Bm, *mask.shape[1:])[b, :, qi, kj].permute(0, 2, 1)  # (Bm, Hm, P)
        s = s.masked_fill(~picked, -torch.inf) if picked.dtype == torch.bool else s + picked
    if r.causal:
        s = s.masked_fill(~masks.visible(qi, kj)[:, None], -torch.inf)  # top-left, elementwise
    lse = r.lse.gather(2, qi[:, None].expand(B, H, P))  # (B, H, P)
    return torch.exp(s - lse)
