"""ring_attention: attention over a sequence sharded across the ranks of a process group.

Each rank holds a shard of the queries and of the keys/values. Key/value shards travel
around the ring (rank r sends to r+1, receives from r-1), the next transfer running
while the current shard is attended to; the partial results of each shard are merged
exactly by their log-sum-exps. The backward pass is a second ring: each shard's dK/dV
accumulate as it travels and arrive home after one more hop.

Per rank the forward holds its shards, the key/value shard arriving (two buffers that
alternate from 3 ranks on) and the output accumulator: memory falls as 1/ranks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sdpa import masks, tile
from sdpa.distributed import kernels, plan
from sdpa.distributed.comm import Ring, RingError, mask_digest, valid_timeout
from sdpa.distributed.layout import check_layout, runs
from sdpa.distributed.weights import RingWeights
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.functional import AttentionResult
from sdpa.inputs import check_structured, compute_dtype, normalize

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for its peers before raising


class _Setup(NamedTuple):
    """What every ring step needs (the same on every rank but `ring.rank`)."""

    ring: Ring
    n: int  # queries per shard
    m: int  # keys per shard
    mask: masks.Mask | None
    causal: bool
    scale: float
    layout: str

    @property
    def L(self) -> int:
        return self.n * self.ring.world

    @property
    def S(self) -> int:
        return self.m * self.ring.world

    def calls(self, src: int, device: torch.device):
        world = self.ring.world
        q_runs = runs(self.n, self.ring.rank, world, self.layout)
        k_runs = runs(self.m, src, world, self.layout)
        return plan.calls(q_runs, k_runs, self.mask, self.causal, self.L, self.S, device)


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat buffer (numel k + numel v,) as views k (B, Hkv, m, E), v (B, Hkv, m, Ev)."""
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


class _Shards:
    """The key/value shard a rank attends to at each step, and the buffers the next one
    arrives in: step 0 sends the rank's own k and v (no copy), later steps pass on
    what arrived. Two buffers alternate (one for 2 ranks, none for 1)."""

    def __init__(self, ring: Ring, k: torch.Tensor, v: torch.Tensor):
        self.ring = ring
        self.current = (k.contiguous(), v.contiguous())  # (B, Hkv, m, E), (B, Hkv, m, Ev)
        self.buffers = [
            tuple(torch.empty_like(t) for t in self.current) for _ in range(min(2, ring.world - 1))
        ]
        self.arriving = None

    def start(self, step: int) -> list:
        """Start the transfer that brings the next step's shard (none at the last)."""
        if step == self.ring.world - 1:
            return []
        self.arriving = self.buffers[step % len(self.buffers)]
        return self.ring.start_rotate(self.current, self.arriving)

    def finish(self, works: list, step: int, what: str) -> None:
        if self.arriving is not None:
            self.ring.finish(works, step, what)
            self.current, self.arriving = self.arriving, None


def _merge(acc, acc_lse, out, lse) -> None:
    """Fold one block's (out, lse) into the running ones, in place (the tile rule's
    merge); lse -inf = no key."""
    merged, new = tile.merge(acc, acc_lse, out, lse)
    acc.copy_(merged)
    acc_lse.copy_(new)


def _ring_forward(setup: _Setup, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, n, E), k (B, Hkv, m, E), v (B, Hkv, m, Ev) -> out (B, Hq, n, Ev),
    lse (B, Hq, n)."""
    ring = setup.ring
    cd = compute_dtype(q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=cd, device=q.device)  # (B, Hq, n, Ev)
    acc_lse = torch.full(q.shape[:-1], -torch.inf, dtype=cd, device=q.device)  # (B, Hq, n)
    shards = _Shards(ring, k, v)
    qc = q.to(cd)  # 16-bit inputs: blocks in float32, so the merge adds no rounding
    for step in range(ring.world):
        works = shards.start(step)
        kk, vv = (t.to(cd) for t in shards.current)  # (B, Hkv, m, E), (B, Hkv, m, Ev)
        for c in setup.calls((ring.rank - step) % ring.world, q.device):
            out, lse = kernels.forward(
                qc[:, :, c.rows], kk[:, :, c.cols], vv[:, :, c.cols],
                plan.bias(c.keep, cd), c.causal, setup.scale,
            )  # fmt: skip
            lse = tile.unsettled(lse, c.alive)  # rows that saw no key here: -inf to merge
            _merge(acc[:, :, c.rows], acc_lse[:, :, c.rows], out, lse)
        shards.finish(works, step, "forward")
    lse = tile.settle(acc_lse)  # rows that saw no key anywhere: lse 0
    return acc.to(q.dtype), lse


def _ring_backward(setup: _Setup, q, k, v, out, lse, dout):
    """The gradients of q, k and v. Each shard's dK/dV accumulate as it travels: a step's
    share is computed into `share` while the accumulator from the previous rank is still
    arriving, then added and sent on; one hop more than K/V brings it home."""
    ring = setup.ring
    cd = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    shards = _Shards(ring, k, v)
    share = torch.empty(k.numel() + v.numel(), dtype=cd, device=q.device)  # step's dK, dV
    dkv = torch.empty_like(share)  # the accumulator arriving with the shard
    dspare = torch.empty_like(share)
    dworks: list = []
    dout = dout.contiguous()
    for step in range(ring.world):
        works = shards.start(step)
        kk, vv = shards.current
        share.zero_()
        dk, dv = _unpack(share, k.shape, v.shape)
        for c in setup.calls((ring.rank - step) % ring.world, q.device):
            r = c.rows
            gq, gk, gv = kernels.backward(
                dout[:, :, r], q[:, :, r], kk[:, :, c.cols], vv[:, :, c.cols],
                out[:, :, r], lse[:, :, r].contiguous(),
                plan.bias(c.keep, q.dtype), c.causal, setup.scale,
            )  # fmt: skip
            dq[:, :, r] += gq
            dk[:, :, c.cols] += gk
            dv[:, :, c.cols] += gv
        if step == 0:
            dkv.copy_(share)
        else:
            ring.finish(dworks, step - 1, "backward")
            dkv, dspare = dspare, dkv  # arrived: the accumulator of the shard held now
            dkv += share
        dworks = ring.start_rotate([dkv], [dspare])  # on to the next rank, over the next step
        shards.finish(works, step, "backward")
    ring.finish(dworks, ring.world - 1, "backward")
    dk, dv = _unpack(dspare, k.shape, v.shape)  # home: this rank's own shard
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup):
        out, lse = _ring_forward(setup, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.setup, q, k, v, out, lse, dout)
        return dq, dk, dv, None


def _header(query, key, value, mask, causal, scale, layout, timeout, world):
    """This rank's view of the call, validated: (what every rank must agree on, the
    normalised inputs)."""
    if not valid_timeout(timeout):
        raise SdpaValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(mask, masks.ScoreMod):
        raise NotSupportedError(
            f"ring_attention does not run softcap or attention sinks yet, got {mask!r}; "
            f"use sdpa.attention on the gathered sequence"
        )
    if mask is not None and not isinstance(mask, masks.Mask):
        raise SdpaTypeError(
            f"ring_attention takes a structured mask (sdpa.masks: padding, documents, "
            f"causal, sliding_window and their combinations), which every rank evaluates at "
            f"its own positions; got {type(mask).__name__}. For key padding use "
            f"sdpa.masks.padding(lengths)"
        )
    check_layout(layout)
    inputs = normalize(query, key, value, None, scale=scale)
    n, m = inputs.query.shape[2], inputs.key.shape[2]
    if causal and n != m:
        raise SdpaValueError(
            f"causal=True needs as many queries as keys per shard, got query {n} and key {m} "
            f"positions along dim -2"
        )
    for name, length in (("query", n), ("key", m)):
        if layout == "zigzag" and length % 2:
            raise SdpaValueError(
                f"layout='zigzag' needs an even shard length (two chunks per rank), got "
                f"{name} shards of {length}; pad the sequence to a multiple of {2 * world}"
            )
    if mask is not None:  # the same rule as sdpa.attention's, at the whole sequence's size
        has_heads = max(t.ndim for t in (query, key, value)) >= 4
        batch = inputs.lead[:-1] if has_heads else inputs.lead
        check_structured(mask, batch, n * world, m * world)
    header = {
        "query": list(query.shape),
        "key": list(key.shape),
        "value": list(value.shape),
        "dtype": str(query.dtype),
        "device": query.device.type,
        "causal": bool(causal),
        "scale": inputs.scale,
        "layout": layout,
        "mask": mask_digest(mask),
    }
    return header, inputs


def _check_agreement(headers: list[dict], rank: int) -> None:
    differ = [key for key in headers[0] if any(h.get(key) != headers[0][key] for h in headers)]
    if differ:
        seen = "; ".join(
            f"{key}: " + ", ".join(f"rank {r} {h.get(key)}" for r, h in enumerate(headers))
            for key in differ
        )
        raise RingError(
            f"rank {rank}: the ranks called ring_attention with different arguments ({seen}). "
            f"Every rank passes a shard of the same shape (the sequence cut into equal "
            f"parts along dim -2) with the same dtype, mask, causal, scale and layout"
        )


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: masks.Mask | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    group=None,
    timeout: float = DEFAULT_TIMEOUT,
) -> AttentionResult:
    """Attention over a sequence sharded along dim -2 across the ranks of `group`.

    Shapes, per rank: query (..., n, E), key (..., m, E), value (..., m, Ev) -> output
    (..., n, Ev), this rank's rows of what `sdpa.attention` gives on the whole sequence
    (L = n * ranks queries, S = m * ranks keys); weights: lazy (..., n, S). Leading dims
    as in `sdpa.attention` (heads at dim -3 of 4-D inputs, GQA when key/value heads
    divide query heads).

    layout: how the sequence was cut ("contiguous", or "zigzag" to balance causal work;
    see sdpa.distributed.shard). mask: a structured mask (sdpa.masks) over the whole
    sequence's positions. causal: query i sees keys j <= i (global positions). A
    collective: every rank of `group` calls it with shards of the same shape, and
    backward through the output is a collective too. Every wait ends after `timeout`
    seconds with RingTimeoutError; ranks that disagree, or a rank whose arguments are
    invalid, make every rank raise.
    """
    ring = Ring(group, timeout if valid_timeout(timeout) else DEFAULT_TIMEOUT)
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    headers, inputs = ring.check_then_agree(
        lambda: _header(query, key, value, mask, causal, scale, layout, timeout, ring.world),
        device,
        (TypeError, ValueError),
    )
    _check_agreement(headers, ring.rank)
    q, k, v = inputs.query, inputs.key, inputs.value  # (B, Hq, n, E), (B, Hkv, m, E|Ev)
    setup = _Setup(ring, q.shape[2], k.shape[2], mask, bool(causal), inputs.scale, layout)
    out, lse = _RingFunction.apply(q, k, v, setup)  # (B, Hq, n, Ev), (B, Hq, n)
    out = out.reshape(*inputs.lead, q.shape[2], v.shape[-1])  # (..., n, Ev)
    rule = masks.TOP_LEFT if causal else None
    if mask is not None:
        rule = mask if rule is None else mask & rule
    weights = RingWeights(ring, query, key, lse, inputs.lead, rule, inputs.scale, layout)
    return AttentionResult(out, weights)
