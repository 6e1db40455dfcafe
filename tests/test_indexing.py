"""sdpa.indexing.spread is torch's reading of an index, written out: on random indices
(ints, slices, '...', None, Python bools, lists, integer and boolean tensors and arrays)
x[spread(index)] is x[index], entries take the dims torch gives them, and the indices
torch refuses for their count ('...' twice, too many) are refused with its IndexError."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sdpa import indexing

SHAPE = (2, 3, 4, 5)


def _entry(rng: random.Random, size: int) -> object:
    kind = rng.choice(["int", "neg", "slice", "step", "list", "tensor", "array", "mask"])
    if kind == "int":
        return rng.randrange(size)
    if kind == "neg":
        return -1 - rng.randrange(size)
    if kind == "slice":
        return slice(rng.randrange(size), None)
    if kind == "step":
        return slice(None, None, rng.choice([1, 2, 3]))
    if kind == "list":
        return [rng.randrange(size) for _ in range(2)]
    if kind == "tensor":
        return torch.tensor([rng.randrange(size)])
    if kind == "array":
        return np.array([size - 1, 0])
    return torch.tensor([rng.random() < 0.5 for _ in range(size)])


def _index(rng: random.Random) -> tuple:
    """A random index of a SHAPE tensor: some dims given an entry, maybe a '...' in
    place of the others, None and Python bools anywhere, sometimes a 2-D boolean mask
    over two adjacent dims."""
    dims = sorted(rng.sample(range(len(SHAPE)), rng.randrange(len(SHAPE) + 1)))
    items: list = []
    d = 0
    while d < len(SHAPE):
        if d in dims:
            if d + 1 < len(SHAPE) and rng.random() < 0.15:
                items.append(torch.rand(SHAPE[d], SHAPE[d + 1]) < 0.5)
                d += 2
                continue
            items.append(_entry(rng, SHAPE[d]))
        elif rng.random() < 0.5:
            items.append(slice(None))
        d += 1
    if rng.random() < 0.5:  # a '...' for the dims left out at the end (or none)
        cut = rng.randrange(len(items) + 1)
        items = [*items[:cut], Ellipsis, *items[cut:]]
    for _ in range(rng.randrange(3)):
        items.insert(rng.randrange(len(items) + 1), rng.choice([None, True, False]))
    return tuple(items)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def _indexed(seed: int, n: int = 25):
    """(x, index, x[index]) for n random indices of a SHAPE tensor x, those torch takes
    (it refuses e.g. a '...' placed after a mask's dims)."""
    rng = random.Random(seed)
    x = torch.arange(np.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    for _ in range(n):
        index = _index(rng)
        try:
            want = x[index]
        except IndexError:
            continue
        yield x, index, want


@pytest.mark.parametrize("seed", range(40))
def test_spread_reads_as_torch_reads_the_index(seed):
    for x, index, want in _indexed(seed):
        items = indexing.spread(index, x.ndim)
        assert not any(i is Ellipsis for i in items)
        assert sum(indexing.dims_taken(i) for i in items) == x.ndim, index
        _same(x[tuple(items)], want)


@pytest.mark.parametrize(
    "index",
    [(0, 0, 0, 0, 0), (torch.ones(3, 4, 5, dtype=torch.bool), 0, 0), (None, 0, 0, 0, 0, 0)],
    ids=["five-ints", "mask-then-two", "none-and-five"],
)
def test_what_torch_refuses_for_its_count_is_refused_alike(index):
    x = torch.zeros(SHAPE)
    with pytest.raises(IndexError):
        x[index]
    with pytest.raises(IndexError, match="too many indices"):
        indexing.spread(index, x.ndim)


def test_a_second_ellipsis_is_refused():
    """numpy's rule: torch reads x[..., 0, ...] as x[..., 0] and x[0, ..., ..., 1] as an
    index out of a dim of size 0, which no user means."""
    for index in ((..., 0, ...), (..., ...), (0, ..., ..., 1)):
        with pytest.raises(IndexError, match="single ellipsis"):
            indexing.spread(index, len(SHAPE))


def test_the_count_message_names_what_is_indexed():
    with pytest.raises(IndexError, match=r"too many indices for weights of shape \(2, 3\): got 3"):
        indexing.spread((0, 0, 0), 2, of="weights of shape (2, 3)")
    with pytest.raises(IndexError, match="a tensor of dimension 2"):
        indexing.spread((0, None, 0, 0), 2)


def test_entries_take_the_dims_torch_gives_them():
    assert indexing.dims_taken(None) == indexing.dims_taken(True) == 0
    assert indexing.dims_taken(np.ones((2, 3), dtype=bool)) == 2
    assert indexing.dims_taken(torch.ones(2, 3, 4, dtype=torch.bool)) == 3
    for one in (3, slice(None), [0, 1], [True, False], torch.tensor([0, 1]), np.int64(2)):
        assert indexing.dims_taken(one) == 1


@pytest.mark.parametrize("seed", range(40))
def test_basic_form_reads_as_torch_reads_the_index(seed):
    """indexing.basic_form on the same random indices: where it gives a form, x[plain]
    with the added dims unsqueezed in turn is x[index]; it gives one for every index of
    ints, slices, '...' and None with a None, and for every one whose last two dims take
    a 1-D boolean mask."""
    for x, index, want in _indexed(seed):
        form = indexing.basic_form(index, SHAPE)
        items = indexing.spread(index, x.ndim)
        added = any(i is None for i in items)
        basic = all(i is None or type(i) in (int, slice) for i in items)
        if basic and added:
            assert form is not None, index
        taken, masked = 0, False
        for i in items:
            masked |= taken >= x.ndim - 2 and getattr(i, "ndim", 0) == 1 and i.dtype == torch.bool
            taken += indexing.dims_taken(i)
        if masked and not added:
            assert form is not None, index
        if form is None:
            continue
        plain, dims = form
        assert not any(i is None for i in plain) and dims == sorted(dims)
        got = x[plain]
        for d in dims:
            got = got.unsqueeze(d)
        _same(got, want)
