"""An index as torch spreads it over a tensor's dims: the one place '...' is expanded and
the dims each entry takes are counted. The lazy tensors (the weights' reads and lead
views, lazy expressions, a bridge's deferred patterns) each start from `spread` and then
take the entries they can answer.

    spread((0, ..., 5), 4)        ->  [0, slice(None), slice(None), 5]
    spread((None, 1), 3)          ->  [None, 1, slice(None), slice(None)]
    spread(bool_mask_2d, 4)       ->  [bool_mask_2d, slice(None), slice(None)]
"""

from __future__ import annotations


def dims_taken(item: object) -> int:
    """How many dims of the indexed tensor an index entry addresses, as torch counts
    them: None and a Python bool none (each adds a dim), a boolean mask (a tensor, an
    array, or a list of bools) its own ndim, anything else one (an int, a slice, a list
    or a tensor of positions)."""
    if item is None or isinstance(item, bool):
        return 0
    if isinstance(item, list | tuple):
        return 1
    dtype = getattr(item, "dtype", None)
    if dtype is not None and str(dtype) in ("bool", "torch.bool"):
        return item.ndim
    return 1


def spread(index: object, ndim: int, *, of: str | None = None) -> list:
    """The entries of x[index] (x of ndim dims) that together take exactly ndim dims:
    '...' replaced by whole slices, whole slices appended; None entries kept. Raises
    torch's IndexError for more than one '...' and for more indices than dims (`of`
    names what is indexed in that message, default "a tensor of dimension ndim")."""
    items = list(index) if isinstance(index, tuple) else [index]
    ellipses = [n for n, item in enumerate(items) if item is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    taken = sum(dims_taken(item) for item in items if item is not Ellipsis)
    if taken > ndim:
        what = of if of is not None else f"a tensor of dimension {ndim}"
        raise IndexError(f"too many indices for {what}: got {taken}")
    fill = [slice(None)] * (ndim - taken)
    if ellipses:
        items[ellipses[0] : ellipses[0] + 1] = fill
    else:
        items += fill
    return items


def is_whole(item: object) -> bool:
    """Whether an entry is `:` (every entry of its dim, as written)."""
    return isinstance(item, slice) and item == slice(None)


def basic_form(index: object, shape: tuple[int, ...]) -> tuple[tuple, list[int]] | None:
    """x[index] (x of this shape) as x[plain].unsqueeze(d) for each d of dims in turn,
    where index adds dims with None among ints, slices and '...' alone (with a tensor or
    list among them torch places the added dims otherwise), or picks query or key
    positions (the last two dims) with a 1-D boolean mask of the dim's size, which
    becomes its positions (as torch's own indexing turns it: it reads the mask's values,
    a host sync on a device); None where neither applies (or torch refuses the index:
    it says why)."""
    ndim = len(shape)
    try:
        items = spread(index, ndim)
    except IndexError:
        return None
    if any(item is None for item in items):
        if not all(item is None or _basic(item) for item in items):
            return None
        dims, out = [], 0
        for item in items:
            if item is None:
                dims.append(out)
            out += not isinstance(item, int)
        return tuple(item for item in items if item is not None), dims
    changed, taken = False, 0
    for n, item in enumerate(items):
        if taken >= ndim - 2 and _mask_1d(item) and item.shape[0] == shape[taken]:
            items[n] = item.nonzero().squeeze(1)
            changed = True
        taken += dims_taken(item)
    return (tuple(items), []) if changed else None


def _basic(item: object) -> bool:
    return isinstance(item, slice) or (isinstance(item, int) and not isinstance(item, bool))


def _mask_1d(item: object) -> bool:
    return str(getattr(item, "dtype", None)) == "torch.bool" and getattr(item, "ndim", 0) == 1
