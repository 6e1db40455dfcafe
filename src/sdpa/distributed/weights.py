"""RingWeights: a rank's lazy view of the attention weights of a ring attention call.

The rank answers for its own queries (rows over all S keys, entropy, top-k) and for its
own keys (attention received, summed over every rank's queries). Each answer gathers
the key shards (O(S * E) per rank, never L x S) and is a collective: every rank of the
group asks the same question at the same time.

The reads are differentiable, as AttentionWeights' are: with grad enabled, where this
rank's query or key shard requires grad, a read carries its gradient to the query shard
and, through the gathered keys, to every rank's key shard. Its backward is then a
collective too (each rank's gradient of the whole key sequence is summed over the
ranks and each keeps its own shard's part, O(S * E)): every rank runs the backward of
the same reads, as with the output's backward ring. The ranks agree up front whether a
read carries gradients, so one that differs makes every rank raise at once.
"""

from __future__ import annotations

import torch

from sdpa import masks
from sdpa.budget import DEFAULT_MAX_BYTES
from sdpa.distributed.comm import Ring, RingError
from sdpa.distributed.layout import positions, shard, unshard
from sdpa.errors import SdpaValueError
from sdpa.inputs import normalize
from sdpa.weights import AttentionWeights, StaleWeightsError, version_of


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


class _Gathered(torch.autograd.Function):
    """Every rank's key shard, as the whole sequence (..., S, E) in position order.
    Backward: each rank's gradient of the whole is summed over the ranks (all_reduce),
    and this rank keeps its own shard's part: a collective, like the forward."""

    @staticmethod
    def forward(ctx, key, ring, layout):
        ctx.ring, ctx.layout = ring, layout
        return unshard(ring.all_gather(key), layout=layout)

    @staticmethod
    def backward(ctx, g):
        ring = ctx.ring
        total = ring.all_reduce(g.contiguous().clone())  # (..., S, E): every rank's share
        return shard(total, ring.rank, ring.world, layout=ctx.layout).contiguous(), None, None


class _Received(torch.autograd.Function):
    """Attention received per key from every rank's queries, this rank's keys:
    local (..., S) summed over the ranks, then own positions (..., m). Backward: the
    gradient of every rank's own keys, placed at their positions and summed over the
    ranks (each rank's queries reach every rank's keys)."""

    @staticmethod
    def forward(ctx, local, ring, own):
        ctx.ring, ctx.own, ctx.S = ring, own, local.shape[-1]
        return ring.all_reduce(local.contiguous().clone()).index_select(-1, own)

    @staticmethod
    def backward(ctx, g):
        placed = g.new_zeros(*g.shape[:-1], ctx.S).index_copy_(-1, ctx.own, g)  # (..., S)
        return ctx.ring.all_reduce(placed), None, None


class RingWeights:
    """This rank's weights (..., n, S): its n queries against all S keys, lazily.

    Same questions as AttentionWeights, each a collective over the group: rows
    (w[b, h, i] with i a local query index), full(), entropy(), topk(k), amax() for this
    rank's
    queries; sum(dim=-2) and mean(dim=-2) for this rank's keys, (..., m), counting the
    queries of every rank. Differentiable where the shards require grad (the backward
    of a read is then a collective: every rank runs it).
    """

    def __init__(self, ring: Ring, query, key, lse, lead, rule: masks.Mask | None, scale, layout):
        self._ring, self._query, self._key = ring, query, key
        self._lse = lse.detach()  # (B, Hq, n)
        self._rule, self._scale, self._layout = rule, scale, layout
        self._versions = (version_of(query), version_of(key))
        n, m = query.shape[-2], key.shape[-2]
        self._n, self._m = n, m
        self._shape = torch.Size((*lead, n, m * ring.world))  # (..., n, S)

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

    def _check_fresh(self) -> None:
        if (version_of(self._query), version_of(self._key)) != self._versions:
            raise StaleWeightsError(
                "the query or key shard changed in place after ring_attention, so these "
                "weights would describe other inputs; read them before the update"
            )

    def _wants_grad(self) -> list[str]:
        """The shards a read must carry gradients to now ([] with grad off)."""
        if not torch.is_grad_enabled():
            return []
        return [n for n, t in (("query", self._query), ("key", self._key)) if t.requires_grad]

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
            check, self.device, (StaleWeightsError, ValueError)
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
            query, keys = self._query, _Gathered.apply(self._key, ring, self._layout)
        else:
            query = self._query.detach()
            keys = unshard(ring.all_gather(self._key.detach()), layout=self._layout)
        mask = None
        if self._rule is not None:
            pos = positions(self._n, ring.rank, ring.world, self._layout)
            mask = _Rows(self._rule, pos.to(self.device), self._n * ring.world)
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

    def sum(self, dim: int = -2) -> torch.Tensor:
        """Attention each of this rank's keys receives from all L queries: (..., m)."""
        local = self._local("sum", dim).sum(-2)  # (..., S): this rank's queries
        ring = self._ring
        own = positions(self._m, ring.rank, ring.world, self._layout).to(local.device)
        if local.requires_grad:
            return _Received.apply(local, ring, own)
        return ring.all_reduce(local.contiguous()).index_select(-1, own)

    def mean(self, dim: int = -2) -> torch.Tensor:
        return self.sum(dim) / (self._n * self._ring.world)
