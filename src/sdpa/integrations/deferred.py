"""Deferred attention scores and patterns: tensors that compute only what is read.

Eager attention code (TransformerLens' attention bridges, transformers' eager
functions) builds the scores `q @ k.transpose(-2, -1) * scale`, masks them, softmaxes
them and multiplies by the values. Inside a forward watched by `Intercept`, that first
product returns a `LazyScores` instead of an L x S tensor; the ops eager code applies to
it are recorded (and understood: scale, softcap, causal / boolean / additive masks), the
softmax turns it into a `LazyPattern`, and the product with the values runs
`sdpa.attention` with the equivalent mask: the fused kernel, nothing L x S allocated.

A deferred tensor is a torch.Tensor (a wrapper subclass with the right shape, dtype and
device). Any op it does not answer itself computes the dense values by replaying the
recorded ops on real tensors: exactly what eager computes (inside a forward with no
limit, as eager would; outside, within `max_bytes`, else WeightsTooLargeError).

Outside a forward, every deferred pattern or scores tensor is a lazy tensor of sdpa's
one table of reads (sdpa.weights / sdpa.lazy, `_lazy_view`): a pattern that sdpa's
weights equal (no edit, no row where eager and sdpa differ: `Node.fused`) is the call's
AttentionWeights, an edit with a lazy form (ZeroAblate, ScaleHeads) a lazy expression
of them, and anything else (the scores, other edits, a sink column, eager's rows that
see no key) eager's exact rows replayed as they are read (sdpa.lazy_rows.LazyRows). So
indexing, reductions, products, diagonals, elementwise chains and the byte budget are
theirs; this module only recognises eager attention code and records what it does.
Inside a forward, reads of a pattern (an index, a sum, a top-k) are those same lazy
reads of its replayed rows, with no budget (as eager's tensors have none). A lead view
of replayed values (p[b], p[:, h]) stays a deferred tensor sharing them, so a write to
the tensor reaches it, as on eager.

In-place ops are eager's too. One the intercept models (s += bias, s *= scale,
masked_fill_ with a masking fill) is recorded on the tensor itself, so every holder of
it sees it (a helper `def add_mask_(s, m): s += m`); any other first turns the tensor,
and every alias of it (a detach, a lazy view), into eager's dense values (Dense), within
the budget; past it the op is refused, naming it and the line of code that applied it.
A view eager code takes of deferred values (s.transpose(...), s[:, 1:]) shares them: a
write through it reaches the tensor, as on eager. Fills that are values (NaN, +inf,
finite) are not masks, and a mask or bias that broadcasts the scores to a larger shape
gives that shape.

Shapes: q (B, H, L, D), kt (B, H, D, S) (the keys transposed, as eager multiplies
them), scores and patterns (B, H, L, S); B: batch, H: query heads (key heads already
repeated by the eager code), L: queries, S: keys. Query rows that see no key: eager
(TransformerLens' default mode, which masks with the dtype's minimum) gives them
uniform weights, sdpa gives 0; elsewhere the two agree to rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from sdpa import indexing, leads, masks
from sdpa.budget import DEFAULT_MAX_BYTES, check_fits, dense_limited
from sdpa.errors import (
    NotSupportedError,
    SdpaTypeError,
    SdpaValueError,
    StaleWeightsError,
    WeightsTooLargeError,
)
from sdpa.functional import attention
from sdpa.lazy import LazyTensor
from sdpa.lazy_rows import Grid, LazyRows
from sdpa.weights import CASTS, AttentionWeights, probs_entropy

F = torch.nn.functional
T = torch.Tensor
_SELF = object()  # where the deferred value goes in a recorded op's arguments
_OF_CHAIN = ("dead", "nan", "rowmax", "rowargmax")  # markers of a chain's own value
MASKED = -1e30  # a fill value at or below this masks the entry out (finfo.min, -inf)

_forward_depth: contextvars.ContextVar[int] = contextvars.ContextVar("sdpa_deferred", default=0)
_active: contextvars.ContextVar[Intercept | None] = contextvars.ContextVar(
    "sdpa_deferred_intercept", default=None
)


def in_forward() -> bool:
    """Whether an intercepted forward is running (dense fallbacks are then unlimited, as
    eager's own tensors are)."""
    return _forward_depth.get() > 0


# ---- the ops eager attention code applies, by the function objects torch passes ----


def _ops(*names: str) -> frozenset:
    found = set()
    for name in names:
        for owner in (torch, T, F):
            f = getattr(owner, name, None)
            if f is not None:
                found.add(f)
    return frozenset(found)


MATMUL = _ops("matmul", "__matmul__")
MUL = _ops("mul", "multiply", "__mul__", "__rmul__")
DIV = _ops("div", "divide", "true_divide", "__truediv__")
ADD = _ops("add", "__add__", "__radd__")
TANH = _ops("tanh")
MASKED_FILL = _ops("masked_fill")
SOFTMAX = _ops("softmax")
CAT, MAX, SUB = (
    _ops("cat", "concat", "concatenate"),
    _ops("max"),
    _ops("sub", "subtract", "__sub__"),
)
BMM, BADDBMM, VIEWS = _ops("bmm"), _ops("baddbmm"), _ops("view", "reshape")
DROPOUT = frozenset({F.dropout, torch.dropout})
WHERE = frozenset({torch.where})
ISNAN, ISNEGINF, ALL = _ops("isnan"), _ops("isneginf"), _ops("all")
INVERT = _ops("__invert__", "logical_not", "bitwise_not")
TRIL = _ops("tril")
STACK = frozenset({torch.stack})
SAME = _ops("contiguous")  # a no-op on a value nobody writes
METADATA = _ops(
    "size", "dim", "numel", "is_floating_point", "is_complex", "element_size", "stride",
    "is_contiguous", "nelement", "ndimension", "get_device", "has_names", "is_signed",
)  # fmt: skip
PROPERTIES = frozenset(
    {
        "shape", "ndim", "dtype", "device", "requires_grad", "is_cuda", "is_cpu", "is_meta",
        "layout", "is_sparse", "is_quantized", "is_nested", "names", "grad_fn", "is_leaf",
        "grad", "is_mkldnn", "is_xpu", "is_mps", "itemsize", "nbytes",
    }
)  # fmt: skip


def _property(func: Callable) -> str | None:
    """The name of the tensor property a __get__ call reads, else None."""
    if getattr(func, "__name__", None) != "__get__":
        return None
    return getattr(getattr(func, "__self__", None), "__name__", None)


_AUGMENTED = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "and", "or",
               "xor", "lshift", "rshift", "matmul")
)  # fmt: skip
_INPLACE: dict[object, bool] = {}  # func -> whether it changes its first argument


def _inplace(func: Callable) -> bool:
    """Whether func changes its first argument in place: add_, masked_fill_, the augmented
    assignments (s += m reaches here as add_), __setitem__."""
    try:
        return _INPLACE[func]
    except (KeyError, TypeError):
        name = getattr(func, "__name__", "")
        got = (
            name == "__setitem__"
            or name in _AUGMENTED
            or (name.endswith("_") and not name.endswith("__"))
        )
        with contextlib.suppress(TypeError):
            _INPLACE[func] = got
        return got


def _out_of_place(func: Callable) -> Callable | None:
    """The out-of-place form of an in-place op (add_, __iadd__ -> add, __add__), else None."""
    name = getattr(func, "__name__", "")
    if name in _AUGMENTED:
        base = "__" + name[3:]
    elif name.endswith("_") and not name.endswith("__"):
        base = name[:-1]
    else:
        return None
    for owner in (T, torch):
        found = getattr(owner, base, None)
        if found is not None:
            return found
    return None


def _number(x: object) -> float | None:
    """x as a float if it is a Python (or numpy) real number, else None."""
    if isinstance(x, bool) or (not isinstance(x, int | float) and not hasattr(x, "__float__")):
        return None
    if isinstance(x, torch.Tensor):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


# ---- nodes: what a deferred tensor stands for ----


@dataclass(frozen=True, eq=False)
class Op:
    """One recorded op: func(*args, **kwargs), _SELF where the deferred value goes."""

    func: Callable
    args: tuple
    kwargs: dict


@dataclass(frozen=True, eq=False)
class Marker:
    """A small tensor eager code builds on the way to the masked scores, kept symbolic:
    ones (L, S) bool, tril(d) of it, its negation, where(keep, 0, fill) (an additive
    mask), zeros_like(pattern), and tests of a chain's own value (dead rows of the
    scores, NaNs of the pattern), evaluated at `prefix` ops of that chain."""

    kind: str  # ones, tril, not_tril, additive, zeros, dead, nan, knock, rowmax
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    diagonal: int = 0
    keep: object = None  # "additive": the bool keep mask (tensor or Marker)
    fill: float = 0.0
    prefix: int = 0  # "dead" / "nan": the chain's value after this many ops
    edit: object = None  # "knock": the KnockOut whose dropped scores this marks (H, L, S)
    of: object = None  # a test of a chain's value: the chain (a Node) at `prefix` ops

    def build(self, rows: Selection | None = None, at: torch.Tensor | None = None) -> T:
        """The dense value, restricted to `rows` where given; `at`: the chain's value at
        `prefix` (for the tests of a chain's value; replayed where not given)."""
        if at is None and self.kind in (*_OF_CHAIN, "isneginf"):
            at = replay(self.of, rows)
        if self.kind == "isneginf":
            return torch.isneginf(at)
        if self.kind == "dead":
            return torch.isneginf(at).all(dim=-1, keepdim=True)
        if self.kind == "rowmax":
            return at.max(dim=-1, keepdim=True).values
        if self.kind == "rowargmax":
            return at.max(dim=-1, keepdim=True).indices
        if self.kind == "nan":
            return torch.isnan(at)
        if self.kind == "additive":
            keep = _value(self.keep, rows, None)
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            return torch.where(keep, zero, torch.full((), self.fill, dtype=self.dtype,
                                                      device=self.device))  # fmt: skip
        if self.kind == "zeros":
            return _pick(torch.zeros(self.shape, dtype=self.dtype, device=self.device), rows)
        if self.kind == "knock":
            H, L, S = self.shape
            return _pick(self.edit.knocked(H, L, S, self.device), rows)
        L, S = self.shape[-2], self.shape[-1]
        q_pos = torch.arange(L, device=self.device)
        if rows is not None and rows.r is not None:
            q_pos = q_pos[rows.r]
        k_pos = torch.arange(S, device=self.device)
        if self.kind == "ones":
            return torch.ones(len(q_pos), S, dtype=torch.bool, device=self.device)
        seen = masks.visible_grid(q_pos, k_pos, self.diagonal)  # tril(ones, diagonal)
        return seen if self.kind == "tril" else ~seen


@dataclass(frozen=True)
class Spec:
    """What the recorded score ops mean: s = post * tanh(pre * q.k) (or pre * q.k without
    tanh), then the mask terms in order: ("causal", d) keeps key j for query i when
    j <= i + d; ("keep", m) keeps where m is True; ("drop", m) masks where m is True;
    ("bias", t) adds t. dead: eager zeroed the scores of rows that see no key
    (TransformerLens' compatibility mode), to be zeroed again after the softmax. sinks:
    a column of logits concatenated after the keys (GPT-OSS), dropped after the softmax."""

    pre: float = 1.0
    tanh: bool = False
    post: float = 1.0
    terms: tuple = ()
    dead: bool = False
    sinks: T | None = None  # (B|1, H|1, L|1, 1) logits eager concatenated as a last key


@dataclass(eq=False)
class Call:
    """One attention call as sdpa runs it: q, k, the mask in sdpa.attention's form and
    the scale; its AttentionWeights once computed (or given, for a call that ran on sdpa
    through transformers' attention interface)."""

    q: T | None
    k: T | None
    mask: object
    scale: float | None
    weights: AttentionWeights | None = None

    def get_weights(self) -> AttentionWeights:
        if self.weights is None:
            q, k = self.q, self.k
            with torch.no_grad():  # the weights' reads recompute from q, k and the LSE
                self.weights = attention(q, k, k[..., :1], self.mask, scale=self.scale).weights
        return self.weights


@dataclass(frozen=True, eq=False)
class Node:
    """A deferred scores or pattern tensor (B, H, L, S): `ops` replayed on
    matmul(q, kt) give its exact eager value; `spec` says what they mean; `call` (for a
    pattern) is the sdpa call it equals, shared by every tensor derived from the same
    softmax; `edits` are sdpa edits a hook applied to the pattern."""

    kind: str  # "scores" or "pattern"
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    q: T | None = None
    kt: T | None = None
    ops: tuple[Op, ...] = ()
    spec: Spec = field(default_factory=Spec)
    call: Call | None = None
    edits: tuple = ()
    # rows that see no key: "sdpa" (there are none, or eager zeroed them: its values are
    # sdpa's), "eager" (eager's finite fill gives them uniform weights, sdpa 0),
    # "pending" (compatibility mode between zeroing their scores and their weights)
    dead: str = "sdpa"
    versions: tuple = ()
    # batch and heads folded into one dim, as BLOOM's bmm / baddbmm run them: the scores
    # are (B*H, L, S) (q and kt 3-D) until a .view(B, H, L, S), and a pattern's
    # (B*H, L, S) reshape keeps its 4-D call (for its bmm with the values)
    folded: bool = False

    @property
    def replayable(self) -> bool:
        return self.q is not None

    @property
    def of_call(self) -> bool:
        """Whether this pattern, its edits aside, is sdpa's weights of its call (to
        rounding) in every row: no row that sees no key where eager and sdpa differ, and
        a call (a pattern with a sink column, before the sink is dropped, has none: its
        reads replay eager's rows)."""
        return self.kind == "pattern" and self.dead == "sdpa" and self.call is not None

    @property
    def fused(self) -> bool:
        """Whether sdpa's weights equal this pattern in every row: of_call, no edits."""
        return self.of_call and not self.edits

    def check_fresh(self) -> None:
        """Refuse where a tensor the recorded ops used (q, k, a mask) changed in place
        since its use: eager computed with the values before the change."""
        now = tuple(t._version for t in self._watched())
        if now == self.versions:
            return
        if in_forward():
            raise StaleWeightsError(
                "a tensor these deferred attention scores were computed from (q, k or a "
                "mask) changed in place after the attention code used it; eager computed "
                "with its values before the change, which sdpa did not keep: change a "
                "clone of it, or change it before its use"
            )
        raise StaleWeightsError(
            "a tensor this deferred attention pattern was computed from (q, k or a "
            "mask) changed in place after the forward; read the pattern before the "
            "update, or pass a clone"
        )

    def _watched(self) -> Iterator[T]:
        if self.q is None:
            return
        for t in (self.q, self.kt):
            if not t.is_inference():
                yield t
        for op in self.ops:
            for a in (*op.args, *op.kwargs.values()):
                if isinstance(a, torch.Tensor) and not isinstance(a, Deferred | type(None)):
                    if a.is_inference():
                        continue
                    yield a


def _versions(q: T, kt: T, ops: tuple[Op, ...]) -> tuple:
    probe = Node("scores", (), q.dtype, q.device, q=q, kt=kt, ops=ops)
    return tuple(t._version for t in probe._watched())


@dataclass(frozen=True, eq=False)
class Dense:
    """A deferred tensor that became eager's own tensor `t`: an op changed it (or a view
    eager code took of its values) in place. Every op runs on t; views of t share it."""

    kind: str  # what it was: scores, pattern, a Marker's kind, stacked
    t: T

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    @property
    def device(self) -> torch.device:
        return self.t.device


def _frozen(a: object) -> object:
    """a as a recorded op or mask term keeps it: a deferred Marker as its (immutable) node,
    so that changing that tensor in place later does not change what was recorded."""
    if isinstance(a, Deferred) and isinstance(a._node, Marker):
        return a._node
    return a


# ---- selections: which lead entries and rows a read wants ----


@dataclass(frozen=True)
class Selection:
    """(b, h, r) of a (B, H, L, S) tensor, each a slice or a 1-D int64 tensor of
    positions (dims kept), or None for all: the block a replay computes."""

    b: slice | T | None = None
    h: slice | T | None = None
    r: slice | T | None = None


def _pick(t: T, sel: Selection | None) -> T:
    """t, broadcasting to (B, H, L, ...) from the right, restricted to sel on each of its
    dims that is not of size 1."""
    if sel is None:
        return t
    for which, index in ((-4, sel.b), (-3, sel.h), (-2, sel.r)):
        dim = t.ndim + which
        if index is None or dim < 0 or t.shape[dim] == 1:
            continue
        if isinstance(index, slice):
            t = t[(slice(None),) * dim + (index,)]
        else:
            t = t.index_select(dim, index.to(t.device))
    return t


def _value(arg: object, sel: Selection | None, at: dict[int, T] | None) -> object:
    """A recorded argument as a real value, restricted to sel."""
    if isinstance(arg, Deferred):
        node = arg._node
        if isinstance(node, Marker):
            return _value(node, sel, at)
        return _pick(arg._dense(None), sel)
    if isinstance(arg, Marker):
        if arg.kind in _OF_CHAIN and at is not None:
            return arg.build(at=at[id(arg)])
        return arg.build(sel)
    if isinstance(arg, torch.Tensor):
        return _pick(arg, sel)
    if isinstance(arg, list | tuple):
        return type(arg)(_value(a, sel, at) for a in arg)
    return arg


def replay(node: Node, sel: Selection | None = None) -> T:
    """The exact eager value of node (B, H, L, S), restricted to sel (dims kept)."""
    node.check_fresh()
    wanted: dict[int, list[Marker]] = {}  # prefix -> the chain tests evaluated there
    for op in node.ops:
        for a in (*op.args, *op.kwargs.values()):
            m = a._node if isinstance(a, Deferred) else a
            if isinstance(m, Marker) and m.kind in _OF_CHAIN:
                wanted.setdefault(m.prefix, []).append(m)
    at: dict[int, T] = {}
    x = torch.matmul(_pick(node.q, sel), _pick(node.kt, replace(sel, r=None) if sel else None))
    for i, op in enumerate(node.ops):
        for m in wanted.get(i, ()):
            at[id(m)] = m.build(at=x)
        args = [_real(a, x, sel, at) for a in op.args]
        kwargs = {k: _real(a, x, sel, at) for k, a in op.kwargs.items()}
        x = op.func(*args, **kwargs)
    return x


def _real(a: object, x: T, sel: Selection | None, at: dict) -> object:
    """A recorded argument with _SELF as x and the rest as real values."""
    if a is _SELF:
        return x
    if isinstance(a, list | tuple) and any(b is _SELF for b in a):
        return type(a)(_real(b, x, sel, at) for b in a)
    return _value(a, sel, at)


# ---- the tensor subclass ----


class Deferred(torch.Tensor):
    """A tensor computed on demand (see the module docstring). Its attributes: _node
    (a Node, a Marker, or Dense once changed in place), _lead (the view's choice
    of lead entries, or None), _to (the conversions the reads go through, in order: a
    tuple of (device, dtype) steps, or None; .to(bfloat16).float() rounds as eager's),
    _budget (the byte limit of dense results outside a forward), _detached (reads carry
    no gradient: a cached value, as TransformerLens' cache stores value.detach()).
    Aliases: a lazy view eager would have made of another deferred tensor (detach, a
    lead index, a reshape) has _source (the tensor whose values it views) and _fn (its
    values from _source's); _source lists its live views in _views."""

    _node: object
    _lead: Grid | None
    _to: tuple[tuple[torch.device, torch.dtype], ...] | None
    _budget: int | None
    _detached: bool
    _source: Deferred | None
    _fn: Callable[[T], T] | None
    _views: dict[int, weakref.ref] | None
    _weights: tuple[object, T | None] | None  # (the node it was made for, _lazy_view)
    _unchanged: Unchanged | None  # the freshness of the lazy tensors made from its values

    @staticmethod
    def __new__(cls, node, shape=None, dtype=None, device=None, lead=None, to=None,
                budget=DEFAULT_MAX_BYTES, detached=False):  # fmt: skip
        shape = tuple(node.shape if shape is None else shape)
        dtype = node.dtype if dtype is None else dtype
        device = node.device if device is None else device
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=False
        )
        t._node, t._lead, t._to, t._budget, t._detached = node, lead, to, budget, detached
        t._source = t._fn = t._views = t._weights = t._unchanged = None
        return t

    def _derive(self, **changes) -> Deferred:
        """A wrapper like this one with some of (node, shape, dtype, device, lead, to,
        budget, detached) changed."""
        now = dict(node=self._node, shape=tuple(self.shape), dtype=self.dtype,
                   device=self.device, lead=self._lead, to=self._to, budget=self._budget,
                   detached=self._detached)  # fmt: skip
        now.update(changes)
        return type(self)(**now)

    def __init__(self, *args, **kwargs):  # the wrapper is built in __new__
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        """What torch prints for the dense tensor where the weights answer (computed from
        the rows shown), else a summary that computes nothing."""
        with contextlib.suppress(StaleWeightsError):  # (a stale one: the summary)
            view = _lazy_view(self)
            if view is not None:
                return repr(view)
        what = getattr(self._node, "kind", "stack")
        how = (
            "dense (changed in place): eager's values"
            if isinstance(self._node, Dense)
            else "computed on demand: .full() for the dense tensor"
        )
        name = type(self).__name__
        return f"{name}(shape={tuple(self.shape)}, dtype={self.dtype}, {what}, {how})"

    # -- public reads --

    @property
    def weights(self) -> AttentionWeights:
        """Deprecated (one release): the pattern answers as its AttentionWeights itself
        (p.pairs(i, j), p.kl(other), p.served_by, every read); weights_of(p) gives the
        handle."""
        warnings.warn(
            "p.weights is deprecated and goes in a later release: the pattern answers as "
            "its weights itself (p.pairs(i, j), p.kl(other), p.served_by and every read); "
            "sdpa.integrations.deferred.weights_of(p) gives the AttentionWeights handle",
            DeprecationWarning,
            stacklevel=2,
        )
        return weights_of(self)

    @property
    def lse(self) -> T:
        """Log-sum-exp of each query row's scores, (*lead, L) (of the view)."""
        return self._convert(_lead_of(weights_of(self).lse, self._lead))

    def __getattr__(self, name: str) -> object:
        """The AttentionWeights reads torch.Tensor has no name for (pairs, kl, served_by,
        max_logits, ...), of a pattern sdpa's weights equal: the handle's (of the view)."""
        if name.startswith("_") or name not in HANDLE_ONLY:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        view = _lazy_view(self)
        if not isinstance(view, AttentionWeights):
            weights_of(self)  # (refuses, saying why this tensor has no handle)
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}': {name} is a read "
                f"of sdpa's weights handle, and this view of the pattern is not one"
            )
        return getattr(view, name)

    def full(self, max_bytes: int | None = DEFAULT_MAX_BYTES) -> T:
        """The dense tensor (a new one); refuses, before computing anything, past max_bytes
        (None: no limit)."""
        if isinstance(self._node, Dense):
            return self._node.t.clone()
        view = _lazy_view(self)
        if view is not None:
            return view.full(max_bytes)
        return self._dense(max_bytes)

    def entropy(self) -> T:
        """-sum_j p_ij ln p_ij per query row, in nats: (*lead, L)."""
        if isinstance(self._node, Dense):
            return probs_entropy(self._node.t)
        node = self._node
        if getattr(node, "kind", None) != "pattern":
            raise SdpaValueError("entropy is a read of an attention pattern, not of the scores")
        view = _made_view(self, node) if in_forward() else _lazy_view(self)
        if isinstance(view, AttentionWeights):
            return view.entropy()
        if view is None:
            view = self._dense()
        with dense_limited(None if in_forward() else self._budget):
            return probs_entropy(view)

    # -- the dispatch --

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        prop = _property(func)
        if prop is not None:
            if prop in PROPERTIES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        elif func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is T.__getitem__ and _replays(args[0]):
            got = _view(args[0], args[1])  # (shares x's values, in a forward and after)
            if got is not NotImplemented:
                return got
        if not in_forward():
            handed = _on_lazy(func, args, kwargs)
            if handed is not NotImplemented:
                return handed
        if func is T.__repr__ or func is T.__format__:
            return Deferred.__repr__(args[0])
        handled = _handle(func, args, kwargs)
        if handled is not NotImplemented:
            return handled
        return _fallback(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Ops that reach the dispatcher without passing __torch_function__: the dense
        values stand in."""
        real = torch.utils._pytree.tree_map(
            lambda a: a._dense(None) if isinstance(a, Deferred) else a, (args, kwargs or {})
        )
        return func(*real[0], **real[1])

    # -- helpers --

    def _convert(self, t: T) -> T:
        """t (values of this view's node) through the view's conversions, in order."""
        for device, dtype in self._to or ():
            t = t.to(device=device, dtype=dtype)
        return t

    def _casts(self) -> bool:
        """Whether a conversion changes the values' dtype: then a reduction reads rows
        converted first, as eager reduces the converted tensor (a cast to bfloat16
        rounds every value before they are summed)."""
        return any(dtype != self._node.dtype for _, dtype in self._to or ())

    def _dense(self, max_bytes: int | str | None = "budget") -> T:
        """The dense value of this tensor (with its view and conversion)."""
        node = self._node
        if isinstance(node, Dense):
            return node.t  # the tensor itself: its views and changes are the tensor's
        if max_bytes == "budget":
            max_bytes = None if in_forward() else self._budget
        check_fits(
            f"the dense {getattr(node, 'kind', 'stacked')} tensor in {self.dtype}",
            tuple(self.shape),
            self.element_size(),
            max_bytes,
            "Read less: rows (p[b, h, i]), key columns (p[..., j]), p.sum(dim=-2), "
            "p.entropy() and p.topk(k) work in O(rows x S), torch.diagonal(p, offset, -2, "
            "-1) and p.weights.pairs(i, j) in O(L); or p.full(max_bytes=None)",
        )
        with _grad(self):
            if isinstance(node, Marker):
                return self._convert(node.build())
            if self._lead is None:  # (also a folded (B*H, L, S) product's)
                t = _rows(node, Selection())
            else:
                grid, (L, S) = self._lead, node.shape[-2:]
                t = _grid_rows(node, grid.rows, slice(None)).reshape(*grid.lead, L, S)
            return self._convert(t.full(None) if isinstance(t, LazyTensor) else t)


def _lazy_view(x: Deferred) -> T | None:
    """x as a lazy tensor of sdpa.weights / sdpa.lazy, outside a forward, where x is a
    pattern or scores (B, H, L, S) (_made_view); else None (a Marker, eager's dense
    values, a folded (B*H, L, S) product: x answers itself, densely)."""
    node = x._node
    if in_forward() or not isinstance(node, Node) or node.folded or len(node.shape) != 4:
        return None
    node.check_fresh()
    made = x._weights
    if made is None or made[0] is not node:  # (made once per node: x's reads reuse it)
        made = x._weights = (node, _made_view(x, node))
    return made[1]


def _made_view(x: Deferred, node: Node) -> T | None:
    """The lazy tensor x is: the call's AttentionWeights where sdpa's weights equal the
    pattern (edited lazily where its edits have a lazy form, Edit.on_weights), else
    eager's exact rows replayed (LazyRows: scores, a sink column, other edits, eager's
    rows that see no key); detached where x is, its lead chosen and converted as x is
    (made once: its reads, and those of its views and chains, go stale with the call's
    inputs and once x is changed in place: they would not see the change)."""
    root = x._source if x._source is not None else x
    if root._unchanged is None:
        root._unchanged = Unchanged(type(root).__name__)
    unchanged = root._unchanged
    weights = node.of_call and (not in_forward() or not node.replayable)
    base = _edited_weights(node) if weights else None
    if base is not None:
        base = base._stale_with(unchanged) if isinstance(base, AttentionWeights) else base
    if base is None:
        if not node.replayable:
            return None
        base = _replayed(node, unchanged)
    if not node.edits and x._lead is None and x._to is None and base.dtype == node.dtype:
        return base.detach() if x._detached else base
    w = base.detach() if x._detached else base
    w = _lead_of(w, x._lead)
    if w.dtype != node.dtype:
        w = w.to(node.dtype)
    for device, dtype in x._to or ():
        w = w.to(device=device, dtype=dtype)
    if tuple(w.shape) != tuple(x.shape) or w.dtype != x.dtype or w.device != x.device:
        return None  # (a safety net: the view must be x's own tensor)
    return w


class Unchanged:
    """Whether a deferred tensor (and its aliases) still holds the values its lazy views
    were made from (_made_view); a write in place (a dense change, or an op recorded on
    its node) makes every lazy tensor made before from it refuse, where eager's views
    would show the change and ours would not."""

    __slots__ = ("by", "what")

    def __init__(self, what: str) -> None:
        self.what, self.by = what, None

    def _check_fresh(self) -> None:
        if self.by is not None:
            raise StaleWeightsError(
                f"the {self.what} this lazy tensor was made from (a view, p.detach(), p.mT, "
                f"p * 2) was changed in place after it ({self.by}), and a lazy tensor does "
                f"not see such a change: make it again from the changed tensor, or change a "
                f"dense copy (p.full(), p.clone())"
            )


def _supersede(x: Deferred, by: str) -> None:
    """x's values change in place (by: the op): the lazy tensors made from them go stale."""
    root = x._source if x._source is not None else x
    if root._unchanged is not None:
        root._unchanged.by, root._unchanged = by, None


def _edited_weights(node: Node) -> T | None:
    """The call's AttentionWeights (B, H, L, S) with node's edits applied lazily, or None
    where an edit has no lazy form."""
    w = node.call.get_weights()
    if tuple(w._inputs.shape) != node.shape:
        return None
    for edit in node.edits:  # (an edit with a lazy form: ZeroAblate, ScaleHeads)
        w = edit.on_weights(w)
        if w is None:
            return None
    return w


def _replayed(node: Node, unchanged: Unchanged) -> LazyRows:
    """node's exact eager values (B, H, L, S) as a lazy tensor: its rows replayed (with
    its edits) as they are read; stale with the node's inputs and with `unchanged`."""

    def read(ids: list, rows: slice | T) -> T:
        return _grid_rows(node, ids, rows)

    def fresh() -> None:
        node.check_fresh()
        unchanged._check_fresh()

    grad = any(t.requires_grad for t in node._watched())
    return LazyRows.of(read, node.shape, node.dtype, node.device, grad, fresh)


def _grid_rows(node: Node, ids: list[int], rows: slice | T) -> T:
    """node's values (len(ids), n, S) at lead positions ids (flat, among B x H) and query
    rows `rows`: the block of every pair of their batch entries and heads (_rows), then
    those pairs in the order asked."""
    B, H = node.shape[:2]
    bs, hs = sorted({i // H for i in ids}), sorted({i % H for i in ids})
    sel = Selection(_chosen(bs, B), _chosen(hs, H), rows)
    t = _rows(node, sel)  # (b, h, n, S) over every pair of bs and hs
    t = t.reshape(len(bs) * len(hs), *t.shape[2:])
    at = {(b, h): n for n, (b, h) in enumerate((b, h) for b in bs for h in hs)}
    order = [at[(i // H, i % H)] for i in ids]
    return t if order == list(range(len(at))) else t[torch.tensor(order)]


def _chosen(values: list[int], n: int) -> slice | T | None:
    """Sorted positions among n as a Selection entry: None for all, a slice for a run."""
    if values == list(range(n)):
        return None
    if values == list(range(values[0], values[-1] + 1)):
        return slice(values[0], values[-1] + 1)
    return torch.tensor(values, dtype=torch.long)


def _on_lazy(func, args, kwargs) -> object:
    """func, outside a forward, with each fused pattern among its arguments (and in the
    lists among them: torch.stack's) as its weights' lazy tensor (_lazy_view):
    AttentionWeights' one table of reads, views, lazy chains and dense ops answers, its
    dense values within the pattern's budget. NotImplemented where an argument is not a
    fused pattern or func writes into one (eager's dense values then take the write, see
    _record_in_place)."""
    if _inplace(func) or "out" in kwargs or kwargs.get("inplace") is True:
        return NotImplemented
    handed, budget = False, DEFAULT_MAX_BYTES  # (budget: the last pattern's handed over)

    def view_of(a: object) -> object:
        nonlocal handed, budget
        if isinstance(a, Deferred):
            got = _lazy_view(a)
            if got is None:
                raise _NotFused
            handed, budget = True, a._budget
            return got
        if isinstance(a, list | tuple) and any(isinstance(b, Deferred) for b in a):
            return type(a)(view_of(b) for b in a)
        return a

    try:
        args = tuple(view_of(a) for a in args)
        kwargs = {k: view_of(a) for k, a in kwargs.items()} if kwargs else kwargs
    except _NotFused:
        return NotImplemented
    if not handed:
        return NotImplemented
    with dense_limited(budget):
        name = getattr(func, "__name__", None)
        own = getattr(type(args[0]), name, None) if args and name else None
        if own is not None and own is not func and getattr(T, name, None) is func:
            if name == "__deepcopy__":
                return copy.deepcopy(args[0], *args[1:])
            return own(*args, **kwargs)  # (the lazy tensor's own method: w.detach())
        return func(*args, **kwargs)


class _NotFused(Exception):
    """An argument of an op is a deferred tensor that is not a fused pattern."""


def _sink_column(node: object) -> bool:
    """Whether node is a pattern over the keys and a sink column (GPT-OSS's softmax of
    the scores with the sinks concatenated), before eager drops the column."""
    return isinstance(node, Node) and node.kind == "pattern" and node.spec.sinks is not None


def _grad(x: Deferred) -> contextlib.AbstractContextManager:
    """No gradient for the reads of a detached (cached) value."""
    return torch.no_grad() if x._detached else contextlib.nullcontext()


def make(node, budget: int | None = DEFAULT_MAX_BYTES) -> Deferred:
    """A deferred tensor for node: LazyScores or LazyPattern for a Node, else Deferred."""
    kind = getattr(node, "kind", None)
    cls = LazyPattern if kind == "pattern" else LazyScores if kind == "scores" else Deferred
    return cls(node, budget=budget)


class LazyScores(Deferred):
    """Deferred masked scores (B, H, L, S), before the softmax: TransformerLens'
    hook_attn_scores value. Reads replay the eager ops on the rows asked for."""


class LazyPattern(Deferred):
    """Deferred attention pattern (B, H, L, S), after the softmax: TransformerLens'
    hook_pattern value (what `cache["pattern", layer]` holds on sdpa). Reads come from
    sdpa's AttentionWeights (`.weights`) where the pattern equals them, else from
    replayed rows."""

    def __reduce_ex__(self, protocol: int):
        """torch.save / pickle of a whole unedited pattern keep sdpa's recipe (q, k, the
        mask, the LSE: O(L x E), not L x S) and load as its AttentionWeights, which reads
        as this pattern (torch.load(..., weights_only=True) too); any other pattern (a
        view, a conversion, edits, a sink column) saves its values."""
        view = _lazy_view(self)
        if isinstance(view, AttentionWeights):
            return view.__reduce_ex__(protocol)
        return super().__reduce_ex__(protocol)


# ---- views and row reads ----


def _lead_of(t: T, grid: Grid | None) -> T:
    """t (B, H, ...) at a view's lead rows (grid: its lead shape and flat B x H positions):
    by flattening and indexing, so a lazy t (the weights, replayed rows) gives a lazy
    view."""
    if grid is None:
        return t
    rows = grid.rows
    run = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
    flat = t.flatten(0, 1)
    picked = flat[rows[0] : rows[-1] + 1] if run else flat[torch.tensor(rows, dtype=torch.long)]
    return picked.reshape(*grid.lead, *picked.shape[1:])


def _rows(node: Node, sel: Selection) -> T:
    """The (B', H', n, S) values of node at a selection, dims kept: from sdpa's weights
    where they equal the pattern and are computed (or the pattern has no recorded ops),
    else replayed (exact eager) rows, with edits applied."""
    fused = node.kind == "pattern" and node.fused
    if not node.replayable or (fused and node.call.weights is not None):
        return _from_weights(node.call.get_weights(), sel)
    x = replay(node, sel)
    for edit in node.edits:
        x = edit.dense(x, _positions(sel, node.shape))
    return x


class Where(NamedTuple):
    """Which values a part of a pattern (B', H', n, S) holds: the int64 positions of its
    batch entries, heads and rows among the whole (B, H, L, S)."""

    b: T
    h: T
    r: T
    B: int
    H: int
    L: int


def _positions(sel: Selection, shape: tuple[int, ...]) -> Where:
    """The positions a selection picks."""
    picked = [
        torch.arange(n)[index] if index is not None else torch.arange(n)
        for n, index in zip(shape[:3], (sel.b, sel.h, sel.r), strict=True)
    ]
    return Where(*picked, *shape[:3])


def _from_weights(w: AttentionWeights, sel: Selection) -> T:
    """w's values at sel (dims kept): its lazy lead view's rows."""
    for dim, index in ((0, sel.b), (1, sel.h)):  # (one dim at a time: their product)
        if index is not None:
            w = w[(slice(None),) * dim + (index,)]
    t = w[:, :, sel.r] if sel.r is not None else w
    return t.full(None) if isinstance(t, LazyTensor) else t


# ---- the ops a deferred tensor answers ----


def _node_of(x: object) -> object:
    return x._node if isinstance(x, Deferred) else None


def _handle(func, args, kwargs) -> object:
    """The answer to func(*args, **kwargs) without dense values, or NotImplemented."""
    if not args:
        return NotImplemented
    first = args[0]
    if (
        func in CAT
        and isinstance(first, list | tuple)
        and first
        and isinstance(_node_of(first[0]), Node)
    ):
        x = first[0]
        if x._node.kind == "scores" and x._lead is None and x._to is None:
            return _score_op(x, func, args, kwargs)
        return NotImplemented
    node = _node_of(first)
    if node is not None and _inplace(func):
        return _record_in_place(first, func, args, kwargs)  # else dense, in _fallback
    if func in MATMUL and isinstance(_node_of(first), Node) and len(args) == 2:
        return _matmul(first, args[1])
    if func in BMM and isinstance(_node_of(first), Node) and len(args) == 2 and not kwargs:
        return _bmm(first, args[1])
    reshaped = func in VIEWS and isinstance(node, Node) and in_forward()
    if reshaped and (node.folded or (node.kind == "pattern" and len(node.shape) == 4)):
        return _unfold(first, func, args, kwargs)
    if func in WHERE and len(args) == 3 and isinstance(_node_of(args[2]), Node):
        return _where(args, kwargs)
    if func in WHERE and len(args) == 3 and isinstance(_node_of(args[1]), Node) and not kwargs:
        return _where_scores(*args)
    if isinstance(node, Marker):
        return _marker_op(first, node, func, args, kwargs)
    swapped = len(args) == 2 and not kwargs and isinstance(_node_of(args[1]), Node)
    if swapped and func in ADD and not isinstance(_node_of(args[0]), Node):
        return _score_op(args[1], func, (args[1], args[0]), {})  # x + scores
    if swapped and func in MUL and not isinstance(first, torch.Tensor):
        return _score_op(args[1], func, (args[1], args[0]), {})  # a * scores
    if not isinstance(node, Node):
        return NotImplemented
    if func is T.detach:
        return _alias(first, first._derive(detached=True), func, args, kwargs)
    if func in SAME:
        return first
    if func in (T.to, T.type, T.cpu, T.cuda) or func in CASTS:
        return _to(first, func, args, kwargs)
    if in_forward() and node.kind == "scores" and (func is T.__getitem__ or func in REDUCTIONS):
        if func is T.__getitem__ and _is_whole(args[1], tuple(first.shape)):
            return first  # run_with_cache's pos_slice of every position
        return NotImplemented  # inside a forward a read of the scores is eager's, exactly
    if func is T.__getitem__:
        return _read(first, func, args, kwargs)
    if first._lead is None and first._to is None:
        if node.kind == "scores":
            got = _score_op(first, func, args, kwargs)
            if got is not NotImplemented:
                return got
        elif in_forward() or func in DROPOUT:
            got = _pattern_op(first, func, args, kwargs)
            if got is not NotImplemented:
                return got
    return _read(first, func, args, kwargs) if func in READS else NotImplemented


def _fallback(func, args, kwargs) -> object:
    """func on the dense values (the budget applies outside a forward). A deferred tensor
    the op changes in place first becomes dense itself (with its aliases), so that every
    holder of it sees the change. Inside a forward, a deferred tensor whose dense values
    an output views (a view eager code took: s.transpose(...), s[:, 1:]) lends them: if
    the view is written to, the tensor becomes those values (see _settle)."""
    deferreds = [a for a in _flat((args, kwargs)) if isinstance(a, Deferred)]
    deferreds = [a for a in deferreds if not isinstance(a._node, Dense)]
    mode = _active.get() if in_forward() else None
    bare = all(isinstance(a._node, Node) and a._node.kind == "scores" and not a._node.ops
               for a in deferreds)  # fmt: skip
    written = _written(func, args, kwargs)
    for x in written:
        _densify(x, func)  # (refused past the budget: then nothing ran densely)
    if mode is not None and deferreds:
        if not bare:  # (a bare product met another op: not attention scores, eager's)
            _note_fallback(func, args)
        else:
            mode.armed = True  # not the scores: the next product may be
    roots: dict[int, tuple[Deferred, T]] = {}  # id(root) -> (root, its dense values)

    def real(a: object) -> object:
        if not isinstance(a, Deferred):
            return a
        if mode is None or isinstance(a._node, Dense):
            return a._dense()
        root = a._source if a._source is not None else a
        got = roots.get(id(root))
        if got is None:
            lent = mode.lent.get(id(root))
            got = roots[id(root)] = (root, lent[1] if lent is not None else root._dense())
        return got[1] if a is root else a._fn(got[1])

    real_args, real_kwargs = torch.utils._pytree.tree_map(real, (args, kwargs))
    out = func(*real_args, **real_kwargs)
    if written:
        return written[0] if out is written[0]._node.t else out
    if roots:
        _lend(mode, roots, out)
    return out


def _written(func, args, kwargs) -> list[Deferred]:
    """The deferred tensors func changes in place: its first argument (add_, __setitem__,
    inplace=True) and its out= tensors."""
    found = []
    first = args[0] if args else None
    if isinstance(first, Deferred) and (
        _inplace(func)
        or kwargs.get("inplace") is True
        or (func in DROPOUT and len(args) > 3 and args[3] is True)
    ):
        found.append(first)
    for o in _flat(kwargs.get("out")):
        if isinstance(o, Deferred) and all(o is not f for f in found):
            found.append(o)
    return found


def _densify(x: Deferred, func) -> None:
    """x, and every alias of it, turned into eager's dense values before func changes x in
    place: the values a view already shares, else computed within x's budget (past it,
    refused: the error names func and the code that applied it)."""
    if isinstance(x._node, Dense):
        return
    root = x._source if x._source is not None else x
    mode = _active.get()
    lent = mode.lent.pop(id(root), None) if mode is not None else None
    if lent is not None:
        values = lent[1]
    else:
        need = math.prod(root.shape) * root.element_size()
        if root._budget is not None and need > root._budget:
            raise _in_place_refusal(x, func, root, need)
        values = root._dense(None)
    _turn_dense(root, values, getattr(func, "__name__", repr(func)))


def _turn_dense(root: Deferred, values: T, by: str) -> None:
    """root becomes Dense(values); each live view of it, Dense(its view of values) (by:
    the op that changes them in place)."""
    _supersede(root, by)
    members = [(root, values)]
    for ref in (root._views or {}).values():
        m = ref()
        if m is not None:
            members.append((m, m._fn(values)))
    for m, t in members:
        m._node = Dense(getattr(m._node, "kind", "stacked"), t)
        m._lead = m._to = m._source = m._fn = m._views = None


def _alias(x: Deferred, out: Deferred, func, args, kwargs) -> Deferred:
    """out, a lazy tensor standing for func(x, *args[1:]) that eager would have made as a
    view of x (detach, x[index], a reshape), linked to x's storage: an in-place change of
    either reaches the other (see _densify)."""
    root = x._source if x._source is not None else x
    parent, rest = x._fn, args[1:]

    def fn(t: T) -> T:
        return func(parent(t) if parent is not None else t, *rest, **kwargs)

    out._source, out._fn = root, fn
    if root._views is None:
        root._views = {}
    root._views[id(out)] = weakref.ref(out)
    return out


def _alone(x: Deferred) -> bool:
    """Whether nothing else views x's values: no lazy view of it, and no view of its dense
    values lent in this forward."""
    mode = _active.get()
    if x._source is not None or (mode is not None and id(x) in mode.lent):
        return False
    views = x._views
    if views:
        for key, ref in list(views.items()):
            if ref() is None:
                del views[key]
    return not views


def _lend(mode: Intercept, roots: dict[int, tuple[Deferred, T]], out: object) -> None:
    """Note the roots whose dense values an output of a fallback views."""
    leaves = [o for o in _flat(out) if isinstance(o, torch.Tensor) and not isinstance(o, Deferred)]
    for key, (root, values) in roots.items():
        if key in mode.lent or values.numel() == 0:
            continue
        at = _storage(values)
        if at is not None and any(_storage(o) == at for o in leaves):
            mode.lent[key] = (root, values, values._version)


def _storage(t: T) -> tuple | None:
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor without storage)
        return None


def _settle(mode: Intercept) -> None:
    """Each deferred tensor whose lent dense values were written through a view becomes
    those values (with its aliases)."""
    for key, (root, values, version) in list(mode.lent.items()):
        if values._version != version:
            del mode.lent[key]
            if not isinstance(root._node, Dense):
                _turn_dense(root, values, "a write through a view of its values")


def _record_in_place(x: Deferred, func, args, kwargs) -> object:
    """An in-place op recorded on x's own node, where its out-of-place form would be
    recorded and nothing else views x (every holder of x then sees it); else
    NotImplemented (x becomes dense in _fallback). Replay runs the in-place op itself
    (eager's dtype: s += bias keeps the dtype of s)."""
    node = x._node
    oop = _out_of_place(func)
    if (
        oop is None or not isinstance(node, Node) or x._lead is not None or x._to is not None
        or not _alone(x)
    ):  # fmt: skip
        return NotImplemented
    if node.kind == "scores":
        got = _score_op(x, oop, args, kwargs)
    elif in_forward() or oop in DROPOUT:
        got = _pattern_op(x, oop, args, kwargs)
    else:
        return NotImplemented
    if got is x:
        return x
    new = _node_of(got)
    if (
        not isinstance(new, Node) or new.kind != node.kind or new.shape != node.shape
        or new.dtype != node.dtype or len(new.ops) != len(node.ops) + 1
    ):  # fmt: skip
        return NotImplemented
    _supersede(x, getattr(func, "__name__", repr(func)))
    x._node = replace(new, ops=(*new.ops[:-1], replace(new.ops[-1], func=func)))
    return x


class Site(NamedTuple):
    """Where an op on a deferred tensor was applied."""

    line: str  # file:line of the first frame outside torch and sdpa
    module: str | None  # the module whose code that is (class 'name')
    hook: bool  # whether a hook function applied it (called by a TransformerLens HookPoint)


_LIBRARIES = (  # torch/ and sdpa/: the frames _site skips
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _site() -> Site:
    """The code that applied the current op, from the Python stack: its line, the module
    of the nearest frame at or above it that runs one (a method's self), and whether a
    HookPoint called it (a hook's `hook` argument, HookPoint's own `module`)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    if frame is None:
        return Site("<unknown>", None, False)
    line = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    while frame is not None:
        local = frame.f_locals
        for key in ("hook", "module", "self"):
            if _is_hook_point(local.get(key)):
                return Site(line, _module_name(local[key]), True)
        if isinstance(local.get("self"), torch.nn.Module):
            return Site(line, _module_name(local["self"]), False)
        frame = frame.f_back
    return Site(line, None, False)


def _is_hook_point(obj: object) -> bool:
    return obj is not None and any("HookPoint" in c.__name__ for c in type(obj).__mro__)


def _module_name(m: object) -> str:
    name = getattr(m, "__dict__", {}).get("name")  # TransformerLens components' own name
    return f"{type(m).__name__} {name!r}" if isinstance(name, str) and name else type(m).__name__


def _in_place_refusal(x: Deferred, func, root: Deferred, need: int) -> Exception:
    """The error for an in-place op on a deferred tensor past its budget: what changed,
    the bytes its dense values need, where the op came from and what would work."""
    name = getattr(func, "__name__", repr(func))
    site = _site()
    kind = getattr(root._node, "kind", "stacked")
    head = (
        f"{name} changes a {type(x).__name__} {tuple(x.shape)} in place; sdpa holds it as a "
        f"recipe and would first need the dense {kind} {tuple(root.shape)}: {need:,} bytes, "
        f"over max_bytes={root._budget:,}. "
    )
    if site.hook:
        tail = (
            f"The op came from a hook on {site.module} at {site.line}: return a new tensor "
            f"from the hook (s - m, s.masked_fill(...)) instead of changing its argument"
        )
    elif in_forward():
        tail = (
            f"The attention code of {site.module or 'the module'} at {site.line} cannot run on "
            f"sdpa's intercept as written (sdpa.integrations.transformer_lens.unfused(bridge) "
            f"names it); a larger budget (use_sdpa(bridge, max_dense_bytes=None)) runs it "
            f"densely, as eager does, or write it out of place (s = s - m)"
        )
    else:
        tail = (
            f"At {site.line}: change a dense copy instead (.full(max_bytes=None)), or read "
            f"less (rows, columns, sums)"
        )
    # not a TypeError for the arithmetic: Tensor.__iadd__ turns a TypeError into
    # NotImplemented, and Python would then run s = s + m, leaving the aliases of s as
    # they were
    return (SdpaTypeError if name == "__setitem__" else WeightsTooLargeError)(head + tail)


def _flat(args) -> list:
    return torch.utils._pytree.tree_leaves(args)


_FALLBACKS: dict[str, int] = {}
FUSED = [0]  # calls of sdpa.attention that stood for an eager attention (a counter)


def fallbacks() -> dict[str, int]:
    """How many times, per op name, an intercepted forward computed a deferred tensor
    densely because it met an op it does not understand (a counter for tests and
    diagnostics; the result is still eager's)."""
    return dict(_FALLBACKS)


def _note_fallback(func, args) -> None:
    name = getattr(func, "__name__", repr(func))
    kinds = sorted({getattr(a._node, "kind", "?") for a in _flat(args) if isinstance(a, Deferred)})
    key = f"{name}({', '.join(kinds)})"
    if key not in _FALLBACKS:
        warnings.warn(
            f"sdpa: an attention forward computed its {'/'.join(kinds)} densely, as eager "
            f"does, because it applied {name!r}, which the deferred scores do not model "
            f"(the result is eager's; only the speed is lost)",
            RuntimeWarning,
            stacklevel=4,
        )
    _FALLBACKS[key] = _FALLBACKS.get(key, 0) + 1


def _record(x: Deferred, func, args, kwargs, **changes) -> Deferred:
    """x with one more op recorded (args with x replaced by _SELF)."""
    node: Node = x._node
    op = Op(func, tuple(_as_self(a, x) for a in args),
            {k: _as_self(a, x) for k, a in kwargs.items()})  # fmt: skip
    ops = (*node.ops, op)
    # each tensor's version as of its use (q, kt expanded by _widen share q's, kt's)
    used = (a for a in (*op.args, *op.kwargs.values())
            if isinstance(a, torch.Tensor) and not isinstance(a, Deferred))  # fmt: skip
    changes.setdefault(
        "versions", (*node.versions, *(a._version for a in used if not a.is_inference()))
    )
    return _wrap(x, replace(node, ops=ops, **changes))


def _as_self(a: object, x: Deferred) -> object:
    """a with x replaced by _SELF (in lists and tuples too: torch.cat's tensors), and a
    deferred Marker by its node (_frozen)."""
    if a is x:
        return _SELF
    if isinstance(a, list | tuple):
        return type(a)(_as_self(b, x) for b in a)
    return _frozen(a)


def _widen(node: Node, other: object) -> dict | None:
    """What becomes of the scores' node after an op with `other` (a mask or bias) that
    broadcasts them to a larger shape, as eager's result does (scores (1, H, L, S) +
    bias (2, 1, L, S) -> (2, H, L, S)): {} where the shape stays; q and kt expanded to
    it (views: same values, nothing copied); None where the node cannot follow."""
    shape = getattr(other, "shape", None)
    if shape is None:
        return {}
    n = max(len(shape), len(node.shape))
    wide = []  # torch's broadcasting rule, in O(ndim) (torch.broadcast_shapes is slow)
    for a, b in zip((1,) * (n - len(node.shape)) + node.shape,
                    (1,) * (n - len(shape)) + tuple(shape), strict=True):  # fmt: skip
        if a != b and a != 1 and b != 1:
            return None
        wide.append(b if a == 1 else a)
    wide = tuple(wide)
    if wide == node.shape:
        return {}
    if len(wide) != 4 or node.folded or node.spec.sinks is not None or not node.replayable:
        return None
    B, H, L, S = wide
    q = node.q.expand(B, H, L, node.q.shape[-1])  # (B, H, L, D)
    kt = node.kt.expand(B, H, node.kt.shape[-2], S)  # (B, H, D, S)
    return {"shape": wide, "q": q, "kt": kt}


def _wrap(x: Deferred, node: object) -> Deferred:
    """A deferred tensor for node with x's budget and detachment."""
    out = make(node, x._budget)
    out._detached = x._detached
    return out


def _score_op(x: Deferred, func, args, kwargs) -> object:
    """One op on the scores: scale, softcap, masks, the softmax."""
    node: Node = x._node
    spec = node.spec
    other = args[1] if len(args) > 1 else None
    if (func in MUL or func in DIV) and not kwargs and len(args) == 2 and not spec.terms:
        a = _number(other)
        if a is None or a == 0:
            return NotImplemented
        a = a if func in MUL else 1.0 / a
        spec = replace(spec, post=spec.post * a) if spec.tanh else replace(spec, pre=spec.pre * a)
        return _record(x, func, args, kwargs, spec=spec)
    if func in TANH and len(args) == 1 and not kwargs and not spec.terms and not spec.tanh:
        return _record(
            x, func, args, kwargs, spec=replace(spec, tanh=True, pre=spec.pre * spec.post, post=1.0)
        )
    if func in MASKED_FILL:
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        value = _number(value)
        m = _node_of(mask)
        if value == 0.0 and isinstance(m, Marker) and m.kind == "dead":
            return _record(x, func, args, kwargs, spec=replace(spec, dead=True))
        if value is None or not value <= MASKED:  # NaN, +inf, finite fills are values
            return NotImplemented
        if isinstance(m, Marker) and m.kind == "not_tril":
            term = ("causal", m.diagonal)
        elif isinstance(m, Marker) and m.kind in ("tril", "ones", "knock"):
            term = ("drop", m)
        elif (
            isinstance(mask, torch.Tensor)
            and not isinstance(mask, Deferred)
            and mask.dtype == torch.bool
        ):
            term = ("drop", mask)
        else:
            return NotImplemented
        wide = _widen(node, mask)
        if wide is None:
            return NotImplemented
        spec = replace(spec, terms=(*spec.terms, term))
        return _record(x, func, args, kwargs, spec=spec, **wide)
    if func in ADD and len(args) == 2 and kwargs.get("alpha", 1) == 1:
        m = _node_of(other)
        if isinstance(m, Marker) and m.kind == "additive" and m.fill <= MASKED:
            term = ("keep", m.keep)
        elif (
            isinstance(other, torch.Tensor)
            and not isinstance(other, Deferred)
            and other.is_floating_point()
        ):
            term = ("bias", other)
        else:
            return NotImplemented
        wide = _widen(node, other)
        if wide is None:
            return NotImplemented
        spec = replace(spec, terms=(*spec.terms, term))
        return _record(x, func, args, kwargs, spec=spec, **wide)
    if func in CAT and spec.sinks is None and not spec.tanh:
        return _cat_sink(x, args, kwargs)
    if func in MAX and spec.sinks is not None and len(args) == 1 + ("dim" not in kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim in (-1, 3) and kwargs.get("keepdim", False) and set(kwargs) <= {"dim", "keepdim"}:
            m = Marker("rowmax", (*node.shape[:-1], 1), node.dtype, node.device,
                       prefix=len(node.ops), of=node)  # fmt: skip
            indices = replace(m, kind="rowargmax", dtype=torch.long)
            return torch.return_types.max((_wrap(x, m), _wrap(x, indices)))
        return NotImplemented
    if func in SUB and spec.sinks is not None and len(args) == 2 and not kwargs:
        m = _node_of(args[1])
        if isinstance(m, Marker) and m.kind == "rowmax" and m.prefix == len(node.ops):
            return _record(x, func, args, kwargs)  # a shift: the softmax is the same
        return NotImplemented
    if func in SOFTMAX:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        at = 3 if func is F.softmax else 2  # F.softmax(x, dim, _stacklevel, dtype)
        dtype = kwargs.get("dtype", args[at] if len(args) > at else None) or node.dtype
        if dim not in (-1, 3) or len(args) > at + 1:
            return NotImplemented
        out = _record(x, func, args, kwargs)
        call = _call(node) if spec.sinks is None else None  # (sinks: at the drop)
        if call is None and spec.sinks is None:
            return NotImplemented
        dead = "pending" if spec.dead else "eager" if _may_see_nothing(spec) else "sdpa"
        pattern = replace(out._node, kind="pattern", dtype=dtype, call=call, dead=dead)
        return _wrap(x, pattern)
    return NotImplemented


def _cat_sink(x: Deferred, args, kwargs) -> object:
    """torch.cat([scores, sinks], dim=-1) with sinks (..., 1) real logits: the sink."""
    tensors = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if (
        dim not in (-1, 3) or len(tensors) != 2 or tensors[0] is not x
        or not isinstance(tensors[1], torch.Tensor) or isinstance(tensors[1], Deferred)
        or tensors[1].shape[-1] != 1 or tensors[1].ndim != 4 or set(kwargs) - {"dim"}
    ):  # fmt: skip
        return NotImplemented
    node: Node = x._node
    spec = replace(node.spec, sinks=tensors[1])
    out = _record(x, torch.cat, args, kwargs, spec=spec)
    return _wrap(x, replace(out._node, shape=(*node.shape[:-1], node.shape[-1] + 1)))


def _drop_sink(x: Deferred, index: object) -> object:
    """pattern[..., :-1] of a pattern with a sink column: the pattern over the keys, the
    sdpa call with masks.sinks."""
    node: Node = x._node
    S = node.shape[-1] - 1
    items = indexing.spread(index, len(node.shape))
    if (
        len(items) != len(node.shape)
        or not all(map(_covers, items[:-1], node.shape[:-1]))
        or not isinstance(items[-1], slice)
        or range(*items[-1].indices(S + 1)) != range(S)
    ):
        return NotImplemented
    out = _record(x, T.__getitem__, (x, index), {})
    keys = replace(out._node, shape=(*node.shape[:-1], S))
    call = _call(keys)
    if call is None:
        return NotImplemented
    call.mask = masks.sinks(node.spec.sinks, call.mask)
    dead = "eager" if _may_see_nothing(node.spec) else "sdpa"
    out = _wrap(x, replace(keys, call=call, dead=dead, spec=replace(node.spec, sinks=None)))
    return _alias(x, out, T.__getitem__, (x, index), {})


def _may_see_nothing(spec: Spec) -> bool:
    """Whether a query row may see no key under the mask terms (a row filled with a
    finite value then softmaxes to uniform weights on eager): any term but causal
    masking that keeps the diagonal."""
    return any(kind != "causal" or value < 0 for kind, value in spec.terms)


def _pattern_op(x: Deferred, func, args, kwargs) -> object:
    """One op on the pattern inside a forward: casts, dropout off, the compatibility
    mode's row zeroing and NaN scrub."""
    node: Node = x._node
    if func in DROPOUT:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        if not training or p == 0:
            return x
        return NotImplemented
    if func in MASKED_FILL:
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        value = _number(args[2] if len(args) > 2 else kwargs.get("value"))
        m = _node_of(mask)
        if value == 0.0 and isinstance(m, Marker) and m.kind == "dead" and node.replayable:
            return _record(x, func, args, kwargs, dead="sdpa")
        return NotImplemented
    if func in ISNAN and len(args) == 1 and node.replayable:
        m = Marker("nan", node.shape, torch.bool, node.device, prefix=len(node.ops), of=node)
        return make(m, x._budget)
    return NotImplemented


def _where(args, kwargs) -> object:
    """torch.where(isnan(p), zeros_like(p), p): the NaN scrub, a no-op on sdpa's values
    (recorded so that replay stays exact)."""
    cond, a, x = args
    c, z = _node_of(cond), _node_of(a)
    node: Node = x._node
    if (
        isinstance(c, Marker) and c.kind == "nan" and c.prefix == len(node.ops)
        and isinstance(z, Marker) and z.kind == "zeros" and not kwargs
    ):  # fmt: skip
        return _record(x, torch.where, args, kwargs)
    return NotImplemented


def _where_scores(cond, x: Deferred, fill) -> object:
    """torch.where(keep, scores, fill) with a 0-d fill at or below MASKED made in this
    forward (GPT-Neo's causal mask): a keep term."""
    mode = _active.get()
    node = x._node
    tagged = mode.fills.get(id(fill)) if mode is not None else None
    if (
        node.kind != "scores" or tagged is None or tagged[0] is not fill
        or not tagged[1] <= MASKED  # (NaN, +inf: values, not masks)
        or not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool
        or (isinstance(cond, Deferred) and not isinstance(cond._node, Marker))
    ):  # fmt: skip
        return NotImplemented
    wide = _widen(node, cond)
    if wide is None:
        return NotImplemented
    term = ("keep", _frozen(cond))
    return _record(x, torch.where, (cond, x, fill), {},
                   spec=replace(node.spec, terms=(*node.spec.terms, term)), **wide)  # fmt: skip


def _to(x: Deferred, func, args, kwargs) -> object:
    """.to(dtype / device), .float(), .cpu(): recorded inside a forward (a cast of the
    scores or pattern), a conversion of the reads outside."""
    node: Node = x._node
    device, dtype, rest = _to_args(func, args[1:], kwargs, x)
    if rest is None:
        return NotImplemented
    if (device is None or torch.device(device) == x.device) and (dtype is None or dtype == x.dtype):
        return x
    if in_forward() and x._lead is None and x._to is None and node.replayable:
        if device is not None and torch.device(device) != x.device:
            return NotImplemented
        return _wrap(x, replace(_record(x, T.to, (x, dtype), {})._node, dtype=dtype))
    to_device = x.device if device is None else torch.device(device)
    to_dtype = x.dtype if dtype is None else dtype
    return x._derive(dtype=to_dtype, device=to_device, to=(*(x._to or ()), (to_device, to_dtype)))


def _to_args(func, rest, kwargs, x) -> tuple:
    """(device, dtype, ok) of a .to / .type / .float (.double, .half, .bfloat16) / .cpu /
    .cuda call."""
    if func in CASTS:  # (memory_format=: eager's, densely)
        return (None, CASTS[func], ()) if not kwargs and not rest else (None, None, None)
    if func is T.cpu:
        return torch.device("cpu"), None, ()
    if func is T.cuda:
        return torch.device("cuda"), None, ()
    kwargs = dict(kwargs)
    for k in ("non_blocking", "copy", "memory_format"):
        if kwargs.pop(k, False) not in (False, None, torch.preserve_format):
            return None, None, None
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    if kwargs:
        return None, None, None
    for a in rest:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, str | torch.device):
            device = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif a is None:
            continue
        else:
            return None, None, None
    return device, dtype, ()


def _call(node: Node) -> Call | None:
    """The sdpa call whose weights equal the softmax of node's scores, or None where the
    mask terms cannot be expressed."""
    spec = node.spec
    L, S = node.shape[-2], node.shape[-1]
    causal, keeps, biases = [], [], []
    for kind, value in spec.terms:
        if kind == "causal":
            causal.append(value)
        elif kind == "bias":
            biases.append(value)
        else:
            keeps.append((kind, value))
    mask: object = None
    if not keeps and not biases and len(causal) == 1 and causal[0] in (S - L, 0):
        mask = masks.causal("bottom-right" if causal[0] == S - L else "top-left")
    elif causal or keeps or biases:
        keep = None
        device = node.device
        q_pos, k_pos = torch.arange(L, device=device), torch.arange(S, device=device)
        for d in causal:
            seen = masks.visible_grid(q_pos, k_pos, d)
            keep = seen if keep is None else keep & seen
        for kind, m in keeps:
            m = _value(m, None, None)
            m = m if kind == "keep" else ~m
            keep = m if keep is None else keep & m
        bias = None
        for b in biases:
            bias = b if bias is None else bias + b
        if bias is not None and keep is not None:
            mask = bias.masked_fill(~keep, -torch.inf)
        else:
            mask = bias if bias is not None else keep
    if spec.tanh:
        if spec.post <= 0:
            return None
        mask = masks.softcap(spec.post, mask)
        scale = spec.pre * spec.post
    else:
        scale = spec.pre
    return Call(node.q, node.kt.mT, mask, scale)


def _matmul(p: Deferred, v: object) -> object:
    """pattern @ values: sdpa.attention, with the pattern's edits (the fused path)."""
    node: Node = p._node
    if (
        node.kind != "pattern" or not isinstance(v, torch.Tensor) or isinstance(v, Deferred)
        or p._lead is not None or p._to is not None or v.ndim not in (3, 4)
        or node.dead == "pending" or node.call is None or node.call.q is None
    ):  # fmt: skip
        return NotImplemented
    call = node.call
    if v.ndim != call.q.ndim or v.ndim != len(node.shape):
        return NotImplemented
    node.check_fresh()  # a mask changed since its use: eager's values are gone
    out_dtype = torch.promote_types(p.dtype, v.dtype)
    q, k = call.q, call.k
    if q.dtype != v.dtype:
        q, k = q.to(v.dtype), k.to(v.dtype)
    FUSED[0] += 1
    if node.edits:
        return node.edits[0].fused(q, k, v, call.mask, call.scale).to(out_dtype)
    out, w = attention(q, k, v, call.mask, scale=call.scale)
    if call.weights is None and q is call.q:
        call.weights = w
    return out.to(out_dtype)


def _sizes(args, kwargs) -> tuple[int, ...] | None:
    """The target sizes of a .view / .reshape call (ints, one may be -1)."""
    sizes = args[1:] if len(args) > 2 or not isinstance(args[1], tuple | list) else args[1]
    sizes = kwargs.get("shape", kwargs.get("size", sizes))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        return None
    return tuple(sizes)


def _unfold(x: Deferred, func, args, kwargs) -> object:
    """BLOOM's scores.view(B, H, L, -1) of a (1, B*H, L, S) product: the node in 4-D
    (q, k and the bias the product added, viewed alike); a pattern's reshape(B*H, L, -1)
    for its bmm: the same node, folded."""
    node: Node = x._node
    sizes = _sizes(args, kwargs)
    if sizes is None or x._lead is not None:
        return NotImplemented
    BH, L, S = node.shape[-3:]
    if (
        node.kind == "scores"
        and node.folded
        and len(sizes) == 4
        and sizes[2] == L
        and sizes[3] in (-1, S)
    ):
        B, H = sizes[0], sizes[1]
        if B * H != BH or len(node.ops) > 2 or node.spec.terms[1:]:
            return NotImplemented
        q = node.q.reshape(B, H, L, -1)  # (B, H, L, D)
        kt = node.kt.reshape(B, H, -1, S)  # (B, H, D, S)
        terms = tuple((k, t.reshape(B, H, *t.shape[-2:])) for k, t in node.spec.terms)
        ops = (
            Op(T.mul, (_SELF, node.spec.pre), {}),
            *(Op(T.add, (_SELF, t), {}) for _, t in terms),
        )
        spec = replace(node.spec, terms=terms)
        four = replace(node, shape=(B, H, L, S), q=q, kt=kt, ops=ops, spec=spec, folded=False,
                       versions=_versions(q, kt, ops))  # fmt: skip
        return _alias(x, _wrap(x, four), func, args, kwargs)
    if (
        node.kind == "pattern"
        and len(node.shape) == 4
        and len(sizes) == 3
        and sizes[1:] in ((L, -1), (L, S))
    ):
        B, H = node.shape[0], node.shape[1]
        if sizes[0] != B * H:
            return NotImplemented
        out = _record(x, func, args, kwargs)  # (B*H, L, S), replayed as eager's reshape
        folded = _wrap(x, replace(out._node, shape=(B * H, L, S), folded=True))
        return _alias(x, folded, func, args, kwargs)
    return NotImplemented


def _bmm(p: Deferred, v: object) -> object:
    """BLOOM's bmm(pattern (B*H, L, S), v (B*H, S, Dv)): the fused call in 4-D."""
    node: Node = p._node
    if node.kind != "pattern" or not isinstance(v, torch.Tensor):
        return NotImplemented
    if isinstance(v, Deferred) or v.ndim != 3 or node.call is None or node.call.q is None:
        return NotImplemented
    if node.call.q.ndim == 3:  # the scores were never viewed 4-D: a 3-D call
        return _matmul(p, v)
    B, H = node.call.q.shape[:2]
    four = _wrap(p, replace(node, shape=(B, H, *node.shape[-2:]), folded=False))
    out = _matmul(four, v.reshape(B, H, *v.shape[-2:]))  # (B, H, L, Dv)
    return out if out is NotImplemented else out.reshape(B * H, *out.shape[-2:])


def _marker_op(x: Deferred, m: Marker, func, args, kwargs) -> object:
    """tril of ones, its negation, .all(dim=-1) of the scores' isneginf, .to(device)."""
    if func in TRIL and m.kind == "ones" and len(m.shape) == 2:
        diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
        return make(replace(m, kind="tril", diagonal=int(diagonal)), x._budget)
    if func in INVERT and len(args) == 1 and m.kind in ("tril", "not_tril"):
        return make(replace(m, kind="not_tril" if m.kind == "tril" else "tril"), x._budget)
    if func in ALL and m.kind == "isneginf":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim in (-1, len(m.shape) - 1) and kwargs.get("keepdim", False):
            return make(replace(m, kind="dead", shape=(*m.shape[:-1], 1)), x._budget)
    if func is T.to or func is T.bool:
        device, dtype, rest = _to_args(func, args[1:], kwargs, x)
        if (
            rest is not None
            and (device is None or torch.device(device) == m.device)
            and (dtype is None or dtype == m.dtype)
        ):
            return x
    return NotImplemented


def _replays(x: Deferred) -> bool:
    """Whether x's values are eager's own, replayed (a pattern or scores that is not
    sdpa's weights outside a forward, a pattern inside one): its lead views share its
    values, as eager's views do (a write to x reaches them)."""
    if not isinstance(x._node, Node):
        return False
    if in_forward():  # (an index of the scores there is eager's, see _handle)
        return x._node.kind == "pattern"
    view = _lazy_view(x)
    return view is None or isinstance(view, LazyRows)


def _view(x: Deferred, index: object) -> object:
    """x[index] as a deferred tensor where it is one: the pattern over the keys of a
    pattern with a sink column (p[..., :-1]), a view of the lead dims (_lead_view)."""
    if _sink_column(x._node):
        got = _drop_sink(x, index)
        if got is not NotImplemented:
            return got
    return _lead_view(x, index)


def _lead_view(x: Deferred, index: object) -> object:
    """x[index] where every query and key stays: a lazy view of x that shares its values
    (a write through it reaches x, as on eager); NotImplemented for any other index (a
    read: sdpa.lazy's)."""
    node: Node = x._node
    if not node.shape or len(node.shape) != 4:
        return NotImplemented
    part = leads.lead_index(index, len(x.shape))  # (torch's indexing of the lead grid)
    if part is None:
        return NotImplemented
    B, H, L, S = node.shape
    now = x._lead or Grid((B, H), list(range(B * H)))
    grid = now.pick(*leads.lead_rows(now.lead, part))
    whole = grid.lead == (B, H) and grid.rows == list(range(B * H))
    view = x._derive(shape=(*grid.lead, L, S), lead=None if whole else grid)
    return _alias(x, view, T.__getitem__, (x, index), {})


def _read(x: Deferred, func, args, kwargs) -> object:
    """A read of x (an index of its rows or keys, a reduction, a diagonal) inside a
    forward: eager's exact values replayed, through sdpa.lazy's reads, with no budget (as
    eager's own tensors have none); NotImplemented where x has no rows to replay."""
    node = x._node
    if not isinstance(node, Node) or node.folded or len(node.shape) != 4:
        return NotImplemented
    view = _made_view(x, node)
    if view is None:
        return NotImplemented
    with dense_limited(None):
        args = tuple(view if a is x else a for a in args)
        return func(*args, **kwargs)


def _is_whole(index: object, shape: tuple[int, ...]) -> bool:
    """Whether index picks every entry of every dim (x[:, :], x[...])."""
    items = indexing.spread(index, len(shape))
    return len(items) == len(shape) and all(map(_covers, items, shape))


def _covers(item: object, n: int) -> bool:
    """Whether an index entry is a slice of every one of n entries."""
    return isinstance(item, slice) and range(*item.indices(n)) == range(n)


# ---- the reads a forward makes of a pattern, answered by sdpa.lazy ----

SUM, MEAN, AMAX, TOPK = _ops("sum"), _ops("mean"), _ops("amax"), _ops("topk")
REDUCTIONS = SUM | MEAN | AMAX | TOPK
READS = REDUCTIONS | _ops("amin", "max", "min", "argmax", "argmin", "diagonal")
"""The reads of a pattern inside a forward that sdpa.lazy answers (replayed rows)."""


# ---- the interception of eager attention inside a forward ----


FILLS = frozenset({torch.zeros, torch.full, torch.tensor})


class Intercept(TorchFunctionMode):
    """Active around an attention module's forward: the first product q @ k^T of 4-D
    tensors (the first only: a later p @ v has the same shapes) returns LazyScores; the
    bool masks and 0-d fill values eager code builds are kept symbolic (Marker).
    `bypass()` turns it off (sdpa's own calls run under it)."""

    def __init__(self, budget: int | None = DEFAULT_MAX_BYTES) -> None:
        super().__init__()
        self.budget = budget
        self.fills: dict[int, tuple[T, float]] = {}  # id -> (0-d tensor, its value)
        self.off = 0
        self.armed = True  # one q @ k^T per forward: later products (p @ v) are not scores
        # deferred tensors whose dense values a view eager code took shares:
        # id -> (tensor, values, values._version when lent)
        self.lent: dict[int, tuple[Deferred, T, int]] = {}

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1

    def __enter__(self):
        self._token = _forward_depth.set(_forward_depth.get() + 1)
        self._mode_token = _active.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _forward_depth.reset(self._token)
        _active.reset(self._mode_token)
        self.fills.clear()
        self.lent.clear()
        self.armed = True
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        if self.lent:
            _settle(self)  # a view written since: its tensor is those values now
        if func in MATMUL and len(args) == 2 and not kwargs and self.armed:
            got = self._scores(*args)
            if got is not None:
                self.armed = False
                return got
        elif (func in BMM or func in BADDBMM) and self.armed:
            got = self._folded_scores(func, args, kwargs)
            if got is not None:
                self.armed = False
                return got
        elif func is torch.ones:
            got = self._ones(args, kwargs)
            if got is not None:
                return got
        elif func is torch.zeros_like and args and isinstance(_node_of(args[0]), Node):
            node = args[0]._node
            if not kwargs:
                return make(Marker("zeros", node.shape, node.dtype, node.device), self.budget)
        elif func in ISNEGINF and args and isinstance(_node_of(args[0]), Node):
            node = args[0]._node
            if node.kind == "scores" and node.spec.terms:
                m = Marker("isneginf", node.shape, torch.bool, node.device,
                           prefix=len(node.ops), of=node)  # fmt: skip
                return make(m, self.budget)
        elif func in WHERE and len(args) == 3 and not kwargs:
            got = self._additive(*args)
            if got is not None:
                return got
        out = func(*args, **kwargs)
        made = func in FILLS and isinstance(out, torch.Tensor) and not isinstance(out, Deferred)
        if made and out.ndim == 0:
            value = self._fill_value(func, args, kwargs)
            if value is not None:
                self.fills[id(out)] = (out, value)
        return out

    @staticmethod
    def _fill_value(func, args, kwargs) -> float | None:
        """The value of a 0-d tensor made by torch.zeros / full / tensor from numbers."""
        if func is torch.zeros:
            return 0.0
        if func is torch.full:
            return _number(args[1] if len(args) > 1 else kwargs.get("fill_value"))
        return _number(args[0] if args else kwargs.get("data"))

    def _scores(self, a: object, b: object) -> Deferred | None:
        if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (a, b)):
            return None
        if a.ndim != 4 or b.ndim != 4 or a.shape[-1] != b.shape[-2] or not a.is_floating_point():
            return None
        if a.shape[:2] != b.shape[:2] or a.dtype != b.dtype or a.shape[-2] == 0 or b.shape[-1] == 0:
            return None
        shape = (a.shape[0], a.shape[1], a.shape[2], b.shape[3])
        node = Node("scores", shape, a.dtype, a.device, q=a, kt=b, versions=_versions(a, b, ()))
        return make(node, self.budget)

    def _folded_scores(self, func, args, kwargs) -> Deferred | None:
        """bmm(q, k^T) or bias.baddbmm(q, k^T, beta=1, alpha=a) of 3-D (B*H, ., .) tensors
        (BLOOM's ALiBi scores): a (B*H, L, S) node until its .view(B, H, L, S)."""
        if func in BMM:
            if len(args) != 2 or kwargs:
                return None
            bias, a, b, beta, alpha = None, args[0], args[1], 1.0, 1.0
        else:
            names = ("input", "batch1", "batch2")
            got = dict(zip(names, args, strict=False)) | kwargs
            if set(got) - {*names, "beta", "alpha"} or len(args) > 3:
                return None
            bias, a, b = got.get("input"), got.get("batch1"), got.get("batch2")
            beta, alpha = _number(got.get("beta", 1.0)), _number(got.get("alpha", 1.0))
        if (
            beta != 1.0
            or alpha is None
            or not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (a, b))
        ):
            return None
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[-1] != b.shape[-2]:
            return None
        if a.dtype != b.dtype or not a.is_floating_point():
            return None
        BH, L, S = a.shape[0], a.shape[1], b.shape[2]
        if bias is not None and (
            not isinstance(bias, torch.Tensor) or isinstance(bias, Deferred) or bias.ndim != 3
            or not bias.is_floating_point()
        ):  # fmt: skip
            return None
        terms = () if bias is None else (("bias", bias),)  # (B*H|1, 1|L, S)
        ops = (Op(T.mul, (_SELF, alpha), {}), *(Op(T.add, (_SELF, t), {}) for _, t in terms))
        node = Node("scores", (BH, L, S), a.dtype, a.device, q=a, kt=b, ops=ops,
                    spec=Spec(pre=alpha, terms=terms), folded=True,
                    versions=_versions(a, b, ops))  # fmt: skip
        return make(node, self.budget)

    def _ones(self, args, kwargs) -> Deferred | None:
        size = (
            args[0] if len(args) == 1 and isinstance(args[0], tuple | list | torch.Size) else args
        )
        if kwargs.get("dtype") is not torch.bool or len(size) != 2:
            return None
        if not all(isinstance(n, int) for n in size) or set(kwargs) - {"dtype", "device"}:
            return None
        device = torch.device(kwargs.get("device") or "cpu")
        return make(Marker("ones", tuple(size), torch.bool, device), self.budget)

    def _additive(self, cond, a, b) -> Deferred | None:
        """torch.where(keep, 0, fill): an additive mask of a bool keep tensor."""
        zero, fill = self.fills.get(id(a)), self.fills.get(id(b))
        if zero is None or fill is None or zero[0] is not a or fill[0] is not b or zero[1] != 0.0:
            return None
        keep = cond
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            return None
        if isinstance(keep, Deferred) and not isinstance(keep._node, Marker):
            return None
        shape = torch.broadcast_shapes(keep.shape, a.shape, b.shape)
        m = Marker("additive", tuple(shape), a.dtype, a.device, keep=_frozen(keep), fill=fill[1])
        return make(m, self.budget)


def with_edit(x: Deferred, edit) -> Deferred | None:
    """x with an sdpa edit applied lazily (the edit's own fused form then runs at the
    product with the values), or None where x cannot keep it lazily: a pattern edit on a
    LazyPattern of a recorded call, a KnockOut (point "hook_attn_scores") on the scores
    as one more mask term."""
    node = x._node
    if not isinstance(node, Node) or x._lead is not None or x._to is not None:
        return None
    if edit.point == "hook_attn_scores" and node.kind == "scores" and node.replayable:
        H, L, S = node.shape[1:]
        marker = Marker("knock", (H, L, S), torch.bool, node.device, edit=edit)
        knocked = _wrap(x, marker)
        got = _score_op(x, T.masked_fill, (x, knocked, -torch.inf), {})
        return None if got is NotImplemented else got
    if edit.point == "hook_pattern" and node.kind == "pattern" and node.replayable:
        if node.edits:
            raise NotSupportedError(
                f"two sdpa edits on one attention call ({node.edits[0]!r} then {edit!r}); "
                f"compose them into one edit, sdpa.integrations.edits.Compose(first, second), "
                f"which runs the chain as one fused call"
            )
        return _wrap(x, replace(node, edits=(*node.edits, edit)))
    return None


HANDLE_ONLY = frozenset(
    n for n in dir(AttentionWeights) if not n.startswith("_") and not hasattr(torch.Tensor, n)
)
"""AttentionWeights' own reads torch.Tensor has no name for: a fused pattern answers them."""


def weights_of(p: object) -> AttentionWeights:
    """The AttentionWeights handle (B, H, L, S) of the whole call of a pattern sdpa's
    weights equal (no edit applied, no eager-only rows); refused with the reason for any
    other deferred tensor."""
    node = p._node if isinstance(p, Deferred) else None
    if not isinstance(node, Node) or not node.fused:
        kind = getattr(node, "kind", type(p).__name__)
        raise SdpaValueError(
            f"this {type(p).__name__} has no sdpa weights handle: only an unedited "
            f"attention pattern has one (this one is {kind}"
            f"{' with edits' if isinstance(node, Node) and node.edits else ''}"
            f"{' with a sink column: p[..., :-1] has one' if _sink_column(node) else ''})"
        )
    return node.call.get_weights()


def weights_pattern(w: AttentionWeights, budget: int | None = DEFAULT_MAX_BYTES) -> LazyPattern:
    """A LazyPattern (B, H, L, S) for weights sdpa already computed (an attention call
    through transformers' attention interface)."""
    B, H, L, S = w.shape
    call = Call(None, None, None, None, w)
    node = Node("pattern", (B, H, L, S), w.dtype, w.device, call=call)
    return LazyPattern(node, budget=budget)


def dense_of(x: object, max_bytes: int | None = DEFAULT_MAX_BYTES) -> object:
    """x as a plain tensor if deferred or lazy (within max_bytes), else x."""
    return x.full(max_bytes) if isinstance(x, Deferred | LazyTensor) else x
