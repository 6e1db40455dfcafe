"""MultiHeadAttention: reproduces torch.nn.MultiheadAttention, and gives its weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdpa import MultiHeadAttention

from oracle import oracle

pytestmark = pytest.mark.small_shapes  # the engines as users run them on these shapes

mask_from_torch = MultiHeadAttention.mask_from_torch


def torch_pair(gen, d_model=64, heads=4, dropout=0.0, bias=True):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    ref = nn.MultiheadAttention(d_model, heads, dropout=dropout, bias=bias, batch_first=True)
    return ref.eval(), MultiHeadAttention.from_torch(ref).eval()


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_reproduces_outputs_and_per_head_weights(gen, cross, bias):
    ref, ours = torch_pair(gen, bias=bias)
    x = torch.randn(3, 11, 64, generator=gen)
    mem = torch.randn(3, 17, 64, generator=gen) if cross else x
    S = mem.shape[1]
    padding = torch.arange(S) >= torch.tensor([[S], [S - 4], [5]])  # torch: True = ignore
    ref_out, ref_w = ref(x, mem, mem, key_padding_mask=padding, average_attn_weights=False)
    out, w = ours(x, mem, mem, mask_from_torch(key_padding_mask=padding))
    assert out.shape == (3, 11, 64) and w.shape == (3, 4, 11, S)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.full(), ref_w, atol=1e-5, rtol=0)


def test_torch_attn_mask_and_padding_combine(gen):
    ref, ours = torch_pair(gen)
    x = torch.randn(2, 9, 64, generator=gen)
    causal_ignore = torch.ones(9, 9, dtype=torch.bool).triu(1)  # torch: True = ignore
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 7:] = True
    ref_out, ref_w = ref(
        x, x, x, attn_mask=causal_ignore, key_padding_mask=padding, average_attn_weights=False
    )
    out, w = ours(x, mask=mask_from_torch(causal_ignore, padding))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.full(), ref_w, atol=1e-5, rtol=0)
    float_bias = torch.randn(2 * 4, 9, 9, generator=gen)  # (B * num_heads, L, S), added
    pad_bias = torch.zeros(2, 9).masked_fill(padding, -torch.inf)  # torch wants one type
    ref_out, _ = ref(x, x, x, attn_mask=float_bias, key_padding_mask=pad_bias)
    out, _ = ours(x, mask=mask_from_torch(float_bias, padding, num_heads=4))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)


def test_mask_polarity_is_converted_only_at_the_torch_edge():
    ignore = torch.tensor([[False, True]])
    assert torch.equal(mask_from_torch(key_padding_mask=ignore), ~ignore[:, None, None, :])
    assert mask_from_torch() is None
    with pytest.raises(ValueError, match=r"pass the num_heads that divides its first dim"):
        mask_from_torch(torch.zeros(8, 3, 3))
    with pytest.raises(ValueError, match=r"pass the num_heads .* got 3"):
        mask_from_torch(torch.zeros(8, 3, 3), num_heads=3)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, S\), got \(5,\)"):
        mask_from_torch(None, torch.zeros(5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"key_padding_mask must be bool .* got torch.uint8"):
        mask_from_torch(None, torch.zeros(2, 5, dtype=torch.uint8))


def test_matches_oracle_with_gqa_and_causal(gen):
    torch.manual_seed(0)
    m = MultiHeadAttention(48, 6, kv_heads=2).eval()
    x = torch.randn(2, 13, 48, generator=gen)
    out, w = m(x, causal=True)
    D = 8
    q = m.q_proj(x).view(2, 13, 6, D).transpose(1, 2)
    k = m.k_proj(x).view(2, 13, 2, D).transpose(1, 2)
    v = m.v_proj(x).view(2, 13, 2, D).transpose(1, 2)
    ref_out, ref_p = oracle(q.detach(), k.detach(), v.detach(), causal=True)
    ref_out = m.out_proj(ref_out.float().transpose(1, 2).reshape(2, 13, 48))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.full().double(), ref_p, atol=2e-5, rtol=0)
    assert m.k_proj.out_features == 16  # key/value projected to kv_heads heads only


def test_gradients_flow_to_every_parameter(gen):
    m = MultiHeadAttention(32, 4)
    x = torch.randn(2, 7, 32, generator=gen, requires_grad=True)
    m(x).output.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dropout_only_in_training(gen):
    m = MultiHeadAttention(32, 4, dropout=0.5)
    x = torch.randn(2, 7, 32, generator=gen)
    m.eval()
    a, b = m(x).output, m(x).output
    assert torch.equal(a, b)
    m.train()
    c, d = m(x).output, m(x).output
    assert not torch.allclose(c, d)
    # weights are the probabilities before dropout, in both modes
    torch.testing.assert_close(m(x).weights.full(), m.eval()(x).weights.full())


def test_from_torch_keeps_training_mode_dtype_and_dropout():
    ref = nn.MultiheadAttention(16, 2, dropout=0.25, batch_first=True).double()
    ours = MultiHeadAttention.from_torch(ref)
    assert ours.training and ours.dropout == 0.25 and ours.q_proj.weight.dtype == torch.float64


@pytest.mark.parametrize(
    "make,exc,pattern",
    [
        (lambda: MultiHeadAttention(30, 4), ValueError, r"d_model=30 and num_heads=4"),
        (lambda: MultiHeadAttention(32, 4, kv_heads=3), ValueError, r"kv_heads=3 and num_heads=4"),
        (lambda: MultiHeadAttention(32, 4, dropout=2.0), ValueError, r"dropout must be"),
        (lambda: MultiHeadAttention.from_torch(nn.Linear(2, 2)), TypeError, r"MultiheadAttention"),
        (
            lambda: MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4)),
            ValueError,
            r"kdim/vdim",
        ),
        (
            lambda: MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True)),
            ValueError,
            r"add_bias_kv",
        ),
    ],
)
def test_construction_refusals(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


def test_call_refusals_name_the_argument():
    m = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"key and value must have the same length"):
        m(torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match=r"key and value batch must be the query's \(1\) or 1"):
        m(torch.randn(1, 5, 16), torch.randn(2, 7, 16))


def test_call_refusals():
    m = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, length, d_model=32\), got \(7, 32\)"):
        m(torch.randn(7, 32))
    with pytest.raises(ValueError, match=r"key must be .* got \(1, 7, 16\)"):
        m(torch.randn(1, 7, 32), torch.randn(1, 7, 16))


def test_packed_projection_follows_parameters_changed_in_place_or_replaced(gen):
    """The q/k/v weights packed once for inference must follow an optimizer step (an
    in-place change) and a parameter replaced by another."""
    torch.manual_seed(gen.initial_seed())
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(2, 5, 32, generator=gen)

    def check():
        with torch.no_grad():
            want, want_w = ref(x, x, x, need_weights=True, average_attn_weights=False)
            got = ours(x)
        torch.testing.assert_close(got.output, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.weights.full(), want_w, atol=1e-5, rtol=0)

    check()  # packs
    with torch.no_grad():
        ref.in_proj_weight[:32].mul_(1.5)  # q rows of torch's packed weight
        ours.q_proj.weight.mul_(1.5)  # the same change, in place
    check()
    with torch.no_grad():
        ref.in_proj_bias[64:].add_(0.25)  # v
    old = ours.v_proj.bias
    new = nn.Parameter(old.detach() + 0.25)
    with torch.no_grad():
        while new._version < old._version:  # the same version: only its address differs
            new.add_(0.0)
    ours.v_proj.bias = new  # replaced
    check()


@pytest.mark.parametrize("three_gemms_tokens", [0, 10**6])  # one packed GEMM, three GEMMs
def test_both_projections_under_autograd_match_torch_with_gradients(
    gen, monkeypatch, three_gemms_tokens
):
    """Under autograd, self-attention projects with three GEMMs up to THREE_GEMMS_TOKENS
    tokens and with a fresh packed one past it: the same outputs and parameter
    gradients as torch's packed in_proj either way."""
    from sdpa.nn import multihead

    monkeypatch.setattr(multihead, "THREE_GEMMS_TOKENS", three_gemms_tokens)
    ref, ours = torch_pair(gen)
    x = torch.randn(2, 9, 64, generator=gen)
    ref_out, _ = ref(x, x, x)
    out = ours(x).output
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    up = torch.randn(out.shape, generator=gen)
    ref_out.backward(up)
    out.backward(up)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        proj = getattr(ours, name)
        rows = slice(64 * i, 64 * (i + 1))
        torch.testing.assert_close(
            proj.weight.grad, ref.in_proj_weight.grad[rows], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            proj.bias.grad, ref.in_proj_bias.grad[rows], atol=1e-5, rtol=1e-5
        )
    torch.testing.assert_close(
        ours.out_proj.weight.grad, ref.out_proj.weight.grad, atol=1e-5, rtol=1e-5
    )
