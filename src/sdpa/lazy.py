"""Lazy expressions of the weights: elementwise ops and transposes of AttentionWeights,
kept as a recipe and evaluated by the read that ends them, on what it reads.

    (w * keep).sum(-1)   (w > 0.1).sum(-1)   -(w * w.log()).sum(-1)   w.log().mean(1)[0, 5]
    w.to(torch.bfloat16).float()[0, 1]      w.mT[..., j, :]      w.mT @ x      u @ w.mT

`LazyExpr` is a torch.Tensor (a wrapper with no storage, as AttentionWeights is) of the
dense value's shape and dtype. Its lazy operands (AttentionWeights and other
expressions) all have its shape; plain tensors and numbers broadcast to it. It answers:

- an index: the op on each operand's indexed entries (a row of the expression reads rows
  of the weights, O(rows x S); a lead index is a lazy view);
- a reduction (sum, mean, amax, amin, any, all; max, min, argmax, argmin, topk over a
  dim other than the queries): over chunks of query rows (tile.chunk_rows), each chunk
  recomputed in the backward (checkpointed), so nothing L x S is held;
- a product with a plain tensor (expr @ x, u @ expr): chunk of query rows by chunk,
  each chunk once (checkpointed as a reduction's); a head sum or mean times a few rows
  or columns is the weights' own product per head, reduced after;
- torch.diagonal over the query and key dims: the op on the operands' diagonals;
- a transpose of the last two dims: rows become key columns (`w.mT[..., j, :]` is the
  column w[..., j]); products with a transpose of the weights are the weights' products;
- anything else: the op on the dense value within the default max_bytes.

Gradients flow through the operands' reads to q, k, the mask and the sinks, and into
plain tensors that require grad. A plain tensor operand changed in place after the op
makes every read refuse (StaleWeightsError), as the weights do for q and k.

This module also holds what every lazy tensor shares: the metadata the wrapper answers,
the dims of a reduction, the refusals (writes, storage, gradients of the lazy tensor
itself) and the dense fallback.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from sdpa import indexing, settings, tile
from sdpa.budget import DEFAULT_MAX_BYTES, check_fits, dense_limit, release_freed
from sdpa.errors import NotSupportedError, StaleWeightsError

T = torch.Tensor
_make_wrapper = torch.Tensor._make_wrapper_subclass

LAZY_READS = (
    "Lazy reads work in O(chunk x S) memory: rows and key columns (w[b, h, i], "
    "w[b, :, i:j], w[..., j]), w.sum(dim=-2), w.mean(dim=-2), w.amax(-1), w.max(-1), "
    "w.topk(k), w.entropy(), torch.diagonal(w, offset, -2, -1), w.pairs(i, j), w @ x "
    "and u @ w; elementwise ops (w * keep, w > 0.1, w.log(), casts) and w.mT stay lazy "
    "until such a read"
)


class Lazy:
    """Values computed as they are read: `_dense(op)` gives the dense value for an op
    nothing lazy answers, within the default budget (AttentionWeights, LazyExpr, and the
    weights inside a torch.compile region)."""

    __slots__ = ()

    def _dense(self, op: str) -> torch.Tensor:
        raise NotImplementedError  # (each class its own)


class LazyTensor(Lazy, torch.Tensor):
    """A lazy torch.Tensor: a wrapper with the dense value's shape, dtype and device and
    no storage (AttentionWeights, LazyExpr)."""

    __slots__ = ()

    def _lead_moved(self, new: tuple[int, ...], grow: bool) -> LazyTensor | None:
        """This lazy tensor reshaped (grow: expanded) to `new`, which keeps the last two
        dims, as a lazy tensor; None where it has no such form (the caller takes the
        dense value)."""
        return None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """A safety net: every op is answered above autograd (__torch_function__), so one
        that reaches the (absent) storage refuses by name: torch.func's transforms (vmap,
        grad, jacrev), ops torch sends straight to its kernels (set_), code with torch
        functions disabled."""
        raise NotSupportedError(
            f"{func} reached {cls.__name__} below torch's function layer, where the lazy "
            f"tensor has no storage to compute on (torch.func transforms such as vmap and "
            f"grad, set_, and code with torch functions disabled get there); take "
            f"p = w.full(), a dense tensor of your own, and apply it to p"
        )


# -- what every lazy tensor shares ---------------------------------------------------

METADATA = frozenset(
    {
        T.size, T.dim, T.ndimension, T.numel, T.nelement, T.__len__, T.__hash__,
        T.is_floating_point, T.is_complex, T.element_size, T.get_device, T.stride,
        T.is_contiguous,
    }
    | {
        getattr(T, name).__get__
        for name in ("shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_cpu",
                     "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn",
                     "itemsize", "nbytes", "grad", "grad_fn", "is_leaf")
    }
)  # fmt: skip
"""What the wrapper answers from its own metadata (the dense tensor's shape, strides,
dtype and device): never a value."""


def metadata(func: Callable, args: tuple, kwargs: dict) -> object:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def dim_of(dim: object, nd: int) -> int | None:
    """dim (an int, or a sequence of one int) as a dim of an nd-dim tensor, else None."""
    if isinstance(dim, list | tuple) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, bool) or not isinstance(dim, int) or not -nd <= dim < nd:
        return None
    return dim % nd


def reduction_of(
    args: tuple, kwargs: dict, nd: int, name: str = "dim", default: object = None, dtype=False
) -> tuple[frozenset[int] | None, bool]:
    """(dims, keepdim) of a reduction called as (dim[, keepdim]) with at most those
    keywords (and dtype=None, or any dtype where `dtype`): dims normalised (every dim for
    None or ()); dims None for any other call (a dim out of range, another tensor)."""
    if len(args) > 2 or not set(kwargs) <= {name, "keepdim", "dtype"}:
        return None, False
    if (kwargs.get("dtype") is not None and not dtype) or (len(args) == 2 and "keepdim" in kwargs):
        return None, False
    dim = args[0] if args else kwargs.get(name, default)
    keepdim = args[1] if len(args) == 2 else kwargs.get("keepdim", False)
    if not isinstance(keepdim, bool) or (args and name in kwargs):
        return None, False
    if dim is None or (isinstance(dim, list | tuple) and not dim):
        return frozenset(range(nd)), keepdim
    dims = [dim_of(d, nd) for d in (dim if isinstance(dim, list | tuple) else [dim])]
    if None in dims or len(set(dims)) != len(dims):
        return None, False
    return frozenset(dims), keepdim


def name_of(func: object) -> str:
    """A torch function's name as a user wrote it: `Tensor.mul_`, `torch.stack`, `data`
    for an attribute."""
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__", "__delete__"):  # an attribute of the tensor
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def holds_lazy(x: object) -> bool:
    return isinstance(x, Lazy) or (
        isinstance(x, list | tuple) and any(isinstance(y, Lazy) for y in x)
    )


_STORAGE = frozenset({"data_ptr", "untyped_storage", "storage", "_typed_storage", "is_shared"})
_IN_PLACE_OPERATORS = "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift"
_WRITES = frozenset({"__setitem__", "__set__", "__delete__"}) | {
    f"__i{op}__" for op in _IN_PLACE_OPERATORS.split(" ")
}


def on_dense(func: Callable, args: tuple, kwargs: dict) -> object:
    """func on the dense value of every lazy tensor among its arguments (each within the
    default budget), as the listing's tensor would answer; refused by name where it
    would write into a lazy tensor or read its storage."""
    name = name_of(func)
    raw = getattr(func, "__name__", "")
    target = args[0] if args else None
    writes = raw in _WRITES or (raw.endswith("_") and not raw.startswith("__"))
    if isinstance(target, Lazy) and (writes or raw in _STORAGE):
        what = "writes into" if writes else "reads the storage of"
        kind = type(target).__name__
        raise NotSupportedError(
            f"`{name}` {what} {kind}, a lazy tensor with no storage of its own (its values "
            f"are computed from q, k and the LSE as they are read); take a dense copy of "
            f"your own first: p = w.full() (or w.clone()), then p.{name}"
        )
    if holds_lazy(kwargs.get("out")):
        kind = type(kwargs["out"]).__name__
        raise NotSupportedError(
            f"`{name}` with out= {'an' if kind[0] in 'AEIOU' else 'a'} {kind}: a lazy tensor "
            f"has no storage to write into; pass out= a tensor of your own (e.g. w.full())"
        )

    def dense(x: object) -> object:
        if isinstance(x, Lazy):
            return x._dense(f"`{name}`")
        if isinstance(x, list | tuple) and holds_lazy(x):
            return type(x)(dense(y) for y in x)
        return x

    return func(*(dense(a) for a in args), **{k: dense(v) for k, v in kwargs.items()})


def refuses_grad(name: str) -> Callable:
    def refuse(*args: object, **kwargs: object):
        raise NotSupportedError(
            f"w.{name}: gradients with respect to the weights themselves are L x S by "
            f"nature, and a lazy tensor is not an autograd node (its reads carry "
            f"gradients to q, k, the mask and the sinks); take p = w.full(), a dense "
            f"tensor in the graph, and call p.{name}"
        )

    return refuse


GRAD_OF_LAZY = ("retain_grad", "register_hook", "register_post_accumulate_grad_hook", "backward")


def printed(x: LazyTensor, shape: tuple[int, ...], full: Callable[[], torch.Tensor]) -> str:
    """What torch prints for x's dense value, summarised past torch's print threshold as
    torch summarises it, computed from the entries shown only (at most 2 x edgeitems per
    dim, read through x's own indexing): a debugger's view never computes L x S."""
    opts = torch._tensor_str.PRINT_OPTS
    summarise = math.prod(shape) > opts.threshold
    shown = _printed_entries(x, shape, opts.edgeitems) if summarise else full()
    shown = shown.detach().requires_grad_(x.requires_grad and shown.dtype.is_floating_point)
    if not summarise:  # torch prints every value: few of them
        return repr(shown)
    # shown's dims past 2 x edgeitems hold one unprinted entry between the edges, so
    # torch summarises them as it would the whole tensor's
    # (sci_mode passed on: set_printoptions resets what it is not given)
    with torch._tensor_str.printoptions(threshold=0, sci_mode=opts.sci_mode):
        return repr(shown)


def _printed_entries(x: LazyTensor, shape: tuple[int, ...], edge: int) -> torch.Tensor:
    """x at the entries torch prints of a summarised tensor: along each dim of more than
    2 x edge entries, the first and last `edge` and one entry between them that no print
    shows; (*picked sizes), read in O(picked rows x S)."""
    picks = [
        list(range(n)) if n <= 2 * edge else [*range(edge), 0, *range(n - edge, n)] for n in shape
    ]
    *lead, q_picks, k_picks = picks
    keys = torch.tensor(k_picks, device=x.device)
    with torch.no_grad():
        parts = [x[(*at, q_picks)][..., keys] for at in itertools.product(*lead)]
    return torch.stack(parts).reshape([len(p) for p in picks])  # (*picked)


# -- expressions ---------------------------------------------------------------------


def _ops(*names: str, methods: bool = True, functions: bool = True) -> set[Callable]:
    out = set()
    for n in names:
        for owner, on in ((torch, functions), (T, methods)):
            f = getattr(owner, n, None) if on else None
            if f is not None:
                out.add(f)
    return out


ELEMENTWISE = frozenset(
    _ops(
        "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide",
        "pow", "neg", "negative", "abs", "exp", "exp2", "expm1", "log", "log2", "log10",
        "log1p", "sqrt", "rsqrt", "square", "reciprocal", "sigmoid", "tanh", "clamp", "clip",
        "clamp_min", "clamp_max", "minimum", "maximum", "fmin", "fmax", "where",
        "masked_fill", "gt", "ge", "lt", "le", "eq", "ne", "greater", "greater_equal",
        "less", "less_equal", "not_equal", "logical_and", "logical_or", "logical_not",
        "logical_xor", "isnan", "isinf", "isfinite", "nan_to_num", "xlogy", "sign", "floor",
        "ceil", "round", "trunc", "frac",
    )
    | _ops("float", "double", "half", "bfloat16", "bool", "int", "long", functions=False)
    | _ops(
        "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
        "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__", "__gt__", "__ge__",
        "__lt__", "__le__", "__eq__", "__ne__", "__and__", "__rand__", "__or__", "__ror__",
        "__xor__", "__rxor__", "__invert__", functions=False,
    )
    | {torch.special.entr, torch.special.xlogy}
)  # fmt: skip
"""The elementwise torch functions an expression records (their out-of-place forms)."""

_TO = T.to
RESHAPES = (
    T.view, T.reshape, torch.reshape, T.flatten, torch.flatten, T.unflatten, torch.unflatten,
    T.squeeze, torch.squeeze, T.unsqueeze, torch.unsqueeze, T.expand,
)  # fmt: skip
"""The ops that change a lazy tensor's leading dims alone (where their result keeps the
query and key dims last and whole): lazy there, the dense value's op elsewhere."""
EXPANDS = frozenset({T.expand})  # (of RESHAPES: rows repeat along the new dims)


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """The dense twin of a transpose node: x with its last two dims swapped."""
    return x.transpose(-2, -1)


class LeadReduction(NamedTuple):
    """The dense twin of a reduction over leading dims alone (the head mean w.mean(1)):
    `name` (sum, mean, amax, amin) over `dims` of its operand."""

    name: str
    dims: tuple[int, ...]
    keepdim: bool
    dtype: torch.dtype | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        extra = {} if self.name in ("amax", "amin") else {"dtype": self.dtype}
        return getattr(T, self.name)(x, self.dims, keepdim=self.keepdim, **extra)


class LazyExpr(LazyTensor):
    """func(*args, **kwargs), kept as a recipe (see the module's docstring): a
    torch.Tensor of the dense value's shape and dtype that computes only what is read.

    Shapes: (*lead, L, S) as the weights it is made of ((*lead, S, L) for a transpose)."""

    __slots__ = ("_args", "_func", "_grad", "_kwargs", "_versions")
    _memo_reads = False  # (an expression is evaluated per read; a row source's reads kept)

    @staticmethod
    def __new__(cls, func, args, kwargs, shape, dtype, device, versions, grad):
        x = _make_wrapper(cls, shape, None, None, None, dtype, torch.strided, device)
        x._func, x._args, x._kwargs = func, args, kwargs
        x._versions, x._grad = versions, grad
        return x

    def __init__(self, *args: object, **kwargs: object):
        pass  # (set in __new__)

    # -- the recipe ----------------------------------------------------------------

    def _operands(self) -> list[object]:
        return [*self._args, *self._kwargs.values()]

    def _check_fresh(self) -> None:
        for t, version in self._versions:
            if t._version != version:
                raise StaleWeightsError(
                    f"a tensor of shape {tuple(t.shape)} used in `{name_of(self._func)}` on "
                    f"the weights changed in place after that op, so this lazy value would "
                    f"describe other inputs; read it before the update, or pass a clone"
                )

    def _autograd(self) -> contextlib.AbstractContextManager:
        """Autograd as it was when the op was made (an op made under no_grad, and the
        reads it makes, carry no gradient)."""
        return torch.set_grad_enabled(self._grad and torch.is_grad_enabled())

    def _apply(self, pick: Callable[[object], object]) -> torch.Tensor:
        """func on every operand as `pick` gives it."""
        self._check_fresh()
        with self._autograd():
            args = [pick(a) for a in self._args]
            kwargs = {k: pick(v) for k, v in self._kwargs.items()}
            return self._func(*args, **kwargs)

    def _at(self, index: object, memo: dict | None = None) -> torch.Tensor:
        """self[index]: the op on each operand's entries at index. memo: the reads made
        for this index so far (an operand met twice, as w in w * w.log(), is read once)."""
        memo = {} if memo is None else memo
        if self._func is _transposed:
            with self._autograd():
                return _transposed_at(self, self._args[0], index, memo)
        if isinstance(self._func, LeadReduction):
            with self._autograd():
                return _reduced_at(self, self._func, self._args[0], index, memo)
        shape = self._shape()
        return self._apply(lambda a: _take(a, index, shape, memo))

    def _shape(self) -> tuple[int, ...]:
        return tuple(metadata(T.size, (self,), {}))

    def _diagonal_read(self, offset: int) -> torch.Tensor:
        """torch.diagonal(self, offset, -2, -1): the op on each operand's diagonal."""
        if self._func is _transposed:
            return torch.diagonal(self._args[0], -offset, -2, -1)
        shape = self._shape()
        return self._apply(lambda a: _diagonal_of(a, offset, shape))

    def _value(self) -> torch.Tensor:
        """The dense value (no budget check: _dense checks it first)."""
        return self._apply(lambda a: a._dense("an op") if isinstance(a, LazyTensor) else a)

    def _dense(self, op: str) -> torch.Tensor:
        """The dense value for an op nothing lazy answers, within budget.dense_limit();
        past it WeightsTooLargeError naming the op and the lazy reads."""
        dtype = metadata(T.dtype.__get__, (self,), {})
        check_fits(
            f"{op} on a lazy expression of the weights takes its dense value in {dtype}: it",
            self._shape(),
            max(4, dtype.itemsize),
            dense_limit(),
            LAZY_READS + "; or w.full(max_bytes=None) and the op on it",
        )
        return self._value()

    def full(self, max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
        """The dense value, a tensor of your own; refuses past max_bytes (None: no limit)."""
        dtype = metadata(T.dtype.__get__, (self,), {})
        check_fits(
            f"the dense value in {dtype}", self._shape(), max(4, dtype.itemsize), max_bytes,
            LAZY_READS + "; or pass max_bytes=None",
        )  # fmt: skip
        return self._value()

    # -- the tensor protocol -------------------------------------------------------

    @property
    def requires_grad(self) -> bool:
        """As the dense value's: a floating value made with autograd on from operands
        that require grad."""
        floating = metadata(T.is_floating_point, (self,), {})
        return (
            self._grad
            and floating
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in self._operands())
        )

    def detach(self) -> LazyExpr:
        """The same expression of detached operands: its reads carry no gradient."""

        def off(a: object) -> object:
            return a.detach() if isinstance(a, torch.Tensor) else a

        shape, dtype = self._shape(), metadata(T.dtype.__get__, (self,), {})
        args = tuple(off(a) for a in self._args)
        kwargs = {k: off(v) for k, v in self._kwargs.items()}
        return LazyExpr(self._func, args, kwargs, shape, dtype, self.device, self._versions, False)

    def _lead_moved(self, new: tuple[int, ...], grow: bool) -> LazyTensor | None:
        """The reshape (expand) to `new`, where it keeps the last two dims, pushed into
        the operands (else None): each lazy
        one moved alike, each plain tensor's broadcast view moved (a copy only where its
        query and key dims are not both whole: O(lead x (L + S))); a transpose moves its
        weights with the last two dims swapped; a reduction over leading dims (the head
        mean), whose operand cannot move alike, moves as a view of its rows (ROWS_VIEW).
        None where an operand has no lazy form."""
        self._check_fresh()
        shape = self._shape()
        if len(new) < 2 or new[-2:] != shape[-2:]:
            return None
        if self._func is _transposed:
            turned = self._args[0]._lead_moved((*new[:-2], new[-1], new[-2]), grow)
            return None if turned is None else transpose(turned)
        if isinstance(self._func, LeadReduction):  # (its rows, read where they are)
            return ROWS_VIEW[0](self)._lead_moved(new, grow) if ROWS_VIEW else None

        def move(a: object) -> object:
            if isinstance(a, LazyTensor):
                return a._lead_moved(new, grow)
            if not isinstance(a, torch.Tensor) or a.ndim == 0:
                return a
            return _plain_moved(a, shape, new, grow)

        moved = [move(a) for a in (*self._args, *self._kwargs.values())]
        if any(m is None for m in moved):
            return None
        n = len(self._args)
        kwargs = dict(zip(self._kwargs, moved[n:], strict=True))
        with self._autograd():
            return expr(self._func, tuple(moved[:n]), kwargs)

    def __repr__(self, *, tensor_contents: object = None) -> str:
        try:
            return printed(self, self._shape(), self.full)
        except StaleWeightsError as e:
            return f"LazyExpr(shape={self._shape()}, stale: {e})"

    def __reduce_ex__(self, protocol: int):
        """pickle and torch.save keep the dense value (within the default budget): a
        tensor of your own, never stale."""
        with torch.no_grad():
            return self._dense("saving").__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> LazyExpr:
        """The same expression of deep copies of its operands (the weights' recipe, plain
        tensors cloned): never stale through the originals; carries no gradient."""
        import copy

        args = copy.deepcopy(self._args, memo)
        kwargs = copy.deepcopy(self._kwargs, memo)
        if self._func is _transposed:
            twin = transpose(args[0])
        elif isinstance(self._func, LeadReduction):
            twin = reduce_lead(args[0], self._func)
        else:
            twin = expr(self._func, args, kwargs)
        twin = twin.detach()
        memo[id(self)] = twin
        return twin

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in METADATA:
            return metadata(func, args, kwargs)
        read = EXPR_READS.get(func)
        if read is not None:
            return read(*args, **kwargs)
        made = expr(func, args, kwargs)
        return made if made is not None else on_dense(func, args, kwargs)


# -- making expressions --------------------------------------------------------------


def _meta(a: object) -> object:
    if isinstance(a, torch.Tensor):
        shape = a.shape if not isinstance(a, LazyTensor) else metadata(T.size, (a,), {})
        dtype = metadata(T.dtype.__get__, (a,), {}) if isinstance(a, LazyTensor) else a.dtype
        return torch.empty(shape, dtype=dtype, device="meta")
    return a


def _cast_only(args: tuple, kwargs: dict) -> bool:
    """Tensor.to called with a dtype alone (no device, copy or memory format)."""
    rest = (*args[1:], *kwargs.values())
    return len(rest) == 1 and isinstance(rest[0], torch.dtype) and set(kwargs) <= {"dtype"}


def expr(func: Callable, args: tuple, kwargs: dict) -> LazyExpr | None:
    """func(*args, **kwargs) with lazy operands as a LazyExpr, or None where it is not
    one (func not elementwise; out=; lazy operands of different shapes or devices; a
    result of another shape than theirs; arguments torch refuses: the dense path then
    raises torch's own error)."""
    if func not in ELEMENTWISE and not (func is _TO and _cast_only(args, kwargs)):
        return None
    if "out" in kwargs:
        return None
    operands = [*args, *kwargs.values()]
    lazies = [a for a in operands if isinstance(a, LazyTensor)]
    if not lazies:
        return None
    shape = tuple(metadata(T.size, (lazies[0],), {}))
    device = metadata(T.device.__get__, (lazies[0],), {})
    for a in operands:
        if isinstance(a, LazyTensor):
            if tuple(metadata(T.size, (a,), {})) != shape:
                return None
            if metadata(T.device.__get__, (a,), {}) != device:
                return None
        elif isinstance(a, torch.Tensor):
            if a.ndim and a.device != device:
                return None
            if a.layout != torch.strided or a.is_nested:
                return None
        elif isinstance(a, list | tuple) and any(isinstance(y, torch.Tensor) for y in a):
            return None
    try:
        out = func(*(_meta(a) for a in args), **{k: _meta(v) for k, v in kwargs.items()})
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        return None
    for a in lazies:
        a._check_fresh()
    versions = tuple(
        (a, a._version)
        for a in operands
        if isinstance(a, torch.Tensor) and not isinstance(a, LazyTensor) and not a.is_inference()
    )
    return LazyExpr(
        func, tuple(args), dict(kwargs), shape, out.dtype, device, versions, torch.is_grad_enabled()
    )


def transpose(x: LazyTensor) -> torch.Tensor:
    """x with its last two dims swapped, lazily: rows become key columns. A transpose of
    a transpose is x itself."""
    if isinstance(x, LazyExpr) and x._func is _transposed:
        return x._args[0]
    shape = tuple(metadata(T.size, (x,), {}))
    if len(shape) < 2:
        return on_dense(T.transpose, (x, -2, -1), {})
    dtype = metadata(T.dtype.__get__, (x,), {})
    device = metadata(T.device.__get__, (x,), {})
    new = (*shape[:-2], shape[-1], shape[-2])
    return LazyExpr(_transposed, (x,), {}, new, dtype, device, (), torch.is_grad_enabled())


def _plain_moved(
    a: torch.Tensor, shape: tuple[int, ...], new: tuple[int, ...], grow: bool
) -> torch.Tensor | None:
    """A plain operand a (broadcasting to `shape`) as an operand of the same op moved to
    `new` (its leading dims reshaped or expanded, the last two kept): its broadcast view,
    moved as a view, or copied where its last two dims are not both whole (O(lead x
    (L + S))); None where that copy would be as large as the dense value."""
    a = a.reshape((1,) * (len(shape) - a.ndim) + tuple(a.shape))  # aligned: a view
    last = tuple(a.shape[-2:])  # (1 or L, 1 or S)
    full = a.expand(*shape[:-2], *last)
    target = (*new[:-2], *last)
    if grow:
        return full.expand(target)
    try:
        return full.view(target)
    except RuntimeError:  # (dims of stride 0 and others merged)
        if last == tuple(shape[-2:]) and math.prod(last) > 1:
            return None
        return full.reshape(target)


def reduce_lead(x: LazyTensor, how: LeadReduction) -> LazyExpr:
    """A reduction of x over leading dims alone (not the query or key dims), lazily: an
    index of it reads x's entries there over the reduced dims (w.mean(1)[0, 5] reads
    row 5 of every head of batch 0)."""
    meta = how(_meta(x))
    device = metadata(T.device.__get__, (x,), {})
    grad = torch.is_grad_enabled()
    return LazyExpr(how, (x,), {}, tuple(meta.shape), meta.dtype, device, (), grad)


def _reduced_at(
    x_r: LazyExpr, how: LeadReduction, x: LazyTensor, index: object, memo: dict
) -> torch.Tensor:
    """x_r[index] for x_r = how(x): x indexed with the reduced dims whole, reduced there
    (keeping them), then the index's own entries for those dims applied; an index with
    lists in the leading dims, None or a boolean mask takes the dense value."""
    nd = len(metadata(T.size, (x_r,), {}))
    full = _full_index(index, nd)
    if full is None or None in full or any(_advanced(i) for i in full[:-2]):
        return x_r._dense("this index")[index]
    entries, at, later = [], 0, []
    for d in range(nd + (0 if how.keepdim else len(how.dims))):  # x's index; where dims land
        if d in how.dims:
            later.append(
                (
                    len([e for e in entries if not isinstance(e, int)]),
                    full[at] if how.keepdim else None,
                )
            )
            entries.append(slice(None))
            at += how.keepdim
        else:
            entries.append(full[at])
            at += 1
    picked = _read(x, tuple(entries), memo)
    dims = tuple(p for p, _ in later)
    if not how.keepdim:
        return how._replace(dims=dims)(picked)  # (of a view of x's rows: lazy again)
    # the index's own entries of the kept size-1 dims: an int drops the dim (reduced
    # without keepdim), a slice keeps it (an empty one reads nothing)
    kept = tuple(p for p, e in later if not isinstance(e, int))
    dropped = tuple(p for p, e in later if isinstance(e, int))
    out = how._replace(dims=kept)(picked) if kept else picked
    out = how._replace(dims=dropped, keepdim=False)(out) if dropped else out
    if any(_span(e, 1) != (0, 1) for _, e in later if not isinstance(e, int)):
        shape = list(out.shape)
        for p, e in later:
            if not isinstance(e, int) and _span(e, 1) != (0, 1):
                shape[p - sum(d < p for d in dropped)] = 0
        return torch.zeros(shape, dtype=out.dtype, device=out.device)
    return out


def _span(s: slice, n: int) -> tuple[int, int]:
    """(start, length) of slice s over n entries."""
    start, stop, step = s.indices(n)
    return start, len(range(start, stop, step))


TRANSPOSES = frozenset(
    _ops("transpose", "swapaxes", "swapdims", "permute", "t")
    | {T.mT.__get__, T.mH.__get__, T.T.__get__, T.H.__get__, T.adjoint, torch.adjoint}
)
"""The torch functions that may swap the last two dims (transposes lazily when they do)."""


def permutation(func: Callable, x: LazyTensor, args: tuple, kwargs: dict) -> list[int] | None:
    """The permutation of x's dims that func(x, *args, **kwargs) makes (one of
    TRANSPOSES: result dim j is x's dim perm[j]), or None where func does something else
    or its arguments are not ones torch takes (the dense path then raises torch's
    error)."""
    nd = len(metadata(T.size, (x,), {}))
    if nd < 2:
        return None
    last_two = [*range(nd - 2), nd - 1, nd - 2]
    if func in (T.mT.__get__, T.mH.__get__, T.adjoint, torch.adjoint):
        return last_two if not args and not kwargs else None
    if func in (T.T.__get__, T.H.__get__, T.t, torch.t):
        return last_two if nd == 2 and not args and not kwargs else None
    if func in (T.permute, torch.permute):
        perm = args[0] if len(args) == 1 and isinstance(args[0], list | tuple) else args
        perm = kwargs.get("dims", perm)
        try:
            perm = [operator.index(d) % nd for d in perm]
        except (TypeError, ZeroDivisionError):
            return None
        return perm if sorted(perm) == list(range(nd)) else None
    dims = [*args, *(kwargs[k] for k in ("dim0", "dim1", "axis0", "axis1") if k in kwargs)]
    if len(dims) != 2:
        return None
    a, b = (dim_of(d, nd) for d in dims)
    if a is None or b is None:
        return None
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def transposes(func: Callable, x: LazyTensor, args: tuple, kwargs: dict) -> bool | None:
    """True where func(x, *args, **kwargs) swaps x's last two dims and nothing else,
    False where it changes nothing (a transpose of one dim with itself), None otherwise."""
    perm = permutation(func, x, args, kwargs)
    if perm is None:
        return None
    nd = len(perm)
    if perm == [*range(nd - 2), nd - 1, nd - 2]:
        return True
    return False if perm == list(range(nd)) else None


# -- reading expressions -------------------------------------------------------------


def _read(x: LazyTensor, index: tuple, memo: dict) -> torch.Tensor:
    """x[index], read once per evaluation: an expression evaluated within `memo`, the
    weights' read kept there by (x, index)."""
    if isinstance(x, LazyExpr) and not x._memo_reads:
        return x._at(index, memo)
    key = (id(x), *(_hashable(i) for i in (index if isinstance(index, tuple) else (index,))))
    if key not in memo:
        memo[key] = x[index]
    return memo[key]


def _hashable(i: object) -> object:
    """An index entry as a key: tensors by identity (memo lives for one evaluation, which
    holds them), lists as tuples, slices by their fields."""
    if isinstance(i, torch.Tensor):
        return ("tensor", id(i))
    if isinstance(i, list):
        return ("list", *map(_hashable, i))
    if isinstance(i, slice):
        return ("slice", i.start, i.stop, i.step)
    return i if i is None or i is Ellipsis or isinstance(i, int) else ("object", id(i))


def _take(a: object, index: object, shape: tuple[int, ...], memo: dict) -> object:
    """An operand of an op of `shape` at `index`: a lazy one indexed (its own read), a
    plain tensor's entries there as a tensor broadcasting to the indexed result (a view
    for ints and slices; else the broadcast entries picked, O(result)); numbers as they
    are. 0-dim tensors stay 0-dim (they promote as scalars)."""
    if isinstance(a, LazyTensor):
        return _read(a, index, memo)
    if not isinstance(a, torch.Tensor) or a.ndim == 0:
        return a
    full = _full_index(index, len(shape))
    if full is not None and all(isinstance(i, int | slice) or i is None for i in full):
        aligned = a.reshape((1,) * (len(shape) - a.ndim) + tuple(a.shape))
        d, picks = 0, []
        for i in full:
            if i is None:
                picks.append(None)
                continue
            if aligned.shape[d] == 1 and shape[d] != 1:  # broadcast along d
                picks.append(0 if isinstance(i, int) else slice(None))
            else:
                picks.append(i)
            d += 1
        return aligned[tuple(picks)]
    return torch.broadcast_to(a, shape)[index]


def _full_index(index: object, nd: int) -> tuple | None:
    """index as a tuple of one entry per dim (sdpa.indexing.spread: '...' filled with
    whole slices; None entries kept), or None for an index of another kind (a boolean
    mask, a tensor of more than one dim). Raises torch's IndexError for too many
    indices or a second '...'."""
    out = []
    for i in indexing.spread(index, nd):
        if type(i).__module__ == "numpy" and getattr(i, "ndim", 0) == 1:
            i = torch.as_tensor(i)  # (positions as numpy gives them)
        if i is None or isinstance(i, slice) or _positions(i):
            out.append(i)
        elif _integer(i):
            out.append(operator.index(i))
        else:
            return None
    return tuple(out)


def _integer(i: object) -> bool:
    """An int index entry (a Python, numpy or 0-dim integer tensor int; not a bool)."""
    if isinstance(i, torch.Tensor):
        return i.ndim == 0 and not i.dtype.is_floating_point and i.dtype != torch.bool
    return not isinstance(i, bool) and hasattr(i, "__index__")


def _positions(i: object) -> bool:
    """A list of ints or a 1-D integer tensor: positions along one dim."""
    if isinstance(i, list):
        return all(isinstance(j, int) and not isinstance(j, bool) for j in i)
    return isinstance(i, torch.Tensor) and i.ndim == 1 and i.dtype in (torch.long, torch.int)


def _advanced(i: object) -> bool:
    return isinstance(i, list | torch.Tensor)


def _transposed_at(x_t: LazyExpr, x: LazyTensor, index: object, memo: dict) -> torch.Tensor:
    """x.mT[index] from x's own reads: x indexed with the last two entries swapped (a
    row of the transpose is a key column of x), the result transposed back where both
    of those dims remain; an index torch would lay out otherwise (lists with ints among
    the lead entries, None, boolean masks) takes the dense value."""
    nd = len(metadata(T.size, (x,), {}))
    full = _full_index(index, nd)
    if full is None or None in full:
        return x_t._dense("this index")[index]
    *lead, a, b = full
    lists = _advanced(a) + _advanced(b)
    if lists and any(_advanced(i) for i in lead):  # lists on both sides: laid out apart
        return x_t._dense("this index")[index]
    # torch takes ints as selects first, then a list stays in place (two of them, in
    # the last two dims, pair up into one dim), so both sides lay out alike
    out = _read(x, (*lead, b, a), memo)
    both = not isinstance(a, int) and not isinstance(b, int)
    return out.transpose(-2, -1) if both and lists < 2 else out


def _diagonal_of(a: object, offset: int, shape: tuple[int, ...]) -> object:
    if isinstance(a, LazyTensor):
        return torch.diagonal(a, offset, -2, -1)
    if not isinstance(a, torch.Tensor) or a.ndim == 0:
        return a
    return torch.diagonal(torch.broadcast_to(a, shape), offset, -2, -1)


def _diagonal(x: LazyExpr, offset: int = 0, dim1: int = 0, dim2: int = 1) -> torch.Tensor:
    """torch.diagonal over the query and key dims: the op on each operand's diagonal (a
    view of a plain tensor); other dims take the dense value."""
    shape = x._shape()
    nd = len(shape)
    if (dim_of(dim1, nd), dim_of(dim2, nd)) != (nd - 2, nd - 1) or isinstance(offset, bool):
        return on_dense(T.diagonal, (x, offset, dim1, dim2), {})
    return x._diagonal_read(operator.index(offset))


# reductions: name -> (how partial results over chunks of query rows combine, or None
# where a reduction over the query dim is not chunked)
_SUMS = {"sum", "mean"}
_COMBINE = {
    "sum": torch.add, "mean": torch.add, "amax": torch.maximum, "amin": torch.minimum,
    "any": torch.logical_or, "all": torch.logical_and,
}  # fmt: skip
_INDEXED = {"max", "min", "argmax", "argmin", "topk"}  # one dim, not the queries'


def _reduce(name: str) -> Callable:
    method = getattr(T, name)

    def reduce(x: LazyExpr, *args: object, **kwargs: object) -> object:
        shape = x._shape()
        nd = len(shape)
        try:
            meta_out = method(_meta(x), *args, **kwargs)  # torch's own checks and shapes
        except (RuntimeError, TypeError, ValueError, IndexError):
            return on_dense(method, (x, *args), kwargs)
        if name in ("max", "min") and not args and not kwargs:  # the largest / smallest entry
            dims, keepdim = frozenset(range(nd)), False
            name_ = "amax" if name == "max" else "amin"
        elif name in _INDEXED:
            return _by_rows_indexed(x, name, method, args, kwargs, shape)
        else:
            default = () if name in ("amax", "amin") else None
            dims, keepdim = reduction_of(args, kwargs, nd, "dim", default, dtype=True)
            name_ = name
        if dims is None:
            return on_dense(method, (x, *args), kwargs)
        if max(dims) < nd - 2 and name_ in _COMBINE and name_ not in ("any", "all"):
            how = LeadReduction(name_, tuple(sorted(dims)), keepdim, kwargs.get("dtype"))
            return reduce_lead(x, how)  # over leading dims alone: lazy
        out_dtype = meta_out.dtype
        return _by_rows(x, name_, dims, keepdim, out_dtype, shape)

    return reduce


def _chunks(x: LazyExpr, shape: tuple[int, ...]) -> list[slice]:
    """Chunks of query rows (of x's second-last dim) within the settings'
    lazy_chunk_bytes."""
    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1] if shape else 1)
    budget = settings.get().lazy_chunk_bytes
    # (a copy per node, and two more: the weights engine's buffers, and a reduction's
    # wider dtype: a sum of booleans counts in int64)
    copies = _nodes(x) + 2
    step = tile.chunk_rows(math.prod(shape[:-2]), cols, torch.float32, copies, budget)
    return tile.row_chunks(rows, step)


def _nodes(x: object) -> int:
    """Copies of a chunk of x's rows its evaluation holds: one per node, a reduction over
    leading dims (the head mean) as many as it reduces (it reads every head's rows)."""
    if not isinstance(x, LazyExpr):
        return 1
    if isinstance(x._func, LeadReduction):
        shape = metadata(T.size, (x._args[0],), {})
        return 1 + math.prod(shape[d] for d in x._func.dims) * _nodes(x._args[0])
    return 1 + sum(_nodes(a) for a in x._operands() if isinstance(a, LazyTensor))


def _each_chunk(
    x: LazyExpr, shape: tuple[int, ...], fn: Callable, take: Callable, also: object = None
) -> None:
    """take(rows, fn(x's rows of each chunk of query rows[, rows])), chunk by chunk;
    each chunk is recomputed in the backward where a gradient is taken (checkpointed),
    so no chunk's intermediates are held. `also`: a plain tensor fn reads (a product's
    other factor); fn then takes the rows too, and a gradient into it checkpoints as
    well. `take` stores each answer at once, into one buffer (small answers kept between
    large chunks fragment the heap: 2.5 MiB of peak memory per chunk, measured)."""
    chunks = _chunks(x, shape)
    wanted = x.requires_grad or (isinstance(also, torch.Tensor) and also.requires_grad)
    grad = torch.is_grad_enabled() and wanted and len(chunks) > 1
    for rows in chunks:

        def part(rows=rows):
            if grad:  # (run again in the backward: each chunk's pages given back first)
                release_freed()
            t = x._at((Ellipsis, rows, slice(None)))
            return fn(t) if also is None else fn(t, rows)

        take(rows, checkpoint(part, use_reentrant=False) if grad else part())


class _Rows:
    """The answers of chunks of query rows laid side by side along dim `row` in buffers
    made at the first chunk (one per tensor of an answer)."""

    def __init__(self, row: int, n: int):
        self.row, self.n, self.out = row, n, None

    def __call__(self, rows: slice, answer: object) -> None:
        parts = (answer,) if isinstance(answer, torch.Tensor) else tuple(answer)
        if self.out is None:
            self.kind = None if isinstance(answer, torch.Tensor) else type(answer)
            self.out = [_spread(p, self.row, self.n) for p in parts]
        for buffer, p in zip(self.out, parts, strict=True):
            buffer.narrow(self.row, rows.start, rows.stop - rows.start).copy_(p)

    def result(self) -> object:
        return self.out[0] if self.kind is None else self.kind(tuple(self.out))


def _spread(p: torch.Tensor, row: int, n: int) -> torch.Tensor:
    shape = list(p.shape)
    shape[row] = n
    return p.new_empty(shape)


class _Combined:
    """The answers of chunks of query rows combined into one (sums added, maxima and
    minima kept, any / all): in place where no gradient is taken."""

    def __init__(self, name: str):
        self.combine, self.out = _COMBINE[name], None

    def __call__(self, rows: slice, p: torch.Tensor) -> None:
        if self.out is None:
            self.out = p if p.requires_grad else p.clone()
        elif self.out.requires_grad or p.requires_grad:
            self.out = self.combine(self.out, p)
        else:
            self.combine(self.out, p, out=self.out)


def _result_fits(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    check_fits(
        f"{what} of a lazy expression of the weights: its result", shape, max(1, dtype.itemsize),
        dense_limit(), LAZY_READS,
    )  # fmt: skip


def _by_rows(x, name, dims, keepdim, out_dtype, shape) -> torch.Tensor:
    """A sum / mean / amax / amin / any / all over dims, over chunks of query rows: over
    the query dim the chunks' partial results combine; else they are concatenated."""
    nd = len(shape)
    row = nd - 2
    kept = tuple(1 if d in dims else n for d, n in enumerate(shape))
    _result_fits(kept, out_dtype, f"`{name}`")
    # sums of 16-bit values add up in float32 and round once at the end, as torch's do
    acc = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    if name in _SUMS:

        def op(t):
            return t.sum(tuple(sorted(dims)), keepdim=True, dtype=acc)
    else:
        method = getattr(T, name)

        def op(t):
            if name in ("any", "all"):
                for d in sorted(dims, reverse=True):
                    t = method(t, d, keepdim=True)
                return t
            return method(t, tuple(sorted(dims)), keepdim=True)

    take = _Combined(name) if row in dims else _Rows(row, shape[row])
    _each_chunk(x, shape, op, take)
    out = take.out if row in dims else take.result()
    if name == "mean":
        out = out / math.prod(shape[d] for d in dims)
    out = out.to(out_dtype) if name in _SUMS else out
    return out if keepdim else out.squeeze(tuple(sorted(dims)))


def _by_rows_indexed(x, name, method, args, kwargs, shape) -> object:
    """max / min / argmax / argmin / topk over one dim other than the queries: each
    chunk of query rows on its own, concatenated; over the queries, the dense value."""
    nd = len(shape)
    row = nd - 2
    if name == "topk":
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        keep = True
    else:
        dim = args[0] if args else kwargs.get("dim")
        keep = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    d = dim_of(dim, nd)
    if d is None or d == row or not isinstance(keep, bool):
        return on_dense(method, (x, *args), kwargs)
    if name == "topk":
        call_args, call_kwargs = args, kwargs
    else:
        call_args, call_kwargs = (d,), {"keepdim": True}
    meta = method(_meta(x), *call_args, **call_kwargs)
    first = meta if isinstance(meta, torch.Tensor) else meta[0]
    _result_fits(tuple(first.shape), torch.float64, f"`{name}`")  # (values and indices)
    take = _Rows(row, shape[row])
    _each_chunk(x, shape, lambda t: method(t, *call_args, **call_kwargs), take)
    out = take.result()
    if isinstance(out, torch.Tensor):
        return out if keep else out.squeeze(d)
    values, indices = out
    if not keep:
        values, indices = values.squeeze(d), indices.squeeze(d)
    return type(out)((values, indices))


def basic_index(x: LazyTensor, index: object, at: Callable) -> torch.Tensor:
    """x[index] by at(index), where an index that adds dims with None (or picks query
    or key positions with a boolean mask) is first made one `at` answers lazily
    (indexing.basic_form: the index without None, the added dims unsqueezed after)."""
    if not _adds_or_masks(index):
        return at(index)  # (the indices made most, decided without spreading them)
    basic = indexing.basic_form(index, tuple(metadata(T.size, (x,), {})))
    if basic is None:
        return at(index)
    plain, dims = basic
    out = at(plain)
    for d in dims:
        out = out.unsqueeze(d)
    return out


def _adds_or_masks(index: object) -> bool:
    """Whether an index holds None or a boolean tensor (a quick look at its entries)."""
    for i in index if type(index) is tuple else (index,):
        if i is None or (
            type(i) is not int
            and type(i) is not slice
            and isinstance(i, T)
            and i.dtype == torch.bool
        ):
            return True
    return False


def _getitem(x: LazyExpr, index: object) -> torch.Tensor:
    return basic_index(x, index, x._at)


def _select(x: LazyExpr, dim: int, index: int) -> torch.Tensor:
    nd = len(x._shape())
    d = dim_of(dim, nd)
    if d is None:
        return on_dense(T.select, (x, dim, index), {})
    return x._at((slice(None),) * d + (operator.index(index),))


def _narrow(x: LazyExpr, dim: int, start: int, length: int) -> torch.Tensor:
    shape = x._shape()
    d = dim_of(dim, len(shape))
    if d is None:
        return on_dense(T.narrow, (x, dim, start, length), {})
    first = operator.index(start) % max(shape[d], 1) if start else 0
    return x._at((slice(None),) * d + (slice(first, first + operator.index(length)),))


def _matmul(a: object, b: object) -> torch.Tensor:
    """Products with a transpose of lazy weights are products of the weights:
    w.mT @ x = (x^T @ w)^T and u @ w.mT = (w @ u^T)^T; any other, the dense value."""
    if isinstance(a, LazyExpr) and a._func is _transposed and not isinstance(b, LazyTensor):
        w = a._args[0]
        if isinstance(b, torch.Tensor) and b.ndim == 1:
            return b @ w  # (L,) -> (*lead, S)
        if isinstance(b, torch.Tensor) and b.ndim >= 2:
            return (b.mT @ w).mT
    if isinstance(b, LazyExpr) and b._func is _transposed and not isinstance(a, LazyTensor):
        w = b._args[0]
        if isinstance(a, torch.Tensor) and a.ndim == 1:
            return (w @ a[:, None])[..., 0]
        if isinstance(a, torch.Tensor) and a.ndim >= 2:
            return (w @ a.mT).mT
    if isinstance(a, LazyExpr) and _plain(b) and (meta := _product_meta(a, b)) is not None:
        pushed = _head_reduced_product(a, b, left=True)
        return pushed if pushed is not None else _rows_times(a, b, meta)
    if isinstance(b, LazyExpr) and _plain(a) and (meta := _product_meta(a, b)) is not None:
        pushed = _head_reduced_product(b, a, left=False)
        return pushed if pushed is not None else _times_rows(a, b, meta)
    return on_dense(torch.matmul, (a, b), {})


def _plain(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, Lazy) and x.ndim >= 1


def _product_meta(a: object, b: object) -> torch.Tensor | None:
    """torch.matmul's result on meta tensors (its shape and dtype), or None where torch
    refuses the operands or the weights' dims are not (..., L, S) (the dense path then
    raises torch's error)."""
    x = a if isinstance(a, LazyExpr) else b
    shape = x._shape()
    if len(shape) < 2 or 0 in shape:
        return None
    ma, mb = _meta(a), _meta(b)
    if ma.dtype != mb.dtype:  # (meta tensors do not check it)
        return None
    try:
        return torch.matmul(ma, mb)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None


def _head_reduced_product(x: LazyExpr, other: torch.Tensor, left: bool) -> torch.Tensor | None:
    """x @ other (left) or other @ x for x a sum or mean of the weights over leading dims
    (the head mean w.mean(1)): the weights' own product per head, reduced after
    (u @ mean_h w = mean_h u @ w_h), where that per-head result is small (within
    lazy_chunk_bytes: a few probe rows or value columns); else None."""
    how, w = x._func, x._args[0] if x._args else None
    if not isinstance(how, LeadReduction) or how.name not in _SUMS or isinstance(w, LazyExpr):
        return None
    vector = other.ndim == 1
    o = other if not vector else (other[:, None] if left else other[None, :])
    nd = len(metadata(T.size, (w,), {}))
    if o.ndim > nd - (0 if how.keepdim else len(how.dims)):
        return None
    o = o.reshape((1,) * (nd - len(how.dims) * (not how.keepdim) - o.ndim) + tuple(o.shape))
    if not how.keepdim:
        for d in how.dims:  # (ascending: each lands where w has it)
            o = o.unsqueeze(d)
    per_head = torch.matmul(_meta(w), _meta(o)) if left else torch.matmul(_meta(o), _meta(w))
    if per_head.numel() * per_head.element_size() > settings.get().lazy_chunk_bytes:
        return None
    out = how(w @ o if left else o @ w)
    return out if not vector else (out[..., 0] if left else out[..., 0, :])


def _rows_times(x: LazyExpr, b: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """x @ b for a plain b (S,) or (..., S, F): each chunk of x's query rows times b, the
    answers side by side; every row of x evaluated once (a head mean inside reads each
    head's rows once), nothing L x S held. meta: the product on meta tensors."""
    _result_fits(tuple(meta.shape), meta.dtype, "`matmul`")
    take = _Rows(meta.ndim - (1 if b.ndim == 1 else 2), x._shape()[-2])
    _each_chunk(x, x._shape(), lambda t, rows: torch.matmul(t, b), take, also=b)
    return take.result()


def _times_rows(u: torch.Tensor, x: LazyExpr, meta: torch.Tensor) -> torch.Tensor:
    """u @ x for a plain u (L,) or (..., F, L): the sum over chunks of x's query rows of
    u's columns there times those rows; every row of x evaluated once, nothing L x S
    held. meta: the product on meta tensors."""
    _result_fits(tuple(meta.shape), meta.dtype, "`matmul`")
    take = _Combined("sum")

    def part(t: torch.Tensor, rows: slice) -> torch.Tensor:
        return torch.matmul(u[..., rows], t)

    _each_chunk(x, x._shape(), part, take, also=u)
    return take.out


def _transpose_read(func: Callable) -> Callable:
    def read(x: LazyExpr, *args: object, **kwargs: object) -> torch.Tensor:
        swaps = transposes(func, x, args, kwargs)
        if swaps is None:
            return on_dense(func, (x, *args), kwargs)
        return transpose(x) if swaps else x

    return read


def reshape_read(func: Callable) -> Callable:
    """The read of a view / reshape / flatten / unflatten / squeeze / unsqueeze / expand
    of a lazy tensor (the handle or an expression): where torch's result (asked of a
    meta tensor) keeps the query and key dims last and whole, the lazy tensor moved
    (`_lead_moved`); else, and for view(dtype) (a reinterpretation), the op on the
    dense value."""

    def reshape(x: LazyTensor, *args: object, **kwargs: object) -> torch.Tensor:
        if not any(isinstance(a, torch.dtype) for a in (*args, *kwargs.values())):
            try:
                new = tuple(func(_meta(x), *args, **kwargs).shape)
            except (RuntimeError, TypeError, IndexError, ValueError):
                new = None
            moved = None if new is None else x._lead_moved(new, func in EXPANDS)
            if moved is not None:
                return moved
        return on_dense(func, (x, *args), kwargs)

    return reshape


def _same(x: LazyExpr, *args: object, **kwargs: object) -> torch.Tensor:
    """contiguous() (any format but channels-last) and to() of nothing new: x itself."""
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    if not args and memory_format in (torch.contiguous_format, torch.preserve_format):
        return x
    return on_dense(T.contiguous, (x, *args), kwargs)


def _to(x: LazyExpr, *args: object, **kwargs: object) -> torch.Tensor:
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    plain = memory_format in (None, torch.preserve_format) and not kwargs.get("copy", False)
    same_device = device is None or torch.device(device) == x.device
    if plain and same_device and (dtype is None or dtype == x.dtype):
        return x
    if plain and same_device and _cast_only((x, *args), kwargs):
        made = expr(T.to, (x, *args), kwargs)
        if made is not None:
            return made
    return on_dense(T.to, (x, *args), kwargs)


ROWS_VIEW: list[Callable[[LazyTensor], LazyTensor]] = []
"""A lazy tensor as a view of its rows, each read through its own reads (sdpa.lazy_rows
adds `LazyRows.over` when imported): what a reduction over leading dims reshapes."""

EXPR_READS: dict[Callable, Callable] = {
    T.__getitem__: _getitem,
    **dict.fromkeys((torch.select, T.select), _select),
    **dict.fromkeys((torch.narrow, T.narrow), _narrow),
    **{f: _reduce(f.__name__) for f in _ops(
        "sum", "mean", "amax", "amin", "any", "all", "max", "min", "argmax", "argmin", "topk"
    )},
    **dict.fromkeys((torch.diagonal, T.diagonal), _diagonal),
    **dict.fromkeys((torch.matmul, T.matmul, T.__matmul__), _matmul),
    T.__rmatmul__: lambda a, b: _matmul(b, a),
    **{f: _transpose_read(f) for f in TRANSPOSES},
    **{f: reshape_read(f) for f in RESHAPES},
    **dict.fromkeys((torch.detach, T.detach, T.data.__get__), LazyExpr.detach),
    T.requires_grad.__get__: LazyExpr.requires_grad.fget,
    T.contiguous: _same,
    T.to: _to,
    T.__format__: lambda x, spec: object.__format__(x, spec),
    **{getattr(T, name): refuses_grad(name) for name in GRAD_OF_LAZY},
}  # fmt: skip
"""Each torch function an expression answers lazily (or refuses): the rest are METADATA,
elementwise ops (a longer expression) or answered on the dense value (on_dense).
sdpa.lazy_rows adds torch.stack and torch.cat (a join of lazy tensors) when imported."""
