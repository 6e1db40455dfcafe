"""The ring: attention of this rank's query rows over every rank's key/value shard.

Each rank holds a shard of the queries and of the keys/values, of any size (zero
included), cut by a layout (sdpa.distributed.layout). The ring runs in R steps: at step
s every rank sends its own key/value shard to rank r + s and attends to the one of rank
r - s, the next step's transfer running while the current shard is attended to; the
partial results merge exactly by their log-sum-exps. A pair of ranks whose shards share
no visible (query, key) entry (causality, documents, windows: decided before any work)
sends nothing: with full visibility each rank sends R - 1 shards, as a ring does, and
with packed documents only the shards some query needs. The backward pass runs the
same steps: each rank computes the gradient of the shard it holds at step s and sends
it straight back to its owner, which sums what arrives.

Per rank the forward holds its shards, the key/value shard arriving and the output
accumulator: memory falls as 1/ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sdpa import masks, tile
from sdpa.distributed import kernels, plan
from sdpa.distributed.comm import Ring
from sdpa.distributed.layout import Run
from sdpa.inputs import compute_dtype


class Setup(NamedTuple):
    """What every ring step needs (the same on every rank but `ring.rank`)."""

    ring: Ring
    q_runs: list[list[Run]]  # every rank's query runs (global positions)
    k_runs: list[list[Run]]  # every rank's key runs
    mask: masks.Mask | None
    causal: bool
    scale: float
    L: int
    S: int
    need: list[list[bool]]  # need[i][j]: rank i's queries see some key of rank j's shard

    def calls(self, src: int, device: torch.device):
        q_runs = self.q_runs[self.ring.rank]
        return plan.calls(q_runs, self.k_runs[src], self.mask, self.causal, self.L, self.S, device)

    def size(self, src: int) -> int:
        return sum(r.length for r in self.k_runs[src])

    def peers(self, step: int) -> tuple[int, int]:
        """(src, dst) of a step: the rank whose shard this one attends to, and the rank
        that attends to this one's."""
        me, world = self.ring.rank, self.ring.world
        return (me - step) % world, (me + step) % world


def make_setup(ring, q_runs, k_runs, mask, causal, scale, L, S, device) -> Setup:
    """The setup of a ring call, with its need matrix: from the runs alone without a
    mask; with one, each rank evaluates its own row and the ranks exchange them."""
    rows = [
        [plan.needs(qr, kr, mask, causal, L, S, device) for kr in k_runs]
        for qr in (q_runs if mask is None else [q_runs[ring.rank]])
    ]
    if mask is not None:
        headers = ring.agree({"need": rows[0]}, device, "ring attention's plan")
        rows = [h["need"] for h in headers]
    return Setup(ring, q_runs, k_runs, mask, causal, scale, L, S, rows)


def _kv_step(setup: Setup, step: int, k, v, what: str):
    """Start a step's key/value transfer: this rank's shard to the rank that needs it
    at this step, the shard this rank needs into fresh buffers. Returns (buffers or
    None, works)."""
    src, dst = setup.peers(step)
    me = setup.ring.rank
    sends = {dst: [k, v]} if setup.need[dst][me] else {}
    arriving = None
    if setup.need[me][src]:
        m = setup.size(src)
        arriving = (
            k.new_empty(*k.shape[:2], m, k.shape[3]),
            v.new_empty(*v.shape[:2], m, v.shape[3]),
        )
    recvs = {src: list(arriving)} if arriving else {}
    return arriving, setup.ring.start(sends, recvs, "kv")


def _steps(setup: Setup, k, v, what: str):
    """(step, src, the shard of src or None) for every step, each transfer overlapping
    the step before it."""
    ring = setup.ring
    current = (k, v) if setup.need[ring.rank][ring.rank] else None
    for step in range(ring.world):
        upcoming = _kv_step(setup, step + 1, k, v, what) if step + 1 < ring.world else None
        yield step, setup.peers(step)[0], current
        if upcoming is not None:
            arriving, works = upcoming
            ring.finish(works, f"{what} ring step {step + 1}")
            current = arriving


def ring_forward(setup: Setup, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, n, E), k (B, Hkv, m, E), v (B, Hkv, m, Ev) -> out (B, Hq, n, Ev),
    lse (B, Hq, n)."""
    cd = compute_dtype(q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=cd, device=q.device)  # (B, Hq, n, Ev)
    acc_lse = torch.full(q.shape[:-1], -torch.inf, dtype=cd, device=q.device)  # (B, Hq, n)
    qc = q.to(cd)  # 16-bit inputs: blocks in float32, so the merge adds no rounding
    for _, src, shard in _steps(setup, k.contiguous(), v.contiguous(), "forward"):
        if shard is None:
            continue
        kk, vv = (t.to(cd) for t in shard)  # (B, Hkv, m, E), (B, Hkv, m, Ev)
        for c in setup.calls(src, q.device):
            out, lse = kernels.forward(
                qc[:, :, c.rows], kk[:, :, c.cols], vv[:, :, c.cols],
                plan.bias(c.keep, cd), c.causal, setup.scale,
            )  # fmt: skip
            lse = tile.unsettled(lse, c.alive)  # rows that saw no key here: -inf to merge
            merged, new = tile.merge(acc[:, :, c.rows], acc_lse[:, :, c.rows], out, lse)
            acc[:, :, c.rows], acc_lse[:, :, c.rows] = merged, new
    lse = tile.settle(acc_lse)  # rows that saw no key anywhere: lse 0
    return acc.to(q.dtype), lse


def ring_backward(setup: Setup, q, k, v, out, lse, dout):
    """The gradients of q, k and v. At each step this rank computes the gradient of the
    shard it holds and sends it to the shard's owner (over the next step), and receives
    its own shard's gradient from the rank that held it."""
    ring, me = setup.ring, setup.ring.rank
    cd = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)  # this rank's own shard's
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    dout = dout.contiguous()
    in_flight: tuple[list, tuple | None] = ([], None)  # the last step's share transfer

    def land() -> None:  # wait for the shares in flight, add the one that came home
        works, got = in_flight
        ring.finish(works, "backward: the gradients of the key/value shards")
        if got is not None:
            dk.add_(got[0])
            dv.add_(got[1])

    for step, src, shard in _steps(setup, k.contiguous(), v.contiguous(), "backward"):
        share = None
        if shard is not None:
            kk, vv = shard
            share = (
                (dk, dv)
                if step == 0
                else (kk.new_zeros(kk.shape, dtype=cd), vv.new_zeros(vv.shape, dtype=cd))
            )
            for c in setup.calls(src, q.device):
                r = c.rows
                gq, gk, gv = kernels.backward(
                    dout[:, :, r], q[:, :, r], kk[:, :, c.cols], vv[:, :, c.cols],
                    out[:, :, r], lse[:, :, r].contiguous(),
                    plan.bias(c.keep, q.dtype), c.causal, setup.scale,
                )  # fmt: skip
                dq[:, :, r] += gq
                share[0][:, :, c.cols] += gk
                share[1][:, :, c.cols] += gv
        if step == 0:
            continue
        dst = setup.peers(step)[1]
        coming = (torch.empty_like(dk), torch.empty_like(dv)) if setup.need[dst][me] else None
        works = ring.start(
            {src: list(share)} if share is not None else {},
            {dst: list(coming)} if coming is not None else {},
            "grad",
        )
        land()
        in_flight = (works, coming)
    land()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup):
        out, lse = ring_forward(setup, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.setup, q, k, v, out, lse, dout)
        return dq, dk, dv, None
