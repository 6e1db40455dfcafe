"""Structured masks: which keys each query sees, answered for any block of positions.

A mask says True where a query *takes part* with a key (torch's bool convention). It
answers for any range of query positions against any range of key positions, so the
fused backend can skip key blocks a query block cannot see, run fully visible blocks
without a mask, and pass a mask slice only where a block is partial. Combine masks with
`&` and `|`; `materialize(L, S)` gives the whole view as a bool tensor.

Alignment (causal, sliding_window) for L queries and S keys: "bottom-right" puts query i
at key position i + S - L (FlashAttention >= 2.1, xFormers, KV-cache decoding);
"top-left" at position i (torch's is_causal). They agree when L == S.
"""

from __future__ import annotations

import operator
import threading
import weakref

import torch

from sdpa.budget import DEFAULT_MAX_BYTES, check_fits
from sdpa.errors import SdpaTypeError, SdpaValueError

EMPTY, PARTIAL, FULL = 0, 1, 2  # block occupancy
ALIGNS = ("bottom-right", "top-left")
Spans = list[list[tuple[int, int, bool]]]  # (Bm, nQ) of (lo, hi, partial): Mask.spans
KeySpan = tuple[int, int, bool]  # (lo, hi, full): key_spans


def visible(i: torch.Tensor, j: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Causal visibility, elementwise (i and j broadcast): key position j is seen by
    query position i when j <= i + offset (offset = S - L for bottom-right, 0 for
    top-left). The one definition: every backend, the weights engine and the masks call
    it; `grid` lays it over rows x keys.

    grid(visible, [0, 1], [0, 1, 2]), offset 0      offset 1
        1 0 0                                        1 1 0
        1 1 0                                        1 1 1
    """
    return j <= i + offset


def visible_grid(q_pos: torch.Tensor, k_pos: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """`visible` over every (query, key) of q_pos (r,) x k_pos (c,): (r, c) bool."""
    return visible(q_pos[:, None], k_pos[None, :], offset)


def top_left(L: int, S: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The top-left causal keep-mask (L, S) bool: query i sees keys j <= i."""
    return visible_grid(torch.arange(L, device=device), torch.arange(S, device=device))


def as_4d(keep: torch.Tensor) -> torch.Tensor:
    """A materialised mask, (L, S) or (B, 1, L, S), as (B|1, 1, L, S) (a view)."""
    return keep if keep.ndim == 4 else keep[None, None]


class Mask:
    """Base class. Subclasses implement `keep` and may answer `blocks` analytically."""

    batch: int | None = None  # size of the mask's batch dim, None if it has none

    def keep(self, q_pos: torch.Tensor, k_pos: torch.Tensor, L: int, S: int) -> torch.Tensor:
        """(Bm, len(q_pos), len(k_pos)) bool, Bm = batch or 1: True where query position
        q_pos[r] sees key position k_pos[c], in an L x S attention."""
        raise NotImplementedError

    def blocks(self, L: int, S: int, bq: int, bk: int) -> torch.Tensor:
        """(Bm, ceil(L/bq), ceil(S/bk)) int8 occupancy of each bq x bk block of the
        L x S view: EMPTY (no True), FULL (all True) or PARTIAL.

        Contract, held to `keep` on block edges by tests/test_mask_blocks.py: always
        *sound* (never FULL where the block holds a False, never EMPTY where it holds a
        True; PARTIAL is always allowed and only costs speed). Exact here (from keep)
        and in causal, sliding_window and padding; documents is exact when q_ids and
        k_ids are sorted and hold the same ids, else sound; & and | are sound."""
        keep = self.materialize(L, S, max_bytes=None).reshape(self.batch or 1, L, S)  # (Bm, L, S)
        return occupancy(keep, bq, bk)

    def spans(self, L: int, S: int, bq: int, bk: int) -> Spans | None:
        """The block plan's view of `blocks`, from the host alone: for each batch element
        (Bm) and query block of bq rows, (lo, hi, partial): the key blocks lo <= j < hi
        of bk keys hold every key the block sees (lo == hi: none), and partial says
        whether any of them is PARTIAL (else all are FULL). O(Bm x nQ) Python, reading
        no tensor that lives on a device, so a GPU call plans without a host sync.

        None where that cannot be had: the mask's data (lengths, ids) is on a device, or
        the keys a query block sees need not be one span (documents, `|`). Exact for
        causal and sliding_window (the same plan as `blocks`), and for padding with
        lengths on the CPU; `&` is sound (partial where either side is)."""
        return None

    def key_spans(self, S: int) -> list[KeySpan] | None:
        """Per batch element (Bm), the keys [lo, hi) outside which no query sees a key and
        whether every query that sees a key sees every key inside (full), from the host
        alone (see `key_spans`); None where this mask has no such span to give (the
        default)."""
        return None

    def query_spans(self, L: int) -> list[tuple[int, int]] | None:
        """Per batch element (Bm), the query rows [lo, hi) outside which a row sees no key
        (declared padded queries: their output and weights are 0), from the host alone;
        None where this mask declares none (the default: every row may see a key)."""
        return None

    def keep_pairs(self, q_pos: torch.Tensor, k_pos: torch.Tensor, L: int, S: int) -> torch.Tensor:
        """(Bm, P) bool: whether query position q_pos[p] sees key position k_pos[p], for
        P pairs (q_pos, k_pos (P,)). Derived from `keep` a few hundred pairs at a time
        (the diagonal of each chunk's grid), so it never disagrees with it."""
        chunk = 256
        parts = [
            self.keep(q_pos[c : c + chunk], k_pos[c : c + chunk], L, S).diagonal(dim1=-2, dim2=-1)
            for c in range(0, len(q_pos), chunk)
        ]  # (Bm, <= chunk) each
        if not parts:
            return torch.ones(self.batch or 1, 0, dtype=torch.bool, device=q_pos.device)
        return torch.cat(parts, dim=-1)  # (Bm, P)

    def is_top_left_causal(self, L: int, S: int) -> bool:
        """Whether this is exactly the top-left causal mask for L x S (the fused kernel
        then runs its own causal path)."""
        return False

    def within_top_left(self, L: int, S: int) -> bool:
        """Whether query i sees no key j > i here (top-left causality is part of this
        mask), decided without a scan: rows < r then see only keys < r. Sound: False
        is always allowed."""
        return False

    def validate(self, L: int, S: int) -> None:
        """Raise ValueError if this mask cannot describe an L x S attention."""

    def take(self, batch: torch.Tensor) -> Mask | None:
        """This mask for the batch elements `batch` (a 1-D integer tensor, repeats
        allowed), in that order: itself where it has no batch dim; None where a subclass
        with a batch dim does not say how (a view of the weights over fewer batch
        elements then takes the dense path)."""
        return self if self.batch is None else None

    def materialize(
        self,
        L: int,
        S: int,
        device: torch.device | str = "cpu",
        max_bytes: int | None = DEFAULT_MAX_BYTES,
    ) -> torch.Tensor:
        """The whole mask: (L, S) bool, or (B, 1, L, S) for a mask with a batch dim.
        Refuses, before allocating, a view over max_bytes (None: no limit)."""
        L, S = _check_size("L", L, "queries"), _check_size("S", S, "keys")
        check_fits(
            f"{self!r}.materialize: the bool mask",
            ((self.batch or 1), L, S),
            1,
            max_bytes,
            "Ask for rows with mask.keep(q_pos, k_pos, L, S), or pass max_bytes=None",
        )
        keep = self.keep(
            torch.arange(L, device=device), torch.arange(S, device=device), L, S
        )  # (Bm, L, S)
        return keep[0] if self.batch is None else keep[:, None]

    def __and__(self, other: Mask) -> Mask:
        return _Combined(self, _check_mask(other), "and")

    def __or__(self, other: Mask) -> Mask:
        return _Combined(self, _check_mask(other), "or")


def _check_mask(other: object) -> Mask:
    if not isinstance(other, Mask):
        raise SdpaTypeError(
            f"masks combine with other sdpa.masks objects, got {type(other).__name__}; for a "
            f"tensor, pass it as the mask (or materialize this one and combine tensors)"
        )
    return other


def _check_size(name: str, value: object, what: str) -> int:
    """value as an int if it is a non-negative integer (not a bool), else a clear error."""
    if torch.compiler.is_compiling():  # a traced size (a SymInt) from the engine
        return value  # type: ignore[return-value]
    try:
        n = None if isinstance(value, bool) else operator.index(value)  # int, numpy ints
    except TypeError:
        n = None
    if n is None:
        raise SdpaTypeError(
            f"materialize: {name} must be an int (the number of {what}), got {value!r} "
            f"({type(value).__name__}); e.g. mask.materialize(L=4, S=6) for 4 queries, 6 keys"
        )
    if n < 0:
        raise SdpaValueError(
            f"materialize: {name} must be a non-negative int (the number of {what}), got "
            f"{n}; e.g. mask.materialize(L=4, S=6) for 4 queries, 6 keys"
        )
    return n


def _offset(align: str, L: int, S: int) -> int:
    return S - L if align == "bottom-right" else 0


def _check_align(align: object) -> str:
    if not isinstance(align, str):
        raise SdpaTypeError(
            f"align must be a str, 'bottom-right' or 'top-left', got {align!r} "
            f"({type(align).__name__})"
        )
    if align not in ALIGNS:
        raise SdpaValueError(f"align must be 'bottom-right' or 'top-left', got {align!r}")
    return align  # type: ignore[return-value]


class _Band(Mask):
    """Query at position p = i + offset sees keys j with p - size < j <= p."""

    def __init__(self, size: int | None, align: str, name: str):
        self.size, self.align, self._name = size, _check_align(align), name

    def is_top_left_causal(self, L, S):
        return self.size is None and (self.align == "top-left" or L == S)

    def within_top_left(self, L, S):
        return _offset(self.align, L, S) <= 0

    def keep(self, q_pos, k_pos, L, S):
        off = _offset(self.align, L, S)
        keep = visible_grid(q_pos, k_pos, off)  # (r, c)
        if self.size is not None:  # and not further back than the window
            keep &= visible_grid(q_pos, k_pos, off - self.size).logical_not_()  # too old
        return keep[None]  # (1, r, c)

    def blocks(self, L, S, bq, bk):
        """Exact. A block's positions p in [p_lo, p_hi] see keys in (p_lo - size, p_hi],
        so keys [k0, k1] are EMPTY past either end and FULL inside (p_hi - size, p_lo]."""
        off = _offset(self.align, L, S)
        q0 = torch.arange(0, L, bq)[:, None]  # first query of each block
        q1 = torch.clamp(q0 + bq, max=L) - 1  # last query
        k0 = torch.arange(0, S, bk)[None, :]
        k1 = torch.clamp(k0 + bk, max=S) - 1
        p_lo, p_hi = q0 + off, q1 + off
        empty = k0 > p_hi  # every key after every query
        full = k1 <= p_lo
        if self.size is not None:
            empty |= k1 <= p_lo - self.size  # every key before every window
            full &= k0 > p_hi - self.size
        out = torch.full(empty.shape, PARTIAL, dtype=torch.int8)
        out[full] = FULL
        out[empty] = EMPTY
        return out[None]

    def spans(self, L, S, bq, bk):
        """Exact, as `blocks` in closed form: a block's positions [p_lo, p_hi] see keys
        [p_lo - size + 1, p_hi] (from 0 without a window), and its span is FULL when the
        last key of the span is at most p_lo and its first is past p_hi - size."""
        off, size = _offset(self.align, L, S), self.size
        row = []
        for q0 in range(0, L, bq):
            p_lo, p_hi = q0 + off, min(L, q0 + bq) - 1 + off
            first = 0 if size is None else max(0, p_lo - size + 1)
            last = min(S - 1, p_hi)
            if last < first:
                row.append((0, 0, False))
                continue
            lo, hi = first // bk, last // bk + 1
            full = min(S, hi * bk) - 1 <= p_lo and (size is None or lo * bk > p_hi - size)
            row.append((lo, hi, not full))
        return [row]

    def __repr__(self):
        size = "" if self.size is None else f"{self.size}, "
        return f"masks.{self._name}({size}align={self.align!r})"


def causal(align: str = "bottom-right") -> Mask:
    """Each query sees the keys at or before its own position.

    L=2, S=5, align="bottom-right"     L=2, S=5, align="top-left"
        1 1 1 1 0                          1 0 0 0 0
        1 1 1 1 1                          1 1 0 0 0

    With L > S and bottom-right, the first L - S queries see no key (their output is 0).
    """
    return _Band(None, align, "causal")


TOP_LEFT = causal("top-left")
"""Top-left causality, one shared immutable mask: what causal=True means (sdpa.attention
needs L == S for it, where both alignments agree; the drop-in's is_causal is top-left),
recognised by identity on the fast lane (no allocation per call)."""


class TensorAnd:
    """A tensor mask AND a structured one: a bool keep-mask or float bias broadcasting to
    (B, H, L, S) (`tensor`), and a Mask (`structured`, e.g. TOP_LEFT for causal=True),
    neither materialised with the other. How a call's mask is read: `split`."""

    __slots__ = ("structured", "tensor")

    def __init__(self, tensor: torch.Tensor, structured: Mask):
        self.tensor, self.structured = tensor, structured

    def __repr__(self) -> str:
        return f"(tensor{tuple(self.tensor.shape)} & {self.structured!r})"


def split(mask: object) -> tuple[torch.Tensor | None, Mask | None]:
    """(the tensor part, the structured part) of a call's mask: a tensor, a Mask, a
    TensorAnd or None. The one place that reads which is which."""
    if mask is None:
        return None, None
    if isinstance(mask, Mask):
        return None, mask
    if mask.__class__ is TensorAnd:
        return mask.tensor, mask.structured
    return mask, None


def combine(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Two tensor masks ANDed, broadcasting, each a bool keep-mask or a float bias: two
    keep-masks meet (&), a bias takes -inf where a keep-mask excludes, two biases add.
    The one keep-and-bias rule."""
    if a is None or b is None:
        return b if a is None else a
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:
        return a.masked_fill(~b, -torch.inf)
    return a + b


def join(tensor: torch.Tensor | None, structured: Mask | None):
    """The mask of a tensor part and a structured part (split's inverse)."""
    if tensor is None or structured is None:
        return structured if tensor is None else tensor
    return TensorAnd(tensor, structured)


def and_top_left(mask: torch.Tensor | Mask | None) -> torch.Tensor | Mask | TensorAnd:
    """mask AND top-left causality (causal=True), with nothing materialised: TOP_LEFT
    alone, a structured mask & TOP_LEFT, or a TensorAnd of a tensor."""
    if mask is None:
        return TOP_LEFT
    if isinstance(mask, Mask):
        return mask & TOP_LEFT
    return TensorAnd(mask, TOP_LEFT)


def state_of(mask: object) -> object:
    """A call's mask as saved data: None, a tensor (detached), or a tuple naming one of
    sdpa's structured masks with its parameters (tensors, numbers, strings), so a saved
    AttentionWeights loads with torch.load(..., weights_only=True). A Mask subclass of
    your own is kept as the object (pickled by its class)."""
    if mask is None or isinstance(mask, torch.Tensor):
        return mask if mask is None else mask.detach()
    if mask.__class__ is TensorAnd:
        return ("and", mask.tensor.detach(), state_of(mask.structured))
    if mask.__class__ is _Band:
        return ("band", mask.size, mask.align, mask._name)
    if mask.__class__ is _Padding:
        return ("padding", mask.lengths.detach(), mask.queries)
    if mask.__class__ is _Documents:
        return ("documents", mask.q_ids.detach(), mask.k_ids.detach(), mask.batch is not None)
    if mask.__class__ is _Combined:
        return ("combined", state_of(mask.a), state_of(mask.b), mask.op)
    return mask


def same(a: object, b: object) -> bool:
    """Whether two structured masks (or None) are one mask: the same object, or equal
    states free of tensors (two causal masks made apart, a detached handle's copy).
    Masks holding tensors are one mask only as one object (no values are compared)."""
    if a is b:
        return True
    sa, sb = state_of(a), state_of(b)
    flat = torch.utils._pytree.tree_leaves((sa, sb))
    return isinstance(sa, tuple) and not any(isinstance(t, torch.Tensor) for t in flat) and sa == sb


def from_state(state: object) -> object:
    """state_of's inverse (top-left causality comes back as the one TOP_LEFT)."""
    if not isinstance(state, tuple):
        return state
    kind, *args = state
    if kind == "and":
        return TensorAnd(args[0], from_state(args[1]))
    if kind == "band":
        top_left = (TOP_LEFT.size, TOP_LEFT.align, TOP_LEFT._name)
        return TOP_LEFT if tuple(args) == top_left else _Band(*args)
    if kind == "padding":  # (loaded: a real tensor, on the host where it is on the CPU)
        queries = len(args) > 1 and args[1]  # (saved before padded queries: keys alone)
        return _Padding(args[0], args[0].tolist() if args[0].is_cpu else None, queries)
    if kind == "documents":
        return _Documents(*args)
    if kind == "combined":
        return _Combined(from_state(args[0]), from_state(args[1]), args[2])
    raise SdpaValueError(f"a saved mask of unknown kind {kind!r} (saved by a newer sdpa?)")


def causal_flag(
    mask: torch.Tensor | Mask | TensorAnd | None, L: int, S: int
) -> tuple[torch.Tensor | Mask | None, bool]:
    """How a kernel with a top-left causal flag takes `mask`: (what is left of the mask,
    True) where exactly top-left causality is ANDed in (TOP_LEFT, or a tensor with it),
    else (mask, False). The one place a causal flag is derived from a mask."""
    if mask.__class__ is torch.Tensor:  # (first: a plain tensor has no causal part)
        return mask, False
    tensor, structured = split(mask)
    if structured is not None and structured.is_top_left_causal(L, S):
        return tensor, True
    return mask, False


def sliding_window(size: int, align: str = "bottom-right") -> Mask:
    """Each query sees the `size` keys ending at its own position (itself included):
    query at position p sees keys j with p - size < j <= p.

    size=2, L=S=4
        1 0 0 0
        1 1 0 0
        0 1 1 0
        0 0 1 1
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise SdpaTypeError(
            f"size must be a positive int (keys per window), got {size!r} "
            f"({type(size).__name__}); e.g. sliding_window(512)"
        )
    if size < 1:
        raise SdpaValueError(
            f"size must be a positive int (keys per window), got {size}; e.g. sliding_window(512)"
        )
    return _Band(size, align, "sliding_window")


class _Padding(Mask):
    def __init__(self, lengths: torch.Tensor, host: list[int] | None = None, queries=False):
        self.lengths = lengths
        self.batch = len(lengths)
        self.host = host  # the lengths as a list, where the host has them (key_spans)
        self.queries = queries  # the query rows past each length padded too

    def keep(self, q_pos, k_pos, L, S):
        lengths = self.lengths.to(k_pos.device, non_blocking=True)  # (a host copy: no sync)
        keep = k_pos[None, None, :] < lengths[:, None, None]  # (B, 1, c)
        if self.queries:
            return keep & (q_pos[None, :, None] < lengths[:, None, None])  # (B, r, c)
        return keep.expand(self.batch, len(q_pos), len(k_pos))

    def take(self, batch):
        # (no host list: the batch indices may live on a device; no key spans then)
        lengths = self.lengths[batch.to(self.lengths.device, non_blocking=True)]
        return _Padding(lengths, queries=self.queries)

    def blocks(self, L, S, bq, bk):
        """Exact: keys [k0, k1) are FULL when k1 <= length, EMPTY when k0 >= length; with
        padded queries, query blocks [q0, q1) are EMPTY when q0 >= length and FULL only
        where q1 <= length too."""
        k0 = torch.arange(0, S, bk)  # (nK,)
        k1 = torch.clamp(k0 + bk, max=S)
        n = self.lengths.cpu()[:, None, None]  # (B, 1, 1)
        q0 = (
            torch.arange(0, L, bq)[:, None] if self.queries else torch.zeros(1, 1, dtype=torch.long)
        )
        q1 = torch.clamp(q0 + bq, max=L) if self.queries else q0
        shape = (self.batch, len(q0), len(k0))
        out = torch.full(shape, PARTIAL, dtype=torch.int8)
        out[((k1[None, :] <= n) & (q1 <= n)).expand(shape)] = FULL
        out[((k0[None, :] >= n) | (q0 >= n)).expand(shape)] = EMPTY
        return out.expand(self.batch, -(-L // bq), len(k0))

    def key_spans(self, S):
        """[0, n_b), every key of it seen by every query that sees one (with padded
        queries, rows past n_b see none); None for lengths on a device (reading them
        would sync)."""
        if self.host is None:
            return None
        return [_span(0, min(n, S), True, S) for n in self.host]

    def query_spans(self, L):
        """With padded queries, [0, n_b): the rows past a length see no key; None for
        lengths on a device (reading them would sync) or key padding alone."""
        if self.host is None or not self.queries:
            return None
        return [(0, min(n, L)) for n in self.host]

    def spans(self, L, S, bq, bk):
        """Exact, from lengths on the CPU (None for lengths on a device: reading them
        would sync): element b sees key blocks [0, ceil(n_b / bk)), the last PARTIAL
        unless it ends at n_b; with padded queries, query blocks from n_b on see none
        and the block holding n_b is PARTIAL."""
        if not self.lengths.is_cpu:
            return None
        nQ = -(-L // bq)
        out = []
        for n in self.lengths.tolist():  # (a host read of a CPU tensor)
            n_k = min(n, S)
            span = (0, -(-n_k // bk), min(S, -(-n_k // bk) * bk) > n_k)
            if n_k == 0:
                span = (0, 0, False)
            row = [span] * nQ
            if self.queries and span[1] > 0:
                for qi in range(nQ):
                    q0, q1 = qi * bq, min(L, (qi + 1) * bq)
                    if q0 >= n:
                        row[qi] = (0, 0, False)
                    elif q1 > n:
                        row[qi] = (span[0], span[1], True)
            out.append(row)
        return out

    def __repr__(self):  # (lengths on a device are not read: a repr must not sync)
        queries = ", queries=True" if self.queries else ""
        if not self.lengths.is_cpu:
            return f"masks.padding(<{self.batch} lengths on {self.lengths.device}>{queries})"
        return f"masks.padding({self.lengths.tolist()}{queries})"


def padding(lengths: torch.Tensor | list[int], queries: bool = False) -> Mask:
    """Key padding: batch element b sees keys j < lengths[b]. Has a batch dim.

    lengths=[3, 1], S=4, any L
        b=0: 1 1 1 0        b=1: 1 0 0 0

    queries=True declares the query rows i >= lengths[b] padded too: they see no key,
    so their output and weights are 0 (eager attention computes them over the real
    keys; a loss that gives them no weight cannot tell) and, with lengths on the CPU,
    they are skipped rather than computed, in the forward, every read and the backward.

    lengths=[3, 1], queries=True, L=S=4
        b=0: 1 1 1 0        b=1: 1 0 0 0
             1 1 1 0             0 0 0 0
             1 1 1 0             0 0 0 0
             0 0 0 0             0 0 0 0
    """
    if not isinstance(queries, bool):
        raise SdpaTypeError(
            f"queries must be True or False, got {queries!r} ({type(queries).__name__})"
        )
    lengths = _int_tensor("lengths", lengths, "a 1-D integer tensor or list of ints, e.g. [5, 3]")
    if lengths.ndim != 1 or len(lengths) == 0:
        raise SdpaValueError(
            f"lengths must be a 1-D integer tensor or list (one length per batch element), "
            f"got shape {tuple(lengths.shape)}; e.g. padding([5, 3])"
        )
    if lengths.is_cpu:
        if (lengths < 0).any():
            raise SdpaValueError(
                f"lengths must be non-negative, one per batch element, got {lengths}"
            )
    else:  # checked on the device (reading it here would sync the host)
        torch._assert_async((lengths >= 0).all(), "sdpa.masks.padding: lengths must be >= 0")
    return _Padding(lengths.long(), lengths.tolist() if lengths.is_cpu else None, queries)


def _int_tensor(name: str, value: object, works: str) -> torch.Tensor:
    """value as a fresh integer tensor (a mask never changes under the weights), or a
    clear SdpaTypeError naming `name`, what was seen and what works."""
    seen = f"{type(value).__name__}"
    try:
        t = torch.as_tensor(value).clone()
    except (TypeError, ValueError, RuntimeError) as e:
        raise SdpaTypeError(f"{name} must be {works}; got {value!r:.60} ({seen}): {e}") from e
    if t.numel() == 0 and not isinstance(value, torch.Tensor):
        t = t.long()  # torch reads [] as float32
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise SdpaTypeError(
            f"{name} must be {works}; got {t.dtype} values of shape {tuple(t.shape)} ({seen})"
        )
    return t


class _Documents(Mask):
    def __init__(self, q_ids: torch.Tensor, k_ids: torch.Tensor, batched: bool):
        self.q_ids, self.k_ids = q_ids, k_ids  # (Bm, L), (Bm, S)
        self.batch = q_ids.shape[0] if batched else None

    def validate(self, L, S):
        if self.q_ids.shape[-1] != L or self.k_ids.shape[-1] != S:
            raise SdpaValueError(
                f"documents mask has ids for {self.q_ids.shape[-1]} queries and "
                f"{self.k_ids.shape[-1]} keys, but the attention has L={L}, S={S}"
            )

    def _ids(self, L, S):
        self.validate(L, S)
        return self.q_ids, self.k_ids

    def take(self, batch):
        if self.batch is None:
            return self
        rows = batch.to(self.q_ids.device, non_blocking=True)
        return _Documents(self.q_ids[rows], self.k_ids[rows], batched=True)

    def keep(self, q_pos, k_pos, L, S):
        q_ids, k_ids = self._ids(L, S)
        q = q_ids.to(q_pos.device, non_blocking=True)[:, q_pos]  # (Bm, r)
        k = k_ids.to(k_pos.device, non_blocking=True)[:, k_pos]  # (Bm, c)
        return q[:, :, None] == k[:, None, :]

    def blocks(self, L, S, bq, bk):
        """From each block's min and max id: FULL when both blocks hold one and the same
        id, EMPTY when their id ranges are apart. Sound; exact when q_ids and k_ids are
        sorted and hold the same ids (packed sequences), as a block then holds every id
        of its range."""
        q_ids, k_ids = self._ids(L, S)
        q_lo, q_hi = _block_min_max(q_ids.cpu(), bq)  # (Bm, nQ)
        k_lo, k_hi = _block_min_max(k_ids.cpu(), bk)  # (Bm, nK)
        out = torch.full((q_ids.shape[0], len(q_lo[0]), len(k_lo[0])), PARTIAL, dtype=torch.int8)
        one_doc = (q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :]
        out[one_doc & (q_lo[:, :, None] == k_lo[:, None, :])] = FULL
        disjoint = (q_hi[:, :, None] < k_lo[:, None, :]) | (k_hi[:, None, :] < q_lo[:, :, None])
        out[disjoint] = EMPTY  # id ranges apart: no id in common
        return out

    def __repr__(self):
        return f"masks.documents(<ids {tuple(self.q_ids.shape)}>)"


def documents(q_ids: torch.Tensor, k_ids: torch.Tensor | None = None) -> Mask:
    """Packed sequences: query i sees key j iff q_ids[i] == k_ids[j]. ids are (L,) or
    (B, L) (then the mask has a batch dim); k_ids defaults to q_ids (self-attention).

    q_ids = k_ids = [0, 0, 1, 1, 1]
        1 1 0 0 0
        1 1 0 0 0
        0 0 1 1 1
        0 0 1 1 1
        0 0 1 1 1
    """
    works = "integer document ids of shape (L,) or (B, L), e.g. [0, 0, 1, 1, 1]"
    q_ids = _int_tensor("q_ids", q_ids, works)
    k_ids = q_ids if k_ids is None else _int_tensor("k_ids", k_ids, works)
    for name, ids in (("q_ids", q_ids), ("k_ids", k_ids)):
        if ids.ndim not in (1, 2):
            raise SdpaValueError(
                f"{name} must be integer document ids of shape (L,) or (B, L), got "
                f"{ids.dtype} of shape {tuple(ids.shape)}"
            )
    if q_ids.ndim != k_ids.ndim or (q_ids.ndim == 2 and q_ids.shape[0] != k_ids.shape[0]):
        raise SdpaValueError(
            f"q_ids {tuple(q_ids.shape)} and k_ids {tuple(k_ids.shape)} must both be (L,) or "
            f"both (B, L) with the same B"
        )
    batched = q_ids.ndim == 2
    return _Documents(
        q_ids if batched else q_ids[None], k_ids if batched else k_ids[None], batched
    )  # (Bm, L), (Bm, S)


class _Combined(Mask):
    def __init__(self, a: Mask, b: Mask, op: str):
        if a.batch is not None and b.batch is not None and a.batch != b.batch:
            raise SdpaValueError(f"cannot combine masks with batch {a.batch} and {b.batch}")
        self.a, self.b, self.op = a, b, op
        self.batch = a.batch if a.batch is not None else b.batch

    def validate(self, L, S):
        self.a.validate(L, S)
        self.b.validate(L, S)

    def take(self, batch):
        a, b = self.a.take(batch), self.b.take(batch)
        return None if a is None or b is None else _Combined(a, b, self.op)

    def within_top_left(self, L, S):
        a, b = self.a.within_top_left(L, S), self.b.within_top_left(L, S)
        return (a or b) if self.op == "and" else (a and b)

    def keep(self, q_pos, k_pos, L, S):
        a, b = self.a.keep(q_pos, k_pos, L, S), self.b.keep(q_pos, k_pos, L, S)
        return (a & b) if self.op == "and" else (a | b)

    def spans(self, L, S, bq, bk):
        """&: each side's span intersected, partial where either side is (sound); | has
        none (its keys need not be one span)."""
        if self.op != "and":
            return None
        a = self.a.spans(L, S, bq, bk)
        b = None if a is None else self.b.spans(L, S, bq, bk)
        return None if b is None else and_spans(a, b)

    def key_spans(self, S):
        """&: each side's span intersected (full where both are); | has none."""
        if self.op != "and":
            return None
        return _and_key_spans(self.a.key_spans(S), self.b.key_spans(S), S)

    def query_spans(self, L):
        """&: each side's rows intersected (a side with none: every row); | has none."""
        if self.op != "and":
            return None
        return _and_query_spans(self.a.query_spans(L), self.b.query_spans(L))

    def blocks(self, L, S, bq, bk):
        """Sound, not exact: & takes the smaller occupancy (EMPTY < PARTIAL < FULL), | the
        larger; two PARTIAL children stay PARTIAL even where their Trues never meet (&,
        truly EMPTY) or together cover the block (|, truly FULL)."""
        a, b = self.a.blocks(L, S, bq, bk), self.b.blocks(L, S, bq, bk)
        return torch.minimum(a, b) if self.op == "and" else torch.maximum(a, b)

    def __repr__(self):
        return f"({self.a!r} {'&' if self.op == 'and' else '|'} {self.b!r})"


def key_spans(mask: object, B: int, S: int) -> tuple[KeySpan, ...] | None:
    """Per batch element (B of them), the keys [lo, hi) outside which no query of any head
    sees a key, and whether every query sees every key inside (full: the mask has
    nothing more to say there): key padding, right or left, made something to skip
    rather than to mask. From the host alone, never by scanning a 4-D mask: padding's
    lengths on the CPU, or a bool tensor on the CPU that is the same for every head and
    query (a (B|1, 1, 1, S) mask, or one expanded from it, as transformers' padding masks
    are: stride 0), read at its B x S distinct entries; parts of a mask ANDed intersect
    (a part with no span leaves the others' spans, not full). An element that sees no
    key gets (0, S, False): nothing skipped. None where no part gives a span (no mask, a
    float mask, a mask varying over heads or queries, causality alone, a tensor on a
    device, or while torch.compile traces)."""
    tensor, structured = split(mask)
    if torch.compiler.is_compiling():  # (a plan read from data cannot live in a graph)
        return None
    a = None if tensor is None else _tensor_key_spans(tensor, S)
    b = None if structured is None else structured.key_spans(S)
    if tensor is not None and structured is not None:
        a = _and_key_spans(a, b, S)
    elif a is None:
        a = b
    if a is None:
        return None
    if len(a) == 1 and B != 1:
        a = a * B
    return tuple(a) if len(a) == B else None


def query_spans(mask: object, B: int, L: int) -> tuple[tuple[int, int], ...] | None:
    """Per batch element (B of them), the query rows [lo, hi) outside which a row sees no
    key, where the mask declares padded queries (`padding(lengths, queries=True)` with
    lengths on the CPU, or a part of an &): those rows' output and weights are 0 and
    cost nothing. None where no part declares any (a tensor part never does: it is not
    scanned for empty rows), or while torch.compile traces."""
    _, structured = split(mask)
    if structured is None or torch.compiler.is_compiling():
        return None
    found = structured.query_spans(L)
    if found is None:
        return None
    if len(found) == 1 and B != 1:
        found = found * B
    return tuple(found) if len(found) == B else None


def rows_within(spans: tuple[tuple[int, int], ...], L: int, device) -> torch.Tensor:
    """(B, L) bool: whether each of L query rows lies in its batch element's [lo, hi)
    (query_spans' rows)."""
    bounds = torch.tensor(spans, device=device)  # (B, 2)
    at = torch.arange(L, device=device)
    return (at >= bounds[:, :1]) & (at < bounds[:, 1:])


def _and_query_spans(
    a: list[tuple[int, int]] | None, b: list[tuple[int, int]] | None
) -> list[tuple[int, int]] | None:
    """Two parts' query rows ANDed (batch lists of length Bm or 1 broadcast; None: every
    row): the intersection, (0, 0) where it is empty."""
    if a is None or b is None:
        return b if a is None else a
    a, b = a * (len(b) if len(a) == 1 else 1), b * (len(a) if len(b) == 1 else 1)
    if len(a) != len(b):
        return None
    out = []
    for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b, strict=True):
        lo = max(lo_a, lo_b)
        out.append((lo, max(lo, min(hi_a, hi_b))))
    return out


def _span(lo: int, hi: int, full: bool, S: int) -> KeySpan:
    """A key span, or (0, S, False) where it holds no key (nothing to skip there)."""
    return (lo, hi, full) if hi > lo else (0, S, False)


def _and_key_spans(
    a: list[KeySpan] | None, b: list[KeySpan] | None, S: int
) -> list[KeySpan] | None:
    """Two parts' key spans ANDed (batch lists of length Bm or 1 broadcast; None: a part
    with no span, every key, not full)."""
    if a is None or b is None:
        one = a if b is None else b
        return None if one is None else [(lo, hi, False) for lo, hi, _ in one]
    a, b = a * (len(b) if len(a) == 1 else 1), b * (len(a) if len(b) == 1 else 1)
    if len(a) != len(b):
        return None
    out = []
    for (lo_a, hi_a, full_a), (lo_b, hi_b, full_b) in zip(a, b, strict=True):
        lo, hi = max(lo_a, lo_b), min(hi_a, hi_b)
        out.append(_span(lo, hi, full_a and full_b, S) if lo < hi else (0, S, False))
    return out


# The key spans of the last few tensor masks read: id -> (a weak reference to the mask,
# its version, the spans). A call's plan (backends.blocks.exact) and each read of its
# weights (rows.Rows) ask for the same mask's spans: one host read serves them all,
# until the mask is written in place (its version moves) or freed (its entry then goes
# at the next read of another mask).
_SPANS_KEPT = 4
_spans_read: dict[int, tuple[weakref.ref, int, list[KeySpan]]] = {}
_spans_lock = threading.Lock()


def _tensor_key_spans(t: torch.Tensor, S: int) -> list[KeySpan] | None:
    """The key spans of a bool tensor mask (B|1, H|1, L|1, S) that is the same for every
    head and query (size 1 or stride 0 there), read on the host from its (B|1, S)
    distinct entries (once per mask and version: `_spans_read`); None for any other
    tensor (never scanned)."""
    if t.dtype != torch.bool or not t.is_cpu or t.ndim != 4 or t.shape[-1] != S:
        return None
    for d in (1, 2):
        if t.shape[d] != 1 and t.stride(d) != 0:
            return None
    if S == 0:
        return None
    version = _version(t)
    with _spans_lock:
        kept = _spans_read.get(id(t))
    if kept is not None and version is not None and kept[0]() is t and kept[1] == version:
        return list(kept[2])
    spans = _read_key_spans(t[:, 0, 0, :], S)  # (B|1, S), a view
    if version is not None:
        with _spans_lock:
            for key in [key for key, (ref, _, _) in _spans_read.items() if ref() is None]:
                del _spans_read[key]  # (freed masks)
            while len(_spans_read) >= _SPANS_KEPT:
                del _spans_read[next(iter(_spans_read))]  # (the oldest)
            _spans_read[id(t)] = (weakref.ref(t), version, spans)
    return list(spans)


def _version(t: torch.Tensor) -> int | None:
    """t's version counter, or None where it has none (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _read_key_spans(keep: torch.Tensor, S: int) -> list[KeySpan]:
    """The key spans of a (B|1, S) bool keep-mask on the CPU: one host read."""
    as_int = keep.to(torch.uint8)
    lo = as_int.argmax(dim=-1)  # first key seen (0 where none)
    hi = S - as_int.flip(-1).argmax(dim=-1)  # one past the last
    seen = as_int.sum(dim=-1, dtype=torch.int64)
    found = torch.stack([lo, hi, seen]).tolist()  # one host read (a CPU tensor)
    return [
        _span(lo, hi, n == hi - lo, S) if n > 0 else (0, S, False)
        for lo, hi, n in zip(*found, strict=True)
    ]


def and_spans(a: Spans, b: Spans) -> Spans:
    """The spans of two masks ANDed (batch lists of length Bm or 1 broadcast): the
    intersection of the key blocks each query block sees, partial where either is."""
    out = []
    a, b = a * (len(b) if len(a) == 1 else 1), b * (len(a) if len(b) == 1 else 1)
    for ra, rb in zip(a, b, strict=True):
        row = []
        for (lo_a, hi_a, part_a), (lo_b, hi_b, part_b) in zip(ra, rb, strict=True):
            lo, hi = max(lo_a, lo_b), min(hi_a, hi_b)
            row.append((lo, hi, part_a or part_b) if lo < hi else (0, 0, False))
        out.append(row)
    return out


def occupancy(keep: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Block occupancy of a bool keep tensor (..., L, S) -> (..., nQ, nK).

    A block is PARTIAL as soon as it holds both values, so a sample of its rows can
    prove it: a mask with no structure is recognised from 1/8 of its rows."""
    *lead, L, S = keep.shape
    nQ, nK = -(-L // bq), -(-S // bk)
    if L % bq or S % bk:  # ragged edges: pad (False for `any`, True for `all`)
        pad = (0, nK * bk - S, 0, nQ * bq - L)
        shape = (*lead, nQ, bq, nK, bk)
        hi = torch.nn.functional.pad(keep, pad, value=False).view(shape).any(-1).any(-2)
        lo = torch.nn.functional.pad(keep, pad, value=True).view(shape).all(-1).all(-2)
    else:
        u = keep.contiguous().view(torch.uint8)
        step = next(d for d in range(max(1, bq // 8), 0, -1) if bq % d == 0)  # ~8 rows/block
        sample = u[..., ::step, :].reshape(*lead, nQ, bq // step, nK, bk)
        if (sample.amin(dim=(-3, -1)) != sample.amax(dim=(-3, -1))).all():
            return torch.full((*lead, nQ, nK), PARTIAL, dtype=torch.int8, device=keep.device)
        rows = u.view(*lead, L, nK, bk)
        hi = rows.amax(dim=-1).view(*lead, nQ, bq, nK).amax(dim=-2).bool()  # any kept
        lo = rows.amin(dim=-1).view(*lead, nQ, bq, nK).amin(dim=-2).bool()  # all kept
    out = torch.full(hi.shape, PARTIAL, dtype=torch.int8, device=keep.device)
    out[lo] = FULL
    out[~hi] = EMPTY
    return out


def _block_min_max(ids: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max of ids (Bm, N) in blocks of b -> each (Bm, ceil(N/b))."""
    N = ids.shape[-1]
    n = -(-N // b)
    padded = torch.cat([ids, ids[:, -1:].expand(-1, n * b - N)], dim=-1)  # (Bm, n * b)
    padded = padded.view(ids.shape[0], n, b)  # (Bm, n, b)
    return padded.amin(dim=-1), padded.amax(dim=-1)


class ScoreMod:
    """A mask together with what else changes the softmax: a softcap on the scores and
    per-head attention sinks. Pass it wherever a mask goes (`sdpa.attention(q, k, v,
    sdpa.masks.sinks(logits, mask))`); build it with `softcap` and `sinks`, which nest.

    With scores s_ij = scale * q_i . k_j:
        softcap c:  s_ij -> c * tanh(s_ij / c), before the mask is applied (Gemma 2)
        sinks z_i:  a virtual key with score z_i and value 0 in row i (one z per head,
                    or per row), so p_ij = exp(s_ij - lse'_i), lse'_i = logaddexp(lse_i,
                    z_i) and a row's weights sum to sigmoid(lse_i - z_i) < 1 (gpt-oss)
    """

    __slots__ = ("mask", "sinks", "softcap")

    def __init__(
        self,
        mask: torch.Tensor | Mask | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ):
        self.mask, self.softcap, self.sinks = mask, softcap, sinks

    def __repr__(self) -> str:
        sinks = None if self.sinks is None else f"tensor{tuple(self.sinks.shape)}"
        return f"ScoreMod(mask={self.mask!r}, softcap={self.softcap}, sinks={sinks})"

    def __and__(self, other: object) -> Mask:
        raise SdpaTypeError(
            "a ScoreMod (softcap / sinks) wraps a mask rather than combining with one: "
            "combine the masks first, then wrap, e.g. sinks(z, causal() & padding(n))"
        )

    __or__ = __rand__ = __ror__ = __and__


def _parts(mask: object) -> ScoreMod:
    """mask as a ScoreMod (a plain mask is one with no softcap and no sinks)."""
    return mask if isinstance(mask, ScoreMod) else ScoreMod(mask)


def softcap(cap: float, mask: torch.Tensor | Mask | ScoreMod | None = None) -> ScoreMod:
    """Scores squashed to (-cap, cap) before masking: s -> cap * tanh(s / cap).

    mask: any mask (tensor, structured, or sinks(...)) applied after the cap.
    """
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < float("inf"):
        raise SdpaValueError(f"softcap must be a positive finite number, got {cap!r}")
    inner = _parts(mask)
    if inner.softcap is not None:
        raise SdpaValueError(f"the mask already has softcap={inner.softcap}; give one softcap")
    return ScoreMod(inner.mask, float(cap), inner.sinks)


def sinks(logits: torch.Tensor, mask: torch.Tensor | Mask | ScoreMod | None = None) -> ScoreMod:
    """Attention sinks: one more logit in each row's softmax denominator, whose key has
    value 0 (it absorbs weight and adds nothing to the output).

    logits: the extra score column, broadcasting to the weights' (..., Hq, L, 1):
    (Hq, 1, 1) for one learned logit per head (gpt-oss), (B, Hq, L, 1) for one per row.
    Differentiable: gradients flow to it.
    mask: any mask (tensor, structured, or softcap(...)) for the real keys.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise SdpaTypeError(
            f"sinks must be a floating tensor of logits broadcasting to (..., Hq, L, 1), "
            f"e.g. (Hq, 1, 1) per head, got {got}"
        )
    inner = _parts(mask)
    if inner.sinks is not None:
        raise SdpaValueError("the mask already has sinks; give one sinks tensor")
    return ScoreMod(inner.mask, inner.softcap, logits)
