"""AttentionWeights is a torch.Tensor: the habits people bring from the listing's p_attn
(issue 35's "Why") give the dense tensor's answer, gradients included; what can be
neither lazy nor dense refuses by name."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sdpa
from engines import ENGINES, run_or_skip
from sdpa.lazy import LazyExpr

from conftest import make_inputs
from oracle import oracle

# habit -> (cost class, the same on a tensor), applied to the handle and to its dense
# weights, at B = 2, H = 3. The cost classes, each held by a test below:
#   lazy   a read whose answer is O(L + S) per head: at L = S = 16384 in a fresh process
#          its peak stays under 64 MiB (the dense weights: 6 GiB)
#   view   a lazy handle of some leading rows (then read as the dense tensor in the
#          value test); under 64 MiB at 16384 too
#   expr   a lazy expression (sdpa.lazy.LazyExpr: elementwise ops, casts, a transpose,
#          a reduction over leading dims), made in O(1) and read as the dense tensor in
#          the value test; under 64 MiB at 16384 too
#   dense  computed on the dense weights within max_bytes: past it refused, naming the
#          lazy reads
#   whole  reads whose answers together are L x S by nature (every row, every key block)
LAZY, VIEW, EXPR, DENSE, WHOLE = "lazy", "view", "expr", "dense", "whole"
HABITS = {
    "numpy": (DENSE, lambda w: torch.from_numpy(w.detach().numpy())),
    "asarray": (DENSE, lambda w: torch.from_numpy(np.asarray(w.detach()))),
    "tolist": (DENSE, lambda w: torch.tensor(w.detach().tolist())),
    "detach": (LAZY, lambda w: w.detach()[0, 1, 3]),
    "cpu": (LAZY, lambda w: w.cpu()[..., 2]),
    "to-float64": (EXPR, lambda w: w.to(torch.float64)),
    "double": (EXPR, lambda w: w.double()),
    "bfloat16": (EXPR, lambda w: w.bfloat16()),
    "half-channels-last": (DENSE, lambda w: w.half(memory_format=torch.channels_last)),
    "contiguous-channels-last": (DENSE, lambda w: w.contiguous(memory_format=torch.channels_last)),
    "max": (LAZY, lambda w: w.max(-1).values),
    "amax-all": (LAZY, lambda w: w.amax()),
    "amin-all": (DENSE, lambda w: w.amin()),
    "amin-keys": (DENSE, lambda w: w.amin(-1)),
    "amin-heads": (EXPR, lambda w: w.amin(1)),
    "amin-heads-row": (LAZY, lambda w: w.amin(dim=(0, 1), keepdim=True)[0, 0, 3]),
    "head-mean": (EXPR, lambda w: w.mean(dim=1)),
    "row-sums": (LAZY, lambda w: w.sum(-1)),
    "row-means-keepdim": (LAZY, lambda w: w.mean((-1, 1), keepdim=True)),
    "mean-keepdim": (EXPR, lambda w: w.mean(1, keepdim=True)),
    "sum-all": (LAZY, lambda w: w.sum()),
    "stack": (VIEW, lambda w: torch.stack([w, w])),
    "cat": (DENSE, lambda w: torch.cat([w, w], dim=-1)),
    "times-mask": (EXPR, lambda w: w * (torch.arange(w.shape[-1]) % 2)),
    "greater": (EXPR, lambda w: (w > 0.1).to(torch.float32)),
    "bool-index": (VIEW, lambda w: w[torch.tensor([True, False])]),
    "new-axis": (VIEW, lambda w: w[:, None]),
    "new-axis-row": (LAZY, lambda w: w[0, None, 1, 3]),
    "bool-rows": (LAZY, lambda w: w[0, 1, torch.arange(w.shape[-2]) % 4096 == 5]),
    "bool-key-columns": (LAZY, lambda w: w[1, ..., torch.arange(w.shape[-1]) % 4096 == 3]),
    "topk-values": (LAZY, lambda w: w.topk(2).values),
    "diagonal": (LAZY, lambda w: torch.diagonal(w[0], -1, -2, -1)),
    "where": (EXPR, lambda w: torch.where(w > 0.2, w, 0.0)),
    "softmax-again": (DENSE, lambda w: torch.softmax(w, -1)),
    "softmax-of-an-expression": (DENSE, lambda w: torch.softmax(w * 2, -1)),
    "masked-row-sums": (LAZY, lambda w: (w * (torch.arange(w.shape[-1]) % 2)).sum(-1)),
    "count-over": (LAZY, lambda w: (w > 0.1).sum(-1)),
    "hand-entropy": (LAZY, lambda w: -(w * w.log()).sum(-1)),
    "log-head-mean-row": (LAZY, lambda w: w.log().mean(1)[0, 5]),
    "bfloat16-row": (LAZY, lambda w: w.to(torch.bfloat16).float()[0, 1, 3]),
    "head-mean-row": (LAZY, lambda w: w.mean(1)[1, 2]),
    "head-mean-image": (EXPR, lambda w: w.mean(1)[0]),
    "head-mean-unsqueeze": (EXPR, lambda w: w.mean(1).unsqueeze(1)),
    "head-means-stacked-row": (LAZY, lambda w: torch.stack([w.mean(1), w.amax(1)])[1, 0, 3]),
    "transpose": (EXPR, lambda w: w.mT),
    "transpose-row": (LAZY, lambda w: w.mT[..., 2, :]),
    "transpose-sums": (LAZY, lambda w: w.transpose(-2, -1).sum(-1)),
    "transpose-product": (LAZY, lambda w: w.mT @ torch.linspace(0, 1, w.shape[-2])),
    "product-with-transpose": (
        LAZY,
        lambda w: torch.linspace(0, 1, 2 * w.shape[-1]).reshape(2, -1) @ w.mT,
    ),
    "masked-max": (LAZY, lambda w: torch.where(w > 0.2, w, 0.0).amax(-1)),
    "scaled-topk": (LAZY, lambda w: (w * 3).topk(2).values),
    "scaled-diagonal": (LAZY, lambda w: torch.diagonal(w * 2, -1, -2, -1)),
    # views over the leading dims (lazy handles of fewer rows), then a read or dense op
    "lead-index": (VIEW, lambda w: w[1]),
    "head-of-each": (LAZY, lambda w: w[:, 2][..., 3, :]),
    "index-list": (LAZY, lambda w: w[[1, 0, 1]].sum(-2)),
    "select": (VIEW, lambda w: w.select(1, -1)),
    "narrow": (LAZY, lambda w: w.narrow(1, 1, 2).amax(-1)),
    "unbind": (VIEW, lambda w: torch.stack(w.unbind(1)[1:])),
    "split": (LAZY, lambda w: torch.cat([p.sum(-1) for p in torch.split(w, [1, 2], dim=1)], 1)),
    "chunk": (VIEW, lambda w: w.chunk(2, 0)[1]),
    "flatten-lead": (VIEW, lambda w: w.flatten(0, 1)[4]),
    "unsqueeze": (LAZY, lambda w: w.unsqueeze(0)[0, 1, 2, 3]),
    "reshape-lead": (EXPR, lambda w: w.reshape(3, 2, *w.shape[-2:]).mean(0)),
    "view-then-diagonal": (LAZY, lambda w: torch.diagonal(w[1, 0], 1, -2, -1)),
    "heads-first": (VIEW, lambda w: w.permute(1, 0, 2, 3)),
    "transpose-lead": (VIEW, lambda w: w.transpose(0, 1)),
    "heads-first-row": (LAZY, lambda w: w.permute(1, 0, 2, 3)[2, 1, 3]),
    "heads-first-keys-rows": (EXPR, lambda w: w.permute(1, 0, 3, 2)),
    "heads-first-key-column": (LAZY, lambda w: w.permute(1, 0, 3, 2)[0, 1, 4]),
    "query-dim-among-the-lead": (DENSE, lambda w: w.permute(0, 2, 1, 3)),
    "row-of-a-view": (WHOLE, lambda w: w.unbind(-2)[4]),
    "keys-split": (WHOLE, lambda w: torch.split(w, 4, dim=-1)[2]),
}
COSTS = {name: cost for name, (cost, _) in HABITS.items()}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("habit", list(HABITS))
def test_a_habit_equals_the_dense_tensors_gradients_included(gen, habit, engine):
    q, k, v, _ = make_inputs(gen, B=2, Hq=3, L=7, S=9)
    q.requires_grad_()
    _, w, reads = run_or_skip(engine, q, k, v)
    apply = HABITS[habit][1]
    with reads:
        got, want = apply(w), apply(w.full())
        # a view is a lazy handle of fewer rows, an expression a lazy recipe (then
        # their dense values are compared)
        assert isinstance(got, sdpa.AttentionWeights) == (COSTS[habit] == VIEW)
        assert isinstance(got, LazyExpr) == (COSTS[habit] == EXPR)
        got = got.full() if COSTS[habit] in (VIEW, EXPR) else got
    assert type(got) is torch.Tensor and got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # (sums: fp32 order)
    if got.requires_grad:
        (g_got,) = torch.autograd.grad(got.double().square().sum(), q)
        (g_want,) = torch.autograd.grad(apply(w.full()).double().square().sum(), q)
        torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=0)  # fp32 gradients
    else:
        assert not want.requires_grad, "the dense twin carries a gradient the habit dropped"


def _read_through(x: object) -> object:
    """What a habit gave, read: a view's or an expression's dense value, else itself."""
    return x.full() if isinstance(x, (sdpa.AttentionWeights, LazyExpr)) else x


@pytest.mark.parametrize("changed", ["key", "mask"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("habit", list(HABITS))
def test_a_habit_refuses_once_an_input_changed_in_place(gen, habit, engine, changed):
    """The staleness column of the habit table: after k (or a float mask) changed in
    place through torch, every habit refuses with StaleWeightsError, on the handle and
    on a view or expression made from it before the change, on every engine (held
    weights included)."""
    q, k, v, _ = make_inputs(gen, B=2, Hq=3, L=7, S=9)
    mask = 0.5 * torch.randn(2, 1, 7, 9, generator=gen) if changed == "mask" else None
    _, w, reads = run_or_skip(engine, q, k, v, mask)
    apply = HABITS[habit][1]
    with reads:
        made = apply(w) if COSTS[habit] in (VIEW, EXPR) else None  # (before the change)
        {"key": k, "mask": mask}[changed].mul_(2)
        with pytest.raises(sdpa.StaleWeightsError, match=f"{changed} changed in place"):
            _read_through(apply(w))
        if made is not None:
            with pytest.raises(sdpa.StaleWeightsError, match=f"{changed} changed in place"):
                _read_through(made)


@pytest.mark.parametrize("habit", [h for h, cost in COSTS.items() if cost == DENSE])
def test_a_dense_habit_past_the_budget_refuses_naming_the_lazy_reads(habit):
    """Weights of (2, 3, 16385, 16385) need 6 GiB dense: each dense habit refuses before
    allocating, and its message names the lazy reads (the diagonal and pairs included)."""
    q, k, v = (torch.randn(2, 3, 16385, 4) for _ in range(3))
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(sdpa.WeightsTooLargeError, match=r"diagonal.*pairs|pairs.*diagonal"):
        HABITS[habit][1](w)


# A fresh process: the table's lazy and view habits on weights of (2, 3, 16384, 16384)
# (6 GiB dense in float32); it prints the peak's rise over the baseline taken after the
# call (per habit on stderr, for a failure's message)
TABLE_PEAK_CHILD = """
import sys, torch, sdpa
sys.path[:0] = [TESTS]
from sdpa.measure import peak_rss_kib
from test_tensor_protocol import EXPR, HABITS, LAZY, VIEW
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 16384, 4) for _ in range(3))
w = sdpa.attention(q, k, v).weights
base = peak_rss_kib()
for name, (cost, habit) in HABITS.items():
    if cost in (LAZY, VIEW, EXPR):
        got = habit(w)
        print(f"{name}: {(peak_rss_kib() - base) / 1024:.1f} MiB", file=sys.stderr)
print((peak_rss_kib() - base) / 1024)
"""


def test_the_lazy_and_view_habits_of_16384_keys_stay_under_64_mib():
    """Every habit classed lazy, view or expr, at L = S = 16384 with two batch elements of
    three heads, in a fresh process: below 64 MiB over the call, where the dense weights
    take 6 GiB."""
    child = TABLE_PEAK_CHILD.replace("TESTS", repr(str(Path(__file__).parent)))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    mib = float(done.stdout.strip().splitlines()[-1])
    assert mib < 64, done.stderr


def test_the_handle_is_a_tensor_of_the_listings_shape_dtype_and_device(gen):
    q, k, v, _ = make_inputs(gen, B=2, Hq=3, L=7, S=9)
    q16 = q.to(torch.bfloat16).requires_grad_()
    w = sdpa.attention(q16, k.to(torch.bfloat16), v.to(torch.bfloat16)).weights
    assert isinstance(w, torch.Tensor) and isinstance(w, sdpa.AttentionWeights)
    assert w.shape == (2, 3, 7, 9) and w.size(-1) == 9 and w.ndim == 4 and len(w) == 2
    assert w.dtype == torch.float32 and w.device == q.device  # float32 for 16-bit inputs
    assert w.requires_grad and w.grad_fn is None  # answers as p_attn; not an autograd node
    assert not w.detach().requires_grad and not w.data.requires_grad
    assert hash(w) == id(w)


def test_what_changes_nothing_returns_the_handle_itself(gen):
    """As torch returns a tensor itself: float() of float32 weights, contiguous(), to()
    of their own dtype and device, cpu() on the CPU."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    w = sdpa.attention(q, k, v).weights
    for same in (w.float(), w.contiguous(), w.to(torch.float32), w.to("cpu"), w.cpu(),
                 w.float(memory_format=torch.preserve_format)):  # fmt: skip
        assert same is w
    w64 = sdpa.attention(q.double(), k.double(), v.double()).weights
    assert w64.double() is w64 and type(w64.float()) is LazyExpr  # (a cast read as read)


def test_detach_is_lazy_carries_no_gradient_and_goes_stale_with_the_original(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=300, S=260)  # the rows engine's sizes
    q.requires_grad_()
    w = sdpa.attention(q, k, v).weights
    twin = w.detach()
    assert isinstance(twin, sdpa.AttentionWeights)
    row = twin[0, 1, 5]
    assert not row.requires_grad
    torch.testing.assert_close(row, w[0, 1, 5].detach(), atol=0, rtol=0)
    with torch.no_grad():
        k.mul_(2)
    for handle in (w, twin):
        with pytest.raises(sdpa.StaleWeightsError, match="key changed in place"):
            handle * 2  # a dense op refuses as a lazy read does
        with pytest.raises(sdpa.StaleWeightsError):
            handle.sum(dim=-2)


@pytest.mark.parametrize(
    "op, pattern",
    [
        (lambda w: w.mul_(2), "`mul_` writes into AttentionWeights"),
        (lambda w: w.zero_(), "`zero_` writes into"),
        (lambda w: w.__setitem__((0, 0), 1.0), "`__setitem__` writes into"),
        (lambda w: w.__iadd__(1.0), "writes into AttentionWeights"),
        (lambda w: w.data_ptr(), "`data_ptr` reads the storage"),
        (lambda w: w.untyped_storage(), "`untyped_storage` reads the storage"),
        (lambda w: torch.add(w.full(), 1, out=w), "out= an AttentionWeights"),
        (lambda w: w.retain_grad(), r"w.retain_grad: gradients with respect to the weights"),
        (lambda w: w.register_hook(print), r"w.register_hook: .* p = w.full\(\)"),
        (lambda w: w.backward(), r"w.backward"),
        (lambda w: w.set_(torch.zeros(1, 2, 5, 6)), r"set_.* take p = w.full\(\)"),
        (lambda w: torch.func.vmap(lambda x: x.sum())(w), r"sum.*torch.func transforms"),
        (lambda w: torch.func.grad(lambda x: x.sum())(w), r"sum.*torch.func transforms"),
        (lambda w: w.share_memory_(), r"`share_memory_` writes into AttentionWeights"),
    ],
)
def test_what_is_neither_lazy_nor_dense_refuses_by_name(gen, op, pattern):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(sdpa.NotSupportedError, match=pattern):
        op(w)
    torch.testing.assert_close(w.full(), sdpa.attention(q, k, v).weights.full())  # untouched


def test_plotting_a_row_block_and_a_head_mean(gen):
    matplotlib = pytest.importorskip("matplotlib")  # (the plot extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    q.requires_grad_()
    w = sdpa.attention(q, k, v).weights
    fig, ax = plt.subplots()
    try:
        ax.imshow(w.detach()[0, 0])
        ax.imshow(w.detach().mean(1)[0])
        with pytest.raises(RuntimeError, match=r"requires grad.*detach\(\)"):
            w.numpy()  # as the dense tensor that requires grad refuses
    finally:
        plt.close(fig)


def test_copies_read_as_the_original(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    w = sdpa.attention(q, k, v).weights
    for twin in (copy.deepcopy(w), pickle.loads(pickle.dumps(w)), copy.copy(w)):
        assert isinstance(twin, sdpa.AttentionWeights)
        torch.testing.assert_close(twin.mean(1), w.mean(1), atol=0, rtol=0)


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any op made while it was on."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize(
    "shape",
    [(1, 2, 5, 9), (2, 3, 7, 6), (1, 1, 1, 1), (1, 4, 1001, 1), (1, 2, 3000, 40), (9, 8, 7, 4)],
)
@pytest.mark.parametrize("grad", [False, True])
def test_print_shows_what_torch_prints_for_the_dense_weights(gen, shape, grad):
    """repr / str / format print the dense tensor's text (summarised past torch's print
    threshold, dims of 6 and 7 entries on both sides of torch's edge of 3), with
    requires_grad=True where the weights carry a gradient."""
    B, H, L, S = shape
    q, k, v, _ = make_inputs(gen, B=B, Hq=H, L=L, S=S)
    q.requires_grad_(grad)
    w = sdpa.attention(q, k, v).weights
    want = repr(w.full().detach().requires_grad_(grad))
    assert repr(w) == str(w) == f"{w}" == want


def test_print_follows_torchs_print_options_and_reads_only_what_it_shows(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=4096, S=4096, E=8)
    w = sdpa.attention(q, k, v).weights
    with _Largest() as seen:
        text = repr(w)
    assert seen.most < 4096 * 4096 // 64  # rows of the shown entries, never L x S
    with torch._tensor_str.printoptions(edgeitems=2, precision=2, sci_mode=False):
        small = repr(w)
        assert small == repr(w.full(max_bytes=None)) and small != text


def test_a_stale_handle_prints_that_it_is_stale(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    w = sdpa.attention(q, k, v).weights
    k.mul_(2)
    assert repr(w).startswith("AttentionWeights(shape=(1, 2, 5, 6), stale: ")


# Reads that hold O(rows x S) or O(L + S), each with its gradient: name -> read (the same
# on the handle and on the oracle's dense float64 weights)
O_N_READS = {
    "a row": lambda w: w[0, 1, 5],
    "rows": lambda w: w[1, :, 3:6],
    "a key column": lambda w: w[..., 7],
    "sum over queries": lambda w: w.sum(-2),
    "mean over queries": lambda w: w.mean(dim=-2, keepdim=True),
    "amax over keys": lambda w: w.amax(-1),
    "max over keys": lambda w: w.max(-1).values,
    "topk": lambda w: w.topk(3).values,
    "diagonal": lambda w: torch.diagonal(w, -1, -2, -1),
}


@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "float"])
@pytest.mark.parametrize("read", list(O_N_READS))
def test_a_lazy_reads_value_and_gradient_are_the_oracles(gen, read, mask_kind):
    """A row, a column and the reductions of the weights with q and k requiring grad:
    values and q.grad / k.grad equal the float64 oracle's (GQA, L != S, a mask)."""
    q, k, v, mask = make_inputs(gen, B=2, Hq=4, Hkv=2, L=67, S=131, mask_kind=mask_kind)
    q.requires_grad_(), k.requires_grad_()
    got = O_N_READS[read](sdpa.attention(q, k, v, mask).weights)
    c = torch.randn(got.shape, generator=gen, dtype=torch.float64)  # a loss of every entry
    (c * got.double()).sum().backward()
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    want = O_N_READS[read](oracle(q64, k64, v.double(), mask)[1])
    (c * want).sum().backward()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k.grad.double(), k64.grad, atol=1e-4, rtol=1e-4)


# A fresh process: the weights of (1, 1, 16384, 16384) keys (1 GiB dense in float32), q
# requiring grad; each O(n) read (a row, a column and a reduction also backpropagated);
# it prints how far its peak rose over the baseline taken after the call (and per read
# on stderr, for a failure's message)
PEAK_CHILD = """
import sys, torch, sdpa
from sdpa.measure import peak_rss_kib
torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, 16384, 8) for _ in range(3))
q.requires_grad_()
w = sdpa.attention(q, k, v).weights
base = peak_rss_kib()
for name, read, backward in [
    ("row", lambda: w[0, 0, 5], True), ("column", lambda: w[..., 7], True),
    ("sum over queries", lambda: w.sum(-2), True), ("rows", lambda: w[0, 0, 100:104], False),
    ("amax", lambda: w.amax(-1), False), ("topk", lambda: w.topk(4).values, False),
    ("diagonal", lambda: torch.diagonal(w, -1, -2, -1), False),
    ("entropy", lambda: w.entropy(), False), ("print", lambda: repr(w), False),
    # views over the leading dims, then an O(n) read (nothing L x S on the way)
    ("views then a row", lambda: w[0].unsqueeze(0).flatten(0, 1).select(0, 0)[3], True),
    ("unbind, split, narrow",
     lambda: torch.split(w.unbind(0)[0], 1)[0].narrow(0, 0, 1)[0, :, 9], True),
    ("chunk then a head sum", lambda: w.chunk(1, 1)[0].reshape(16384, 16384).sum(-2), False),
    ("a stack of layers, a row", lambda: torch.stack([w, w.detach()])[1, 0, 0, 9], False),
]:
    got = read()
    if backward:
        got.square().sum().backward()
    print(f"{name}: {(peak_rss_kib() - base) / 1024:.1f} MiB", file=sys.stderr)
print((peak_rss_kib() - base) / 1024)
"""


def test_lazy_reads_of_16384_keys_stay_under_96_mib():
    """Peak memory of the O(n) reads and their backwards at L = S = 16384 in a fresh
    process: below 96 MiB, where the dense weights take 1 GiB. (The peak resident set
    over thirteen reads depends on how glibc reuses freed pages: measured 39-41 MiB on
    torch 2.13 and 45-66 MiB on torch 2.14.1 over repeated runs of the same code; the
    64 MiB bound this test had failed one CI run on 2.14.1 at 66.8.)"""
    done = subprocess.run([sys.executable, "-c", PEAK_CHILD], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    mib = float(done.stdout.strip().splitlines()[-1])
    assert mib < 96, done.stderr


def test_moving_the_handle_moves_its_recipe_not_the_weights(gen):
    """w.to(device) / w.cpu() / w.cuda(): the recipe moves (q, k, the mask, LSE), nothing
    L x S is made; a meta move answers every read with the dense tensor's shape, dtype
    and device; the same device is the handle itself; another dtype too converts."""
    q, k, v, mask = make_inputs(gen, B=2, Hq=3, L=7, S=9, mask_kind="float")
    w = sdpa.attention(q, k, v, sdpa.masks.sinks(torch.randn(3, 1, 1), mask)).weights
    assert w.cpu() is w and w.to("cpu") is w and w.to(w.dtype) is w
    m = w.to("meta")
    assert isinstance(m, sdpa.AttentionWeights) and m.device.type == "meta"
    assert m._inputs.query.is_meta and m._inputs.mask.is_meta and m._inputs.sinks.is_meta
    dense = w.full().to("meta")
    for read in (lambda x: x, lambda x: x[0, 1, 2], lambda x: x.sum(-2), lambda x: x[1]):
        got, want = read(m), read(dense)
        got = got.full() if isinstance(got, sdpa.AttentionWeights) else got
        assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device)
    d = w.to("meta", torch.float64)  # a move, then the dtype: dense on the new device
    assert (d.shape, d.dtype, d.device.type) == (w.shape, torch.float64, "meta")
    k.add_(1.0)
    with pytest.raises(sdpa.StaleWeightsError):
        m[0, 1, 2]  # stale with the call's inputs


@pytest.mark.cuda
def test_a_handle_moved_to_cuda_and_back_reads_as_the_dense_weights(gen):
    q, k, v, mask = make_inputs(gen, B=2, Hq=3, L=70, S=90, mask_kind="key_padding")
    q.requires_grad_()
    w = sdpa.attention(q, k, v, mask).weights
    g = w.cuda()
    assert g.device.type == "cuda" and isinstance(g, sdpa.AttentionWeights)
    torch.testing.assert_close(g[1, 2, 5].cpu(), w[1, 2, 5])
    torch.testing.assert_close(g.sum(-2).cpu(), w.sum(-2), atol=1e-5, rtol=1e-5)
    (got,) = torch.autograd.grad(g[0, 1, 3].square().sum(), q)
    (want,) = torch.autograd.grad(w[0, 1, 3].square().sum(), q)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.cpu().full(), w.full(), atol=1e-6, rtol=1e-5)
