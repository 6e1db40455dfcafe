"""AttentionWeights: the attention probabilities, rebuilt on demand from the LSE.

A fused kernel returns the output and, per query row, the log-sum-exp of its scores.
Any weight is then p_ij = exp(s_ij - lse_i) with s_ij = scale * q_i . k_j + bias_ij:
rows cost one GEMM and one exp, and nothing L x S is kept between calls (`sdpa.rows`
does the work, tile by tile). The entropy costs one more fused call instead:
H_i = lse_i - sum_j p_ij s_ij = lse_i - scale * q_i . (P K)_i, and P K is attention
with the keys as values.

On CUDA with triton installed, `sdpa.kernels` serves the statistics in single passes:
entropy and row max from one flash-style pass, attention received per key from q, k
and the LSE; the chunked engine stays the fallback (and the oracle in the tests).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable

import torch

from sdpa import kernels, masks, rows, settings
from sdpa.backends import small
from sdpa.backends.reference import Reference
from sdpa.budget import DEFAULT_MAX_BYTES, check_fits
from sdpa.errors import SdpaTypeError, SdpaValueError, StaleWeightsError
from sdpa.inputs import Inputs, empty, no_autocast

# Runs torch's fused kernel on normalised inputs -> (output, lse), or None where it can't.
FusedRunner = Callable[[Inputs], "tuple[torch.Tensor, torch.Tensor] | None"]
# Where the Triton kernels serve (kernel_devices), the largest structured mask they
# take materialised (kernel_mask_bytes) and the |lse| past which the received-attention
# kernel's float32 subtraction has lost digits (kernel_lse_limit): sdpa.settings.


def chunked_engine() -> contextlib.AbstractContextManager:
    """Within it, every statistic comes from the chunked engine, on every device: the
    reference the Triton kernels are checked and timed against (this thread / task only:
    `sdpa.settings.override(kernel_devices=set())`)."""
    return settings.override(kernel_devices=frozenset())


def version_of(t: object) -> int | None:
    """t's version counter (bumped by every in-place write), or None where there is
    none to read: an inference tensor, a structured mask (immutable), None."""
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return None
    return t._version


def _versions(inputs: Inputs) -> tuple[int | None, int | None, int | None]:
    """The version counters of q, k and the mask at the call: (None, None, None) while
    torch.compile / torch.export traces (such a handle never leaves the graph, and
    traced tensors have no counter to read)."""
    if torch.compiler.is_compiling():
        return None, None, None
    q, k, mask = inputs.query, inputs.key, inputs.mask
    try:  # the common case: plain tensors, none made under inference_mode
        return q._version, k._version, None if mask is None else mask._version
    except (AttributeError, RuntimeError):
        return version_of(q), version_of(k), version_of(mask)


class AttentionWeights:
    """Lazy view of the attention weights, shape (*lead, L, S) (query heads for GQA).

    Shapes: query (..., L, E), key (..., S, E) -> weights (..., L, S); with heads,
    (..., Hq, L, S). Values are the softmax probabilities *before* dropout, in float32
    for 16-bit inputs. Rows that see no key are all 0.

    The handle keeps q, k and the mask by reference, not by copy: if any of them is
    modified in place after the call, every access raises StaleWeightsError rather than
    answer for other inputs (tensors made under torch.inference_mode cannot be checked).
    """

    __slots__ = ("_fused", "_inputs", "_lse", "_probs", "_versions")

    def __init__(
        self,
        inputs: Inputs,
        lse: torch.Tensor | None,
        fused: FusedRunner | None = None,
        probs: torch.Tensor | None = None,
    ):
        self._inputs = inputs
        self._lse = lse if lse is None or not lse.requires_grad else lse.detach()  # (B, Hq, L)
        self._fused = fused
        # (B, Hq, L, S), detached, and its version: the weights themselves where a
        # backend computed them (the small backend); dropped if changed in place
        self._probs = None if probs is None else (probs, version_of(probs))
        self._versions = _versions(inputs)

    def _kept(self) -> torch.Tensor | None:
        """The whole weights (B, Hq, L, S) if kept (handed over by the backend, or
        computed by _held), unless someone changed them in place since: w.full()
        returns them without a copy, so they are then dropped (and recomputed)."""
        if self._probs is None:
            return None
        p, version = self._probs
        if version_of(p) == version:
            return p
        self._probs = None
        return None

    def _held(self) -> torch.Tensor | None:
        """_kept, else computed in one product and kept where small (small.one_product)."""
        p = self._kept()
        if p is None and small.one_product(self._inputs):
            with torch.no_grad(), no_autocast(self.device.type):
                p = small.probabilities(self._inputs)
            self._probs = (p, version_of(p))
        return p

    def _hand_out(self, view: torch.Tensor) -> torch.Tensor:
        """A view of the kept weights for the caller: as it is where a change in place
        would be noticed, else (inference tensors have no version counter) a copy."""
        return view if self._probs[1] is not None else view.clone()

    def _log_sum_exp(self) -> torch.Tensor:
        """The LSE (B, Hq, L), computed on first use where the backend gave none."""
        if self._lse is None:
            with torch.no_grad(), no_autocast(self.device.type):
                self._lse = Reference().forward(self._inputs._replace(dropout_p=0.0))[1]
        return self._lse

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
        return self._log_sum_exp().reshape(self.shape[:-1])

    def __repr__(self) -> str:
        return f"AttentionWeights(shape={tuple(self.shape)}, dtype={self.dtype}, lazy)"

    def _check_fresh(self) -> None:
        if _versions(self._inputs) == self._versions:
            return
        i = self._inputs
        now = (version_of(i.query), version_of(i.key), version_of(i.mask))
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

    def full(self, max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
        """The dense weights, (*lead, L, S). Refuses, before allocating anything, when
        they need more than max_bytes (None: no limit)."""
        self._check_fresh()
        p = self._kept()  # (nothing to allocate: the budget needs no check within it)
        if p is None or (max_bytes is not None and p.numel() * p.element_size() > max_bytes):
            check_fits(
                f"the dense weights in {self.dtype}",
                tuple(self.shape),
                torch.finfo(self.dtype).bits // 8,
                max_bytes,
                "Ask for less: rows (w[b, h, i], w[b, :, i:j]), w.sum(dim=-2), "
                "w.mean(dim=-2), w.entropy() and w.topk(k) work in O(chunk x S) memory; "
                "or pass max_bytes=None",
            )
            if self._shape_only:
                return self._zeros(*self.shape[len(self._inputs.lead) :])
            p = self._held()
            if p is None:
                with torch.no_grad(), no_autocast(self.device.type):  # every row at once
                    return rows.dense(self._rows()).reshape(self.shape)  # (*lead, L, S)
        # no copy (if the caller changes it, _kept notices)
        return self._hand_out(p if len(self._inputs.lead) == 2 else p.reshape(self.shape))

    def __getitem__(self, index: object) -> torch.Tensor:
        """Only the selected rows, computed from the LSE: ints and slices address the
        leading dims and the query dim, e.g. w[0, :, 5] -> (H, S), w[0, 1, 10:20] ->
        (10, S). The key dim takes an int, a slice or a list / 1-D integer tensor of key
        indices, and only those columns are computed: w[0, :, :, j] -> (H, L) and
        w[..., [j1, j2]] -> (..., L, 2) cost O(L x |J|), not O(L x S)."""
        self._check_fresh()
        i = self._inputs
        lead, L, S = i.lead, i.query.shape[-2], i.key.shape[-2]
        *lead_idx, q_idx, k_idx = _normalize_index(index, self.shape)
        if self._shape_only:
            return self._zeros(*self.shape[len(lead) :])[(*lead_idx, q_idx)][..., k_idx]
        held = self._held()
        if held is not None:  # a view of the weights the backend kept
            picked = held.reshape(self.shape)[(*lead_idx, q_idx)][..., k_idx]
            return self._hand_out(picked)
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

        heads, rows_ = _as_slice(head_idx), _as_slice(q_idx)
        lse = pick(self._log_sum_exp()[..., None], heads, rows_)[..., 0]  # (B', H', n)
        # a selection of keys, unless every key is asked for, or a row needs every key
        every_key = (
            isinstance(k_idx, slice) and range(*k_idx.indices(S)) == range(S)
        ) or rows.needs_every_key(lse)
        k_pos = None if every_key else _key_positions(k_idx, S, i.key.device)  # (m,)
        k = _key_heads(
            pick(i.key, None, None), i.query.shape[1], i.group, heads
        )  # (B', Hkv', S, E)
        q_pos = torch.arange(L, device=i.query.device)[rows_]
        mask = i.mask
        if isinstance(mask, masks.Mask):  # materialise just the selected rows and keys
            keys = torch.arange(S, device=q_pos.device) if k_pos is None else k_pos
            mask = mask.keep(q_pos, keys, L, S)[:, None]
            mask = pick(mask, heads, None)  # (B', 1, n, m)
        elif mask is not None:
            mask = pick(mask, heads, rows_)  # (B'|1, H'|1, n, S)
            mask = mask if k_pos is None else mask.index_select(-1, k_pos)  # (..., n, m)
        selection = rows.Rows(
            pick(i.query, heads, rows_),  # (B', H', n, E)
            k if k_pos is None else k.index_select(2, k_pos),  # (B', Hkv', m, E)
            lse,
            mask,
            q_pos,
            i.causal,
            L,
            i.scale,
            i.compute_dtype,
            i.softcap,
            None
            if i.sinks is None
            else pick(
                i.sinks.detach(), heads, None if i.sinks.shape[-1] == 1 else rows_
            ),  # (B', H', n|1)
            k_pos,
            None if k_pos is None else S,
        )
        with torch.no_grad(), no_autocast(self.device.type):
            p = rows.dense(selection)  # (B', H', n, S|m)
        # int indices drop their dim, as in torch
        p = p.reshape(*sizes, *p.shape[1:])  # (*batch', H', n, S|m)
        drop = [*batch_idx, head_idx, q_idx] if has_heads else [*batch_idx, 0, q_idx]
        p = p[tuple(0 if isinstance(d, int) else slice(None) for d in drop)]
        if k_pos is None:
            return p[..., k_idx]
        return p[..., 0] if isinstance(k_idx, int) else p

    def pairs(self, q_index: object, k_index: object) -> torch.Tensor:
        """The weights at chosen (query, key) pairs, computed from q, k and the LSE in
        O(|lead| x P x E): w.pairs(i, j)[..., p] == w.full()[..., i[p], j[p]].

        q_index, k_index: integer tensors (or lists) of one shape, (P,) for pairs shared
        by every lead index, or (B, P) for pairs per batch element (inputs with exactly
        one batch dim B, the weights' first dim). Returns (*lead, P). Head fingerprints
        (previous-token, duplicate-token, induction scores) are sums of such pairs."""
        self._check_fresh()
        i = self._inputs
        B, Hq, L, _ = i.query.shape
        S = i.key.shape[2]
        batched = len(i.lead) == 2 or (len(i.lead) == 1 and i.query.shape[1] == 1)
        qi, kj = _pair_indices(q_index, k_index, L, S, B if batched else None, self.device)
        P = qi.shape[-1]
        if self._shape_only:
            return self._zeros(P)
        held = self._held()
        if held is not None:  # (B, Hq, L, S): gather the pairs
            flat = (qi * S + kj)[:, None].expand(B, Hq, P)  # (B, Hq, P)
            return held.reshape(B, Hq, L * S).gather(-1, flat).reshape(*i.lead, P)
        with torch.no_grad(), no_autocast(self.device.type):
            p = rows.pair_probabilities(self._rows(), qi, kj)  # (B, Hq, P)
        return p.reshape(*i.lead, P)

    def diagonal(self, offset: int = 0) -> torch.Tensor:
        """The weights w[..., i, i + offset], as torch.diagonal(w.full(), offset, dim1=-2,
        dim2=-1): (*lead, n), n the number of such (query, key) pairs. offset=-1 is each
        query's weight on the previous token. O(|lead| x n x E)."""
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise SdpaTypeError(
                f"offset must be an int (key index minus query index), got {offset!r} "
                f"({type(offset).__name__})"
            )
        L, S = self.shape[-2], self.shape[-1]
        first = max(0, -offset)
        last = min(L, S - offset)  # exclusive
        q_index = torch.arange(first, max(first, last))
        return self.pairs(q_index, q_index + offset)

    def sum(self, dim: int = -2) -> torch.Tensor:
        """Attention each key receives, summed over the queries: (*lead, S).

        Only dim=-2 (over the queries): over the keys every row sums to 1 (0 for a row
        that sees no key)."""
        self._check_query_dim(dim, "sum")
        self._check_fresh()
        i = self._inputs
        if self._shape_only:
            return self._zeros(i.key.shape[2])
        held = self._held()
        if held is not None:
            return held.sum(dim=-2).reshape(*i.lead, i.key.shape[2])
        with torch.no_grad(), no_autocast(self.device.type):
            sums = self._received_kernel()
            if sums is None:
                sums = self._received_fused()
            if sums is None:
                sums = rows.key_sums(self._rows())
        return sums.reshape(*i.lead, i.key.shape[2])

    def mean(self, dim: int = -2) -> torch.Tensor:
        """sum(dim=-2) divided by the number of queries L: (*lead, S)."""
        self._check_query_dim(dim, "mean")
        return self.sum(dim) / max(1, self._inputs.query.shape[-2])

    def entropy(self) -> torch.Tensor:
        """-sum_j p_ij ln p_ij for each query, in nats: (*lead, L); 0 for rows that see
        no key."""
        self._check_fresh()
        i = self._inputs
        if self._shape_only:
            return self._zeros(i.query.shape[2])
        held = self._held()
        if held is not None:  # -sum p ln p; p = 0 adds 0 * ln(tiny) = 0 (torch's entr is
            # 3x slower on CPU)
            logp = held.clamp_min(torch.finfo(held.dtype).tiny).log_()
            h = logp.mul_(held).sum(dim=-1).neg_()
            return h.reshape(*i.lead, i.query.shape[2])
        with torch.no_grad(), no_autocast(self.device.type):
            h = self._stats_kernel("entropy")
            if h is None:
                h = self._entropy_fused()
            if h is None:
                h = rows.entropy(self._rows())
        return h.reshape(*i.lead, i.query.shape[2])

    def amax(self, dim: int = -1) -> torch.Tensor:
        """The largest weight of each query row, like torch.amax(w, dim=-1): (*lead, L);
        0 for rows that see no key. Only dim=-1 (over the keys)."""
        if dim not in (-1, len(self.shape) - 1):
            raise SdpaValueError(
                f"amax works over the keys, dim=-1 (-> (..., L): each query's largest "
                f"weight), got dim={dim}; for the queries a key attends most, use "
                f"w[...] rows or w.sum(dim=-2)"
            )
        self._check_fresh()
        i = self._inputs
        if self._shape_only:
            return self._zeros(i.query.shape[2])
        held = self._held()
        if held is not None:
            return held.amax(dim=-1).reshape(*i.lead, i.query.shape[2])
        with torch.no_grad(), no_autocast(self.device.type):
            top = self._stats_kernel("amax")
            if top is None:
                top = rows.topk(self._rows(), 1)[0][..., 0]  # (B, Hq, L)
        return top.reshape(*i.lead, i.query.shape[2])

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest weights of each query row and their key indices, like
        torch.topk(w, k, dim=-1): (values, indices), each (*lead, L, k). Rows that see
        no key give values 0."""
        i = self._inputs
        S = i.key.shape[-2]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= S:
            raise SdpaValueError(f"k must be an int in [0, S={S}], got {k!r}")
        self._check_fresh()
        L = i.query.shape[2]
        if self._shape_only:
            return self._zeros(L, k), self._zeros(L, k, dtype=torch.long)
        held = self._held()
        if held is not None:
            values, indices = held.topk(k, dim=-1)
            return values.reshape(*i.lead, L, k), indices.reshape(*i.lead, L, k)
        with torch.no_grad(), no_autocast(self.device.type):
            values, indices = rows.topk(self._rows(), k)
        return values.reshape(*i.lead, L, k), indices.reshape(*i.lead, L, k)

    @property
    def _shape_only(self) -> bool:
        """Only the shape of an answer can be given: an empty batch, 0 heads, queries or
        keys (every value is 0), or meta tensors (shapes without data)."""
        i = self._inputs
        if i.query.is_cpu:  # the common case, without building a device object
            return i.no_work or empty(i.query.shape[0])
        return i.no_work or empty(i.query.shape[0]) or self.device.type == "meta"

    def _zeros(self, *tail: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Zeros (*lead, *tail), in the weights' dtype unless given: the answer where
        nothing is seen (on the meta device, a tensor of that shape)."""
        dtype = self.dtype if dtype is None else dtype
        return torch.zeros((*self._inputs.lead, *tail), dtype=dtype, device=self.device)

    def _check_query_dim(self, dim: int, what: str) -> None:
        if dim not in (-2, len(self.shape) - 2):
            raise SdpaValueError(
                f"{what} works over the queries, dim=-2 (-> (..., S): attention each key "
                f"receives), got dim={dim}; over the keys (dim=-1) every row sums to 1"
            )

    def _rows(self) -> rows.Rows:
        i = self._inputs
        L = i.query.shape[-2]
        q_pos = torch.arange(L, device=i.query.device)
        sinks = None if i.sinks is None else i.sinks.detach()
        return rows.Rows(
            i.query, i.key, self._log_sum_exp(), i.mask, q_pos, i.causal, L, i.scale,
            i.compute_dtype,
            i.softcap, sinks,
        )  # fmt: skip

    def _kernel_args(self) -> tuple | None:
        """(q, k, mask tensor or None, causal) for the Triton kernels, or None where they
        can't serve: not on the settings' kernel_devices, triton missing, an unsupported
        dtype or head size, or a structured mask over kernel_mask_bytes."""
        i = self._inputs
        tuning = settings.get()
        if self.device.type not in tuning.kernel_devices or kernels.unsupported(i.query, i.key):
            return None
        if i.softcap is not None or i.sinks is not None:  # the kernels score plain q . k
            return None
        mask, causal = (None, True) if i.causal_only else (i.mask, i.causal)
        L, S = i.query.shape[2], i.key.shape[2]
        if isinstance(mask, masks.Mask):
            if (mask.batch or 1) * L * S > tuning.kernel_mask_bytes:
                return None
            mask = masks.as_4d(mask.materialize(L, S, self.device, max_bytes=None))  # (B|1,1,L,S)
        return i.query, i.key, mask, causal

    def _stats_kernel(self, which: str) -> torch.Tensor | None:
        """Entropy or row max (B, Hq, L) from the one-pass Triton kernel, or None."""
        args = self._kernel_args()
        if args is None:
            return None
        from sdpa.kernels.stats import forward_stats  # imports triton

        q, k, mask, causal = args
        scale = self._inputs.scale
        _, _, entropy, top = forward_stats(q, k, None, mask, causal=causal, scale=scale)
        return entropy if which == "entropy" else top

    def _received_kernel(self) -> torch.Tensor | None:
        """Attention received per key (B, Hq, S) from the Triton kernel, or None."""
        args = self._kernel_args()
        limit = settings.get().kernel_lse_limit
        if args is None or bool((self._log_sum_exp().abs() > limit).any()):
            return None
        from sdpa.kernels.received import received  # imports triton

        q, k, mask, causal = args
        return received(q, k, self._log_sum_exp(), mask, causal=causal, scale=self._inputs.scale)

    def _received_fused(self) -> torch.Tensor | None:
        """Attention received per key (B, Hq, S) from one fused call with queries and
        keys swapped, or None where it does not apply.

        sum_i p_ij = exp(log sum_i exp(s_ij - lse_i)): the LSE of an attention whose
        queries are the keys. With the LSE folded into one more column,
        scale * [k_j, 1] . [q_i, -lse_i / scale] = scale * q_i . k_j - lse_i, so the
        swapped call needs no bias beyond the mask's transpose; under top-left causality
        (key j is seen by queries i >= j) both sequences are reversed and the kernel
        runs its own causal path. Serves where the fused kernel runs, without softcap
        or sinks, with no mask, the top-left causal one (L == S) or a tensor mask that is
        the same for every query (key padding: its transpose is one column, so nothing
        L x S is allocated), and |lse| <= fold_lse_limit (the folded column then keeps
        float32 error < 1e-5)."""
        i = self._inputs
        L, S = i.query.shape[2], i.key.shape[2]
        mask, causal = (None, True) if i.causal_only else (i.mask, i.causal)
        per_key = mask is None or (  # key padding: the same row for every query
            isinstance(mask, torch.Tensor) and (mask.shape[-2] == 1 or mask.stride(-2) == 0)
        )
        if (
            self._fused is None
            or not per_key
            or (causal and (L != S or mask is not None))
            or i.softcap is not None
            or i.sinks is not None
            or bool((self._log_sum_exp().abs() > settings.get().fold_lse_limit).any())
        ):
            return None
        cd = i.compute_dtype
        k = i.key.to(cd).repeat_interleave(i.group, dim=1)  # (B, Hq, S, E)
        swapped_q = torch.cat([k, k.new_ones(*k.shape[:-1], 1)], dim=-1)  # (B, Hq, S, E+1)
        lse = (-self._log_sum_exp() / i.scale)[..., None].to(cd)  # (B, Hq, L, 1)
        swapped_k = torch.cat([i.query.to(cd).expand(*lse.shape[:-1], -1), lse], dim=-1)
        if causal:  # (B, Hq, L, E+1): reversed, key j sees swapped keys i >= j
            swapped_q, swapped_k = swapped_q.flip(2), swapped_k.flip(2)
        seen = None
        if mask is not None:  # one row (B|1, Hq|1, 1, S), seen by the swapped queries
            row = mask[..., :1, :]
            seen = row[..., 0, :] if row.dtype == torch.bool else ~torch.isneginf(row[..., 0, :])
            mask = row.transpose(-2, -1).expand(*row.shape[:-2], S, L)  # (B|1, Hq|1, S, L)
        nothing = swapped_k.new_zeros(*swapped_k.shape[:-1], 1)  # only the LSE is read
        ran = self._fused(
            i._replace(
                query=swapped_q, key=swapped_k, value=nothing, mask=mask, causal=causal,
                dropout_p=0.0,
            )
        )  # fmt: skip
        if ran is None:
            return None
        sums = ran[1].exp()  # (B, Hq, S)
        if seen is not None:  # a key no query sees came back with the kernel's lse 0
            sums = sums.masked_fill(~seen, 0.0)
        return sums.flip(-1) if causal else sums

    def _entropy_fused(self) -> torch.Tensor | None:
        """H_i = lse_i - scale * q_i . (P K)_i with one fused call (keys as values); None
        where the fused kernel can't serve, an additive mask needs sum_j p_ij b_ij, or a
        softcap or sinks break the identity."""
        i = self._inputs
        additive = isinstance(i.mask, torch.Tensor) and i.mask.dtype != torch.bool
        if self._fused is None or additive or i.softcap is not None or i.sinks is not None:
            return None  # the identity needs rows summing to 1 and sum_j p_ij s_ij = q . PK
        q, k = i.query.to(i.compute_dtype), i.key.to(i.compute_dtype)
        ran = self._fused(i._replace(query=q, key=k, value=k, dropout_p=0.0))
        if ran is None:
            return None
        pk, lse = ran  # (B, Hq, L, E), (B, Hq, L)
        return lse - i.scale * (q * pk).sum(dim=-1)


def _pair_indices(
    q_index: object, k_index: object, L: int, S: int, B: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) positions of the pairs as (1|B, P) int64 on `device`, checked: integers of
    one shape, (P,) or (B, P) (B given only for inputs with one batch dim), in range."""
    out = []
    for name, index, size in (("q_index", q_index, L), ("k_index", k_index, S)):
        t = _key_list(index, size, name, 2)
        if t is None:
            raise SdpaTypeError(
                f"{name} must be an integer tensor or list of positions, (P,) or (B, P), "
                f"got {type(index).__name__}"
            )
        out.append(t)
    qi, kj = out
    if qi.shape != kj.shape:
        raise SdpaValueError(
            f"q_index and k_index must have one shape (P,) or (B, P), got {tuple(qi.shape)} "
            f"and {tuple(kj.shape)}"
        )
    if qi.ndim == 2 and qi.shape[0] != B:
        raise SdpaValueError(
            f"pairs per batch element are (B, P) with B the weights' first dim"
            f"{f' ({B})' if B is not None else ' (these inputs have no single batch dim)'}, "
            f"got q_index {tuple(qi.shape)}; pass (P,) for pairs shared by every batch element"
        )
    rows = qi.shape[0] if qi.ndim == 2 else 1
    return qi.reshape(rows, qi.shape[-1]).to(device), kj.reshape(rows, kj.shape[-1]).to(device)


def _key_heads(k: torch.Tensor, Hq: int, group: int, heads: slice) -> torch.Tensor:
    """The key heads that query heads `heads` use (query head h uses key head
    h // group, Inputs.group): a view when the slice covers whole groups, else one key
    head per selected query head."""
    start, stop, step = heads.indices(Hq)
    if group == 1:
        return k[:, heads]
    if step == 1 and start % group == 0 and stop % group == 0:
        return k[:, start // group : max(start, stop) // group]
    return k[:, torch.arange(Hq)[heads] // group]


def _as_slice(index: int | slice) -> slice:
    return slice(index, index + 1) if isinstance(index, int) else index


def _key_positions(index: int | slice | torch.Tensor, S: int, device: torch.device) -> torch.Tensor:
    """The positions (m,) that a key-dim index selects among S keys."""
    if isinstance(index, torch.Tensor):
        return index.to(device)
    return torch.arange(S, device=device)[_as_slice(index)]


def _key_list(
    item: object, size: int, what: str = "the key dim", max_ndim: int = 1
) -> torch.Tensor | None:
    """A list, range or integer tensor / array (1-D, or up to max_ndim dims) of indices
    into a dim of `size` -> int64 on the CPU, negatives wrapped; None for anything else."""
    if isinstance(item, list | range):
        flat = list(item)
        while flat and all(isinstance(j, list) for j in flat):  # nested lists: (B, P)
            flat = [x for row in flat for x in row]
        if not all(isinstance(j, int) and not isinstance(j, bool) for j in flat):
            raise SdpaTypeError(
                f"a list of {'key ' if what == 'the key dim' else ''}indices takes ints, got "
                f"{sorted({type(j).__name__ for j in flat})}"
            )
        t = torch.tensor(list(item), dtype=torch.long)
    elif isinstance(item, torch.Tensor) or type(item).__name__ == "ndarray":
        t = torch.as_tensor(item)
        integer = not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
        if not 1 <= t.ndim <= max_ndim or not integer:
            dims = "1-D" if max_ndim == 1 else f"1-D to {max_ndim}-D"
            raise SdpaTypeError(
                f"{what} takes a {dims} integer tensor of indices, got {tuple(t.shape)} "
                f"{t.dtype}; for a boolean selection pass sel.nonzero()[:, 0]"
            )
        t = t.to("cpu", torch.long)
    else:
        return None
    if t.numel() and not bool(((t >= -size) & (t < size)).all()):
        bad = t[(t < -size) | (t >= size)][0].item()
        noun = "key index" if what == "the key dim" else f"{what} entry"
        raise IndexError(f"{noun} {bad} is out of bounds for {what} with size {size}")
    return t % size if t.numel() else t


def _normalize_index(index: object, shape: torch.Size) -> list[int | slice | torch.Tensor]:
    """One int (non-negative, in range) or slice (positive step) per dim of `shape`; the
    key dim (the last) may also be a (m,) int64 tensor of key indices."""
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
        if dim == len(shape) - 1:
            keys = _key_list(item, size)
            if keys is not None:
                out.append(keys)
                continue
        tensor_with_dims = isinstance(item, torch.Tensor) and item.ndim > 0
        if (
            not isinstance(item, bool | slice)
            and hasattr(item, "__index__")
            and not tensor_with_dims
        ):
            with contextlib.suppress(TypeError):  # numpy integers, 0-d integer tensors
                item = operator.index(item)
        if isinstance(item, bool) or not isinstance(item, int | slice):
            raise SdpaTypeError(
                f"AttentionWeights takes ints, slices and '...' as indices (they choose which "
                f"rows to compute; the key dim also a list or 1-D integer tensor of keys), got "
                f"{type(item).__name__} for dim {dim}; index the resulting tensor for anything "
                f"else"
            )
        if isinstance(item, int):
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of bounds for dim {dim} with size {size}")
            item %= size
        elif item.step is not None and item.step <= 0:
            raise SdpaValueError(f"slice step must be positive, got {item.step} for dim {dim}")
        out.append(item)
    return out
