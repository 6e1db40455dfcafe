"""AttentionWeights: the attention probabilities, rebuilt on demand from the LSE.

A fused kernel returns the output and, per query row, the log-sum-exp of its scores.
Any weight is then p_ij = exp(s_ij - lse_i) (sdpa.tile, the one tile rule): rows cost
one GEMM and one exp, and nothing L x S is kept between calls (`sdpa.rows` does the
work, tile by tile).

Each read lists its providers in order, each with one eligibility rule (`PROVIDERS`):

    held      the weights themselves, where the small backend kept them (or they are
              small enough to compute whole in one product)
    triton    a single-pass Triton kernel (CUDA with triton: settings.kernel_devices)
    rows      the rows engine, tile by tile: serves everything (the reference)

The first provider whose rule holds answers; adding a read is one entry. (The fused
identities of earlier versions, entropy = lse - scale q . (P K) and attention received
as the LSE of a call with queries and keys swapped, are gone: their error grows like
eps x |lse| where the listing's does not, and the rows engine on cache-sized tiles
costs about as much.)
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import operator
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import torch

from sdpa import grads, indexing, kernels, leads, masks, rows, settings, tile
from sdpa.backends import BACKENDS, small
from sdpa.backends.reference import Reference
from sdpa.budget import DEFAULT_MAX_BYTES, check_fits, check_max_bytes, dense_limit
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError, StaleWeightsError
from sdpa.inputs import Inputs, check_flag, compute_dtype, empty, no_autocast
from sdpa.lazy import (
    GRAD_OF_LAZY,
    LAZY_READS,
    METADATA,
    RESHAPES,
    TRANSPOSES,
    Lazy,
    LazyTensor,
    LeadReduction,
    basic_index,
    dim_of,
    expr,
    metadata,
    on_dense,
    permutation,
    printed,
    reduce_lead,
    reduction_of,
    refuses_grad,
    reshape_read,
    transpose,
)
from sdpa.lazy_rows import join_read


def chunked_engine() -> contextlib.AbstractContextManager:
    """Within it, every statistic comes from the rows engine, on every device: the
    reference the Triton kernels are checked and timed against (this thread / task only:
    `sdpa.settings.override(kernel_devices=set())`)."""
    return settings.override(kernel_devices=frozenset())


def version_of(t: object) -> int | None:
    """t's version counter (bumped by every in-place write through torch), or None where
    there is none to read: an inference tensor, a structured mask (immutable), None."""
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return None
    return t._version


def _versions(inputs: Inputs) -> tuple[int | None, int | None, int | None]:
    """The version counters of q, k and the mask at the call: (None, None, None) while
    torch.compile / torch.export traces (such a handle never leaves the graph, and
    traced tensors have no counter to read)."""
    if torch.compiler.is_compiling():
        return None, None, None
    return versions_now(inputs)


def versions_now(inputs: Inputs) -> tuple[int | None, int | None, int | None]:
    """_versions outside a traced region (the caller knows it is not tracing)."""
    q, k, mask = inputs.query, inputs.key, inputs.mask
    if mask is None or isinstance(mask, torch.Tensor):
        try:  # the common case: plain tensors, none made under inference_mode
            return q._version, k._version, None if mask is None else mask._version
        except RuntimeError:  # (an inference tensor has no counter)
            pass
    # (a structured mask, or one ANDed with a tensor: TensorAnd; inference tensors)
    return version_of(q), version_of(k), version_of(inputs.tensor_mask)


class MaxLogits(NamedTuple):
    """AttentionWeights.max_logits(): each row's largest raw score (*lead, L) and the
    largest over the rows (*lead): per head for inputs with heads."""

    row: torch.Tensor
    head: torch.Tensor


class Provider(NamedTuple):
    """One way to answer a read: its name, its one eligibility rule, its computation.
    Both take the handle (compute also the read's arguments) and compute returns the
    (B, Hq, ...) layout (or a tuple of them), or None where a kernel declined."""

    name: str
    serves: Callable[[AttentionWeights], bool]
    compute: Callable[..., object]


class _Reads(Lazy):
    """The reads of a handle, shared by AttentionWeights (the tensor) and GraphWeights
    (the same recipe inside a torch.compile region)."""

    __slots__ = ()  # each handle class lists _SLOTS: set and read faster than a __dict__

    def __init__(
        self,
        inputs: Inputs,
        lse: torch.Tensor | None,
        probs: torch.Tensor | None = None,
        backend: object = None,
        frozen: bool = False,
        versions: tuple[int | None, int | None, int | None] | None = None,
    ):
        self._inputs = inputs
        self._lse = lse if lse is None or not lse.requires_grad else lse.detach()  # (B, Hq, L)
        # (B, Hq, L, S), detached: the weights themselves where a backend computed them
        # (the small backend) or one product did (_held); `full()` hands them out
        # uncopied (and lets go of them) unless another handle may hold them too
        self._probs = probs
        self._shared = False  # whether a view or a detached twin holds them too
        self._versions = _versions(inputs) if versions is None else versions
        self._backend = backend  # the Backend that ran the call (None: made elsewhere)
        self._frozen = frozen  # made under sdpa.frozen() from q / k that required grad
        # the inputs whose q, k and mask the version counters are of: these, or for a view
        # over some leading rows (sdpa.leads), the call's, whose rows it may have copied
        self._source = inputs

    @property
    def served_by(self) -> str:
        """Which backend computed the call and how, e.g. "fused: one kernel call" (the
        path as the backend decides it from these inputs; see sdpa.explain)."""
        b = self._backend
        if b is None:
            return "not an attention call (weights made from an LSE)"
        return f"{b.name}: {b.path(self._inputs)}"

    # -- state ---------------------------------------------------------------------

    def _held(self, grad: bool = False, own: bool = False) -> torch.Tensor | None:
        """The whole weights (B, Hq, L, S) if the backend kept them, else computed in
        one product and kept where small (small.one_product), else None. With grad, for
        this read alone (torch then differentiates the read): kept weights as a graph of
        their own (grads.kept: the product again in the backward), or weights computed
        afresh with autograd where small; so no two reads, nor a read and the output,
        share a graph (each may have its own backward), and the backward sees q and k as
        they were at the read. own (with grad): a tensor of the read's own, never a view
        of the kept weights (full())."""
        p = self._probs
        if grad:
            if p is None and not small.one_product(self._inputs):
                return None
            if p is not None:  # kept: the read's own graph, the product again in backward
                return grads.kept(p, self._probabilities, self._inputs, copy=own)
            with torch.enable_grad():
                p = self._probabilities()
            mask = self._inputs.tensor_mask  # (autograd saves q and k, not an added mask)
            if mask is None:
                return p
            return grads.watch(p.clone() if own else p, [mask])
        if p is not None:
            return p
        if small.one_product(self._inputs):
            with torch.no_grad():
                p = self._probabilities()
            self._probs = p
            return p
        return None

    def _probabilities(self) -> torch.Tensor:
        """The whole weights (B, Hq, L, S) in one product, with autograd where grad mode is
        on (small.probabilities, outside autocast: the inputs carry its dtype)."""
        with no_autocast(self.device.type):
            return small.probabilities(self._inputs)

    def _copies_held(self, p: torch.Tensor) -> bool:
        """Whether a copy of the kept weights p answers `full()` as the providers would,
        in O(1): within the default budget, and not frozen weights (they refuse under
        grad)."""
        return not self._frozen and p.numel() * p.element_size() <= DEFAULT_MAX_BYTES

    def _needs(self, inputs: Inputs | None = None) -> grads.Needs | None:
        """Which inputs a read must carry gradients to (None: no read needs any). The
        weights of a call under sdpa.frozen() refuse: their q and k were detached."""
        if self._frozen and torch.is_grad_enabled():
            raise NotSupportedError(
                "these weights come from a call under sdpa.frozen(): the pattern was held "
                "constant, so its reads carry no gradient to q and k; read them under "
                "torch.no_grad(), or make the call outside sdpa.frozen() to differentiate "
                "them"
            )
        return grads.needs(self._inputs if inputs is None else inputs)

    def _log_sum_exp(self) -> torch.Tensor:
        """The LSE (B, Hq, L), computed on first use where the backend gave none."""
        if self._lse is None:
            with torch.no_grad(), no_autocast(self.device.type):
                self._lse = Reference().forward(self._inputs._replace(dropout_p=0.0))[1]
        return self._lse

    def _check_fresh(self) -> None:
        if self._source.__class__ is not Inputs:  # handles joined (torch.stack), _stale_with
            for part in self._source:
                part._check_fresh()
            return
        if _versions(self._source) == self._versions:
            return
        i = self._source
        now = (version_of(i.query), version_of(i.key), version_of(i.tensor_mask))
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

    # -- properties ----------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """Shape of the full weights, (*lead, L, S)."""
        self._check_fresh()
        return torch.Size(self._inputs.shape)

    @property
    def dtype(self) -> torch.dtype:
        """float32 for 16-bit inputs, else the inputs' dtype."""
        return self._inputs.compute_dtype

    @property
    def device(self) -> torch.device:
        return self._inputs.query.device

    @property
    def query(self) -> torch.Tensor:
        """The query the call attended with, (B, Hq, L, E) (leading dims folded into B):
        the tensor itself, not a copy, in the graph that made it. In a capture of a
        model, the layer's projected queries with heads split (distillation's relations
        read them: sdpa.losses.relation_kl)."""
        return self._inputs.query

    @property
    def key(self) -> torch.Tensor:
        """The key the call attended with, (B, Hkv, S, E) (grouped-query heads as given)."""
        return self._inputs.key

    @property
    def value(self) -> torch.Tensor:
        """The value the call attended with, (B, Hkv, S, Ev)."""
        return self._inputs.value

    @property
    def lse(self) -> torch.Tensor:
        """Log-sum-exp of each query row's scores, (*lead, L); 0 for rows that see no key.
        Differentiable (dlse_i / ds_ij = p_ij)."""
        self._check_fresh()
        lse = tile.marked(self._log_sum_exp())  # a copy; +inf, a kernel's other NaN mark
        needs = self._needs()
        if needs is not None and not self._shape_only:
            value = lse
            lse = grads.read(grads.Spec(self._every_row(), grads.lse_rule(), needs, lambda: value))
        return lse.reshape(self._inputs.shape[:-1])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self._inputs.shape)}, dtype={self.dtype}, lazy)"

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

    def _lead(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hq, ...) -> (*lead, ...)."""
        lead = self._inputs.lead
        return t if len(lead) == 2 else t.reshape(*lead, *t.shape[2:])

    def _provide(self, read: str, *args: object, held: bool = True) -> object:
        """The answer of the first provider of `read` whose rule holds (the last, the
        rows engine, always does), without autograd."""
        with torch.no_grad(), no_autocast(self.device.type):
            for provider in PROVIDERS[read]:
                if (held or provider.name != "held") and provider.serves(self):
                    answer = provider.compute(self, *args)
                    if answer is not None:
                        return answer
        raise AssertionError(f"no provider answered {read}")  # the rows engine always does

    def _read(
        self,
        read: str,
        *args: object,
        rule: Callable[[object], grads.Rule],
        selection: rows.Rows | None = None,
    ) -> object:
        """A read's answer, carrying its gradient where q, k, a float mask or the sinks
        require grad: through torch's own ops on weights kept inside the autograd graph,
        else through grads.read (the tile-by-tile backward of `rule(value)`)."""
        needs = self._needs()
        if needs is None:
            return self._provide(read, *args)
        held = self._held(grad=True)
        if held is not None:  # in the graph: torch differentiates the read
            with no_autocast(self.device.type):
                return HELD[read](held, *args)
        value = self._provide(read, *args, held=False)
        spec = grads.Spec(
            self._every_row() if selection is None else selection,
            rule(value),
            needs,
            lambda: value[0] if isinstance(value, tuple) else value,
        )
        out = grads.read(spec)
        return (out, value[1]) if isinstance(value, tuple) else out

    # -- reads ---------------------------------------------------------------------

    def full(self, max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
        """The dense weights, (*lead, L, S): a tensor of your own (editing it changes
        nothing here). Refuses, before allocating anything, when they need more than
        max_bytes (None: no limit). Weights the call kept are handed out uncopied where no
        other handle holds them (this handle then computes them again if read again)."""
        return self._full(max_bytes, give=True)

    def _full(self, max_bytes: int | None, give: bool) -> torch.Tensor:
        """full(max_bytes); give: whether kept weights may be handed out uncopied (not for
        an op on the dense weights, whose result may be a view of them: w.numpy())."""
        p = self._probs
        if max_bytes is DEFAULT_MAX_BYTES or max_bytes is None:  # (the weights kept or
            # small, within the default budget: handed out, or a copy of them)
            self._check_fresh()
            if p is None and not self._frozen and not self._shape_only:
                p = self._held()  # (one product, kept, where small; else None)
            if p is not None and self._copies_held(p):
                # (no graph saved p: nothing the call took requires grad; not frozen here)
                if not (p.requires_grad or self._inputs.value.requires_grad or self.requires_grad):
                    if give and not self._shared:  # (no other handle holds them)
                        self._probs = None  # yours, uncopied: read again, computed again
                        return self._lead(p)
                elif torch.is_grad_enabled() and grads.needs(self._inputs) is not None:
                    return self._lead(self._held(grad=True, own=True))  # (a graph of its own)
                return self._lead(p.clone())
        max_bytes = check_max_bytes(max_bytes)
        self._check_fresh()
        check_fits(
            f"the dense weights in {self.dtype}",
            tuple(self._inputs.shape),
            torch.finfo(self.dtype).bits // 8,
            max_bytes,
            LAZY_READS + "; or pass max_bytes=None",
        )
        if self._shape_only:
            return self._zeros(*self._inputs.shape[len(self._inputs.lead) :])
        return self._lead(self._read("full", rule=lambda _: grads.rows_rule(rows.ALL)))

    def __getitem__(self, index: object) -> torch.Tensor:
        """Only the selected weights, computed from the LSE: ints and slices address the
        leading dims; the query dim takes an int, a slice or a list / 1-D integer tensor
        or array of query positions, and so does the key dim, e.g. w[0, :, 5] -> (H, S),
        w[0, 1, 10:20] -> (10, S), w[0, :, :, j] -> (H, L), w[..., [j1, j2]] ->
        (..., L, 2); two lists pair up as torch pairs them, w[..., [i1, i2], [j1, j2]] ->
        (..., 2). A selection of rows costs O(rows x S), of keys O(L x keys)."""
        self._check_fresh()
        try:
            selection = _Selection.of(index, self._inputs)
        except SdpaTypeError:  # None, boolean masks, tensors over the lead dims...
            return self._dense("indexing")[index]
        if self._shape_only:
            return selection.apply(self._zeros(*self._inputs.shape[len(self._inputs.lead) :]))
        needs = self._needs()
        held = self._held(grad=needs is not None)
        if held is not None:  # a copy of the selected weights the backend kept
            return selection.apply(held.reshape(self._inputs.shape)).clone()
        q_item, k_item = selection.q_item, selection.k_item
        if isinstance(q_item, torch.Tensor) and isinstance(k_item, torch.Tensor):
            # two lists of positions pair up, as torch's indexing does: w[i[p], j[p]]
            qi, kj = torch.broadcast_tensors(q_item, k_item)
            return self.pairs(qi, kj)[selection.lead_items]
        return selection.read(self._inputs, self._log_sum_exp(), needs)

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
        batched = len(i.lead) == 2 or (len(i.lead) == 1 and Hq == 1)
        qi, kj = _pair_indices(q_index, k_index, L, S, B if batched else None, self.device)
        P = qi.shape[-1]
        if self._shape_only:
            return self._zeros(P)
        needs = self._needs()
        held = self._held(grad=needs is not None)
        if held is not None:  # (B, Hq, L, S): gather the pairs
            flat = (qi * S + kj)[:, None].expand(B, Hq, P)  # (B, Hq, P)
            return self._lead(held.reshape(B, Hq, L * S).gather(-1, flat))
        lse = self._log_sum_exp()
        with torch.no_grad(), no_autocast(self.device.type):
            p = rows.pairs(i, lse, qi, kj)  # (B, Hq, P)
        if needs is not None:
            value = p
            rule = grads.pairs_rule(qi, kj, S)
            p = grads.read(grads.Spec(self._every_row(), rule, needs, lambda: value))
        return self._lead(p)

    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> torch.Tensor:
        """torch.diagonal of the weights. Over the query and key dims (dim1=-2, dim2=-1)
        it is lazy: w[..., i, i + offset], (*lead, n), n the number of such (query, key)
        pairs, in O(|lead| x n x E); offset=-1 is each query's weight on the previous
        token. Other dims (torch's default 0, 1 included) take the dense weights."""
        nd = len(self._inputs.shape)
        dims = dim_of(dim1, nd), dim_of(dim2, nd)
        if dims != (nd - 2, nd - 1) or isinstance(offset, bool) or not isinstance(offset, int):
            return on_dense(torch.Tensor.diagonal, (self, offset, dim1, dim2), {})
        L, S = self._inputs.shape[-2:]
        first = max(0, -offset)
        last = min(L, S - offset)  # exclusive
        q_index = torch.arange(first, max(first, last))
        return self.pairs(q_index, q_index + offset)

    def kl(
        self, other: AttentionWeights | torch.Tensor, reverse: bool = False, head_map=None
    ) -> torch.Tensor:
        """The KL divergence between other weights and these, per query row, in nats:
        (*lead, L). w.kl(t) = KL(t || w) = sum_j t_ij ln(t_ij / w_ij), the distillation
        loss with w the student and t the teacher; reverse=True gives KL(w || t).

        other: AttentionWeights over the same batch, queries and keys (its own q, k,
        mask and heads), or a dense target tensor broadcasting to (*lead, L, S).
        head_map: for weights with other heads, which of other's query heads each of
        these heads is compared with (a list or 1-D integer tensor of length Hq).
        Differentiable into both sides as they require grad, tile by tile (never
        L x S): into w, g (w - t) (forward) or g w (ln w - ln t - KL) (reverse). Where
        both sides' whole weights are kept (small calls: the small backend's, or one
        product), one elementwise pass over them instead, on CPU, with the same value."""
        return self._kl(other, reverse, head_map)

    def _kl(self, other, reverse: bool = False, head_map=None, real=None) -> torch.Tensor:
        """kl, and for a caller that gives padded query rows no weight (sdpa.losses), real:
        a (B, L) bool of the real rows; the others then read as 0, with gradient 0, and
        are not computed (rows.real_rows)."""
        check_flag("reverse", reverse)
        self._check_fresh()
        i = self._inputs
        if isinstance(other, _Reads):
            other._check_fresh()
            if head_map is None and not self._shape_only:
                value = self._held_kl(other, reverse, real)
                if value is not None:
                    return self._lead(value)
            o_inputs, o_lse = _aligned(other, head_map, i)
            mine, theirs = rows.joint(self._every_row(), rows.Rows.every(o_inputs, o_lse))
            mine, theirs = rows.real_rows(mine, real), rows.real_rows(theirs, real)

            def other_source(budget, both=False):
                return rows.Source(theirs, budget, both)
        elif isinstance(other, torch.Tensor):
            if head_map is not None:
                raise SdpaValueError(
                    "head_map applies to AttentionWeights; a dense target "
                    "already has these weights' heads (*lead, L, S)"
                )
            target = _dense_target(other, i)  # (B|1, Hq|1, L, S)
            # (its mass may sit anywhere; its gradient is laid out over every row)
            mine, theirs = self._every_row()._replace(spans=None, real=None), None

            def other_source(budget, both=False):
                return rows.DenseSource(target)
        else:
            raise SdpaTypeError(
                f"kl takes AttentionWeights or a dense target tensor (*lead, L, S), got "
                f"{type(other).__name__}"
            )
        if self._shape_only:
            return self._zeros(i.query.shape[2])
        with torch.no_grad(), no_autocast(self.device.type):
            value = rows.kl(mine, other_source, reverse)  # (B, Hq, L)
        sides, extras = [], []
        needs = self._needs()
        if needs is not None:
            rule = grads.kl_rule(other_source, weighs=reverse)
            sides.append(grads.Side(mine, rule, needs))
        if theirs is not None and (o_needs := other._needs(theirs.inputs)) is not None:

            def my_source(budget, both=False):
                return rows.Source(mine, budget, both)

            rule = grads.kl_rule(my_source, weighs=not reverse)
            sides.append(grads.Side(theirs, rule, o_needs))
        if theirs is None and torch.is_grad_enabled() and other.requires_grad:
            extras.append((other, _target_grad(mine, target, other, reverse)))
        if sides or extras:
            # what the backward reads without differentiating it: the other side's q, k,
            # mask and sinks, or a dense target
            watch = [other] if theirs is None else grads.watched(theirs.inputs)
            value = grads.read_sides(lambda v=value: v, sides, extras, watch)
        return self._lead(value)

    def _held_kl(self, other: _Reads, reverse: bool, real) -> torch.Tensor | None:
        """kl from both sides' whole weights where they are kept or small (`_held`: the
        small backend's, or one product), on CPU: one elementwise pass over them, which
        torch differentiates through each side's kept graph, where tiles would compute
        both sides' scores again; (B, Hq, L), rows outside `real` 0 as rows.real_rows
        leaves them. None where a side has no such weights, or where the value is not
        finite (a NaN, or a key the first side weighs that the second gives 0: a mask's
        +inf, or a weight that underflowed, whose log the tiles keep): the tiles then."""
        if torch.compiler.is_compiling() or self.device.type != "cpu" or other._shape_only:
            return None  # (its finite check reads the host: no graph material)
        mine, theirs = self._held(), other._held()
        if (
            mine is None
            or theirs is None
            or (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype)
        ):
            return None
        with no_autocast(self.device.type):
            if self._needs() is not None:
                mine = self._held(grad=True)
            if torch.is_grad_enabled() and other._needs() is not None:
                theirs = other._held(grad=True)
            first, second = (mine, theirs) if reverse else (theirs, mine)
            # where the first is 0 both logs are of 1: its term 0 x 0 = 0 (0 log 0 = 0),
            # gradients finite; a NaN weight stays NaN (the tiles then)
            seen = first > 0
            terms = first * (
                torch.where(seen, first, 1.0).log() - torch.where(seen, second, 1.0).log()
            )
            value = terms.sum(dim=-1)  # (B, Hq, L)
        if not bool(value.detach().isfinite().all()):  # (one host read of B x Hq x L)
            return None
        read = rows.read_rows(rows.query_spans(self._inputs), real)
        if read is not None:
            value = value * masks.rows_within(read, value.shape[-1], value.device)[:, None, :]
        if value.requires_grad:  # (either side's q, k, mask or sinks changed after the
            # read: its backward refuses, as the tiles' does, which read them again)
            value = grads.watch(value, grads.watched(self._inputs) + grads.watched(other._inputs))
        return value

    def score_errors(self, other: AttentionWeights, head_map=None) -> torch.Tensor:
        """The squared differences between the pre-softmax scores of these weights' call
        and other's, summed over the keys per query row: (*lead, L), sum_j (s_ij -
        t_ij)^2 with s = scale q k^T (softcap applied, a float mask added) and 0 where a
        call's mask excludes the key (so an entry both calls exclude adds 0). The
        TinyBERT distillation loss is its mean (sdpa.losses.score_mse).

        other: AttentionWeights over the same batch, queries and keys; head_map as for
        kl. Differentiable into both sides as they require grad, tile by tile (never
        L x S): into s, 2 g (s - t) where this call sees the key."""
        if not isinstance(other, _Reads):
            raise SdpaTypeError(
                f"score_errors compares the scores of two attention calls: other must be "
                f"AttentionWeights, got {type(other).__name__}"
            )
        self._check_fresh()
        other._check_fresh()
        i = self._inputs
        o_inputs, o_lse = _aligned(other, head_map, i, "score_errors")
        if self._shape_only or other._shape_only:
            return self._zeros(i.query.shape[2])
        mine, theirs = rows.joint(self._every_row(), rows.Rows.every(o_inputs, o_lse))
        with torch.no_grad(), no_autocast(self.device.type):
            value = rows.score_errors(mine, theirs)  # (B, Hq, L)
        sides = []
        if (needs := self._needs()) is not None:
            sides.append(grads.Side(mine, grads.score_errors_rule(mine, theirs), needs))
        if (o_needs := other._needs(o_inputs)) is not None:
            sides.append(grads.Side(theirs, grads.score_errors_rule(theirs, mine), o_needs))
        if sides:  # (each side's backward reads the other's q, k and mask)
            watch = grads.watched(o_inputs) + grads.watched(i)
            value = grads.read_sides(lambda v=value: v, sides, [], watch)
        return self._lead(value)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """w @ x: P X for x broadcasting to (*lead, S, F) -> (*lead, L, F), in the
        weights' dtype: the attention of these queries and keys with x as the values
        (one fused call, differentiable in q, k, x, a float mask and the sinks; never
        L x S). Rollout, span mass and value-weighted reads are such products."""
        if isinstance(x, _Reads):
            return on_dense(torch.matmul, (self, x), {})
        self._check_fresh()
        i = self._inputs
        xb = _per_head(x, i, "x", -2)  # (B, Hq, S, F)
        held = self._held(grad=self._needs() is not None or xb.requires_grad)
        if held is not None:
            return self._lead(torch.matmul(held, xb.to(held.dtype)))
        from sdpa.backends import run, select  # (the registry imports this module's layer)

        key = i.key if i.group == 1 else i.key.repeat_interleave(i.group, dim=1)  # (B,Hq,S,E)
        product = i._replace(key=key, value=xb.to(i.query.dtype), dropout_p=0.0)
        with no_autocast(self.device.type):
            out = run(select(product), product)[0]  # (B, Hq, L, F)
        return self._lead(out.to(self.dtype))

    def __rmatmul__(self, u: torch.Tensor) -> torch.Tensor:
        """u @ w: u^T P for u broadcasting to (*lead, F, L) -> (*lead, F, S) (u of shape
        (..., L) gives (*lead, S)): weights summed over queries with weights of your
        own, e.g. one step of attention rollout. Tile by tile, never L x S;
        differentiable in u, q, k, a float mask and the sinks."""
        self._check_fresh()
        i = self._inputs
        vector = isinstance(u, torch.Tensor) and u.ndim == 1
        ub = _per_head(u[None] if vector else u, i, "u", -1)  # (B, Hq, F, L)
        S = i.key.shape[2]
        needs = self._needs()
        held = self._held(grad=needs is not None or ub.requires_grad)
        if held is not None:
            out = torch.matmul(ub.to(held.dtype), held)
        elif self._shape_only:
            out = torch.zeros(*ub.shape[:-1], S, dtype=self.dtype, device=self.device)
        else:
            r = self._every_row()
            with torch.no_grad(), no_autocast(self.device.type):
                out = rows.weighted_rows(r, ub.detach())  # (B, Hq, F, S)
            extras = []
            if torch.is_grad_enabled() and ub.requires_grad:
                extras.append((ub, lambda g, r=r: rows.weighted_rows_grad(r, g)))
            if needs is not None or extras:
                sides = []
                if needs is not None:
                    rule = grads.weighted_rows_rule(ub.detach())
                    sides.append(grads.Side(r, rule, needs))
                out = grads.read_sides(lambda v=out: v, sides, extras, [ub])  # (its rule reads u)
        out = self._lead(out)
        return out[..., 0, :] if vector else out

    def max_logits(self) -> MaxLogits:
        """The largest raw score of each query row, after the scale and any float mask,
        before the softcap and the softmax: MaxLogits(row (*lead, L), head (*lead)), head
        the maximum over the rows (what QK-clip / MuonClip read at every step). -inf for
        rows that see no key. One pass of q k^T on CPU, tile by tile. Forward only: it
        refuses to run where its inputs require grad (compute it under torch.no_grad())."""
        self._check_fresh()
        i = self._inputs
        if self._needs() is not None:
            raise NotSupportedError(
                "max_logits is forward only (no gradient): call it under torch.no_grad(), "
                "as QK-clip reads it outside the loss"
            )
        if self._shape_only:
            row = torch.full((*i.lead, i.query.shape[2]), -torch.inf, device=self.device)
        else:
            row = self._lead(self._provide("max_logits"))
        head = row.amax(dim=-1) if row.shape[-1] else row.new_full(row.shape[:-1], -torch.inf)
        return MaxLogits(row, head)

    def sum(self, *args: object, **kwargs: object) -> torch.Tensor:
        """torch.sum of the weights, lazy over any dims that include the queries or the
        keys: over the queries (dim=-2; no dim: every dim) the attention each key
        receives, (*lead, S), in O(L + S) memory, then the other dims of that; over the
        keys, each row's sum (1, or 0 where it sees no key), (*lead, L), as the product
        w @ 1 in O(chunk x S)."""
        nd = len(self._inputs.shape)
        dims, _ = reduction_of(args, kwargs, nd)
        if dims is not None and (nd - 2) not in dims and (nd - 1) in dims:
            return self._reduce(torch.Tensor.sum, self._row_sums, -1, args, kwargs)
        return self._reduce(torch.Tensor.sum, self._key_sums, -2, args, kwargs)

    def _row_sums(self) -> torch.Tensor:
        """Each query row's sum over the keys, (*lead, L): w @ 1 (the product read, its
        gradient included)."""
        S = self._inputs.key.shape[2]
        return (self @ torch.ones(S, 1, dtype=self.dtype, device=self.device))[..., 0]

    def mean(self, *args: object, **kwargs: object) -> torch.Tensor:
        """torch.mean of the weights: lazy over dims that include the queries (sum / L
        then the mean of the other dims) or the keys (row sums / S); other dims (the
        head mean w.mean(1), (B, L, S)) are a lazy expression whose index reads rows
        (sdpa.lazy.reduce_lead)."""
        L, S = max(1, self._inputs.query.shape[-2]), max(1, self._inputs.key.shape[-2])
        nd = len(self._inputs.shape)
        dims, _ = reduction_of(args, kwargs, nd)
        if dims is not None and (nd - 2) not in dims and (nd - 1) in dims:  # over the keys
            return self._reduce(torch.Tensor.mean, lambda: self._row_sums() / S, -1, args, kwargs)
        return self._reduce(torch.Tensor.mean, lambda: self._key_sums() / L, -2, args, kwargs)

    def _reduce(self, op: Callable, lazy: Callable | None, at: int, args: tuple, kwargs: dict):
        """op(w, *args, **kwargs): over leading dims alone a lazy expression (sdpa.lazy);
        where its dims include `at` (-2 or -1), lazy() (the reduction over `at`) reduced
        over the other dims by op; else (or with no lazy reduction) the dense op."""
        nd = len(self._inputs.shape)
        every = () if op in (T.amax, T.amin) else None  # (their default dim=(): every dim)
        dims, keepdim = reduction_of(args, kwargs, nd, "dim", every)
        if dims is not None and max(dims) < nd - 2 and isinstance(self, LazyTensor):
            # over leading dims alone (the head mean): lazy, its index reads rows
            return reduce_lead(self, LeadReduction(op.__name__, tuple(sorted(dims)), keepdim, None))
        if lazy is None or dims is None or at % nd not in dims:
            return on_dense(op, (self, *args), kwargs)
        out = lazy().unsqueeze(at)
        rest = sorted(dims - {at % nd})
        if rest:
            out = op(out, rest, keepdim=True)
        return out if keepdim else out.squeeze(tuple(sorted(dims)))

    def _key_sums(self) -> torch.Tensor:
        """Attention each key receives, summed over the queries: (*lead, S)."""
        self._check_fresh()
        if self._shape_only:
            return self._zeros(self._inputs.key.shape[2])
        return self._lead(self._read("sum", rule=lambda _: grads.key_sums_rule()))

    def entropy(self) -> torch.Tensor:
        """-sum_j p_ij ln p_ij for each query, in nats: (*lead, L); 0 for rows that see
        no key."""
        self._check_fresh()
        if self._shape_only:
            return self._zeros(self._inputs.query.shape[2])
        return self._lead(self._read("entropy", rule=lambda _: grads.entropy_rule()))

    def amax(self, *args: object, **kwargs: object) -> torch.Tensor:
        """torch.amax of the weights: lazy over dims that include the keys (each query
        row's largest weight, (*lead, L), 0 for rows that see no key, then the other
        dims of that); over leading dims alone a lazy expression (sdpa.lazy); other
        dims take the dense weights."""
        return self._reduce(torch.Tensor.amax, self._row_max, -1, args, kwargs)

    def amin(self, *args: object, **kwargs: object) -> torch.Tensor:
        """torch.amin of the weights: over leading dims alone a lazy expression whose
        index reads rows (sdpa.lazy); other dims take the dense weights."""
        return self._reduce(torch.Tensor.amin, None, -1, args, kwargs)

    def _row_max(self) -> torch.Tensor:
        self._check_fresh()
        if self._shape_only:
            return self._zeros(self._inputs.query.shape[2])
        return self._lead(self._read("amax", rule=grads.amax_rule))

    def max(self, *args: object, **kwargs: object):
        """torch.max of the weights: over the keys (dim=-1) lazy, torch.return_types.max
        (values, indices), each (*lead, L), from topk(1); otherwise (no dim: the largest
        weight; another tensor: elementwise) on the dense weights."""
        nd = len(self._inputs.shape)
        if not args and not kwargs:  # the largest weight of all
            return self.amax()
        dims, keepdim = reduction_of(args, kwargs, nd, "dim", -nd - 1)
        if dims != {nd - 1} or not (args or "dim" in kwargs):
            return on_dense(torch.Tensor.max, (self, *args), kwargs)
        values, indices = self._topk(1)
        if not keepdim:
            values, indices = values[..., 0], indices[..., 0]
        return torch.return_types.max((values, indices))

    def argmax(self, *args: object, **kwargs: object) -> torch.Tensor:
        """torch.argmax of the weights: over the keys (dim=-1) lazy (the key each query
        attends most, from topk(1)); otherwise on the dense weights."""
        nd = len(self._inputs.shape)
        dims, keepdim = reduction_of(args, kwargs, nd, "dim", -nd - 1)
        if dims != {nd - 1}:
            return on_dense(torch.Tensor.argmax, (self, *args), kwargs)
        with torch.no_grad():  # (indices carry no gradient)
            indices = self._topk(1)[1]
        return indices if keepdim else indices[..., 0]

    def topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        """torch.topk of the weights: over the keys (dim=-1, largest) lazy, the k largest
        weights of each query row and their key indices, torch.return_types.topk
        (values, indices), each (*lead, L, k); rows that see no key give values 0.
        Other dims, or largest=False, take the dense weights."""
        nd = len(self._inputs.shape)
        if largest is not True or dim_of(dim, nd) != nd - 1:
            return on_dense(torch.Tensor.topk, (self, k, dim, largest, sorted), {})
        return torch.return_types.topk(self._topk(k))

    def _topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._inputs
        S = i.key.shape[-2]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= S:
            raise SdpaValueError(f"k must be an int in [0, S={S}], got {k!r}")
        self._check_fresh()
        if self._shape_only:
            L = i.query.shape[2]
            return self._zeros(L, k), self._zeros(L, k, dtype=torch.long)
        values, indices = self._read("topk", k, rule=lambda v: grads.topk_rule(v[1]))
        return self._lead(values), self._lead(indices)

    @property
    def requires_grad(self) -> bool:
        """As the listing's p_attn: True where q, k, a float mask or the sinks require
        grad (and the call was not under sdpa.frozen()); its reads then carry gradients."""
        i = self._inputs
        mask, sinks = i.tensor_mask, i.sinks
        return not self._frozen and (
            i.query.requires_grad
            or i.key.requires_grad
            or (mask is not None and mask.requires_grad)
            or (sinks is not None and sinks.requires_grad)
        )

    def detach(self) -> AttentionWeights:
        """A lazy handle on the same weights whose reads carry no gradient (q, k, the
        mask and the sinks detached: they share the originals' version counters, so
        the twin goes stale with them). O(1)."""
        self._check_fresh()
        i = self._inputs
        inputs = i._replace(
            query=i.query.detach(),
            key=i.key.detach(),
            value=i.value.detach(),
            mask=masks.from_state(masks.state_of(i.mask)),
            sinks=None if i.sinks is None else i.sinks.detach(),
        )
        probs = None if self._probs is None else self._probs.detach()
        twin = self._stale_as_this(handle(inputs, self._lse, probs, self._backend))
        if probs is not None:  # (the twin holds the same weights)
            self._shared = twin._shared = True
        return twin

    def _stale_as_this(self, view: AttentionWeights) -> AttentionWeights:
        """view (a twin or view of this handle), made to go stale exactly when this one
        does: the same freshness source and the version counters read with it."""
        view._source, view._versions = self._source, self._versions
        return view

    def _stale_with(self, part: object) -> AttentionWeights:
        """A twin of this handle (the same recipe, O(1)) that also goes stale where
        part._check_fresh() raises, and so does every view and chain of it: the lazy view
        of a cached pattern, stale once that pattern is changed in place."""
        twin = new_handle(
            AttentionWeights, self._inputs, self._lse, self._probs, self._backend, self._frozen,
            self._versions,
        )  # fmt: skip
        twin._source = (self, part)
        if self._probs is not None:  # (the twin holds the same weights)
            self._shared = twin._shared = True
        return twin

    def to(self, *args: object, **kwargs: object) -> torch.Tensor:
        """The handle itself where nothing changes (as torch returns the tensor itself);
        to another device the recipe moves (q, k, the mask, LSE and sinks: nothing L x S
        is made, and the handle there computes what is read); another dtype takes the
        weights converted as they are read (a lazy expression: w.to(torch.bfloat16)[0, 1]
        reads one row and rounds it)."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        plain = memory_format in (None, torch.preserve_format) and not kwargs.get("copy", False)
        if plain and device is not None and torch.device(device) != self.device:
            moved = self._moved(torch.device(device), non_blocking)
            if moved is not None:
                return moved if dtype is None or dtype == self.dtype else moved.to(dtype)
        same_device = device is None or torch.device(device) == self.device
        if plain and same_device and (dtype is None or dtype == self.dtype):
            return self
        if plain and same_device and dtype is not None:  # w.to(dtype): lazy
            made = expr(torch.Tensor.to, (self, dtype), {})
            if made is not None:
                return made
        return on_dense(torch.Tensor.to, (self, *args), kwargs)

    def _moved(self, device: torch.device, non_blocking: bool) -> AttentionWeights | None:
        """This handle's recipe on `device` (gradients flow back through the moves; stale
        with the originals), or None where a structured mask of your own cannot say what
        its tensors are."""
        self._check_fresh()
        i = self._inputs
        tensor, structured = masks.split(i.mask)
        if structured is not None:
            state = masks.state_of(structured)
            if state is structured:  # (a Mask subclass of your own: its tensors unknown)
                return None
            structured = masks.from_state(_state_to(state, device, non_blocking))

        def to(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        inputs = i._replace(
            query=to(i.query), key=to(i.key), value=to(i.value),
            mask=masks.join(to(tensor), structured), sinks=to(i.sinks),
        )  # fmt: skip
        return self._stale_as_this(
            new_handle(
                AttentionWeights, inputs, to(self._lse), to(self._probs), self._backend,
                self._frozen,
            )
        )  # fmt: skip

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format):
        """The handle itself (it answers as a contiguous tensor), as torch returns a
        contiguous tensor itself; another memory format takes the dense weights."""
        if memory_format in (torch.contiguous_format, torch.preserve_format):
            return self
        return on_dense(torch.Tensor.contiguous, (self,), {"memory_format": memory_format})

    def cpu(self, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        """The handle itself on the CPU, else its recipe moved there (see `to`)."""
        return self.to("cpu", memory_format=memory_format)

    def cuda(
        self,
        device: object = None,
        non_blocking: bool = False,
        memory_format: torch.memory_format = torch.preserve_format,
    ) -> torch.Tensor:
        """The recipe moved to a CUDA device (see `to`)."""
        where = (
            torch.device("cuda")
            if device is None
            else torch.device("cuda", device)
            if isinstance(device, int)
            else torch.device(device)
        )
        return self.to(where, non_blocking=non_blocking, memory_format=memory_format)

    def _dense(self, op: str) -> torch.Tensor:
        """The dense weights for an op no lazy read answers, within budget.dense_limit();
        past it WeightsTooLargeError naming the op and the lazy reads."""
        check_fits(
            f"{op} on AttentionWeights takes the dense weights in {self.dtype}: they",
            tuple(self._inputs.shape),
            torch.finfo(self.dtype).bits // 8,
            dense_limit(),
            LAZY_READS + "; or w.full(max_bytes=None)",
        )
        return self._full(DEFAULT_MAX_BYTES, give=False)

    # -- saving and copying ----------------------------------------------------------

    def __reduce_ex__(self, protocol: int):
        """pickle and torch.save keep the recipe, detached: q, k, the mask, the LSE and
        the sinks (O(L x E) for q and k), not the weights (except those the call kept
        because they are small: the small backend's, at most small_weights bytes); the
        copy reads
        exactly as this handle and carries no gradient. torch.load(..., weights_only=
        True) loads it (sdpa allowlists this class). A stale handle refuses."""
        return _from_state, (self._state(),)

    def __deepcopy__(self, memo: dict) -> AttentionWeights:
        """A detached copy of the recipe (q, k, the mask, LSE, sinks cloned): reads as
        this handle, carries no gradient, and never goes stale through the originals."""
        twin = _from_state(copy.deepcopy(self._state(), memo))
        memo[id(self)] = twin
        return twin

    def _state(self) -> dict:
        """What a saved or copied handle holds: tensors (detached; a view of a larger
        tensor compacted), numbers, strings, tuples and a dict."""
        self._check_fresh()
        i = self._inputs
        return {
            "format": 1,
            "query": _compact(i.query),
            "key": _compact(i.key),
            "value": i.value.detach().new_zeros(()).expand(i.value.shape),  # (shape only)
            "mask": _compact_mask(masks.state_of(i.mask)),
            "scale": i.scale,
            "dropout_p": i.dropout_p,
            "lead": tuple(i.lead),
            "softcap": i.softcap,
            "sinks": None if i.sinks is None else _compact(i.sinks),
            "lse": _compact(self._log_sum_exp()),
            # the weights themselves where the call kept them (the small backend, under
            # its small_weights bytes): the copy then reads them as this handle does
            "probs": None if self._probs is None else self._probs.detach(),
            "backend": None if self._backend is None else self._backend.name,
            "frozen": self._frozen,
        }

    def _every_row(self) -> rows.Rows:
        return rows.Rows.every(self._inputs, self._log_sum_exp())


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided
_SLOTS = ("_inputs", "_lse", "_probs", "_shared", "_versions", "_backend", "_frozen", "_source")


def new_handle(
    cls: type,
    inputs: Inputs,
    lse: torch.Tensor | None,
    probs,
    backend,
    frozen: bool,
    versions: tuple | None = None,
) -> AttentionWeights:
    """A handle of class cls, in O(1) with nothing allocated: a tensor of the weights'
    shape, dtype and device that holds the recipe (AttentionWeights(...) and `handle`
    make it here; `handle` without the class call, whose cost every attention call pays).
    Never called while torch.compile traces (a tensor subclass cannot be made there)."""
    q = inputs.query
    # (size, strides, storage_offset, memory_format, dtype, layout, device) by position:
    # torch's argument parser takes them ~0.5 us faster than as keywords
    shape = (*inputs.lead, q.shape[2], inputs.key.shape[2])  # (Inputs.shape, inline)
    dtype = compute_dtype(q.dtype)
    w = _make_wrapper(cls, shape, None, None, None, dtype, _STRIDED, q.device)
    versions = versions_now(inputs) if versions is None else versions  # (as of the call)
    _Reads.__init__(w, inputs, lse, probs, backend, frozen, versions)
    return w


class AttentionWeights(_Reads, LazyTensor):
    """Lazy view of the attention weights, shape (*lead, L, S) (query heads for GQA): a
    torch.Tensor (a wrapper subclass with the listing's shape, dtype and device, that
    holds no storage) which computes only what is read.

    Every torch op answers as the dense tensor would, in one of two ways chosen by one
    table (`READS`, in `__torch_function__`, above autograd): a lazy read (indexing,
    sum / mean over the queries, amax / max / argmax / topk over the keys, diagonal,
    products, entropy, kl, max_logits, pairs, detach) in O(rows x S) or O(L + S) memory;
    or, for any other op (or arguments a lazy read does not take), the op on the dense
    weights within the default `max_bytes` (past it WeightsTooLargeError naming the lazy
    reads). In-place ops, `out=` and storage access refuse by name (take `w.full()`, a
    dense copy of your own). Gradients flow to q, k, a float mask and the sinks; the
    handle itself is never an autograd node (`w.retain_grad()` and hooks refuse by name:
    take them on `p = w.full()`). Inside a torch.compile region the call hands out a
    GraphWeights instead, with the same reads.

    Shapes: query (..., L, E), key (..., S, E) -> weights (..., L, S); with heads,
    (..., Hq, L, S). Values are the softmax probabilities *before* dropout, in float32
    for 16-bit inputs. Rows that see no key are all 0.

    The handle keeps q, k and the mask by reference, not by copy. An in-place change
    made through torch (k.mul_(2), a KV-cache write, resize_, set_) bumps their version
    counters, and every access then raises StaleWeightsError rather than answer for
    other inputs. Writes torch cannot see are not detected: through `.data`, a numpy
    view (`t.numpy()`), or another tensor sharing the storage; nor are tensors made
    under torch.inference_mode (they have no counter). Read the weights before such a
    write, or pass a clone.

    served_by: the backend and path that computed the call (e.g. "fused: one kernel
    call"), as sdpa.explain describes them.
    """

    @staticmethod
    def __new__(
        cls,
        inputs: Inputs,
        lse: torch.Tensor | None,
        probs: torch.Tensor | None = None,
        backend: object = None,
        frozen: bool = False,
    ):
        return new_handle(cls, inputs, lse, probs, backend, frozen)

    __slots__ = _SLOTS  # (torch.Tensor's __dict__ stays: attributes a user sets work)

    def __init__(self, *args: object, **kwargs: object):
        pass  # (set in __new__)

    # -- the tensor protocol ---------------------------------------------------------

    def __repr__(self, *, tensor_contents: object = None) -> str:
        """What torch prints for the dense weights, summarised past torch's print
        threshold as torch summarises them, computed from the entries shown only
        (sdpa.lazy.printed): a debugger's view never computes L x S. A stale handle says
        so instead of raising."""
        try:
            return printed(self, tuple(self._inputs.shape), self.full)
        except StaleWeightsError as e:
            return f"AttentionWeights(shape={tuple(self._inputs.shape)}, stale: {e})"

    # -- views over the leading dims ------------------------------------------------

    def __getitem__(self, index: object) -> torch.Tensor:
        """An index of the leading dims alone (w[0], w[:, 2], w[[0, 3]], a boolean mask
        over them) is a view: the same lazy weights of those (batch, head) rows, made in
        O(rows x (L + S) x E) with nothing L x S; any other index is a read (_Reads)."""
        return basic_index(self, index, self._index)

    def _index(self, index: object) -> torch.Tensor:
        lead = self._inputs.lead
        part = leads.lead_index(index, len(lead) + 2)
        if part is not None:
            view = self._lead_view(*leads.lead_rows(tuple(lead), part))
            if view is not None:
                return view
        return _Reads.__getitem__(self, index)

    def _lead_view(self, new_lead: tuple[int, ...], rows: list[int]) -> AttentionWeights | None:
        """The view of lead rows `rows` in shape new_lead (sdpa.leads), or None where that
        layout has none.
        It reads as the handle's own rows (gradients to the call's q, k, mask and sinks)
        and goes stale with the call's inputs."""
        self._check_fresh()
        taken = leads.take(self._inputs, self._lse, self._probs, new_lead, rows)
        if taken is None:
            return None
        inputs, lse, probs = taken
        view = self._stale_as_this(
            new_handle(AttentionWeights, inputs, lse, probs, self._backend, self._frozen)
        )
        if probs is not None:  # (a view of the kept weights, or a copy: either way held)
            self._shared = view._shared = True
        return view

    @staticmethod
    def _joined(func: Callable, tensors: object, dim: object) -> torch.Tensor | None:
        """torch.stack / torch.cat of handles over a leading dim (the layers of a capture
        as one (layers, B, H, L, S) tensor): the lazy view of their rows, one call after
        another, or None where the handles are not one kind of call (sizes, dtype,
        scale, masks: sdpa.leads.join) or the result's rows mix batch elements."""
        parts = list(tensors)
        if not parts or not all(type(t) is AttentionWeights for t in parts):
            return None
        for t in parts:
            t._check_fresh()
        nd = len(parts[0]._inputs.shape) + (func is torch.stack)
        d = dim_of(dim, nd)
        if d is None or d >= nd - 2:
            return None  # (over the query or key dims: the dense weights)
        inputs = [t._inputs for t in parts]
        frozen = [t._frozen for t in parts]
        rows = leads.joined_rows(inputs, "stack" if func is torch.stack else "cat", d)
        if rows is None or not all(f == frozen[0] for f in frozen):
            return None  # (shapes torch refuses: the dense path raises its error)
        joined = leads.join(inputs, [t._log_sum_exp() for t in parts], [t._probs for t in parts])
        if joined is None:
            return None
        inputs_j, lse, probs = joined
        backend = parts[0]._backend if all(t._backend is parts[0]._backend for t in parts) else None
        base = new_handle(AttentionWeights, inputs_j, lse, probs, backend, frozen[0])
        base._source = tuple(parts)  # (stale with any of them)
        return base._lead_view(*rows)

    def _lead_moved(self, new: tuple[int, ...], grow: bool) -> AttentionWeights | None:
        """The lazy view of the rows in the new leading shape `new[:-2]` (torch's
        row-major order; grow: an expand, rows repeat along the new dims), where `new`
        keeps the query and key dims last and whole; else None."""
        shape = tuple(self._inputs.shape)
        if len(new) < 2 or new[-2:] != shape[-2:]:
            return None
        if grow:  # rows repeat (read once each) along the new dims
            return self._lead_view(*leads.expanded_rows(shape[:-2], new[:-2]))
        return self._lead_view(*leads.reshaped_rows(shape[:-2], new[:-2]))

    def _permuted(self, perm: list[int] | None) -> torch.Tensor | None:
        """A permutation of the dims (permute, transpose, swapaxes, mT) that keeps the
        query and key dims last: the lead dims' part a lazy view of the rows in their new
        order, the last two swapped a lazy transpose of it; None for any other."""
        if perm is None:
            return None
        nd = len(perm)
        lead, last = perm[:-2], perm[-2:]
        if sorted(lead) != list(range(nd - 2)) or sorted(last) != [nd - 2, nd - 1]:
            return None  # (a query or key dim moved among the lead: the dense weights)
        view = self
        if lead != list(range(nd - 2)):
            view = self._lead_view(*leads.permuted_rows(tuple(self._inputs.lead), lead))
            if view is None:
                return None
        return transpose(view) if last == [nd - 1, nd - 2] else view

    def backward(self, *args: object, **kwargs: object):
        refuses_grad("backward")()

    def retain_grad(self):
        refuses_grad("retain_grad")()

    def register_hook(self, hook: Callable):
        refuses_grad("register_hook")()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Every torch op on a handle: a lazy read (READS), the wrapper's own metadata
        (shape, dims, device), a transpose of the query and key dims or an elementwise
        op (a lazy expression, sdpa.lazy), a refusal (in place, out=, storage, gradients
        of the handle itself), else the op on the dense weights within the default
        budget."""
        kwargs = {} if kwargs is None else kwargs
        read = READS.get(func)
        if read is not None:
            return read(*args, **kwargs)
        if func in METADATA:
            return metadata(func, args, kwargs)
        if func in TRANSPOSES and args and isinstance(args[0], AttentionWeights):
            moved = args[0]._permuted(permutation(func, args[0], args[1:], kwargs))
            if moved is not None:
                return moved
        made = expr(func, args, kwargs)  # an elementwise op: a lazy expression
        return made if made is not None else on_dense(func, args, kwargs)


class GraphWeights(_Reads):
    """The handle made inside a torch.compile region: the same recipe and reads as
    AttentionWeights, as a plain object, since dynamo cannot create a tensor subclass in
    a graph. Each read is one graph break (it runs eagerly, as a whole: dynamo traces
    none of its Python, so no resume frames are compiled inside it and no tile loop
    unrolls into a graph); torch ops on it (w * 2, torch.stack) are not taken: read it
    (w[...], w.sum(dim=-2), w.full()) or return it from the compiled function and use it
    outside."""

    def _check_fresh(self) -> None:
        """As AttentionWeights', from the version counters read at the handle's first
        check outside the trace (a traced region has none to read, see _versions): a
        read inside the compiled step, or after it returned the handle. A change made
        between the end of the compiled call and that first read is not seen."""
        if self._versions == (None, None, None) and not torch.compiler.is_compiling():
            self._versions = versions_now(self._source)
        super()._check_fresh()


# the reads a compiled step makes of its handle, each run eagerly as a whole
GRAPH_READS = (
    "full", "__getitem__", "pairs", "diagonal", "kl", "score_errors", "__matmul__",
    "__rmatmul__", "max_logits", "sum", "mean", "entropy", "amax", "amin", "max", "argmax",
    "topk",
)  # fmt: skip
for _name in GRAPH_READS:
    setattr(GraphWeights, _name, torch.compiler.disable(getattr(_Reads, _name)))


def handle(
    inputs: Inputs,
    lse: torch.Tensor | None,
    probs: torch.Tensor | None = None,
    backend: object = None,
    frozen: bool = False,
) -> AttentionWeights | GraphWeights:
    """The weights of an attention call: an AttentionWeights tensor, or inside a
    torch.compile region a GraphWeights."""
    if torch.compiler.is_compiling():
        return GraphWeights(inputs, lse, probs, backend, frozen)
    return new_handle(AttentionWeights, inputs, lse, probs, backend, frozen)


HANDLES = (AttentionWeights, GraphWeights)
"""Both kinds of handle, for isinstance."""


# -- the table of reads ---------------------------------------------------------------


def _matmul(a: object, b: object) -> torch.Tensor:
    return a.__matmul__(b) if isinstance(a, _Reads) else b.__rmatmul__(a)


CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
         torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16}  # fmt: skip
"""The tensor methods that cast to one dtype, and that dtype."""


def _cast(dtype: torch.dtype) -> Callable:
    """w.float(), w.double(), ... as w.to(dtype): the handle itself where nothing changes."""

    def cast(w: AttentionWeights, *, memory_format=torch.preserve_format) -> torch.Tensor:
        return w.to(dtype, memory_format=memory_format)

    return cast


def _state_to(state: object, device: torch.device, non_blocking: bool) -> object:
    """A saved mask's state (masks.state_of) with its tensors on `device`."""
    if isinstance(state, torch.Tensor):
        return state.to(device, non_blocking=non_blocking)
    if isinstance(state, tuple):
        return tuple(_state_to(s, device, non_blocking) for s in state)
    return state


def _meta_result(w: AttentionWeights, func: Callable, args: tuple, kwargs: dict) -> object:
    """func on a meta tensor of the weights' shape: torch's own checks and result
    shapes, computing nothing."""
    return func(torch.empty(tuple(w._inputs.shape), device="meta"), *args, **kwargs)


def _along(w: AttentionWeights, dim: int, item: int | slice) -> torch.Tensor:
    """w indexed by `item` along dim (normalised) alone: a view over a leading dim, a
    read of rows or keys over the last two."""
    return w[(slice(None),) * dim + (item,)]


def _select(w: AttentionWeights, dim: int, index: int) -> torch.Tensor:
    """w.select(dim, index) / torch.select: w[..., index, ...] (a view or a read)."""
    _meta_result(w, torch.Tensor.select, (dim, index), {})  # torch's errors
    return _along(w, dim_of(dim, len(w._inputs.shape)), operator.index(index))


def _narrow(w: AttentionWeights, dim: int, start: int, length: int) -> torch.Tensor:
    """w.narrow(dim, start, length): the slice start:start + length along dim."""
    _meta_result(w, torch.Tensor.narrow, (dim, start, length), {})  # torch's errors
    d = dim_of(dim, len(w._inputs.shape))
    first = operator.index(start) % max(w._inputs.shape[d], 1) if start else 0
    return _along(w, d, slice(first, first + operator.index(length)))


def _pieces(func: Callable) -> Callable:
    """unbind, split and chunk: torch's pieces (sizes asked of a meta tensor), each a
    view over a leading dim or a read of rows or keys."""

    def pieces(w: AttentionWeights, *args: object, **kwargs: object) -> tuple:
        parts = _meta_result(w, func, args, kwargs)  # torch's errors and piece sizes
        if func in _UNBIND:  # unbind(dim=0)
            d = dim_of(args[0] if args else kwargs.get("dim", 0), len(w._inputs.shape))
            return tuple(_along(w, d, i) for i in range(len(parts)))
        # split(split_size_or_sections, dim=0), chunk(chunks, dim=0)
        d = dim_of(args[1] if len(args) > 1 else kwargs.get("dim", 0), len(w._inputs.shape))
        out, start = [], 0
        for part in parts:
            n = part.shape[d]
            out.append(_along(w, d, slice(start, start + n)))
            start += n
        return tuple(out)

    return pieces


def _join_read(func: Callable) -> Callable:
    """torch.stack / torch.cat with handles: lazy over a leading dim (_joined), else the
    dense weights (out= refuses or writes as _on_dense says)."""

    def join(tensors: object, dim: int = 0, *, out: object = None) -> torch.Tensor:
        if out is None and isinstance(tensors, list | tuple):
            view = AttentionWeights._joined(func, tensors, dim)
            if view is not None:
                return view
        return join_read(func)(tensors, dim, out=out)  # (other lazy parts: their rows)

    return join


T = torch.Tensor
_UNBIND = frozenset({torch.unbind, T.unbind})
READS: dict[Callable, Callable] = {
    **dict.fromkeys((torch.sum, T.sum), AttentionWeights.sum),
    **dict.fromkeys((torch.mean, T.mean), AttentionWeights.mean),
    **dict.fromkeys((torch.amax, T.amax), AttentionWeights.amax),
    **dict.fromkeys((torch.amin, T.amin), AttentionWeights.amin),
    **dict.fromkeys((torch.max, T.max), AttentionWeights.max),
    **dict.fromkeys((torch.argmax, T.argmax), AttentionWeights.argmax),
    **dict.fromkeys((torch.topk, T.topk), AttentionWeights.topk),
    **dict.fromkeys((torch.diagonal, T.diagonal), AttentionWeights.diagonal),
    **dict.fromkeys((torch.matmul, T.matmul, T.__matmul__), _matmul),
    T.__rmatmul__: lambda a, b: _matmul(b, a),
    T.__getitem__: AttentionWeights.__getitem__,
    **dict.fromkeys((torch.select, T.select), _select),
    **dict.fromkeys((torch.narrow, T.narrow), _narrow),
    **{f: _pieces(f) for f in (torch.unbind, T.unbind, torch.split, T.split, torch.chunk, T.chunk)},
    **{f: reshape_read(f) for f in RESHAPES},
    torch.stack: _join_read(torch.stack),
    torch.cat: _join_read(torch.cat),
    **dict.fromkeys((torch.detach, T.detach, T.data.__get__), AttentionWeights.detach),
    T.requires_grad.__get__: AttentionWeights.requires_grad.fget,
    T.to: AttentionWeights.to,
    T.cpu: AttentionWeights.cpu,
    T.cuda: AttentionWeights.cuda,
    T.contiguous: AttentionWeights.contiguous,
    **{cast: _cast(dtype) for cast, dtype in CASTS.items()},
    T.__format__: lambda w, spec: object.__format__(w, spec),  # (its repr: entries shown)
    **{getattr(T, name): refuses_grad(name) for name in GRAD_OF_LAZY},
}
"""Each torch function a handle answers lazily (or refuses): the rest are METADATA or
answered on the dense weights (_on_dense)."""

# -- providers -----------------------------------------------------------------------


def _from_state(state: dict) -> AttentionWeights:
    """A handle from AttentionWeights._state (torch.load, pickle, deepcopy)."""
    if not isinstance(state, dict) or state.get("format") != 1:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise SdpaValueError(
            f"saved AttentionWeights of format {got!r}; this sdpa reads format 1 (saved by "
            f"a newer sdpa?)"
        )
    inputs = Inputs(
        state["query"], state["key"], state["value"], masks.from_state(state["mask"]),
        state["scale"], state["dropout_p"], tuple(state["lead"]), state["softcap"],
        state["sinks"],
    )  # fmt: skip
    name = state["backend"]
    backend = None if name is None else BACKENDS.get(name)
    return AttentionWeights(inputs, state["lse"], state["probs"], backend, state["frozen"])


def _compact(t: torch.Tensor) -> torch.Tensor:
    """t detached, copied where it views a larger storage (a head slice of a fused QKV
    projection, a KV cache's first S rows), so what is saved is t's own elements."""
    t = t.detach()
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def _compact_mask(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return _compact(state)
    if isinstance(state, tuple):
        return tuple(_compact_mask(part) for part in state)
    return state


def _has_held(w: AttentionWeights) -> bool:
    return w._held() is not None


def _always(w: AttentionWeights) -> bool:
    return True


def _triton_serves(w: AttentionWeights) -> bool:
    return kernels.admit(w._inputs) is not None


def _triton_stats(w: AttentionWeights, which: str) -> torch.Tensor:
    """Entropy or row max (B, Hq, L) from the one-pass Triton kernel (Q K^T only, the
    LSE as the shift, rows normalised by their own sum)."""
    from sdpa.kernels.entropy import entropy_and_max  # imports triton

    q, k, mask, causal = kernels.admit(w._inputs)
    entropy, top = entropy_and_max(
        q, k, w._log_sum_exp(), mask, causal=causal, scale=w._inputs.scale
    )
    return entropy if which == "entropy" else top


def _triton_logits_serves(w: AttentionWeights) -> bool:
    """The max-logits kernel scores raw q . k (before any softcap; sinks are no key's
    score)."""
    return kernels.admit(w._inputs, raw_scores=True) is not None


def _triton_logits(w: AttentionWeights) -> torch.Tensor:
    """Each row's largest raw score (B, Hq, L) from the one-pass Triton kernel."""
    from sdpa.kernels.logits import max_logits  # imports triton

    q, k, mask, causal = kernels.admit(w._inputs, raw_scores=True)
    return max_logits(q, k, mask, causal=causal, scale=w._inputs.scale)[0]


def _triton_received_serves(w: AttentionWeights) -> bool:
    """The received kernel's float32 subtraction s - lse loses digits past
    kernel_lse_limit (a huge finite bias): those calls go to the rows engine. On CPU
    that is read from the LSE (_lse_within); on a GPU it is decided from the mask's
    type, never read (no host sync): a float mask, which can hold such biases (-1e9,
    finfo.min), goes to the rows engine; without one only scores past the limit could
    (|q.k| * scale > 1024), where the kernel's error eps * |lse| is that of the float32
    scores, and a NaN row (a NaN or +inf score) makes every sum of its head NaN, as the
    listing's sum over the queries does."""
    if not _triton_serves(w):
        return False
    i = w._inputs
    if i.query.is_cpu:
        return _lse_within(w, settings.get().kernel_lse_limit)
    tensor = i.tensor_mask
    return not (tensor is not None and tensor.is_floating_point())


def _triton_received(w: AttentionWeights) -> torch.Tensor:
    """Attention received per key (B, Hq, S) from the Triton kernel."""
    from sdpa.kernels.received import received  # imports triton

    q, k, mask, causal = kernels.admit(w._inputs)
    return received(q, k, w._log_sum_exp(), mask, causal=causal, scale=w._inputs.scale)


def _lse_within(w: AttentionWeights, limit: float) -> bool:
    """Every row's LSE finite and within +-limit (a NaN LSE marks a row the listing
    makes NaN: only the rows engine keeps such rows apart). Reads the host."""
    lse = w._log_sum_exp()
    return bool((lse.abs() <= limit).all())


def probs_entropy(p: torch.Tensor) -> torch.Tensor:
    """-sum p ln p over the last dim of weights p (kept weights, eager's dense pattern, or
    a lazy tensor of rows, summed row by row): p = 0 adds 0 * ln(tiny) = 0 (torch's entr
    is 3x slower on CPU); a NaN row stays NaN."""
    logp = p.clamp_min(torch.finfo(p.dtype).tiny).log()
    if isinstance(logp, LazyTensor) or (p.requires_grad and torch.is_grad_enabled()):
        return -(logp * p).sum(dim=-1)  # (out of place: autograd, or the rows, read them)
    return logp.mul_(p).sum(dim=-1).neg_()


HELD: dict[str, Callable[..., object]] = {
    "full": torch.clone,
    "sum": lambda p: p.sum(dim=-2),
    "entropy": probs_entropy,
    "amax": lambda p: p.amax(dim=-1),
    "topk": lambda p, k: p.topk(k, dim=-1),
}
"""Each read of the whole weights p (B, Hq, L, S), as torch ops on p: the held
provider's answer, and under grad the read differentiated by torch (p then computed
afresh with autograd for the read: AttentionWeights._held)."""


def _on_held(read: str) -> Provider:
    return Provider("held", _has_held, lambda w, *args: HELD[read](w._held(), *args))


PROVIDERS: dict[str, tuple[Provider, ...]] = {
    "full": (
        _on_held("full"),
        Provider("rows", _always, lambda w: rows.dense(w._every_row())),
    ),
    "sum": (
        _on_held("sum"),
        Provider("triton", _triton_received_serves, _triton_received),
        Provider("rows", _always, lambda w: rows.key_sums(w._every_row())),
    ),
    "entropy": (
        _on_held("entropy"),
        Provider("triton", _triton_serves, lambda w: _triton_stats(w, "entropy")),
        Provider("rows", _always, lambda w: rows.entropy(w._every_row())),
    ),
    "amax": (
        _on_held("amax"),
        Provider("triton", _triton_serves, lambda w: _triton_stats(w, "amax")),
        Provider("rows", _always, lambda w: rows.amax(w._every_row())),
    ),
    "topk": (
        _on_held("topk"),
        Provider("rows", _always, lambda w, k: rows.topk(w._every_row(), k)),
    ),
    "max_logits": (
        Provider("triton", _triton_logits_serves, _triton_logits),
        Provider("rows", _always, lambda w: rows.max_logits(w._every_row())),
    ),
}
"""Each read's providers, in order: the first whose rule (`serves`) holds answers."""


# -- indexing ------------------------------------------------------------------------


class _Selection(NamedTuple):
    """An index of the weights in named parts: the leading dims' ints or slices, the
    query rows and the keys (an int, a slice or a tensor of positions each)."""

    lead_items: tuple[int | slice, ...]
    q_item: int | slice | torch.Tensor
    k_item: int | slice | torch.Tensor

    @classmethod
    def of(cls, index: object, inputs: Inputs) -> _Selection:
        *lead_items, q_item, k_item = _normalize_index(index, torch.Size(inputs.shape))
        return cls(tuple(lead_items), q_item, k_item)

    def apply(self, p: torch.Tensor) -> torch.Tensor:
        """The selection of dense weights (*lead, L, S), as torch indexes them (two
        position lists pair up)."""
        return p[(*self.lead_items, self.q_item, self.k_item)]

    def read(self, inputs: Inputs, lse: torch.Tensor, needs: grads.Needs | None) -> torch.Tensor:
        """The selected weights, computed: only these rows and keys (their backward,
        where needs says so, reads every key of these rows)."""
        parts, heads, sizes = self._lead_parts(inputs)
        device = inputs.query.device
        q_rows, keys = _part(self.q_item, device), _part(self.k_item, device)
        if isinstance(keys, slice) and range(*keys.indices(inputs.key.shape[2])) == range(
            inputs.key.shape[2]
        ):
            keys = rows.ALL
        read = [_read_rows(rows.Rows(inputs, lse, b, heads, q_rows, keys), needs) for b in parts]
        p = read[0] if len(read) == 1 else torch.cat(read)  # (B', H', n, m)
        p = p.reshape(*sizes, *p.shape[1:])  # (*batch', H', n, m)
        has_heads = len(inputs.lead) >= 2
        drop = [*self.lead_items, self.q_item] if has_heads else [*self.lead_items, 0, self.q_item]
        p = p[tuple(0 if isinstance(d, int) else slice(None) for d in drop)]  # ints drop dims
        return p[..., 0] if isinstance(self.k_item, int) else p

    def _lead_parts(self, inputs: Inputs) -> tuple[list[range], range, list[int]]:
        """(the selected batch elements among the B flattened ones, as evenly spaced runs
        in order, the query heads, the sizes of the selected batch dims), in plain Python:
        slices of two or more batch dims select elements that no one range spans."""
        lead = inputs.lead
        has_heads = len(lead) >= 2
        batch = lead[:-1] if has_heads else lead
        batch_items = self.lead_items[:-1] if has_heads else self.lead_items
        head_item = self.lead_items[-1] if has_heads else slice(None)
        heads = range(inputs.query.shape[1])[_as_slice(head_item)]
        chosen = [range(n)[_as_slice(item)] for n, item in zip(batch, batch_items, strict=True)]
        if not chosen:  # no batch dim: the one element
            return [range(1)], heads, []
        strides = [math.prod(batch[d + 1 :]) for d in range(len(batch))]
        parts: list[range] = []
        for at in itertools.product(*chosen):  # increasing: every slice steps forward
            f = sum(i * st for i, st in zip(at, strides, strict=True))
            prev = parts[-1] if parts else None
            if prev is not None and len(prev) == 1:
                parts[-1] = range(prev[0], f + 1, f - prev[0])  # a run of two
            elif prev is not None and f == prev[-1] + prev.step:
                parts[-1] = range(prev.start, f + prev.step, prev.step)
            else:
                parts.append(range(f, f + 1))
        return parts or [range(0)], heads, [len(r) for r in chosen]


def _read_rows(r: rows.Rows, needs: grads.Needs | None) -> torch.Tensor:
    """The weights of a selection r (B', H', n, m), carrying the gradient where needs
    says so."""
    with torch.no_grad(), no_autocast(r.inputs.query.device.type):
        if not r.complete and rows.needs_every_key(_selected_lse(r)):
            p = rows.dense(r._replace(keys=rows.ALL))[..., r.keys]  # such rows: read whole
        else:
            p = rows.dense(r)  # (B', H', n, m)
    if needs is None:
        return p
    return grads.read(grads.Spec(r, grads.rows_rule(r.keys), needs, lambda: p))


def _part(item: int | slice | torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    """A query or key index as the rows engine takes it: a slice or positions on device."""
    return item.to(device) if isinstance(item, torch.Tensor) else _as_slice(item)


def _selected_lse(r: rows.Rows) -> torch.Tensor:
    """The LSE of a selection's rows, (B', H', n)."""
    lse = r.lse[_range_slice(r.batch)][:, _range_slice(r.heads)]
    return tile.cut(lse, 2, r.rows)


def _range_slice(r: range) -> slice:
    return slice(r.start, r.stop, r.step)


def _as_slice(index: int | slice) -> slice:
    return slice(index, index + 1) if isinstance(index, int) else index


def _per_head(x: object, mine: Inputs, name: str, dim: int) -> torch.Tensor:
    """A tensor of the user's (..., X, Y) broadcast to the weights' leading dims and laid
    out (B, Hq, X, Y) (a view where it can be; differentiable)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise SdpaTypeError(f"{name} must be a floating tensor of 2+ dims, got {got}")
    lead = mine.lead
    n = mine.key.shape[2] if dim == -2 else mine.query.shape[2]
    if x.shape[dim] != n:
        what = "S (the keys)" if dim == -2 else "L (the queries)"
        raise SdpaValueError(
            f"{name}'s dim {dim} must be {what} = {n}, got {name} of shape {tuple(x.shape)}"
        )
    try:
        full = torch.broadcast_to(x, (*lead, *x.shape[-2:]))
    except RuntimeError as e:
        raise SdpaValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to the weights' leading "
            f"dims {tuple(lead)}"
        ) from e
    B, Hq = mine.query.shape[:2]
    return full.reshape(B, Hq, *x.shape[-2:]).to(x.device)


def _aligned(
    other: AttentionWeights, head_map: object, mine: Inputs, read: str = "kl"
) -> tuple[Inputs, torch.Tensor]:
    """other's inputs and LSE laid out with these weights' query heads: head h of ours
    meets head head_map[h] of theirs, each with its own key head (no grouping left);
    gathered with autograd, so gradients reach other's own tensors summed over the heads
    that share them. Without a map, head h meets head h: other's own inputs (no copy)."""
    o = other._inputs
    B, Hq, L, _ = mine.query.shape
    S = mine.key.shape[2]
    if o.query.shape[0] != B or o.query.shape[2] != L or o.key.shape[2] != S:
        raise SdpaValueError(
            f"{read} needs weights over the same batch, queries and keys: these are "
            f"{tuple(mine.shape)}, the other {tuple(o.shape)}"
        )
    Ho = o.query.shape[1]
    if head_map is None:
        if Ho != Hq:
            raise SdpaValueError(
                f"these weights have {Hq} heads and the other {Ho}: pass head_map, a list of "
                f"{Hq} of the other's heads (e.g. [h * {Ho} // {Hq} for h in range({Hq})])"
            )
        return o._replace(lead=mine.lead), other._log_sum_exp()  # head h meets head h
    else:
        index = _index_list(head_map, Ho, "head_map")
        if index is None or len(index) != Hq:
            raise SdpaValueError(
                f"head_map must list one of the other's {Ho} heads for each of these {Hq} "
                f"heads, got {head_map!r}"
            )
    index = index.to(o.query.device)
    tensor, structured = masks.split(o.mask)
    if tensor is not None and tensor.shape[1] > 1:
        tensor = tensor.index_select(1, index)
    mask = masks.join(tensor, structured)
    sinks = None if o.sinks is None else o.sinks.index_select(1, index)
    inputs = o._replace(
        query=o.query.index_select(1, index),  # (B, Hq, L, E')
        key=o.key.index_select(1, index // o.group),  # (B, Hq, S, E')
        value=o.value.index_select(1, index // o.group),
        mask=mask,
        sinks=sinks,
        lead=mine.lead,
    )
    return inputs, other._log_sum_exp().index_select(1, index)


def _dense_target(target: torch.Tensor, mine: Inputs) -> torch.Tensor:
    """A dense target of probabilities broadcasting to the weights' (*lead, L, S), as
    (B|1, Hq|1, L, S)."""
    shape = mine.shape
    if not target.is_floating_point() or target.ndim > len(shape):
        raise SdpaTypeError(
            f"a dense KL target is a floating tensor broadcasting to {tuple(shape)}, got "
            f"{target.dtype} {tuple(target.shape)}"
        )
    try:
        full = torch.broadcast_to(target, shape)
    except RuntimeError as e:
        raise SdpaValueError(
            f"the KL target {tuple(target.shape)} does not broadcast to the weights' "
            f"shape {tuple(shape)}"
        ) from e
    B, Hq, L, S = mine.query.shape[0], mine.query.shape[1], shape[-2], shape[-1]
    return full.reshape(B, Hq, L, S).to(mine.compute_dtype)


def _target_grad(mine: rows.Rows, target: torch.Tensor, original: torch.Tensor, reverse: bool):
    """dKL / d(target) as a function of the upstream gradient (B, Hq, L): forward KL(T ||
    P): g (ln T + 1 - ln P); reverse KL(P || T): -g P / T. Dense, as the target is."""

    def grad_of(g: torch.Tensor) -> torch.Tensor:
        out = torch.empty(target.shape, dtype=target.dtype, device=target.device)
        budget = settings.get().chunk_bytes
        source, dense = rows.Source(mine, budget, both=False), rows.DenseSource(target)
        for t in rows.tiles(mine, budget):
            logp = source.tile(t).logp
            q = dense.tile(t).p
            gt = g[t.at_b, t.at_h, t.at_r][..., None]
            part = -gt * logp.exp() / q if reverse else gt * (torch.log(q) + 1.0 - logp)
            hs = slice(t.heads.start, t.heads.stop, t.heads.step)
            tile.cut(out[t.b, hs], 2, t.q_rows).copy_(part)
        full = out.reshape(mine.inputs.shape)  # (*lead, L, S)
        return full.sum_to_size(original.shape).to(original.dtype)

    return grad_of


def _pair_indices(
    q_index: object, k_index: object, L: int, S: int, B: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) positions of the pairs as (1|B, P) int64 on `device`, checked: integers of
    one shape, (P,) or (B, P) (B given only for inputs with one batch dim), in range."""
    out = []
    for name, index, size in (("q_index", q_index, L), ("k_index", k_index, S)):
        t = _index_list(index, size, name, 2)
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
    n = qi.shape[0] if qi.ndim == 2 else 1
    return qi.reshape(n, qi.shape[-1]).to(device), kj.reshape(n, kj.shape[-1]).to(device)


def _index_list(
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
    query and key dims (the last two) may also be (m,) int64 tensors of positions."""
    items = indexing.spread(index, len(shape), of=f"weights of shape {tuple(shape)}")
    out: list[int | slice | torch.Tensor] = []
    for n, item in enumerate(items):
        if indexing.dims_taken(item) != 1:  # None, a bool, a boolean mask of 2+ dims
            _not_an_index(item, n)
    for dim, (item, size) in enumerate(zip(items, shape, strict=True)):
        if dim >= len(shape) - 2:  # the query and key dims also take lists of positions
            what = "the key dim" if dim == len(shape) - 1 else "the query dim"
            positions = _index_list(item, size, what)
            if positions is not None:
                out.append(positions)
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
            _not_an_index(item, dim)
        if isinstance(item, int):
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of bounds for dim {dim} with size {size}")
            item %= size
        elif item.step is not None and item.step <= 0:
            raise SdpaValueError(f"slice step must be positive, got {item.step} for dim {dim}")
        out.append(item)
    return out


def _not_an_index(item: object, dim: int) -> NoReturn:
    raise SdpaTypeError(
        f"AttentionWeights takes ints, slices and '...' as indices (they choose which "
        f"rows to compute; the query and key dims also a list or 1-D integer tensor "
        f"of positions), got {type(item).__name__} for dim {dim}; index the "
        f"resulting tensor for anything else"
    )


# torch.load(..., weights_only=True) of a saved handle: its state is tensors, numbers,
# strings, tuples and a dict (AttentionWeights._state); only the class is allowlisted.
torch.serialization.add_safe_globals([AttentionWeights, _from_state])
