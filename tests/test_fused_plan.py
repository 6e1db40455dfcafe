"""The fused backend's one plan (backends/fused.plan) is what runs and what it says.

Every kernel call torch's CPU flash op receives is recorded (its causal flag, whether a
mask went with it) and held to the plan of the same inputs: one call with the plan's
mask and causal flag, one call per piece with keys, or none for no work; `served_by` and
`sdpa.explain` print the plan's own words. Over shapes on the block edges, every mask
form (none, causal=True, tensors with and without it, structured masks and their `&`,
sinks), both float32 and bfloat16. The kernel's own causal path is taken wherever only
top-left causality (ANDed with a tensor the kernel takes whole) masks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdpa
from sdpa import masks
from sdpa.backends import aten, blocks, fused
from sdpa.inputs import normalize

LENGTHS = [1, 7, blocks.BLOCK_Q - 1, blocks.BLOCK_Q, blocks.BLOCK_Q + 1, 2 * blocks.BLOCK_Q + 3]
FORMS = [
    "none", "causal", "bool", "key padding", "float", "bool & causal", "float & causal",
    "causal()", "window", "padding", "documents", "window & padding", "sinks & causal",
    "padded queries",
]  # fmt: skip


class Recorder:
    """aten.CPU_FLASH, counting its calls: (causal flag, a mask given) each."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, q, k, v, dropout_p, causal, attn_mask=None, scale=None):
        self.calls.append((bool(causal), attn_mask is not None))
        return self.real(q, k, v, dropout_p, causal, attn_mask=attn_mask, scale=scale)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder(aten.CPU_FLASH)
    monkeypatch.setattr(aten, "CPU_FLASH", rec)
    return rec


def _case(form: str, B: int, L: int, S: int, seed: int):
    """(mask argument, causal flag) of a mask form."""
    g = torch.Generator().manual_seed(seed)
    if form in ("causal", "causal()", "bool & causal", "float & causal", "sinks & causal"):
        S = L  # (attention's causal=True needs L == S)
    bool_mask = torch.rand(B, 1, L, S, generator=g) > 0.3
    float_mask = torch.randn(B, 1, L, S, generator=g)
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    pad[-1, ..., S // 2 + 1 :] = False
    table = {
        "none": (None, False),
        "causal": (None, True),
        "bool": (bool_mask, False),
        "key padding": (pad, False),
        "float": (float_mask, False),
        "bool & causal": (bool_mask, True),
        "float & causal": (float_mask, True),
        "causal()": (masks.causal(), False),
        "window": (masks.sliding_window(37, align="top-left"), False),
        "padding": (masks.padding([S, max(1, S // 3)][:B]), False),
        "documents": (masks.documents(torch.arange(L) * 3 // max(1, L)), False),
        "window & padding": (
            masks.sliding_window(70, align="top-left") & masks.padding([S, S // 2 + 1][:B]),
            False,
        ),
        "sinks & causal": (masks.sinks(torch.randn(2, 1, 1, generator=g)), True),
        "padded queries": (masks.padding([S, S // 2 + 1][:B], queries=True), False),
    }
    mask, causal = table[form]
    if form == "documents" and L != S:
        mask = masks.documents(torch.arange(L) * 3 // L, torch.arange(S) * 3 // S)
    return mask, causal, S


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    form=st.sampled_from(FORMS),
    L=st.sampled_from(LENGTHS),
    S=st.sampled_from(LENGTHS),
    B=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_what_ran_is_the_plan_and_what_it_says(recorder, form, L, S, B, dtype, seed):
    mask, causal, S = _case(form, B, L, S, seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 2, L, 16, generator=g).to(dtype)
    k, v = (torch.randn(B, 2, S, 16, generator=g).to(dtype) for _ in range(2))
    inputs = normalize(q, k, v, mask, causal=causal)
    plan = fused.plan(inputs)
    recorder.calls.clear()
    out, w = sdpa.attention(q, k, v, mask, causal=causal, backend="fused")
    said = sdpa.explain(q, k, v, mask, causal=causal)
    assert w.served_by == f"fused: {fused.Fused().path(inputs)}"
    if said.backend == "fused":
        assert said.path == fused.Fused().path(inputs)
    if plan.call == "empty":
        assert recorder.calls == []
    elif plan.call == "one":
        assert recorder.calls == [(plan.causal, plan.mask is not None or plan.whole)], plan
    else:
        calls = [p for p in plan.pieces if p.k1 > p.k0]
        assert len(recorder.calls) == len(calls)
        assert all(not flag for flag, _ in recorder.calls)
        assert [m for _, m in recorder.calls] == [p.masked for p in calls]
        assert f"{len(calls)} calls" in w.served_by
    # the kernel's own causal path wherever top-left causality alone (or with a tensor
    # the kernel takes whole) masks
    if form in ("causal", "causal()", "sinks & causal") or (
        form in ("bool & causal", "float & causal") and blocks.whole(inputs.tensor_mask, L)
    ):
        assert plan.call == "one" and plan.causal and "on its own causal path" in w.served_by
    ref = sdpa.attention(q, k, v, mask, causal=causal, backend="reference").output
    torch.testing.assert_close(
        out.float(), ref.float(), atol=2e-2 if dtype != torch.float32 else 2e-5, rtol=0
    )


def test_the_common_plans_allocate_nothing():
    """No mask and causal=True: the same plan objects every call (the fast lane)."""
    q = torch.randn(1, 2, 8, 16)
    assert fused.plan(normalize(q, q, q)) is fused.plan(normalize(q, q, q))
    assert fused.plan(normalize(q, q, q, causal=True)) is fused.plan(
        normalize(q, q, q, causal=True)
    )
    assert normalize(q, q, q, causal=True).mask is masks.TOP_LEFT


EDGES = [1, blocks.BLOCK_K - 1, blocks.BLOCK_K, blocks.BLOCK_K + 1, 300, 435]


@pytest.mark.parametrize("form", ["bool", "padding", "padded queries", "left", "window & padding"])
@pytest.mark.parametrize("n", EDGES)
def test_key_padding_runs_on_the_real_keys_alone(form, n):
    """Key padding cuts each batch element's calls to its real keys, with no mask
    (blocks.exact), where every row sees every one of them: on block edges and off them,
    right and left padding, padded queries (whose rows outside the span keep their
    masked or empty calls). Outputs and gradients equal the reference's."""
    B, H, L, S, E = 2, 2, 300, 448, 16
    g = torch.Generator().manual_seed(n)
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    lo, hi = (S - n, S) if form == "left" else (0, n)
    keep[1] = False
    keep[1, ..., lo:hi] = True
    mask = {
        "bool": keep.expand(B, 1, L, S),
        "left": keep.expand(B, 1, L, S),
        "padding": masks.padding([S, n]),
        "padded queries": masks.padding([S, n], queries=True),
        "window & padding": masks.sliding_window(70, align="top-left") & masks.padding([S, n]),
    }[form]
    q = torch.randn(B, H, L, E, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, S, E, generator=g, requires_grad=True) for _ in range(2))
    inputs = normalize(q, k, v, mask)
    plan = fused.plan(inputs)
    assert plan.call == "pieces", plan
    second = [p for p in plan.pieces if range(B)[p.batch] == range(1, 2) and p.k1 > p.k0]
    if form == "window & padding":  # (a window: not every row sees every key)
        assert any(p.masked for p in second)
    else:
        live = n if form == "padded queries" else L  # (rows past n see no key)
        cut = [p for p in second if not p.masked]
        assert [(p.k0, p.k1) for p in cut] == [(lo, hi)] and cut[0].q1 - cut[0].q0 >= min(
            live, blocks.BLOCK_Q
        ), plan.pieces
    out, _ = sdpa.attention(q, k, v, mask, backend="fused")
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = sdpa.attention(*exact, mask, backend="reference").output
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    up = torch.randn(out.shape, generator=g)
    mine = torch.autograd.grad(out, (q, k, v), up)
    theirs = torch.autograd.grad(ref, exact, up.double())
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=0)


@pytest.mark.parametrize("layout", ["contiguous", "(B, L, H, D) memory", "last dim strided"])
@pytest.mark.parametrize("form", ["none", "padding", "sinks & causal"])
def test_the_kernels_backward_takes_any_gradient_layout(form, layout):
    """The CPU kernel's backward is handed the output gradient as it comes (a model's
    transposed output gives (B, L, H, D) memory); one whose last dim is strided is made
    unit-strided first (the kernel would misread it). Gradients equal the reference's."""
    B, H, L, S, E = 2, 2, 300, 300, 16
    mask, causal, S = _case(form, B, L, S, 7)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, L, E, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, S, E, generator=g, requires_grad=True) for _ in range(2))
    out, _ = sdpa.attention(q, k, v, mask, causal=causal, backend="fused")
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = sdpa.attention(*exact, mask, causal=causal, backend="reference").output
    up = torch.randn(out.shape, generator=g)
    shaped = {
        "contiguous": up,
        "(B, L, H, D) memory": up.transpose(1, 2).contiguous().transpose(1, 2),
        "last dim strided": up.mT.contiguous().mT,
    }[layout]
    assert shaped.stride(-1) != 1 or layout != "last dim strided"
    mine = torch.autograd.grad(out, (q, k, v), shaped)
    theirs = torch.autograd.grad(ref, exact, up.double())
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=0)
