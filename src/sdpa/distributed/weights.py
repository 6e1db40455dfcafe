"""RingWeights: a rank's lazy view of the attention weights of a sharded attention call
(ring, Ulysses or the hybrid: every scheme's weights are its rows over all S keys).

The rank answers for its own queries (rows, columns, entropy, top-k, row max, max
logits, KL against another call's weights) and for its own keys (attention received,
summed over every rank's queries). Each answer gathers the key shards (O(S * E) per
rank, never L x S) and is a collective: every rank of the group asks the same question
at the same time; a rank that never asks makes the others raise RingTimeoutError naming
the read.

The reads are differentiable, as AttentionWeights' are: with grad enabled, where this
rank's query or key shard requires grad, a read carries its gradient to the query shard
and, through the gathered keys, to every rank's key shard. Its backward is then a
collective too (each rank's gradient of the whole key sequence goes back to the shards'
owners, O(S * E)): every rank runs the backward of the same reads, as with the output's
backward. The ranks agree up front whether a read carries gradients, so one that differs
makes every rank raise at once.

Why not a torch.Tensor like AttentionWeights: a tensor's every operation (printing, an
index, numpy()) must be answerable by the one process that makes it, while every answer
here needs the other ranks' keys; a collective hidden behind `print(w)` would hang the
job the first time one rank logs it. So the ring's weights keep their own class, whose
reads are explicit calls every rank makes; `repr`, shape, dtype and device never
communicate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdpa import masks
from sdpa.budget import DEFAULT_MAX_BYTES
from sdpa.distributed import local_masks
from sdpa.distributed.comm import Ring, RingError, _count
from sdpa.distributed.layout import Run, index
from sdpa.errors import SdpaTypeError, SdpaValueError
from sdpa.inputs import normalize
from sdpa.weights import AttentionWeights, MaxLogits, StaleWeightsError, version_of


class _Rows(masks.Mask):
    """A whole-sequence mask seen from one shard's queries: local query index t is
    global position `pos[t]` of L."""

    def __init__(self, rule: masks.Mask, pos: torch.Tensor, L: int):
        self.rule, self.pos, self.L = rule, pos, L
        self.batch = rule.batch

    def validate(self, L, S):
        self.rule.validate(self.L, S)

    def keep(self, q_pos, k_pos, L, S):
        return self.rule.keep(self.pos.to(q_pos.device)[q_pos], k_pos, self.L, S)

    def blocks(self, L, S, bq, bk):
        """Occupancy a block row at a time: O(bq * S) memory."""
        k_pos = torch.arange(S)
        rows = [
            masks.occupancy(self.keep(torch.arange(r0, min(L, r0 + bq)), k_pos, L, S), bq, bk)
            for r0 in range(0, L, bq)
        ]
        return torch.cat(rows, dim=-2)  # (Bm, nQ, nK)

    def __repr__(self):
        return f"{self.rule!r} at {len(self.pos)} positions"


def gather(ring: Ring, x: torch.Tensor, runs: list[list[Run]], dim: int) -> torch.Tensor:
    """Every rank's x (its shard along `dim`, cut as `runs`) as the whole sequence in
    position order."""
    dim = dim % x.ndim
    x = x.contiguous()
    pieces = {
        r: x.new_empty(*x.shape[:dim], sum(run.length for run in rs), *x.shape[dim + 1 :])
        for r, rs in enumerate(runs)
        if r != ring.rank
    }
    others = list(pieces)
    ring.exchange(
        {r: [x] for r in others},
        {r: [pieces[r]] for r in others},
        "reads",
        "a read of the ring weights: the key shards",
    )
    pieces[ring.rank] = x
    S = sum(run.length for rs in runs for run in rs)
    whole = x.new_empty(*x.shape[:dim], S, *x.shape[dim + 1 :])
    for r, rs in enumerate(runs):
        whole.index_copy_(dim, index(rs).to(x.device), pieces[r])
    return whole


def scatter_sum(ring: Ring, whole: torch.Tensor, runs: list[list[Run]], dim: int) -> torch.Tensor:
    """The sum over the ranks of `whole` (a tensor over the whole sequence along dim),
    this rank's positions: each rank sends every other its positions' part."""
    dim = dim % whole.ndim
    parts = {r: whole.index_select(dim, index(rs).to(whole.device)) for r, rs in enumerate(runs)}
    mine = parts.pop(ring.rank)
    coming = {r: torch.empty_like(mine) for r in parts}
    ring.exchange(
        {r: [t] for r, t in parts.items()},
        {r: [t] for r, t in coming.items()},
        "reads",
        "a read of the ring weights: the sums over ranks",
    )
    for t in coming.values():
        mine = mine + t
    return mine


class _Gathered(torch.autograd.Function):
    """Every rank's key shard, as the whole sequence (..., S, E) in position order.
    Backward: each rank's gradient of the whole goes to the owners, who sum it: a
    collective, like the forward."""

    @staticmethod
    def forward(ctx, key, ring, runs):
        ctx.ring, ctx.runs = ring, runs
        return gather(ring, key, runs, -2)

    @staticmethod
    def backward(ctx, g):
        return scatter_sum(ctx.ring, g, ctx.runs, -2), None, None


class _Received(torch.autograd.Function):
    """Attention received per key from every rank's queries, this rank's keys: local
    (..., S) summed over the ranks at this rank's positions (..., m). Backward: every
    rank's gradient of its own keys, gathered into (..., S) (each rank's queries reach
    every rank's keys)."""

    @staticmethod
    def forward(ctx, local, ring, runs):
        ctx.ring, ctx.runs = ring, runs
        return scatter_sum(ring, local, runs, -1)

    @staticmethod
    def backward(ctx, g):
        return gather(ctx.ring, g, ctx.runs, -1), None, None


class RingWeights:
    """This rank's weights (..., n, S): its n queries against all S keys, lazily.

    Same questions as AttentionWeights, each a collective over the group: rows and
    columns (w[b, h, i] with i a local query index, w[..., j] with j a global key),
    full(), entropy(), topk(k), amax(), max_logits(), kl(other) for this rank's queries;
    sum(dim=-2) and mean(dim=-2) for this rank's keys, (..., m), counting the queries of
    every rank. Differentiable where the shards require grad (the backward of a read is
    then a collective: every rank runs it).
    """

    def __init__(
        self,
        ring: Ring,
        query,
        key,
        lse,
        lead,
        rule: masks.Mask | None,
        scale,
        q_runs: list[list[Run]],
        k_runs: list[list[Run]],
        local: local_masks.Local = local_masks.NONE,
    ):
        """query, key: this rank's shards as given; lse (B, Hq, n); q_runs, k_runs:
        every rank's runs of query and key positions; local: the call's tensor masks."""
        self._ring, self._query, self._key = ring, query, key
        self._lse = lse.detach()  # (B, Hq, n)
        self._rule, self._scale = rule, scale
        self._q_runs, self._k_runs = q_runs, k_runs
        self._local_masks = local
        self._versions = self._versions_now()
        n = query.shape[-2]
        self._n = n
        self._L = sum(r.length for rs in q_runs for r in rs)
        S = sum(r.length for rs in k_runs for r in rs)
        self._shape = torch.Size((*lead, n, S))  # (..., n, S)

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._lse.dtype

    @property
    def device(self) -> torch.device:
        return self._query.device

    @property
    def lse(self) -> torch.Tensor:
        """Log-sum-exp of each local query row over all keys, (..., n). Where it must
        carry a gradient (grad enabled, the shards require grad) it is read through the
        gathered keys: a collective then, like every other read."""
        if self._wants_grad():
            return self._local("lse").lse
        return self._lse.reshape(self.shape[:-1])

    def __repr__(self) -> str:
        r = self._ring
        return f"RingWeights(shape={tuple(self.shape)}, rank={r.rank} of {r.world}, lazy)"

    def numpy(self, *args: object, **kwargs: object):
        raise TypeError(
            "RingWeights are this rank's rows over keys held by every rank, so converting "
            "them is a collective: call w.full() on every rank (a (..., n, S) tensor), "
            "then .numpy()"
        )

    __array__ = numpy

    def __iter__(self):
        raise TypeError(
            "RingWeights cannot be iterated: each read is a collective (w[i], w.full() on "
            "every rank)"
        )

    def _versions_now(self) -> tuple:
        local = self._local_masks
        tensors = (self._query, self._key, local.rows, local.keys)
        return tuple(None if t is None else version_of(t) for t in tensors)

    def _check_fresh(self) -> None:
        if self._versions_now() != self._versions:
            raise StaleWeightsError(
                "the query or key shard (or the mask) changed in place after the attention "
                "call, so these weights would describe other inputs; read them before the "
                "update"
            )

    def _wants_grad(self) -> list[str]:
        """The shards a read must carry gradients to now ([] with grad off)."""
        if not torch.is_grad_enabled():
            return []
        said = [n for n, t in (("query", self._query), ("key", self._key)) if t.requires_grad]
        return said + (["mask"] if self._local_masks.wants_grad else [])

    def _ask(self, question: str, dim: int | None = None) -> None:
        """Agree with every rank on the question (and on which shards it carries
        gradients to, since its backward is then a collective) before any collective
        work: a rank whose check fails makes every rank raise at once instead of
        waiting out the timeout."""

        def check() -> tuple[dict, None]:
            self._check_fresh()
            if dim is not None and dim not in (-2, len(self.shape) - 2):
                raise SdpaValueError(
                    f"{question} works over the queries, dim=-2 (-> (..., m): attention each "
                    f"of this rank's keys receives), got dim={dim}"
                )
            return {"question": question, "grad": self._wants_grad()}, None

        headers, _ = self._ring.check_then_agree(
            check, self.device, (StaleWeightsError, ValueError), f"the ring weights' {question}"
        )
        asked = [h["question"] for h in headers]
        if len(set(asked)) > 1:
            raise RingError(
                f"rank {self._ring.rank}: the ranks asked different questions of their ring "
                f"weights ({', '.join(f'rank {r} {q}' for r, q in enumerate(asked))}); each "
                f"is a collective: every rank asks the same one at the same time"
            )
        grads = [h["grad"] for h in headers]
        if any(g != grads[0] for g in grads):
            seen = ", ".join(f"rank {r} {g or 'none'}" for r, g in enumerate(grads))
            raise RingError(
                f"rank {self._ring.rank}: the ranks read their ring weights with gradients to "
                f"different shards ({seen}); the backward of a read is a collective, so every "
                f"rank's shards require grad alike (or read under torch.no_grad() everywhere)"
            )

    def _local(self, question: str, dim: int | None = None) -> AttentionWeights:
        """AttentionWeights of the local queries over the gathered keys (a collective)."""
        self._ask(question, dim)
        ring = self._ring
        if self._wants_grad():  # (..., S, E), differentiable into every rank's key shard
            query, keys = self._query, _Gathered.apply(self._key, ring, self._k_runs)
        else:
            query = self._query.detach()
            keys = gather(ring, self._key.detach(), self._k_runs, -2)
        structured = None
        if self._rule is not None:
            pos = index(self._q_runs[ring.rank]).to(self.device)
            structured = _Rows(self._rule, pos, self._L)
        tensor, local = None, self._local_masks
        if local.rows is not None:  # this rank's rows over every key, as given
            tensor = local.rows if self._wants_grad() else local.rows.detach()
        if local.keys is not None:  # every rank's key padding, (B, S) -> (B, 1, 1, S)
            every = gather(ring, local.keys.view(torch.uint8), self._k_runs, -1)
            every = every.view(torch.bool)
            has_heads = self._query.ndim >= 4
            tensor = every[:, None, None] if has_heads else every[:, None]
        mask = masks.join(tensor, structured)
        inputs = normalize(query, keys, keys.detach(), mask, scale=self._scale)
        return AttentionWeights(inputs, self._lse)

    def __getitem__(self, index: object) -> torch.Tensor:
        return self._local("rows")[index]

    def full(self, max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
        return self._local("rows").full(max_bytes)

    def entropy(self) -> torch.Tensor:
        return self._local("entropy").entropy()

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._local("topk").topk(k)

    def amax(self, dim: int = -1) -> torch.Tensor:
        return self._local("amax").amax(dim)

    def kl(self, other: RingWeights, reverse: bool = False) -> torch.Tensor:
        """KL(other || self) per local query row, (..., n) (reverse: KL(self || other)):
        the distillation loss with self the student and other the teacher, both sharded
        the same way (each its own q, k, mask). Gradients reach both sides' shards as
        they require grad. A collective."""
        if not isinstance(other, RingWeights):
            raise SdpaTypeError(
                f"RingWeights.kl takes the RingWeights of another sharded call, got "
                f"{type(other).__name__}"
            )
        if (
            other.shape != self.shape
            or other._q_runs != self._q_runs
            or other._k_runs != self._k_runs
        ):
            raise SdpaValueError(
                f"RingWeights.kl compares weights of the same rows and keys, sharded alike: "
                f"got shapes {tuple(self.shape)} and {tuple(other.shape)}"
            )
        teacher = other._local("kl")
        return self._local("kl").kl(teacher, reverse=reverse)

    def max_logits(self, group=None) -> MaxLogits:
        """The largest raw score (after the scale) of each local query row, row (..., n),
        and per head the largest over every rank's rows, head (...): what QK-clip reads.
        group: a further process group to take the maximum over (data-parallel ranks),
        so that every rank of both clips by the same value. Forward only, as
        AttentionWeights.max_logits. A collective over the ring (and `group`)."""
        with torch.no_grad():
            local = self._local("max_logits").max_logits()  # row (..., n), head (...)
        ring = self._ring
        head = torch.stack(ring.all_gather(local.head.contiguous(), "reads", "max_logits"))
        head = head.amax(0)  # over every rank's rows
        if group is not None:
            work = dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group, async_op=True)
            _count("reads", [head])
            ring.wait(
                [work], lambda: f"max_logits over `group` did not finish within {ring.timeout} s"
            )
        return MaxLogits(local.row, head)

    def sum(self, dim: int = -2) -> torch.Tensor:
        """Attention each of this rank's keys receives from all L queries: (..., m)."""
        local = self._local("sum", dim).sum(-2)  # (..., S): this rank's queries
        if local.requires_grad:
            return _Received.apply(local, self._ring, self._k_runs)
        return scatter_sum(self._ring, local, self._k_runs, -1)

    def mean(self, dim: int = -2) -> torch.Tensor:
        return self.sum(dim) / self._L
