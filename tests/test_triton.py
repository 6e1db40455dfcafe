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
    with pytest.raises(ValueError, match=r"lse must be a floating \(B, Hq, L\) = \(1, 3, 4\)"):
        received(q, k[:, :1], torch.zeros(1, 3, 5), scale=1.0)


# --- AttentionWeights on the kernels (told to use them on CPU) --------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """AttentionWeights uses the kernels on CPU; returns the names of the kernels run."""
    import sdpa.kernels.entropy as entropy_mod
    import sdpa.kernels.logits as logits_mod
    import sdpa.kernels.received as received_mod

    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    spy(entropy_mod, "entropy_and_max")
    spy(logits_mod, "max_logits")
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
    with torch.no_grad():
        got = {"entropy": w.entropy(), "amax": w.amax(-1), "sum": w.sum(dim=-2),
               "max_logits": w.max_logits().row}  # fmt: skip
    assert kernel_calls == ["entropy_and_max", "entropy_and_max", "received", "max_logits"]
    for what, fn in [("entropy", lambda w: w.entropy()), ("amax", lambda w: w.amax(-1)),
                     ("sum", lambda w: w.sum(dim=-2)),
                     ("max_logits", lambda w: w.max_logits().row)]:  # fmt: skip
        ref = _chunked(w, fn)
        assert got[what].shape == ref.shape and got[what].dtype == ref.dtype == torch.float32
        # received is sum_i exp(s_ij - lse_i) with the call's LSE, so it carries that
        # LSE's own error (torch's CPU flash kernel on bf16 inputs: ~6e-5 against the
        # float64 one), where the rows engine normalises each row by its own sum
        rtol = 1e-5 + (2 * _lse_error(w, q, k, mask, causal) if what == "sum" else 0.0)
        torch.testing.assert_close(got[what], ref, atol=5e-5, rtol=rtol)


def _lse_error(w, q, k, mask, causal) -> float:
    """max |LSE of the call - the float64 LSE| over rows that see a key."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q.double() @ kk.mT) * w._inputs.scale
    L, S = s.shape[-2:]
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    if isinstance(mask, masks.Mask):
        keep = keep & mask.materialize(L, S)
    elif mask is not None:
        keep = keep & mask
    exact = torch.logsumexp(s.masked_fill(~keep, -math.inf), dim=-1)
    seen = keep.expand(s.shape).any(-1)
    return float((w._log_sum_exp().double() - exact).abs()[seen].max())


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
    torch.testing.assert_close(w64.amax(-1), oracle(q, k, v)[1].amax(-1), atol=1e-12, rtol=0)
    assert kernel_calls == []


# --- single-pass statistics: entropy_and_max, received, max_logits --------------------


def _mask_more(gen, kind, B, H, L, S):
    """More mask layouts for the single-pass kernels, each with a row that sees no key
    where the layout allows one: stride-0 broadcasts and a non-contiguous view."""
    if kind == "bool_1h_broadcast":  # (1, 1, L, S) seen as (B, H, L, S): strides 0, 0
        keep = torch.rand(1, 1, L, S, generator=gen) < 0.5
        keep[..., L // 2, :] = False
        return keep
    if kind == "float_inf_heads":  # (B, H, L, S) additive with -inf, a dead row per head
        bias = torch.randn(B, H, L, S, generator=gen)
        bias = bias.masked_fill(torch.rand(B, H, L, S, generator=gen) < 0.3, -torch.inf)
        bias[:, :, L - 1] = -torch.inf
        return bias
    if kind == "float_transposed":  # (L, S) view of an (S, L) tensor: strides (1, L)
        return torch.randn(S, L, generator=gen).mT
    return _mask(gen, kind, B, H, L, S)


# (dtype, B, Hq, Hkv, L, S, E, causal, mask kind, scale): sizes that are not multiples
# of the tiles (16 here, the sm90 ones below), 1, head sizes 40/59/80/128, GQA, every
# mask layout, causal top-left with L = S, L > S and L < S, non-default, negative, 0
ONE_PASS = [
    (torch.float32, 2, 4, 2, 37, 53, 40, False, "bool_heads", 0.3),
    (torch.float32, 1, 2, 2, 50, 50, 59, True, "none", None),
    (torch.bfloat16, 2, 2, 1, 33, 33, 80, True, "key_padding", None),
    (torch.float16, 1, 2, 1, 64, 17, 16, False, "float_2d", 1.7),
    (torch.bfloat16, 1, 3, 1, 45, 70, 128, False, "float_inf_heads", -0.2),
    (torch.float32, 2, 2, 1, 41, 29, 32, False, "bool_1h_broadcast", 0.5),
    (torch.bfloat16, 1, 2, 2, 70, 45, 40, True, "float_transposed", None),
    (torch.float32, 1, 2, 1, 20, 57, 32, True, "none", 0.0),
    (torch.float32, 1, 2, 1, 1, 40, 32, False, "bool_heads", None),
    (torch.float32, 1, 2, 2, 40, 1, 32, True, "none", None),
    (torch.float32, 1, 1, 1, 1, 1, 16, False, "none", None),
]
ONE_PASS_IDS = [
    "f32-gqa-bool-e40", "f32-causal-e59", "bf16-causal-padding-e80", "f16-float2d",
    "bf16-floatinf-e128-negscale", "f32-broadcast-bool", "bf16-causal-l>s-transposed",
    "f32-causal-l<s-scale0", "f32-l1", "f32-s1-causal", "f32-1x1",
]  # fmt: skip


def _one_pass_case(gen, case):
    dtype, B, Hq, Hkv, L, S, E, causal, kind, scale = case
    q = randn(gen, B, Hq, L, E, dtype=dtype)
    k = randn(gen, B, Hkv, S, E, dtype=dtype)
    v = randn(gen, B, Hkv, S, 8, dtype=dtype)
    mask = _mask_more(gen, kind, B, Hq, L, S)
    return q, k, v, mask, causal, 1 / math.sqrt(E) if scale is None else scale


@pytest.mark.parametrize("case", ONE_PASS, ids=ONE_PASS_IDS)
def test_entropy_and_max_match_the_oracle(gen, case):
    from sdpa.kernels.entropy import entropy_and_max

    q, k, v, mask, causal, scale = _one_pass_case(gen, case)
    _, ref_lse, ref_ent, ref_top, _ = _oracle_stats(q, k, v, mask, causal, scale)
    ent, top = entropy_and_max(q, k, ref_lse.float(), mask, causal=causal, scale=scale)
    assert ent.shape == top.shape == ref_ent.shape and ent.dtype == top.dtype == torch.float32
    # statistics depend on q and k only: float32 accuracy whatever the input dtype
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-6, rtol=0)
    dead = ref_top == 0  # rows with no key: 0, exactly
    assert (ent[dead] == 0).all() and (top[dead] == 0).all()
    assert dead.any() == (case[8] not in ("none", "float_transposed"))


@pytest.mark.parametrize("case", ONE_PASS, ids=ONE_PASS_IDS)
def test_one_pass_received_matches_the_oracle(gen, case):
    from sdpa.kernels.received import received

    q, k, v, mask, causal, scale = _one_pass_case(gen, case)
    _, ref_lse, _, _, ref_sum = _oracle_stats(q, k, v, mask, causal, scale)
    got = received(q, k, ref_lse.float(), mask, causal=causal, scale=scale)
    assert got.shape == ref_sum.shape and got.dtype == torch.float32
    L = q.shape[2]
    torch.testing.assert_close(got.double(), ref_sum, atol=1e-5 * max(1, L), rtol=1e-5)


@pytest.mark.parametrize("case", ONE_PASS, ids=ONE_PASS_IDS)
def test_max_logits_match_the_oracle(gen, case):
    from sdpa.kernels.logits import max_logits

    q, k, _, mask, causal, scale = _one_pass_case(gen, case)
    ref = _scores(q, k, mask, causal, scale).amax(-1)  # (B, Hq, L); -inf: no key
    rows, heads = max_logits(q, k, mask, causal=causal, scale=scale)
    assert rows.shape == ref.shape and heads.shape == ref.shape[:2]
    assert rows.dtype == heads.dtype == torch.float32
    assert torch.equal(rows == -math.inf, ref == -math.inf)  # rows that see no key
    torch.testing.assert_close(rows.double(), ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(heads.double(), ref.amax(-1), atol=1e-5, rtol=1e-6)


PIPELINED_CASES = [ONE_PASS[i] for i in (0, 1, 2, 6, 7, 9)]  # dense, causal, L > S, S = 1


@pytest.mark.parametrize("case", PIPELINED_CASES, ids=[ONE_PASS_IDS[i] for i in (0, 1, 2, 6, 7, 9)])
def test_the_pipelined_loops_give_the_same_statistics(gen, case):
    """Config.pipelined: the unmasked loop issues the next tile's product before this
    tile's exponentials (a prologue, a shifted loop, an epilogue; none where no block is
    unmasked); entropy, max and received as the oracle's."""
    from sdpa.kernels import configs
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.received import received

    q, k, v, mask, causal, scale = _one_pass_case(gen, case)
    _, lse, ref_ent, ref_top, ref_sum = _oracle_stats(q, k, v, mask, causal, scale)
    with configs.use(configs.Config(16, 16, 4, 1, pipelined=True)):
        ent, top = entropy_and_max(q, k, lse.float(), mask, causal=causal, scale=scale)
        sums = received(q, k, lse.float(), mask, causal=causal, scale=scale)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-6, rtol=0)
    torch.testing.assert_close(sums.double(), ref_sum, atol=1e-5 * q.shape[2], rtol=1e-5)


SM90_SIZES = [(False, "none", 200, 333), (True, "none", 300, 300), (False, "bool_heads", 130, 70)]


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
@pytest.mark.parametrize("causal,kind,L,S", SM90_SIZES, ids=["dense", "causal", "bool"])
def test_the_sm90_tiles_under_the_interpreter(gen, causal, kind, L, S, pipelined):
    """The pinned GPU configs (128-row tiles) run the same loops: full blocks, the
    diagonal and the tails, at sizes that are not multiples of them."""
    from sdpa.kernels import configs
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k, v, _ = _inputs(gen, torch.bfloat16, 1, 2, 1, L, S, 128, 8, "none")
    mask = _mask(gen, kind, 1, 2, L, S)
    _, lse, ref_ent, ref_top, ref_sum = _oracle_stats(q, k, v, mask, causal, 0.1)
    lse = lse.float()
    ref_max = _scores(q, k, mask, causal, 0.1).amax(-1)
    entropy_cfg, received_cfg = configs.SM90["entropy"][0], configs.SM90["received"][0]
    with configs.use(entropy_cfg._replace(pipelined=pipelined)):
        ent, top = entropy_and_max(q, k, lse, mask, causal=causal, scale=0.1)
    with configs.use(received_cfg._replace(pipelined=pipelined)):
        got_sum = received(q, k, lse, mask, causal=causal, scale=0.1)
    with configs.use(configs.SM90["max_logits"][0]):
        rows, _ = max_logits(q, k, mask, causal=causal, scale=0.1)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-6, rtol=0)
    torch.testing.assert_close(got_sum.double(), ref_sum, atol=1e-5 * L, rtol=1e-5)
    torch.testing.assert_close(rows.double(), ref_max, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kind,causal", [("none", False), ("none", True), ("bool_heads", False), ("float_2d", True)]
)
def test_one_pass_kernels_match_the_chunked_engine(gen, dtype, kind, causal):
    """Fed the LSE of sdpa.attention's own call, the kernels give what the chunked
    engine reads from AttentionWeights (entropy, amax, sum over the queries), up to
    that LSE's own error (torch's CPU kernel's bf16 LSE is off by ~5e-5: the chunked
    engine's p = exp(s - lse) carries it, the entropy kernel normalises it away)."""
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.received import received

    L, S = (45, 45) if causal else (37, 61)
    q, k, v, mask = _inputs(gen, dtype, 2, 4, 2, L, S, 40, 16, kind)
    w = sdpa.attention(q, k, v, mask, causal=causal, scale=0.35).weights
    ref = _chunked(w, lambda w: (w.entropy(), w.amax(-1), w.sum(dim=-2)))
    slack = (w.lse.double() - _oracle_stats(q, k, v, mask, causal, 0.35)[1]).abs().max().item()
    mask4 = _mask4(mask)
    ent, top = entropy_and_max(q, k, w.lse, mask4, causal=causal, scale=0.35)
    got_sum = received(q, k, w.lse, mask4, causal=causal, scale=0.35)
    torch.testing.assert_close(ent, ref[0], atol=5e-5 + slack, rtol=1e-5)
    torch.testing.assert_close(top, ref[1], atol=5e-6 + slack, rtol=1e-5)
    torch.testing.assert_close(got_sum, ref[2], atol=(5e-5 + 2 * slack) * L, rtol=1e-5)


def test_entropy_under_a_huge_bias_is_the_listings(gen):
    """A row under a -1e9 bias: the fused LSE has lost its digits, yet entropy and max
    come out as the chunked engine's (the float32 listing's: uniform weights), since
    the kernel normalises by its own sum."""
    from sdpa.kernels.entropy import entropy_and_max

    q, k, v, _ = _inputs(gen, torch.float32, 1, 2, 1, 6, 40, 16, 16, "none")
    bias = torch.randn(6, 40, generator=gen)
    bias[2] = -1e9
    bias[4, :20] = -1e9  # half the keys swallowed: the other half keep their weights
    w = sdpa.attention(q, k, v, bias).weights
    ref_ent, ref_top = _chunked(w, lambda w: (w.entropy(), w.amax(-1)))
    ent, top = entropy_and_max(q, k, w.lse, bias[None, None], scale=0.25)
    torch.testing.assert_close(ent, ref_ent, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(top, ref_top, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(ent[..., 2], torch.full((1, 2), math.log(40)), atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the NaN tiles
def test_nan_and_inf_scores_make_the_listings_nan(gen):
    """A NaN or +inf score where the row sees the key: the listing's softmax row is NaN,
    so entropy and max of that row are NaN, every key of that head receives NaN, and
    the max logit is NaN (NaN) or +inf (+inf). A NaN score a bool mask hides is never
    seen (the listing's masked_fill replaces it); one under a -inf bias is NaN, as
    NaN + -inf is in the listing."""
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    B, H, L, S = 1, 4, 20, 37
    q, k, v, _ = _inputs(gen, torch.float32, B, H, 1, L, S, 32, 8, "none")
    q[0, 0, 3, 5] = math.nan  # head 0, row 3: every score NaN
    q[0, 3, 7, 0] = math.nan  # head 3, row 7: NaN scores under a -inf bias row
    bias = torch.randn(B, H, L, S, generator=gen)
    bias[0, 1, 5, 2] = math.inf  # head 1, row 5: +inf
    bias[0, 1, 9, 30] = math.nan  # head 1, row 9: NaN in the mask
    bias[0, 3, 7] = -math.inf
    lse = _oracle_stats(q, k, v, bias, False, 0.2)[1].float().nan_to_num(0.0)
    ent, top = entropy_and_max(q, k, lse, bias, scale=0.2)
    sums = received(q, k, lse, bias, scale=0.2)
    rows, heads = max_logits(q, k, bias, scale=0.2)
    nan_rows = {(0, 3), (1, 5), (1, 9), (3, 7)}
    for h in range(H):
        for i in range(L):
            assert ent[0, h, i].isnan() == ((h, i) in nan_rows), (h, i)
            assert top[0, h, i].isnan() == ((h, i) in nan_rows), (h, i)
    assert sums[0, [0, 1, 3]].isnan().all() and sums[0, 2].isfinite().all()
    assert rows[0, 0, 3].isnan() and rows[0, 1, 9].isnan() and rows[0, 3, 7].isnan()
    assert rows[0, 1, 5] == math.inf
    assert heads[0, [0, 1, 3]].isnan().all() and heads[0, 2].isfinite()
    torch.testing.assert_close(rows[0, 2].double(), _scores(q, k, bias, False, 0.2)[0, 2].amax(-1),
                               atol=1e-5, rtol=1e-6)  # fmt: skip
    # a bool mask hides row 3 of head 0 and row 7 of head 3: dead rows, nothing NaN
    keep = torch.rand(B, H, L, S, generator=gen) < 0.7
    keep[0, 0, 3] = keep[0, 3, 7] = False
    _, lse, ref_ent, ref_top, ref_sum = _oracle_stats(q, k, v, keep, False, 0.2)
    ent, top = entropy_and_max(q, k, lse.float(), keep, scale=0.2)
    sums = received(q, k, lse.float(), keep, scale=0.2)
    rows, heads = max_logits(q, k, keep, scale=0.2)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-6, rtol=0)
    torch.testing.assert_close(sums.double(), ref_sum, atol=1e-5 * L, rtol=1e-5)
    assert rows[0, 0, 3] == rows[0, 3, 7] == -math.inf and heads.isfinite().all()


def test_scale_zero_gives_uniform_weights(gen):
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    L = S = 23
    q, k, _, _ = _inputs(gen, torch.bfloat16, 1, 2, 1, L, S, 40, 8, "none")
    seen = torch.arange(1, L + 1, dtype=torch.float32)  # causal: row i sees i + 1 keys
    lse = seen.log().expand(1, 2, L)
    ent, top = entropy_and_max(q, k, lse, causal=True, scale=0.0)
    torch.testing.assert_close(ent[0, 1], seen.log(), atol=1e-5, rtol=0)
    torch.testing.assert_close(top[0, 1], 1 / seen, atol=1e-6, rtol=0)
    sums = received(q, k, lse, causal=True, scale=0.0)  # key j: sum over i >= j of 1/(i+1)
    want = (1 / seen).flip(0).cumsum(0).flip(0)
    torch.testing.assert_close(sums[0, 0], want, atol=1e-5, rtol=0)
    rows, heads = max_logits(q, k, causal=True, scale=0.0)
    assert (rows == 0).all() and (heads == 0).all()


def test_one_pass_kernels_on_empty_inputs(gen):
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k = randn(gen, 2, 2, 5, 16), randn(gen, 2, 2, 0, 16)  # no key at all
    ent, top = entropy_and_max(q, k, torch.zeros(2, 2, 5), scale=0.5)
    assert ent.shape == (2, 2, 5) and (ent == 0).all() and (top == 0).all()
    rows, heads = max_logits(q, k, scale=0.5)
    assert (rows == -math.inf).all() and heads.shape == (2, 2) and (heads == -math.inf).all()
    assert received(q, k, torch.zeros(2, 2, 5), scale=0.5).shape == (2, 2, 0)
    q0, k0 = randn(gen, 2, 2, 0, 16), randn(gen, 2, 2, 4, 16)  # no query
    assert (received(q0, k0, torch.zeros(2, 2, 0), scale=0.5) == 0).all()
    assert max_logits(q0, k0, scale=0.5)[1].shape == (2, 2)


def test_one_pass_kernels_refuse_what_they_cannot_honour(gen):
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k, lse = randn(gen, 1, 4, 6, 16), randn(gen, 1, 2, 9, 16), torch.zeros(1, 4, 6)
    with pytest.raises(ValueError, match=r"entropy_and_max: k must be \(B, Hkv, S, E\)"):
        entropy_and_max(q, randn(gen, 1, 3, 9, 16), lse, scale=1.0)
    with pytest.raises(ValueError, match=r"received: lse must be a floating \(B, Hq, L\)"):
        received(q, k, torch.zeros(1, 4, 7), scale=1.0)
    with pytest.raises(TypeError, match=r"max_logits: mask must be bool .* got torch.int64"):
        max_logits(q, k, torch.ones(6, 9, dtype=torch.int64), scale=1.0)
    with pytest.raises(ValueError, match=r"mask \(6, 8\) does not broadcast to"):
        max_logits(q, k, torch.ones(6, 8, dtype=torch.bool), scale=1.0)
    with pytest.raises(TypeError, match=r"scale must be a Python float"):
        entropy_and_max(q, k, lse, scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"cannot run these inputs: dtype torch.float64"):
        max_logits(q.double(), k.double(), scale=1.0)
    with pytest.raises(ValueError, match=r"q must be a 4-D tensor"):
        received(q[0], k, lse, scale=1.0)
    with pytest.raises(TypeError, match=r"q and k must share dtype"):
        max_logits(q, k.to(torch.bfloat16), scale=1.0)


def test_more_heads_than_one_grid_takes_run_in_several_launches(gen, monkeypatch):
    """B x H programs past CUDA's 65,535 on a grid's second axis: one launch per slice,
    each from its first (batch, head). With the limit at 3, 2 x 4 heads take 3 launches."""
    from sdpa.kernels import launch
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k, v, mask = _inputs(gen, torch.float32, 2, 4, 2, 21, 19, 16, 8, "bool_heads")
    _, lse, ref_ent, ref_top, ref_sum = _oracle_stats(q, k, v, mask, False, 0.3)
    ref_max = _scores(q, k, mask, False, 0.3).amax(-1)
    monkeypatch.setattr(launch, "MAX_GRID_Y", 3)
    assert launch.head_blocks(8) == [(0, 3), (3, 3), (6, 2)]
    ent, top = entropy_and_max(q, k, lse.float(), mask, scale=0.3)
    sums = received(q, k, lse.float(), mask, scale=0.3)
    rows, _ = max_logits(q, k, mask, scale=0.3)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(top.double(), ref_top, atol=2e-6, rtol=0)
    torch.testing.assert_close(sums.double(), ref_sum, atol=1e-5 * 21, rtol=1e-5)
    torch.testing.assert_close(rows.double(), ref_max, atol=1e-5, rtol=1e-6)


def test_one_pass_kernels_refuse_inputs_that_require_grad(gen, monkeypatch):
    """They have no backward: a result that would be silently detached is refused, and
    under no_grad they run."""
    from sdpa.kernels import launch
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k = randn(gen, 1, 2, 5, 16).requires_grad_(), randn(gen, 1, 2, 7, 16)
    lse = torch.zeros(1, 2, 5)
    for call in (lambda: entropy_and_max(q, k, lse, scale=0.5),
                 lambda: received(q, k, lse, scale=0.5),
                 lambda: max_logits(q, k, scale=0.5)):  # fmt: skip
        with pytest.raises(ValueError, match=r"has no backward, and an input requires grad"):
            call()
        with torch.no_grad():
            call()
    # CPU tensors outside the interpreter: refused, naming what would work
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"CPU tensors run only under Triton's interpreter"):
        max_logits(q.detach(), k, scale=0.5)
