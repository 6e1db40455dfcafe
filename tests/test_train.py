"""What training users do with the weights' gradients: a backward on another thread uses
its forward's settings, a double backward refuses, torch.compile'd steps give eager's
gradients (graph breaks counted), activation checkpointing changes nothing, and 16-bit
and autocast gradients stay within 3x the listing's error against float64."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sdpa
from sdpa import listing, rows, settings

from conftest import randn

TINY = 1e-30


def qkv(gen, B=1, H=2, L=64, S=64, E=16, dtype=torch.float32):
    return [randn(gen, B, H, n, E, dtype=dtype).requires_grad_() for n in (L, S, S)]


def loss_of(read, q, k, v, teacher=None, mask=None):
    """out and a read of the weights in one scalar, as a training step builds it."""
    out, w = sdpa.attention(q, k, v, mask)
    return out.sum() + READS[read](w, teacher)


def teacher_of(gen, like, mask=None):
    q, k = (randn(gen, *like.shape) for _ in range(2))
    with torch.no_grad():
        return sdpa.attention(q, k, k, mask).weights


READS = {
    "entropy": lambda w, t: w.entropy().square().sum(),
    "kl": lambda w, t: w.kl(t).sum(),
    "kl_reverse": lambda w, t: w.kl(t, reverse=True).sum(),
    "sum": lambda w, t: w.sum(dim=-2).square().sum(),
    "full": lambda w, t: w.full().square().sum(),
    "rows": lambda w, t: w[0, :, 3:9].square().sum(),
    "lse": lambda w, t: w.lse.sum(),
    "rmatmul": lambda w, t: (torch.ones(w.shape[-2]) @ w).square().sum(),
    "column": lambda w, t: w[..., 5].square().sum(),
}


def grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    fn().backward()
    return [t.grad.clone() for t in tensors]


# --- the settings of the forward, in the backward ---------------------------------------


@pytest.fixture
def tile_budgets(monkeypatch):
    """The budgets of every tiling the weights engine makes (reads and their backward)."""
    seen = []
    real = rows.tiles

    def spy(r, budget):
        seen.append(budget)
        return real(r, budget)

    monkeypatch.setattr(rows, "tiles", spy)
    return seen


@pytest.mark.parametrize("read", ["entropy", "kl", "sum", "rmatmul"])
def test_a_backward_on_another_thread_uses_the_settings_of_its_forward(gen, tile_budgets, read):
    """autograd's threads (here: a thread of our own, whose context is empty) do not see
    the caller's settings; the reads' backward runs with those of its forward. A small
    chunk_bytes tiles the backward row by row; the gradients are the default's."""
    q, k, v = qkv(gen)
    teacher = teacher_of(gen, q)
    want = grads(lambda: loss_of(read, q, k, v, teacher), q, k)
    small = 4 * 64 * 4  # bytes: 4 rows of 64 float32 scores per tile
    with settings.override(chunk_bytes=small):
        loss = loss_of(read, q, k, v, teacher)
    tile_budgets.clear()
    q.grad = k.grad = None
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert tile_budgets and set(tile_budgets) <= {small, small // 2}  # (kl: two tiles at once)
    for got, ref in zip((q.grad, k.grad), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_backward_inside_other_settings_keeps_those_of_its_forward(gen, tile_budgets):
    q, k, v = qkv(gen)
    loss = loss_of("entropy", q, k, v)
    tile_budgets.clear()
    with settings.override(chunk_bytes=1024):
        loss.backward()
    assert tile_budgets and set(tile_budgets) == {settings.Settings.chunk_bytes}


# --- first order only -------------------------------------------------------------------


@pytest.mark.parametrize("read", sorted(READS))
def test_a_double_backward_is_refused_by_name(gen, read):
    q, k, v = qkv(gen)
    teacher = teacher_of(gen, q)
    w = sdpa.attention(q, k, v).weights
    value = READS[read](w, teacher)
    with pytest.raises(sdpa.NotSupportedError, match=r"double backward .*first order only"):
        torch.autograd.grad(value, (q, k), create_graph=True)
    (dq,) = torch.autograd.grad(value, q)  # first order is fine
    assert torch.isfinite(dq).all() and dq.abs().max() > 0


# --- torch.compile ----------------------------------------------------------------------

# Graph breaks of a compiled step `out.sum() + read` (1, 2, 64, 16) fp32, torch 2.13, the
# teacher's handle made outside the step: the settings are a ContextVar (dynamo does not
# trace ContextVar.get), and the read is one break (GraphWeights' reads run eagerly as a
# whole, torch.compiler.disable: no resume frames inside them, no tile loop in a graph;
# at 702ddac dynamo traced into them, 2 and 3 breaks, and compiled the KL step in 1.3-1.9x
# the time it takes now). Documented in docs/guide/training.md.
BREAKS = {"entropy": 2, "kl": 2}
MOST_OPS_IN_A_GRAPH = 8


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


@pytest.mark.parametrize("read", sorted(BREAKS))
def test_a_compiled_training_step_gives_eagers_gradients(gen, dynamo, read):
    q, k, v = qkv(gen)
    teacher = teacher_of(gen, q)

    def step(q, k, v):
        return loss_of(read, q, k, v, teacher)

    explained = dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == BREAKS[read], [b.reason for b in explained.break_reasons]
    assert max(len(ops) for ops in explained.ops_per_graph) <= MOST_OPS_IN_A_GRAPH
    dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")  # inductor's front end, no C++ build
    want = grads(lambda: step(q, k, v), q, k, v)
    for _ in range(2):  # the second step reuses the graphs
        got = grads(lambda: compiled(q, k, v), q, k, v)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(q, k, v)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile


def test_a_handle_returned_by_a_compiled_function_reads_and_goes_stale(gen, dynamo):
    """The handle a compiled function returns (GraphWeights) reads as the eager call's,
    and refuses once q changes in place: its version counters are read at its first
    read outside the trace (it refused every read, stale, though nothing changed)."""
    q, k, v = qkv(gen)

    def f(q, k, v):
        return sdpa.attention(q, k, v)

    _out, w = torch.compile(f, backend="aot_eager")(q, k, v)
    want = sdpa.attention(q, k, v).weights
    torch.testing.assert_close(w.entropy(), want.entropy(), atol=1e-6, rtol=0)
    torch.testing.assert_close(w[0, 1, 5], want[0, 1, 5], atol=1e-7, rtol=0)
    with torch.no_grad():
        q.add_(1.0)
    with pytest.raises(sdpa.StaleWeightsError, match="query changed"):
        w.entropy()


@pytest.mark.parametrize("specialize_int", [False, True])
@pytest.mark.parametrize("read", ["kl", "entropy_float_mask"])
def test_a_compiled_step_whose_read_tiles_head_by_head(gen, dynamo, read, specialize_int):
    """One head per tile (H x L x S x 4 bytes over chunk_bytes, as 8 heads at L >= 2048
    by default): the tile loop's head index once reached dynamo as a SymInt and failed;
    the reads run eagerly now, with or without specialize_int, at eager's gradients."""
    q, k, v = qkv(gen)
    mask = randn(gen, 1, 1, 64, 64) if read == "entropy_float_mask" else None
    teacher = teacher_of(gen, q)

    def step(q, k, v):
        return loss_of(read.split("_")[0], q, k, v, teacher, mask)

    with (
        settings.override(chunk_bytes=64 * 64 * 4),
        dynamo.config.patch(specialize_int=specialize_int),
    ):
        want = grads(lambda: step(q, k, v), q, k, v)
        compiled = torch.compile(step, backend="aot_eager")
        got = grads(lambda: compiled(q, k, v), q, k, v)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


STEP_MASKS = {
    "none": lambda gen: None,
    "float": lambda gen: randn(gen, 1, 1, 64, 64),
    "causal": lambda gen: sdpa.masks.causal(),
}


@pytest.mark.parametrize("mask_kind", sorted(STEP_MASKS))
@pytest.mark.parametrize("read", ["column", "rmatmul"])
def test_a_compiled_step_reading_a_column_or_a_product_gives_eagers_gradients(
    gen, dynamo, read, mask_kind
):
    """A key column and u @ w in a compiled step (issue 35 item 7's reads besides entropy
    and KL), with no mask, a float mask (its gradient too) and causal: the loss and the
    gradients of q, k, v (and the mask) equal the eager step's."""
    q, k, v = qkv(gen)
    mask = STEP_MASKS[mask_kind](gen)
    if mask is not None and not isinstance(mask, sdpa.masks.Mask):
        mask.requires_grad_()
    leaves = [q, k, v] + ([mask] if isinstance(mask, torch.Tensor) else [])

    def step(q, k, v):
        return loss_of(read, q, k, v, None, mask)

    want = grads(lambda: step(q, k, v), *leaves)
    compiled = torch.compile(step, backend="aot_eager")
    got = grads(lambda: compiled(q, k, v), *leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- activation checkpointing ----------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("read", ["entropy", "kl", "sum", "full"])
def test_activation_checkpointing_gives_the_same_gradients(gen, read, reentrant):
    q, k, v = qkv(gen)
    wq = (torch.eye(16) + 0.1 * randn(gen, 16, 16)).requires_grad_()  # a projection inside
    teacher = teacher_of(gen, q)

    def block(q, k, v):
        return loss_of(read, q @ wq, k, v, teacher)

    want = grads(lambda: block(q, k, v), q, k, v, wq)
    got = grads(lambda: checkpoint(block, q, k, v, use_reentrant=reentrant), q, k, v, wq)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# --- 16-bit and autocast ----------------------------------------------------------------


def listing_loss(read, q, k, v, teacher, g, mask=None):
    """The listing's out and p_attn, with the read written on the dense weights."""
    out, p = listing.attention(q, k, v, mask)
    p = p.float() if p.dtype != torch.float64 else p
    if read == "entropy":
        r = -(p * p.clamp_min(TINY).log()).sum(-1)
    else:
        t = teacher.to(p.dtype)
        r = (t * (t.clamp_min(TINY).log() - p.clamp_min(TINY).log())).sum(-1)
    return (out.to(g.dtype) * g).sum() + r.sum()


def ours_loss(read, q, k, v, teacher, g, mask=None):
    out, w = sdpa.attention(q, k, v, mask)
    r = w.entropy() if read == "entropy" else w.kl(teacher)
    return (out.to(g.dtype) * g).sum() + r.sum()


@pytest.mark.parametrize("how", ["bfloat16", "autocast"])
@pytest.mark.parametrize("read", ["entropy", "kl"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padding"])
def test_16_bit_and_autocast_gradients_within_3x_the_listings(gen, how, read, masked):
    """Gradients to q, k and v of out + read: err(ours) <= 3 x err(the listing run the
    same way), both against the listing in float64 (the flash-attention rule). Seen: 0.5
    to 0.9 x the listing's error."""
    B, H, L, S, E = 2, 3, 97, 130, 32
    base = [randn(gen, B, H, n, E) for n in (L, S, S)]
    g = randn(gen, B, H, L, E)
    mask = None
    if masked:
        lengths = torch.tensor([S, S - 40])
        mask = (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S)
    teacher = torch.softmax(randn(gen, B, H, L, S).masked_fill(~mask, -torch.inf), -1) if masked \
        else torch.softmax(randn(gen, B, H, L, S), -1)  # fmt: skip

    def run(loss, dtype, autocast=False):
        ts = [t.detach().clone().to(dtype).requires_grad_() for t in base]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = loss(read, *ts, teacher, g.double() if dtype == torch.float64 else g, mask)
        value.backward()
        return [t.grad.double() for t in ts]

    exact = run(listing_loss, torch.float64)
    autocast = how == "autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    peer = run(listing_loss, dtype, autocast)
    ours = run(ours_loss, dtype, autocast)
    for name, x, p, o in zip("qkv", exact, peer, ours, strict=True):
        err_peer, err_ours = (p - x).abs().max(), (o - x).abs().max()
        assert err_peer > 0
        assert err_ours <= 3 * err_peer, (name, err_ours, err_peer)
