"""The Triton statistics kernels under Triton's interpreter, on CPU tensors.

Small sizes (the interpreter is slow): each kernel against the float64 oracle, and the
AttentionWeights wiring (told to use the kernels on CPU) against the chunked engine.
The interpreter must be chosen before triton is first imported, so this module sets
TRITON_INTERPRET=1 when there is no GPU; with a GPU the kernels run compiled and
tests/test_cuda.py checks them there.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sdpa
from sdpa import kernels, masks, weights

from conftest import randn
from oracle import oracle


def _skip_reason() -> str | None:
    why = kernels.unavailable()
    if why is not None:
        return why
    from sdpa.kernels.launch import interpreting

    if not interpreting():
        return (
            "triton runs compiled here (a GPU, or triton imported before TRITON_INTERPRET=1 "
            "was set); run `TRITON_INTERPRET=1 pytest tests/test_triton.py` for these"
        )
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _mask(gen, kind, B, H, L, S):
    """A mask of `kind` broadcasting to (B, H, L, S), with a row that sees no key."""
    if kind == "none":
        return None
    if kind == "bool_heads":  # (B, H, L, S), row 1 of every head sees nothing
        keep = torch.rand(B, H, L, S, generator=gen) < 0.6
        keep[:, :, min(1, L - 1)] = False
        return keep
    if kind == "key_padding":  # (B, 1, 1, S): batch 0 sees no key at all
        lengths = torch.tensor([0] + [S] * (B - 1))
        return (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S)
    if kind == "float_2d":  # (L, S) additive, -inf on row 0
        bias = torch.randn(L, S, generator=gen)
        bias[0] = -torch.inf
        return bias
    raise ValueError(kind)


def _scores(q, k, mask, causal, scale):
    """float64 scores (B, Hq, L, S) with -inf where excluded; GQA by repeating keys."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.mT * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        s = s + mask.double() if mask.is_floating_point() else s.masked_fill(~mask, -math.inf)
    return s


def _oracle_stats(q, k, v, mask, causal, scale):
    """(out, lse, entropy, max, received) in float64; rows with no key give 0."""
    out, p = oracle(q, k, v, mask, causal=causal, scale=scale)
    lse = _scores(q, k, mask, causal, scale).logsumexp(-1)
    lse = lse.masked_fill(lse == -math.inf, 0.0)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))
    return out, lse, -plogp.sum(-1), p.amax(-1), p.sum(-2)


# (dtype, B, Hq, Hkv, L, S, E, Ev, causal, mask kind, scale): awkward sizes, GQA, every
# mask layout, a row with no key in each masked case, non-default scales
CASES = [
    (torch.float32, 2, 4, 2, 17, 64, 16, 16, False, "bool_heads", 0.3),
    (torch.float32, 1, 2, 2, 64, 64, 32, 16, True, "none", None),
    (torch.bfloat16, 2, 2, 1, 17, 17, 32, 32, True, "key_padding", None),
    (torch.float16, 1, 2, 1, 64, 17, 16, 32, False, "float_2d", 1.7),
    (torch.float32, 1, 1, 1, 1, 1, 16, 16, False, "none", None),
]
IDS = ["f32-gqa-bool", "f32-causal", "bf16-causal-padding", "f16-float2d", "f32-1x1"]


def _inputs(gen, dtype, B, Hq, Hkv, L, S, E, Ev, kind):
    q = randn(gen, B, Hq, L, E, dtype=dtype)
    k = randn(gen, B, Hkv, S, E, dtype=dtype)
    v = randn(gen, B, Hkv, S, Ev, dtype=dtype)
    return q, k, v, _mask(gen, kind, B, Hq, L, S)


def _mask4(mask):
    """The kernels' mask layout: (B|1, H|1, L, S)."""
    return mask if mask is None or mask.ndim == 4 else mask[None, None]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_stats_match_the_oracle(gen, case):
    from sdpa.kernels.stats import forward_stats

    dtype, B, Hq, Hkv, L, S, E, Ev, causal, kind, scale = case
    q, k, v, mask = _inputs(gen, dtype, B, Hq, Hkv, L, S, E, Ev, kind)
    scale = 1 / math.sqrt(E) if scale is None else scale
    out, lse, ent, top = forward_stats(q, k, v, _mask4(mask), causal=causal, scale=scale)
    ref_out, ref_lse, ref_ent, ref_top, _ = _oracle_stats(q, k, v, mask, causal, scale)
    assert out.dtype == dtype and lse.dtype == ent.dtype == top.dtype == torch.float32
    # statistics depend on q and k only: float32 accuracy whatever the input dtype
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-6, rtol=0)
    err = (out.double() - ref_out).abs().max()
    if dtype == torch.float32:
        assert err <= 2e-5
    else:  # the flash-attention rule, against the listing's own error in that dtype:
        # P is rounded to 16 bits before P V, as in FlashAttention; over 300 seeds the
        # mean error was at most 1.8x the listing's and the max 2.6x
        low = (oracle(q, k, v, mask, causal=causal, scale=scale, dtype=dtype)[0].double()
               - ref_out).abs()  # fmt: skip
        assert err <= 4 * low.max() + 1e-6
        assert (out.double() - ref_out).abs().mean() <= 2.5 * low.mean() + 1e-7
    dead = ref_top == 0  # rows with no key: everything 0, exactly
    assert (lse[dead] == 0).all() and (ent[dead] == 0).all() and (out[dead] == 0).all()
    assert dead.any() == (kind != "none")


def test_statistics_only_skips_the_output(gen):
    from sdpa.kernels.stats import forward_stats

    q, k, v, mask = _inputs(gen, torch.float32, 1, 2, 1, 17, 33, 16, 16, "bool_heads")
    full = forward_stats(q, k, v, mask, scale=0.25)
    only = forward_stats(q, k, None, mask, scale=0.25)
    assert only[0] is None
    for a, b in zip(full[1:], only[1:], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_received_matches_the_oracle(gen, case):
    from sdpa.kernels.received import received

    dtype, B, Hq, Hkv, L, S, E, Ev, causal, kind, scale = case
    q, k, v, mask = _inputs(gen, dtype, B, Hq, Hkv, L, S, E, Ev, kind)
    scale = 1 / math.sqrt(E) if scale is None else scale
    _, ref_lse, _, _, ref_sum = _oracle_stats(q, k, v, mask, causal, scale)
    got = received(q, k, ref_lse.float(), _mask4(mask), causal=causal, scale=scale)
    assert got.shape == (B, Hq, S) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref_sum, atol=1e-5 * max(1, L), rtol=1e-5)


def test_received_keeps_query_heads_of_a_group_apart(gen):
    """GQA: two query heads on one key head receive different sums (not their total)."""
    from sdpa.kernels.received import received

    q, k, v, _ = _inputs(gen, torch.float32, 1, 2, 1, 17, 17, 16, 16, "none")
    q[:, 1] *= 3  # a sharper second head
    lse = _oracle_stats(q, k, v, None, False, 0.25)[1].float()
    got = received(q, k, lse, None, scale=0.25)
    assert not torch.allclose(got[:, 0], got[:, 1], atol=1e-3)
    torch.testing.assert_close(got.sum(-1), torch.full((1, 2), 17.0), atol=1e-4, rtol=0)


def test_kernels_refuse_heads_that_do_not_divide(gen):
    from sdpa.kernels.received import received
    from sdpa.kernels.stats import forward_stats

    q, k = randn(gen, 1, 3, 4, 16), randn(gen, 1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"key heads must divide query heads"):
        forward_stats(q, k, None, scale=1.0)
    with pytest.raises(ValueError, match=r"lse must be \(B, Hq, L\) = \(1, 3, 4\)"):
        received(q, k[:, :1], torch.zeros(1, 3, 5), scale=1.0)


# --- AttentionWeights on the kernels (told to use them on CPU) --------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """AttentionWeights uses the kernels on CPU; returns the names of the kernels run."""
    import sdpa.kernels.received as received_mod
    import sdpa.kernels.stats as stats_mod

    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(stats_mod, "forward_stats")
    spy(received_mod, "received")
    with sdpa.settings.override(kernel_devices={"cpu"}):
        yield calls


def _chunked(w, what):
    """The chunked engine's answer (kernels off)."""
    with weights.chunked_engine():
        return what(w)


MASKS = {
    "causal_flag": (None, True),
    "tensor_bool": ("tensor", False),
    "causal_bottom_right": (masks.causal(), False),
    "window_and_padding": (masks.sliding_window(5) & masks.padding([0, 20]), False),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_weights_statistics_on_the_kernels_match_the_chunked_engine(gen, kernel_calls, name):
    mask, causal = MASKS[name]
    L = 20 if causal else 13
    q, k, v, _ = _inputs(gen, torch.bfloat16, 2, 4, 2, L, 20, 16, 16, "none")
    if isinstance(mask, str):
        mask = _mask(gen, "bool_heads", 2, 4, L, 20)
    w = sdpa.attention(q, k, v, mask, causal=causal).weights
    got = {"entropy": w.entropy(), "amax": w.amax(), "sum": w.sum(dim=-2)}
    assert kernel_calls == ["forward_stats", "forward_stats", "received"]
    for what, fn in [("entropy", lambda w: w.entropy()), ("amax", lambda w: w.amax()),
                     ("sum", lambda w: w.sum(dim=-2))]:  # fmt: skip
        ref = _chunked(w, fn)
        assert got[what].shape == ref.shape and got[what].dtype == ref.dtype == torch.float32
        torch.testing.assert_close(got[what], ref, atol=5e-5, rtol=1e-5)


def test_weights_fall_back_where_the_kernels_cannot_serve(gen, kernel_calls):
    # a huge finite bias: the fused LSE has lost the digits the received kernel needs
    q, k, v, _ = _inputs(gen, torch.float32, 1, 1, 1, 4, 6, 16, 16, "none")
    bias = torch.zeros(4, 6)
    bias[2] = -1e9  # a row masked with the listing's -1e9: uniform weights
    w = sdpa.attention(q, k, v, bias).weights
    ref_p = oracle(q, k, v, bias)[1]
    ref_p[..., 2, :] = 1 / 6  # in float32, s + (-1e9) rounds to -1e9 for every key
    torch.testing.assert_close(w.sum(dim=-2).double(), ref_p.sum(-2), atol=1e-5, rtol=0)
    assert "received" not in kernel_calls
    kernel_calls.clear()
    # float64 is not a kernel dtype: the chunked engine serves, silently
    w64 = sdpa.attention(q.double(), k.double(), v.double()).weights
    torch.testing.assert_close(w64.amax(), oracle(q, k, v)[1].amax(-1), atol=1e-12, rtol=0)
    assert kernel_calls == []
