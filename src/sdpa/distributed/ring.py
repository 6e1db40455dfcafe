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


def _kv_step(setup: Setup, step: int, shard: tuple):
    """Start a step's key/value transfer: this rank's shard (k, v and its key padding,
    if any) to the rank that needs it at this step, the shard this rank needs into fresh
    buffers. Returns (buffers or None, works)."""
    src, dst = setup.peers(step)
    me = setup.ring.rank
    k, v, keys = shard
    sends = {dst: [k, v]} if setup.need[dst][me] else {}
    arriving = None
    if setup.need[me][src]:
        m = setup.size(src)
        arriving = (
            k.new_empty(*k.shape[:2], m, k.shape[3]),
            v.new_empty(*v.shape[:2], m, v.shape[3]),
            None if keys is None else keys.new_empty(keys.shape[0], m),
        )
    recvs = {src: list(arriving[:2])} if arriving else {}
    works = setup.ring.start(sends, recvs, "kv")
    if keys is not None:  # (B, m) bool, as bytes
        mask_sends = {p: [keys.view(torch.uint8)] for p in sends}
        mask_recvs = {src: [arriving[2].view(torch.uint8)]} if arriving else {}
        works += setup.ring.start(mask_sends, mask_recvs, "mask")
    return arriving, works


def _steps(setup: Setup, k, v, keys, what: str):
    """(step, src, the shard of src (k, v, key padding) or None) for every step, each
    transfer overlapping the step before it."""
    ring = setup.ring
    own = (k.contiguous(), v.contiguous(), None if keys is None else keys.contiguous())
    current = own if setup.need[ring.rank][ring.rank] else None
    for step in range(ring.world):
        upcoming = _kv_step(setup, step + 1, own) if step + 1 < ring.world else None
        yield step, setup.peers(step)[0], current
        if upcoming is not None:
            arriving, works = upcoming
            ring.finish(works, f"{what} ring step {step + 1}")
            current = arriving


def _bias(c: plan.Call, rows: torch.Tensor | None, keys: torch.Tensor | None, dtype):
    """A call's mask: (additive bias (..., r|1, c) or None, causal for the kernel, alive
    (..., r|1) where some key is kept or None: c.alive holds). The structured keep, the
    rows mask's block and the held shard's key padding meet by masks.combine; with a
    tensor part, the kernel's causality is folded into the bias so that alive reads it."""
    if rows is None and keys is None:
        return plan.bias(c.keep, dtype), c.causal, None
    tensor = (
        None if rows is None else rows[:, :, c.rows if rows.shape[-2] > 1 else slice(None), c.kpos]
    )
    if tensor is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if keys is not None:
        tensor = masks.combine(tensor, keys[:, None, None, c.cols])  # (B, 1, 1, c)
    if c.keep is not None:
        tensor = masks.combine(tensor, c.keep[:, None])  # (Bm, 1, r, c)
    if c.causal:
        r, k = c.rows.stop - c.rows.start, c.cols.stop - c.cols.start
        tensor = masks.combine(
            tensor, torch.ones(r, k, dtype=torch.bool, device=tensor.device).tril()
        )
    bias = tile.additive(tensor, dtype)
    return bias, False, (bias > -torch.inf).any(dim=-1)


def _fold(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """grad (B, Hq, r, c) summed over the dims where `like` (Bm, Hm, r|1, c) broadcasts."""
    dims = [d for d in range(3) if like.shape[d] == 1 and grad.shape[d] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def ring_forward(setup: Setup, q, k, v, rows=None, keys=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, n, E), k (B, Hkv, m, E), v (B, Hkv, m, Ev), rows mask (Bm, Hm, n|1, S)
    or None, key padding (B, m) bool or None -> out (B, Hq, n, Ev), lse (B, Hq, n)."""
    cd = compute_dtype(q.dtype)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=cd, device=q.device)  # (B, Hq, n, Ev)
    acc_lse = torch.full(q.shape[:-1], -torch.inf, dtype=cd, device=q.device)  # (B, Hq, n)
    qc = q.to(cd)  # 16-bit inputs: blocks in float32, so the merge adds no rounding
    for _, src, shard in _steps(setup, k, v, keys, "forward"):
        if shard is not None:
            _attend(setup, src, shard, qc, acc, acc_lse, rows)
        del shard  # before the next step's buffers are made: two shards in memory, not three
    lse = tile.settle(acc_lse)  # rows that saw no key anywhere: lse 0
    return acc.to(q.dtype), lse


def _attend(setup: Setup, src: int, shard: tuple, qc, acc, acc_lse, rows) -> None:
    """Fold the attention of this rank's rows over src's shard into acc, acc_lse."""
    cd = qc.dtype
    kk, vv = (t.to(cd) for t in shard[:2])  # (B, Hkv, m, E), (B, Hkv, m, Ev)
    for c in setup.calls(src, qc.device):
        bias, causal, alive = _bias(c, rows, shard[2], cd)
        out, lse = kernels.forward(
            qc[:, :, c.rows], kk[:, :, c.cols], vv[:, :, c.cols], bias, causal, setup.scale
        )
        lse = tile.unsettled(lse, c.alive if alive is None else alive)  # -inf: saw no key
        merged, new = tile.merge(acc[:, :, c.rows], acc_lse[:, :, c.rows], out, lse)
        acc[:, :, c.rows], acc_lse[:, :, c.rows] = merged, new


def ring_backward(setup: Setup, q, k, v, out, lse, dout, rows=None, keys=None, want=False):
    """The gradients of q, k and v, and of the rows mask where `want` (else None). At
    each step this rank computes the gradient of the shard it holds and sends it to the
    shard's owner (over the next step), and receives its own shard's gradient from the
    rank that held it."""
    ring, me = setup.ring, setup.ring.rank
    cd = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)  # this rank's own shard's
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    drows = torch.zeros(rows.shape, dtype=cd, device=q.device) if want else None
    dout = dout.contiguous()
    in_flight: tuple[list, tuple | None] = ([], None)  # the last step's share transfer

    def land() -> None:  # wait for the shares in flight, add the one that came home
        works, got = in_flight
        ring.finish(works, "backward: the gradients of the key/value shards")
        if got is not None:
            dk.add_(got[0])
            dv.add_(got[1])

    for step, src, shard in _steps(setup, k, v, keys, "backward"):
        share = None
        if shard is not None:
            share = (
                (dk, dv) if step == 0 else tuple(t.new_zeros(t.shape, dtype=cd) for t in shard[:2])
            )
            _differentiate(setup, src, shard, share, q, out, lse, dout, dq, rows, drows)
        del shard  # before the next step's buffers are made
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
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return (*grads, None if drows is None else drows.to(rows.dtype))


def _differentiate(setup, src, shard, share, q, out, lse, dout, dq, rows, drows) -> None:
    """Add this rank's rows' share of the gradients over src's shard: into dq, the
    shard's (dk, dv) `share`, and drows (a float rows mask's, or None)."""
    cd = dq.dtype
    kk, vv = shard[:2]
    for c in setup.calls(src, q.device):
        r = c.rows
        bias, causal, _ = _bias(c, rows, shard[2], q.dtype)
        dbias = None
        if drows is not None:
            dbias = q.new_empty(
                *q.shape[:2], r.stop - r.start, c.cols.stop - c.cols.start, dtype=cd
            )
        gq, gk, gv = kernels.backward(
            dout[:, :, r], q[:, :, r], kk[:, :, c.cols], vv[:, :, c.cols],
            out[:, :, r], lse[:, :, r].contiguous(), bias, causal, setup.scale, dbias,
        )  # fmt: skip
        dq[:, :, r] += gq
        share[0][:, :, c.cols] += gk
        share[1][:, :, c.cols] += gv
        if drows is not None:
            rr = r if rows.shape[-2] > 1 else slice(None)
            drows[:, :, rr, c.kpos] += _fold(dbias, rows)


class RingFunction(torch.autograd.Function):
    """(q, k, v, rows mask or None, key padding or None, setup) -> (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, rows, keys, setup):
        out, lse = ring_forward(setup, q, k, v, rows, keys)
        ctx.save_for_backward(q, k, v, out, lse, rows, keys)
        ctx.setup = setup
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, rows, keys = ctx.saved_tensors
        want = ctx.needs_input_grad[3]  # a float rows mask's gradient
        dq, dk, dv, drows = ring_backward(ctx.setup, q, k, v, out, lse, dout, rows, keys, want)
        return dq, dk, dv, drows, None, None
