"""RingWeights: a rank's lazy view of the attention weights of a ring attention call.

The rank answers for its own queries (rows over all S keys, entropy, top-k) and for its
own keys (attention received, summed over every rank's queries). Each answer gathers
the key shards (O(S * E) per rank, never L x S) and is a collective: every rank of the
group asks the same question at the same time.
"""

from __future__ import annotations

import torch

from sdpa import masks
from sdpa.budget import DEFAULT_MAX_BYTES
from sdpa.distributed.comm import Ring, RingError
from sdpa.distributed.layout import positions, unshard
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


class RingWeights:
    """This rank's weights (..., n, S): its n queries against all S keys, lazily.

    Same questions as AttentionWeights, each a collective over the group: rows
    (w[b, h, i] with i a local query index), full(), entropy(), topk(k), amax() for this
    rank's
    queries; sum(dim=-2) and mean(dim=-2) for this rank's keys, (..., m), counting the
    queries of every rank.
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
        """Log-sum-exp of each local query row over all keys, (..., n)."""
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

    def _ask(self, question: str, dim: int | None = None) -> None:
        """Agree with every rank on the question before any collective work: a rank whose
        check fails makes every rank raise at once instead of waiting out the timeout."""

        def check() -> tuple[dict, None]:
            self._check_fresh()
            if dim is not None and dim not in (-2, len(self.shape) - 2):
                raise SdpaValueError(
                    f"{question} works over the queries, dim=-2 (-> (..., m): attention each "
                    f"of this rank's keys receives), got dim={dim}"
                )
            return {"question": question}, None

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

    def _local(self, question: str, dim: int | None = None) -> AttentionWeights:
        """AttentionWeights of the local queries over the gathered keys (a collective)."""
        self._ask(question, dim)
        ring = self._ring
        keys = unshard(ring.all_gather(self._key.detach()), layout=self._layout)  # (..., S, E)
        mask = None
        if self._rule is not None:
            pos = positions(self._n, ring.rank, ring.world, self._layout)
            mask = _Rows(self._rule, pos.to(self.device), self._n * ring.world)
        inputs = normalize(self._query.detach(), keys, keys, mask, scale=self._scale)
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
        local = self._local("sum", dim)
        received = self._ring.all_reduce(local.sum(-2).contiguous())  # (..., S)
        ring = self._ring
        own = positions(self._m, ring.rank, ring.world, self._layout).to(received.device)
        return received.index_select(-1, own)

    def mean(self, dim: int = -2) -> torch.Tensor:
        return self.sum(dim) / (self._n * self._ring.world)
