"""sdpa.lazy_rows.LazyRows: a lazy tensor whose rows come from a function (deferred's
replayed patterns, joined lazy tensors) answers sdpa.lazy's reads as the dense tensor
would, gradients included, reading at most a chunk of rows at a time.

The source here is a dense softmax of q @ k^T read through a counting function, so each
test sees both the values and how they were read. Chunks are made small (lazy_chunk_bytes)
so that every read crosses chunk edges."""

from __future__ import annotations

import copy

import pytest
import torch

import sdpa
from sdpa import settings
from sdpa.lazy import LazyExpr
from sdpa.lazy_rows import LazyRows

B, H, L, S = 2, 3, 13, 11


class Source:
    """A dense (B, H, L, S) softmax from q requiring grad, read row by row."""

    def __init__(self, seed: int = 0, grad: bool = True):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(B, H, L, 5, generator=g, dtype=torch.float64).requires_grad_(grad)
        self.k = torch.randn(B, H, S, 5, generator=g, dtype=torch.float64)
        self.reads: list[int] = [0]  # entries per read
        self.changed = False

    def dense(self) -> torch.Tensor:
        return torch.softmax(self.q @ self.k.mT, -1)

    def read(self, ids: list, rows: object) -> torch.Tensor:
        q = self.q.reshape(B * H, L, 5)[torch.tensor(ids)][:, rows]
        k = self.k.reshape(B * H, S, 5)[torch.tensor(ids)]
        self.reads.append(q.shape[0] * q.shape[1] * S)
        return torch.softmax(q @ k.mT, -1)

    def fresh(self) -> None:
        if self.changed:
            raise sdpa.StaleWeightsError("the source changed")

    def lazy(self) -> LazyRows:
        return LazyRows.of(self.read, (B, H, L, S), torch.float64, torch.device("cpu"),
                           self.q.requires_grad, self.fresh)  # fmt: skip


CHUNK = 3 * B * H * S  # entries: 3 rows of every head


@pytest.fixture
def small_chunks():
    with settings.override(lazy_chunk_bytes=CHUNK * 8):  # (float32, and a copy)
        yield


INDICES = [
    (0,), (1, 2), (..., 3), (0, 1, 4), (1, slice(None), slice(2, 9)), (..., slice(3, 12, 4), 5),
    (..., [1, 7, 12], slice(None)), (0, 2, [1, 5], [3, 10]), (slice(None), [0, 2], 6),
    ([1, 0], 1, 2), (..., -1, -1), (torch.tensor([True, False]),), (1, ..., 5, slice(None)),
    (None, 0), (0, 1, torch.tensor([12, 0, 4])), (0, None, 1, slice(2, 5)), (..., None),
    (1, 2, torch.arange(L) % 5 == 1), (0, ..., torch.arange(S) % 4 == 2),
    (1, None, ..., None, 3, slice(None)),
]  # fmt: skip


@pytest.mark.parametrize("index", INDICES, ids=[str(i) for i in range(len(INDICES))])
def test_an_index_reads_what_the_dense_tensor_holds(index, small_chunks):
    src = Source()
    x, want = src.lazy(), src.dense()
    got = x[index]
    if index[-1] is not None:  # (a new last dim: the dense value's, within the budget)
        assert max(src.reads, default=0) <= CHUNK  # a chunk of rows (a lead view: none)
    got = got.full() if isinstance(got, LazyExpr) else got  # (the dense value: one read)
    torch.testing.assert_close(got, want[index], atol=1e-12, rtol=0)


READS = {
    "sum-keys": lambda p: p.sum(-1),
    "sum-queries": lambda p: p.sum(dim=-2),
    "mean-keepdim": lambda p: p.mean((1, -1), keepdim=True),
    "max": lambda p: p.max(-1).values,
    "topk": lambda p: p.topk(3).values,
    "argmax": lambda p: p.argmax(-1),
    "head-mean-row": lambda p: p.mean(1)[1, 4],
    "entropy": lambda p: -(p * p.clamp_min(1e-30).log()).sum(-1),
    "count": lambda p: (p > 0.1).sum(-1),
    "diagonal": lambda p: torch.diagonal(p, 0, -2, -1),
    "diagonal-up": lambda p: torch.diagonal(p, 4, -2, -1),
    "diagonal-down": lambda p: torch.diagonal(p[1], -5, -2, -1),
    "column": lambda p: p[..., 7],
    "transpose-row": lambda p: p.mT[..., 2, :],
    "times": lambda p: p @ torch.linspace(0, 1, S, dtype=torch.float64),
    "left-times": lambda p: torch.linspace(0, 1, 2 * L, dtype=torch.float64).reshape(2, L) @ p,
    "reshape": lambda p: p.reshape(B * H, L, S)[4, 3],
    "expand": lambda p: p[0].expand(2, H, L, S)[1, 2, 5],
    "flatten": lambda p: p.flatten(0, 1).sum(-2),
    "cast": lambda p: p.float()[1, 1, 1],
    "stack": lambda p: torch.stack([p, p * 2])[1, 0, 2],
    "cat": lambda p: torch.cat([p[:1], p], 0)[2, 1].sum(-1),
    "head-mean-reshaped": lambda p: p.mean(1).reshape(B, 1, L, S)[1, 0, 2:5],
    "head-means-stacked": lambda p: torch.stack([p.mean(1), p.sum(1)])[:, 0, 5].sum(-1),
    "batch-mean-flattened": lambda p: torch.stack([p, p * 2]).mean(1).flatten(0, 1)[5, 3],
}


@pytest.mark.parametrize("read", list(READS))
def test_a_read_equals_the_dense_tensors_gradients_included(read, small_chunks):
    src = Source()
    x, want = src.lazy(), src.dense()
    got = READS[read](x)
    got = got.full() if isinstance(got, LazyExpr) else got
    expected = READS[read](want)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    assert max(src.reads) <= CHUNK
    if expected.is_floating_point():
        (g_got,) = torch.autograd.grad(got.square().sum(), src.q)
        (g_want,) = torch.autograd.grad(expected.square().sum(), src.q)
        torch.testing.assert_close(g_got, g_want, atol=1e-12, rtol=0)


def test_detach_and_requires_grad_answer_as_the_dense_tensor():
    src = Source()
    x = src.lazy()
    assert x.requires_grad and not x.detach().requires_grad
    assert not x.detach()[0, 1, 2].requires_grad and x[0, 1, 2].requires_grad
    assert not Source(grad=False).lazy().requires_grad
    with torch.no_grad():
        assert not x[0, 1, 2].requires_grad


def test_reads_refuse_once_the_source_changed():
    src = Source()
    x = src.lazy()
    view, chain = x[1], x * 2
    src.changed = True
    for read in (lambda: x[0, 0, 0], lambda: view.sum(-1), lambda: chain[0, 0, 0], x.full):
        with pytest.raises(sdpa.StaleWeightsError):
            read()


def test_a_deepcopy_is_the_dense_values_and_the_budget_holds():
    src = Source()
    x = src.lazy()
    twin = copy.deepcopy(x)
    assert type(twin) is torch.Tensor and not twin.requires_grad
    torch.testing.assert_close(twin, src.dense().detach(), atol=0, rtol=0)
    with pytest.raises(sdpa.WeightsTooLargeError):
        x.full(max_bytes=64)
    with pytest.raises(sdpa.NotSupportedError, match="mul_"):
        x.mul_(2)


def test_weights_of_other_calls_join_lazily(gen):
    """torch.stack of AttentionWeights of two kinds of call (another scale), and of a
    handle with a lazy expression: LazyRows, each part read through its own reads."""
    q = torch.randn(2, 3, 40, 8, generator=gen, requires_grad=True)
    k, v = torch.randn(2, 3, 40, 8, generator=gen), torch.randn(2, 3, 40, 8, generator=gen)
    a = sdpa.attention(q, k, v).weights
    b = sdpa.attention(q, k, v, scale=0.2).weights
    for parts in ([a, b], [a, a * 2], [b.mT, a]):
        got = torch.stack(parts)
        assert isinstance(got, LazyRows)
        want = torch.stack([p.full() for p in parts])
        torch.testing.assert_close(got.full(), want)  # (every row of every part at once)
        torch.testing.assert_close(got[1, 1, 2, 5], want[1, 1, 2, 5])
        torch.testing.assert_close(got.sum(-2), want.sum(-2))
        (g_got,) = torch.autograd.grad(got[:, 0, 1].square().sum(), q)
        (g_want,) = torch.autograd.grad(want[:, 0, 1].square().sum(), q)
        torch.testing.assert_close(g_got, g_want)
