"""Lazy tensors whose rows come from a function, read through sdpa.lazy's one table.

Values sdpa's weights do not hold as a recipe of their own (eager attention code's
replayed patterns and scores in sdpa.integrations.deferred: edited patterns, a sink
column, eager's rows that see no key) and lazy tensors joined by torch.stack /
torch.cat are `LazyRows`: a LazyExpr with no operands whose entries come from

    read(ids, rows) -> (len(ids), n, S)

the source's lead rows `ids` (positions in its flattened lead, a list of ints) at the
query rows `rows` (a slice, or a 1-D int64 tensor of positions). A `Grid` says which
source rows the view holds (sdpa.leads' layout, in plain Python: w[0] of a (B, H, L, S)
source holds rows 0..H-1).

An index reads chunks of query rows (tile.chunk_rows within the settings'
lazy_chunk_bytes) and picks the keys in each, so a key column costs O(chunk x S)
memory; an index of the lead dims alone, a reshape, an expand or a detach is a view
(the grid indexed or reshaped as torch indexes a tensor, by sdpa.leads); a diagonal
reads the chunks' diagonals.
Everything else is sdpa.lazy's, as for the weights: reductions and products chunk by
chunk, lead reductions (the head mean), transposes, elementwise chains, the dense value
within the budget, and the refusals.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from sdpa import leads, settings, tile
from sdpa.lazy import (
    EXPR_READS,
    ROWS_VIEW,
    LazyExpr,
    LazyTensor,
    _advanced,
    _chunks,
    _full_index,
    dim_of,
    metadata,
    on_dense,
)

T = torch.Tensor
Read = Callable[[list, "slice | torch.Tensor"], torch.Tensor]


class Grid(NamedTuple):
    """Which source rows a view holds: its lead shape and, in row-major order, the
    source's flat lead position of each (sdpa.leads' layout, in plain Python: no tensor
    is made or read to index the lead)."""

    lead: tuple[int, ...]
    rows: list[int]

    def pick(self, new_lead: tuple[int, ...], positions: list[int]) -> Grid:
        return Grid(tuple(new_lead), [self.rows[p] for p in positions])


class LazyRows(LazyExpr):
    """Values (*lead, L, S) read row by row from `read` (see the module docstring).
    grid: the view's source rows; grad: whether the reads carry a gradient (the source's
    does); fresh: a check that refuses where the source's inputs changed in place
    (StaleWeightsError), or None."""

    __slots__ = ("_fresh", "_grid", "_rows_of")
    _memo_reads = True  # (one read per evaluation where an expression meets it twice)

    @staticmethod
    def __new__(cls, read: Read, grid: Grid, L: int, S: int, dtype, device, grad: bool,
                fresh=None):  # fmt: skip
        shape = (*grid.lead, L, S)
        x = LazyExpr.__new__(cls, None, (), {}, shape, dtype, device, (), grad)
        x._rows_of, x._grid, x._fresh = read, grid, fresh
        return x

    @classmethod
    def of(cls, read: Read, shape: tuple[int, ...], dtype, device, grad: bool, fresh=None):
        """The whole source (*lead, L, S) as a LazyRows."""
        *lead, L, S = shape
        grid = Grid(tuple(lead), list(range(math.prod(lead))))
        return cls(read, grid, L, S, dtype, device, grad, fresh)

    @classmethod
    def over(cls, x: LazyTensor) -> LazyRows:
        """Any lazy tensor (*lead, L, S) as a LazyRows, each row read through x's own
        reads at its lead position (what a head mean, which has no lazy reshape of its
        own, reshapes as)."""
        shape = tuple(metadata(T.size, (x,), {}))
        dtype, device = metadata(T.dtype.__get__, (x,), {}), metadata(T.device.__get__, (x,), {})
        grad = x.requires_grad  # (the lazy answer: whether its reads carry a gradient)
        return cls.of(_rows_of_tensor(x, True), shape, dtype, device, grad, x._check_fresh)

    def _derive(self, grid: Grid | None = None, grad: bool | None = None) -> LazyRows:
        """This view with other source rows (grid) or grad."""
        L, S = self._shape()[-2:]
        return LazyRows(
            self._rows_of,
            self._grid if grid is None else grid,
            L,
            S,
            metadata(T.dtype.__get__, (self,), {}),
            metadata(T.device.__get__, (self,), {}),
            self._grad if grad is None else grad,
            self._fresh,
        )

    # -- the recipe ------------------------------------------------------------------

    def _check_fresh(self) -> None:
        if self._fresh is not None:
            self._fresh()

    def _operands(self) -> list[object]:
        return []

    def _value(self) -> T:
        """The dense value (its budget checked by the caller): one read of every row."""
        self._check_fresh()
        grid = self._grid
        with self._autograd():
            return self._rows_of(grid.rows, slice(None)).reshape(self._shape())

    def _at(self, index: object, memo: dict | None = None) -> T:
        """self[index]: a view where the index takes the lead dims alone, else the rows."""
        self._check_fresh()
        shape = self._shape()
        nd, (L, S) = len(shape), shape[-2:]
        lead = leads.lead_index(index, nd)
        if lead is not None:  # (torch's own indexing semantics and errors, on the grid)
            return self._derive(grid=self._grid.pick(*leads.lead_rows(self._grid.lead, lead)))
        full = _full_index(index, nd)
        if full is None or None in full:
            return self._dense("this index")[index]
        *lead, r, k = full
        if any(_advanced(i) for i in lead) and (_advanced(r) or _advanced(k)):
            return self._dense("this index")[index]  # (laid out apart by torch)
        grid = self._grid.pick(*leads.lead_rows(self._grid.lead, tuple(lead)))
        rows, keys = _entry(r, L, "query"), _entry(k, S, "key")
        if _advanced(r) and _advanced(k):  # (rows[i], keys[i]): torch pairs two lists
            rows, keys = torch.broadcast_tensors(_as_tensor(rows), _as_tensor(keys))
            out = self._box(grid, rows, slice(None), L, S)
            at = keys.to(out.device).expand(*out.shape[:-1])
            return out.gather(-1, at[..., None])[..., 0]
        return self._box(grid, rows, keys, L, S)

    def _box(self, grid: Grid, rows: object, keys: object, L: int, S: int) -> T:
        """The values (*grid.lead, rows', keys') of the grid's source rows, in chunks of
        query rows (each recomputed in the backward where a gradient is taken); an int
        row or key drops its dim."""
        ids = grid.rows
        step = tile.chunk_rows(max(1, len(ids)), S, torch.float32, 2,
                               settings.get().lazy_chunk_bytes)  # fmt: skip
        parts = _row_chunks(rows, L, step)
        grad = self._grad and torch.is_grad_enabled() and len(parts) > 1

        def part(at: object) -> T:
            t = self._rows_of(ids, at)  # (n_ids, n, S)
            if not (isinstance(keys, slice) and keys == slice(None)):
                t = t[..., keys if not isinstance(keys, T) else keys.to(t.device)]
            return t

        with self._autograd():
            got = [checkpoint(part, p, use_reentrant=False) if grad else part(p) for p in parts]
        out = got[0] if len(got) == 1 else torch.cat(got, dim=1)
        out = out.reshape(*grid.lead, *out.shape[1:])
        return out.squeeze(len(grid.lead)) if isinstance(rows, int) else out

    def _diagonal_read(self, offset: int) -> T:
        """torch.diagonal(self, offset, -2, -1): each chunk of query rows' part of it."""
        shape = self._shape()
        grid = self._grid
        grad = self._grad and torch.is_grad_enabled()
        out = []
        for rows in _chunks(self, shape):

            def part(rows: slice = rows) -> T:
                t = self._box(grid, rows, slice(None), shape[-2], shape[-1])
                return torch.diagonal(t, offset + rows.start, -2, -1)

            out.append(checkpoint(part, use_reentrant=False) if grad else part())
        return torch.cat(out, dim=-1)

    # -- the tensor protocol ---------------------------------------------------------

    @property
    def requires_grad(self) -> bool:
        return self._grad and metadata(T.is_floating_point, (self,), {})

    def detach(self) -> LazyRows:
        return self._derive(grad=False)

    def _lead_moved(self, new: tuple[int, ...], grow: bool) -> LazyTensor | None:
        shape = self._shape()
        if len(new) < 2 or tuple(new[-2:]) != shape[-2:]:
            return None
        lead = self._grid.lead
        moved = leads.expanded_rows(lead, new[:-2]) if grow else leads.reshaped_rows(lead, new[:-2])
        return self._derive(grid=self._grid.pick(*moved))

    def __deepcopy__(self, memo: dict) -> T:
        """A dense copy of the values (within the default budget): a tensor of your own,
        never stale, carrying no gradient."""
        with torch.no_grad():
            out = self._dense("copying")
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        own = _OWN.get(func)
        if own is not None:
            return own(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _entry(i: object, n: int, what: str) -> object:
    """A row or key index entry as an int, a slice, a list of ints or an int64 tensor
    (a tensor's values are not read: it may live on the device), within 0..n; torch's
    IndexError out of bounds (of ints and lists)."""
    if isinstance(i, slice):
        return i
    if isinstance(i, T) and i.ndim:
        return i.long() % n
    if isinstance(i, list):
        if not all(-n <= j < n for j in i):
            raise IndexError(f"an index is out of bounds for the {what} dim with size {n}")
        return [j % n for j in i]
    i = int(i)
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for the {what} dim with size {n}")
    return i % n


def _as_tensor(i: object) -> T:
    return i if isinstance(i, T) else torch.tensor(i, dtype=torch.long)


def _row_chunks(rows: object, L: int, step: int) -> list[object]:
    """The rows an index picks (an int, a slice, a list or a tensor of positions) in
    chunks of `step`: slices where they run by one (views of the rows), else lists as
    tensors, tensors by narrowing (never read on the host)."""
    if isinstance(rows, T):
        return [rows[i : i + step] for i in range(0, rows.numel(), step)] or [rows]
    if isinstance(rows, int):
        return [slice(rows, rows + 1)]
    if isinstance(rows, slice):
        start, stop, by = rows.indices(L)
        if by == 1:
            return [slice(a, min(stop, a + step)) for a in range(start, stop, step)] or [
                slice(0, 0)
            ]
        rows = list(range(start, stop, by))
    out = []
    for a in range(0, len(rows), step):
        chunk = rows[a : a + step]
        run = chunk == list(range(chunk[0], chunk[0] + len(chunk)))
        out.append(slice(chunk[0], chunk[-1] + 1) if run else torch.tensor(chunk))
    return out or [slice(0, 0)]


def _rows_of_tensor(x: LazyTensor, by_position: bool = False) -> Read:
    """read(ids, rows) of any lazy tensor (*lead, L, S): its own lead view and rows (a
    run of ids as a slice of its rows, read without a tensor index); by_position (or
    where x has no lazy reshape), each id's rows read at its lead position."""
    shape = tuple(metadata(T.size, (x,), {}))
    lead, (L, S) = shape[:-2], shape[-2:]
    flat = None if by_position else x._lead_moved((math.prod(lead), L, S), False)

    def read(ids: list, rows: object) -> T:
        if flat is None:
            got = [_dense(x[(*_unravel(i, lead), rows)]) for i in ids]
            return torch.stack(got)
        run = ids == list(range(ids[0], ids[0] + len(ids)))
        picked = flat[ids[0] : ids[-1] + 1] if run else flat[ids]
        return _dense(picked[:, rows])

    return read


def _dense(t: T) -> T:
    return t.full(None) if isinstance(t, LazyTensor) else t  # (every row: a lazy view)


def _unravel(i: int, lead: tuple[int, ...]) -> tuple[int, ...]:
    """Flat lead position i as one int per lead dim (row-major)."""
    out = []
    for n in reversed(lead):
        i, at = divmod(i, n)
        out.append(at)
    return tuple(reversed(out))


def join(func: Callable, tensors: object, dim: object) -> T | None:
    """torch.stack / torch.cat of lazy tensors of one kind of values over a leading dim,
    lazily: a LazyRows whose rows are the parts' (each read through its own lazy reads);
    None where a part is not lazy, the parts' dtypes or devices differ, or dim is the
    query or key dim (the dense path then answers, or raises torch's error)."""
    parts = list(tensors) if isinstance(tensors, list | tuple) else None
    if not parts or not all(isinstance(p, LazyTensor) for p in parts):
        return None
    shapes = [tuple(metadata(T.size, (p,), {})) for p in parts]
    dtypes = {metadata(T.dtype.__get__, (p,), {}) for p in parts}
    devices = {metadata(T.device.__get__, (p,), {}) for p in parts}
    if len(dtypes) != 1 or len(devices) != 1 or min(map(len, shapes)) < 2:
        return None
    nd = len(shapes[0]) + (func is torch.stack)
    d = dim_of(dim, nd)
    if d is None or d >= nd - 2 or len({s[-2:] for s in shapes}) != 1:
        return None
    how = "stack" if func is torch.stack else "cat"
    joined = leads.joined_rows([SimpleNamespace(lead=s[:-2]) for s in shapes], how, d)
    if joined is None:
        return None  # (shapes torch refuses: the dense path raises its error)
    sizes = [math.prod(s[:-2]) for s in shapes]
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    reads = [_rows_of_tensor(p) for p in parts]

    def read(ids: list, rows: object) -> T:
        out, order = [], []
        for r, s0, n in zip(reads, starts, sizes, strict=True):
            mine = [j for j, f in enumerate(ids) if s0 <= f < s0 + n]
            if mine:
                out.append(r([ids[j] - s0 for j in mine], rows))
                order.extend(mine)
        got = torch.cat(out, dim=0)
        if order == list(range(len(ids))):
            return got
        back = [0] * len(order)  # (where each id's rows landed)
        for at, j in enumerate(order):
            back[j] = at
        return got[torch.tensor(back)]

    def fresh() -> None:
        for p in parts:
            p._check_fresh()

    fresh()
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in parts)
    L, S = shapes[0][-2:]
    return LazyRows(read, Grid(*joined), L, S, dtypes.pop(), devices.pop(), grad, fresh)


def join_read(func: Callable) -> Callable:
    """torch.stack / torch.cat of lazy tensors over a leading dim: a LazyRows of their
    rows (join), else the dense values (out= refuses or writes as on_dense says)."""

    def joined(tensors: object, dim: int = 0, *, out: object = None) -> T:
        got = join(func, tensors, dim) if out is None else None
        if got is not None:
            return got
        return on_dense(func, (tensors, dim), {} if out is None else {"out": out})

    return joined


# lazy expressions join by their rows too, and a head mean reshapes as a view of its rows
# (sdpa.lazy's tables, which cannot import this)
EXPR_READS.update({torch.stack: join_read(torch.stack), torch.cat: join_read(torch.cat)})
ROWS_VIEW.append(LazyRows.over)

_OWN: dict[Callable, Callable] = {
    **dict.fromkeys((torch.detach, T.detach, T.data.__get__), LazyRows.detach),
    T.requires_grad.__get__: LazyRows.requires_grad.fget,
    T.__deepcopy__: LazyRows.__deepcopy__,
}
"""What a LazyRows answers differently from an expression (the rest: sdpa.lazy's)."""
