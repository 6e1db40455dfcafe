"""Views of the weights over their leading dims: which (batch, head) rows of a call a view
keeps, and that call's inputs, LSE and kept weights for those rows alone, laid out as a
call on them would be (so every read of the view is a read of a smaller call).

A view is given as `flat`, an integer tensor of the view's leading shape whose entries
are rows of the call's flattened (B x Hq) lead: w[0] of (B, Hq, L, S) weights is
arange(B * Hq).reshape(B, Hq)[0]. Any indexing, select, narrow, unbind, split, chunk or
reshape of the leading dims is such a tensor, computed by torch's own indexing on the
small (B, Hq) grid, so its semantics are torch's.

    lead (*batch, H) -> layout (B, H) = (prod(batch), H); a lead of under 2 dims has no
    heads: (prod(lead), 1) (sdpa.inputs: the weights are (*lead, L, S))
"""

from __future__ import annotations

import itertools
import math

import torch

from sdpa import indexing, masks
from sdpa.inputs import Inputs


def layout(lead: tuple[int, ...]) -> tuple[int, int]:
    """The (B, Hq) the engines read for a call whose weights lead with `lead`."""
    if len(lead) >= 2:
        return math.prod(lead[:-1]), lead[-1]
    return math.prod(lead), 1


def rows_of(lead: tuple[int, ...]) -> torch.Tensor:
    """The call's lead rows as a (*lead) grid of flat positions (CPU; B x Hq entries)."""
    return torch.arange(math.prod(lead)).reshape(lead)


def _span(values: list[int]) -> slice | None:
    """values (not empty) as a slice: start:stop:step where they step evenly forward,
    start:start+1 where every one is the same (read once, broadcast), else None."""
    first, n = values[0], len(values)
    step = values[1] - first if n > 1 else 1
    if step < 0 or values != list(range(first, first + step * n, step) if step else [first] * n):
        return None
    return slice(first, first + 1) if step == 0 else slice(first, first + step * (n - 1) + 1, step)


def _sliced(t: torch.Tensor, dim: int, s: slice) -> torch.Tensor:
    """t[..., s, ...] along dim, as a view (narrow where the step is 1: a tenth of the
    cost of Python indexing; t itself where s takes every row)."""
    n = t.shape[dim]
    if s.step == 1 or s.step is None:
        return t if (s.start, s.stop) == (0, n) else t.narrow(dim, s.start, s.stop - s.start)
    return t[(slice(None),) * dim + (s,)]


def _pick(
    t: torch.Tensor, b: list[int], h: list[int], shape: tuple[int, int], broadcast: bool
) -> torch.Tensor:
    """t (B|1, H|1, ...) at the rows (b[i], h[i]), laid out (*shape, ...): a view where
    the rows are a grid of two ranges (a batch range by a head range, or one batch
    element's heads as batch), else a copy of the rows. broadcast: a dim that reads one
    row stays of size 1 (a mask broadcasts), else it is expanded to the shape."""
    Bn, Hn = shape
    rest = t.shape[2:]
    n = len(b)
    if t.shape[0] == 1:
        b = [0] * n
    if t.shape[1] == 1:
        h = [0] * n
    part = None
    if n:
        rows_b, cols_h = b[::Hn], h[:Hn]  # the batch of each row, the heads of the first
        if b == [x for x in rows_b for _ in range(Hn)] and h == cols_h * Bn:  # a grid
            sb, sh = _span(rows_b), _span(cols_h)
            if sb is not None and sh is not None:
                part = _sliced(_sliced(t, 0, sb), 1, sh)
        elif Hn == 1 and b == [b[0]] * n:  # one element's heads as batch
            sh = _span(h)
            if sh is not None:
                part = _sliced(t.select(0, b[0]), 0, sh).unsqueeze(1)
    if part is None:  # gathered: a copy of these rows
        index = (torch.tensor(b, dtype=torch.long, device=t.device),
                 torch.tensor(h, dtype=torch.long, device=t.device))  # fmt: skip
        return t[index].reshape(Bn, Hn, *rest)
    if broadcast or (part.shape[0] == Bn and part.shape[1] == Hn):
        return part
    return part.expand(Bn, Hn, *rest)


def _four_d(t: torch.Tensor) -> torch.Tensor:
    """A mask broadcasting to (B, Hq, L, S) as a 4-D view."""
    return t[(None,) * (4 - t.ndim)] if t.ndim < 4 else t


def take(
    inputs: Inputs,
    lse: torch.Tensor | None,
    probs: torch.Tensor | None,
    new_lead: tuple[int, ...],
    rows: list[int],
) -> tuple[Inputs, torch.Tensor | None, torch.Tensor | None] | None:
    """(inputs, lse, kept weights) of the call for the lead rows `rows` (a view's
    (*new_lead) grid of flat row positions, flattened), or None where a structured mask
    with a batch dim cannot follow: the rows under one new batch element come from
    several of the call's batch elements, or the mask cannot say how to select
    (masks.Mask.take).

    q, k, v, the mask, the sinks, the LSE and kept weights are views where the rows are
    ranges, else copies of the chosen rows (O(rows x (L + S) x E), never L x S beyond
    a mask's own rows): a view then holds its own tensors, and the caller keeps the
    staleness check on the call's."""
    Hq = inputs.query.shape[1]
    group = inputs.group
    Bn, Hn = layout(new_lead)
    b, h = [f // Hq for f in rows], [f % Hq for f in rows]  # (n,) each
    tensor, structured = masks.split(inputs.mask)
    if structured is not None and structured.batch is not None:
        batch_rows = b[::Hn] if Hn else [0] * Bn  # the call's batch element of each row
        if Hn and b != [x for x in batch_rows for _ in range(Hn)]:
            return None  # a row over several of the call's elements: one mask per row
        structured = structured.take(torch.tensor(batch_rows, dtype=torch.long))
        if structured is None:
            return None
    shape = (Bn, Hn)
    q = _pick(inputs.query, b, h, shape, False)  # (Bn, Hn, L, E)
    kv_heads = [x // group for x in h]
    k = _pick(inputs.key, b, kv_heads, shape, False)  # (Bn, Hn, S, E): a key head per head
    v = _pick(inputs.value, b, kv_heads, shape, False)
    if tensor is not None:
        tensor = _pick(_four_d(tensor), b, h, shape, True)  # (Bn|1, Hn|1, L|1, S)
    sinks = None if inputs.sinks is None else _pick(inputs.sinks, b, h, shape, False)
    lse = None if lse is None else _pick(lse, b, h, shape, False)
    probs = None if probs is None else _pick(probs, b, h, shape, False)
    taken = inputs._replace(
        query=q, key=k, value=v, mask=masks.join(tensor, structured), lead=new_lead, sinks=sinks
    )
    return taken, lse, probs


def lead_index(index: object, nd: int) -> tuple | None:
    """The part of `index` (of weights with nd dims) that addresses the leading dims,
    where it leaves the query and key dims whole (w[0], w[:, 2], w[mask_over_lead],
    w[[0, 1]], w[0, ..., :, :]), else None (the index reads rows or keys, adds a dim
    with None, or is one torch refuses: the read says why)."""
    try:
        items = indexing.spread(index, nd)
    except IndexError:
        return None
    lead, taken = nd - 2, 0
    for n, item in enumerate(items):
        if item is None or isinstance(item, bool) or _bools(item):
            return None  # (a dim added, or a list of bools: not a view's)
        dims = indexing.dims_taken(item)
        if taken + dims > lead:  # the rest address the query and key dims: whole only
            return tuple(items[:n]) if all(map(indexing.is_whole, items[n:])) else None
        taken += dims
    return tuple(items)


def _bools(item: object) -> bool:
    return isinstance(item, list | tuple) and any(isinstance(x, bool) for x in item)


def grid(flat: torch.Tensor) -> tuple[tuple[int, ...], list[int]]:
    """A (*new lead) tensor of rows as take's (new_lead, rows)."""
    return tuple(flat.shape), flat.reshape(-1).tolist()


def lead_rows(lead: tuple[int, ...], index: tuple) -> tuple[tuple[int, ...], list[int]]:
    """The view's (new lead, rows): torch's indexing of the lead grid (its semantics and
    errors), in plain Python for ints and slices (the indices made most: a few
    microseconds). Tensor indices are read on the CPU (a boolean mask's selection has a
    size only its values give)."""
    if all(isinstance(i, int | slice) and not isinstance(i, bool) for i in index):
        picked, new = [], []
        for d, (n, item) in enumerate(
            zip(lead, (*index, *[slice(None)] * (len(lead) - len(index))), strict=True)
        ):
            if isinstance(item, slice):
                if item.step is not None and item.step <= 0:
                    raise ValueError("step must be greater than zero")  # (torch's text)
                picked.append(range(n)[item])
                new.append(len(picked[-1]))
            elif -n <= item < n:
                picked.append((item % n,))
            else:
                raise IndexError(f"index {item} is out of bounds for dimension {d} with size {n}")
        strides = [math.prod(lead[d + 1 :]) for d in range(len(lead))]
        rows = [
            sum(i * st for i, st in zip(at, strides, strict=True))
            for at in itertools.product(*picked)
        ]
        return tuple(new), rows
    index = tuple(i.cpu() if isinstance(i, torch.Tensor) else i for i in index)
    return grid(rows_of(lead)[index])


def _same(values: list) -> bool:
    return all(v == values[0] for v in values[1:])


def _joined_mask(parts: list[Inputs]) -> object:
    """The parts' masks for their rows one after another along the batch dim, or
    _NO_JOIN: the same mask object (no batch dim of its own) is kept; tensor masks are
    concatenated (each expanded to its part's batch: a copy of the masks' own rows);
    structured masks must be one mask (masks.same) without a batch dim."""
    split = [masks.split(p.mask) for p in parts]
    tensors, structured = [t for t, _ in split], [s for _, s in split]
    if not all(masks.same(s, structured[0]) for s in structured) or (
        structured[0] is not None and structured[0].batch is not None
    ):
        return _NO_JOIN
    if all(t is None for t in tensors):
        return masks.join(None, structured[0])
    if any(t is None for t in tensors) or not _same([t.dtype for t in tensors]):
        return _NO_JOIN
    four = [_four_d(t) for t in tensors]
    if all(t is tensors[0] for t in tensors) and four[0].shape[0] == 1:
        return masks.join(tensors[0], structured[0])  # one mask, broadcast over batch
    heads = 1 if all(t.shape[1] == 1 for t in four) else parts[0].query.shape[1]
    rows = 1 if all(t.shape[2] == 1 for t in four) else parts[0].query.shape[2]
    S = parts[0].key.shape[2]
    cat = torch.cat(
        [t.expand(p.query.shape[0], heads, rows, S) for t, p in zip(four, parts, strict=True)]
    )
    return masks.join(cat, structured[0])


_NO_JOIN = object()


def join(
    parts: list[Inputs], lses: list[torch.Tensor], probs: list[torch.Tensor | None]
) -> tuple[Inputs, torch.Tensor, torch.Tensor | None] | None:
    """One call's inputs for the rows of several calls one after another along the batch
    dim (the layers of a capture stacked), their LSEs and kept weights likewise; None
    where they are not one kind of call: the same heads, key heads, sizes, dtype,
    device, scale and softcap, sinks on all or none, masks that join (_joined_mask).
    q, k and v are concatenated (copies, O(rows x (L + S) x E))."""
    first = parts[0]
    shapes = [(p.query.shape[1:], p.key.shape[1:], p.value.shape[1:]) for p in parts]
    kinds = [(p.query.dtype, p.query.device, p.scale, p.softcap, p.sinks is None) for p in parts]
    heads = [len(p.lead) >= 2 for p in parts]
    if not (_same(shapes) and _same(kinds) and _same(heads)):
        return None
    mask = _joined_mask(parts)
    if mask is _NO_JOIN:
        return None
    B = sum(p.query.shape[0] for p in parts)
    sinks = None
    if first.sinks is not None:
        Hq, rows = first.query.shape[1], first.sinks.shape[-1]
        sinks = torch.cat([p.sinks.expand(p.query.shape[0], Hq, rows) for p in parts])
    joined = first._replace(
        query=torch.cat([p.query for p in parts]),
        key=torch.cat([p.key for p in parts]),
        value=torch.cat([p.value for p in parts]),
        mask=mask,
        lead=(B, first.query.shape[1]) if heads[0] else (B,),
        sinks=sinks,
    )
    kept = None if any(p is None for p in probs) else torch.cat(probs)
    return joined, torch.cat(lses), kept


def _flat(at: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The row-major position of index `at` in `shape`."""
    f = 0
    for i, n in zip(at, shape, strict=True):
        f = f * n + i
    return f


def _each(shape: tuple[int, ...]):
    return itertools.product(*(range(n) for n in shape))


def reshaped_rows(lead: tuple[int, ...], new_lead: tuple[int, ...]):
    """(new_lead, rows) of a row-major reshape of the lead (the same rows in order)."""
    return tuple(new_lead), list(range(math.prod(lead)))


def permuted_rows(lead: tuple[int, ...], perm: list[int]):
    """(new_lead, rows) of a permutation of the lead dims (new dim j is old dim perm[j])."""
    new = tuple(lead[p] for p in perm)
    back = [perm.index(d) for d in range(len(lead))]  # old dim d is new dim back[d]
    return new, [_flat(tuple(at[back[d]] for d in range(len(lead))), lead) for at in _each(new)]


def expanded_rows(lead: tuple[int, ...], new_lead: tuple[int, ...]):
    """(new_lead, rows) of torch's expand of the lead to new_lead (aligned on the right:
    new leading dims and dims of size 1 repeat their rows)."""
    off = len(new_lead) - len(lead)
    return tuple(new_lead), [
        _flat(tuple(0 if n == 1 else at[j + off] for j, n in enumerate(lead)), lead)
        for at in _each(new_lead)
    ]


def joined_rows(parts: list[Inputs], how: str, d: int):
    """(new_lead, rows) of torch.stack (how "stack") or torch.cat ("cat") of the parts'
    leads at dim d, in the joined call (part after part), or None where torch would
    refuse the shapes (the dense path then raises torch's own error)."""
    shapes = [tuple(p.lead) for p in parts]
    starts = list(itertools.accumulate((math.prod(s) for s in shapes), initial=0))
    first = shapes[0]
    if how == "stack":
        if any(s != first for s in shapes) or not 0 <= d <= len(first):
            return None
        new = (*first[:d], len(parts), *first[d:])
        rows = [starts[at[d]] + _flat(at[:d] + at[d + 1 :], first) for at in _each(new)]
        return new, rows
    if not 0 <= d < len(first) or any(
        len(s) != len(first) or s[:d] + s[d + 1 :] != first[:d] + first[d + 1 :] for s in shapes
    ):
        return None
    offsets = list(itertools.accumulate((s[d] for s in shapes), initial=0))
    new = (*first[:d], offsets[-1], *first[d + 1 :])
    rows = []
    for at in _each(new):
        n = next(i for i in range(len(parts)) if at[d] < offsets[i + 1])
        local = (*at[:d], at[d] - offsets[n], *at[d + 1 :])
        rows.append(starts[n] + _flat(local, shapes[n]))
    return new, rows
