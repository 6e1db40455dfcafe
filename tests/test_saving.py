"""Saving and copying a weights handle: torch.save / torch.load (weights_only=True too),
pickle and copy.deepcopy give a detached copy that reads exactly as the original, is
never stale through the originals' later changes, and stores the recipe (q, k, the
mask, the LSE: O(L x E)), not the L x S weights."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import sdpa
from engines import ENGINES, run_or_skip
from sdpa import masks

from conftest import MASK_KINDS, make_mask, randn


def _saved(w) -> tuple[object, int]:
    """(w through torch.save and torch.load(weights_only=True), the saved bytes)."""
    buffer = io.BytesIO()
    torch.save(w, buffer)
    size = buffer.tell()
    buffer.seek(0)
    return torch.load(buffer, weights_only=True), size


COPIES = {
    "torch.save": lambda w: _saved(w)[0],
    "pickle": lambda w: pickle.loads(pickle.dumps(w)),
    "deepcopy": copy.deepcopy,
}

STRUCTURED = {
    "causal=True": lambda B, L, S: (None, {"causal": True}),
    "causal()": lambda B, L, S: (masks.causal(), {}),
    "sliding_window": lambda B, L, S: (masks.sliding_window(3, "top-left"), {}),
    "padding": lambda B, L, S: (masks.padding([max(1, S - 3 * b) for b in range(B)]), {}),
    "documents": lambda B, L, S: (masks.documents(torch.arange(L) // 4), {}),
    "combined": lambda B, L, S: (masks.causal() & masks.padding([S] * B), {}),
}


def _reads(w) -> dict[str, torch.Tensor]:
    """Reads of every kind: rows, a key column, statistics, a product, whole (last: it
    hands kept weights out, and the reads after it compute them again, equal up to
    rounding)."""
    L, S = w.shape[-2:]
    u = torch.linspace(-1, 1, L, dtype=w.dtype)
    return {
        "row": w[0, 1, L - 1],
        "column": w[..., S // 2],
        "sum": w.sum(dim=-2),
        "entropy": w.entropy(),
        "topk": w.topk(2)[0],
        "lse": w.lse,
        "rmatmul": u @ w,
        "full": w.full(),
    }


def _check_copy(w, twin) -> None:
    want = {name: value.detach() for name, value in _reads(w).items()}
    got = _reads(twin)
    for name, value in got.items():
        assert not value.requires_grad, name  # a copy is detached
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, equal_nan=True, msg=name)
    assert twin.served_by == w.served_by
    assert (twin.shape, twin.dtype, twin.device) == (w.shape, w.dtype, w.device)


CASES = [("auto", kind) for kind in MASK_KINDS + list(STRUCTURED)]
CASES += [(engine, "dead_rows") for engine in ENGINES if engine != "auto"]


@pytest.mark.parametrize("engine, kind", CASES)
def test_a_copy_reads_as_the_original(gen, engine, kind):
    """Every mask kind, and every engine (what is saved is the same recipe whichever ran
    the call, with the small backend's kept weights), through torch.save and the
    weights_only load: the other copies take the same state
    (test_every_copy_reads_as_the_original)."""
    B, H, L, S, E = 2, 3, 33, 33, 16
    q, k, v = (randn(gen, B, H, n, E) for n in (L, S, S))
    q.requires_grad_(True)
    mask, kw = (
        STRUCTURED[kind](B, L, S) if kind in STRUCTURED else (make_mask(gen, kind, B, H, L, S), {})
    )
    _, w, reads = run_or_skip(engine, q * 1.0, k, v, mask, scale=0.3, **kw)  # q * 1: a non-leaf
    with reads:
        _check_copy(w, COPIES["torch.save"](w))


@pytest.mark.parametrize("how", list(COPIES))
def test_every_copy_reads_as_the_original(gen, how):
    q, k, v = (randn(gen, 2, 3, 33, 16) for _ in range(3))
    mask = make_mask(gen, "float_inf", 2, 3, 33, 33)
    w = sdpa.attention(q.requires_grad_(True) * 1.0, k, v, mask, causal=True).weights
    _check_copy(w, COPIES[how](w))


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_is_not_stale_and_keeps_the_values_it_was_made_from(gen, how):
    q, k, v = (randn(gen, 1, 2, 40, 8) for _ in range(3))
    mask = torch.randn(1, 1, 40, 40, generator=gen)
    w = sdpa.attention(q, k, v, mask, causal=True).weights
    want = w.full()
    twin = COPIES[how](w)
    for t in (q, k, mask):
        t.mul_(2)  # the original goes stale; the copy holds its own tensors
    with pytest.raises(sdpa.StaleWeightsError):
        w.full()
    torch.testing.assert_close(twin.full(), want, rtol=0, atol=0)
    twin2 = COPIES[how](twin)  # and a copy of a copy
    torch.testing.assert_close(twin2.full(), want, rtol=0, atol=0)


@pytest.mark.parametrize("how", list(COPIES))
def test_a_stale_handle_refuses_to_be_copied(gen, how):
    q, k, v = (randn(gen, 1, 2, 8, 4) for _ in range(3))
    w = sdpa.attention(q, k, v).weights
    k.add_(1)
    with pytest.raises(sdpa.StaleWeightsError, match="key changed in place"):
        COPIES[how](w)


def test_sinks_softcap_gqa_and_lead_dims_survive(gen):
    q = randn(gen, 2, 4, 20, 8)
    k, v = randn(gen, 2, 2, 24, 8), randn(gen, 2, 2, 24, 8)
    sinks = randn(gen, 4, 1, 1)  # one logit per head
    mod = masks.sinks(sinks, masks.softcap(5.0, masks.sliding_window(6)))
    w = sdpa.attention(q, k, v, mod).weights  # 4 query heads over 2 key heads
    for how in COPIES.values():
        _check_copy(w, how(w))
    x = randn(gen, 7, 16)  # the listing's 2-D call: weights (L, S)
    w2 = sdpa.attention(x, x, x).weights
    twin = copy.deepcopy(w2)
    assert twin.shape == (7, 7)
    torch.testing.assert_close(twin.full(), w2.full(), rtol=0, atol=0)


def test_a_saved_handle_stores_the_recipe_not_the_weights(gen):
    """(1, 4, 4096, 32): q, k and the LSE are ~1.1 MiB; the weights would be 256 MiB. A
    head slice of a fused QKV projection is saved as its own elements (not the whole
    projection)."""
    B, H, L, E = 1, 4, 4096, 32
    qkv = randn(gen, B, L, 3, H, E)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # views of the whole qkv
    w = sdpa.attention(q, k, v).weights
    _, size = _saved(w)
    recipe = 2 * B * H * L * E * 4 + B * H * L * 4  # q, k, the LSE in float32
    assert recipe <= size < recipe * 1.1 + 65536, size
    assert size < B * H * L * L * 4 / 50  # (the weights: 256 MiB)


def test_the_top_left_causal_mask_comes_back_as_the_shared_one(gen):
    q, k, v = (randn(gen, 1, 2, 8, 4) for _ in range(3))
    w = sdpa.attention(q, k, v, causal=True).weights
    assert masks.from_state(masks.state_of(masks.TOP_LEFT)) is masks.TOP_LEFT
    assert copy.deepcopy(w).served_by == w.served_by


class _EveryOther(masks.Mask):
    """A mask of your own: keys of even position."""

    def keep(self, q_pos, k_pos, L, S):
        return (k_pos[None, None, :] % 2 == 0).expand(1, len(q_pos), len(k_pos))


def test_a_mask_of_your_own_pickles_and_needs_allowlisting_for_weights_only(gen):
    q, k, v = (randn(gen, 1, 2, 8, 4) for _ in range(3))
    w = sdpa.attention(q, k, v, _EveryOther()).weights
    torch.testing.assert_close(pickle.loads(pickle.dumps(w)).full(), w.full(), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(w, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="_EveryOther"):
        torch.load(buffer, weights_only=True)  # torch names the class to allowlist
    buffer.seek(0)
    with torch.serialization.safe_globals([_EveryOther]):
        torch.testing.assert_close(torch.load(buffer, weights_only=True).full(), w.full())


def test_a_saved_state_of_another_format_is_refused():
    w = sdpa.attention(*(torch.ones(1, 1, 2, 2) for _ in range(3))).weights
    rebuild, (state,) = w.__reduce_ex__(2)
    with pytest.raises(sdpa.SdpaValueError, match="format 2"):
        rebuild({**state, "format": 2})
