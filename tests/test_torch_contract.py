"""The drop-in keeps torch's contract to the letter; nothing is silently wrong.

torch's own mask objects, tensor subclasses, nested tensors, the meta device, flag
types, and the exception classes code written for torch catches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import sdpa

from conftest import randn
from oracle import oracle


def torch_bias(variant, L, S):
    with warnings.catch_warnings():  # lower-right with L > S: torch warns of NaNs (gives 0)
        warnings.simplefilter("ignore")
        return {"upper_left": causal_upper_left, "lower_right": causal_lower_right}[variant](L, S)


# Every torch object documented as an SDPA mask, and what sdpa makes of it.
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("L,S", [(128, 256), (256, 128), (7, 7), (1, 300), (300, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_bias_is_the_causal_mask_of_its_alignment(gen, variant, L, S, dtype):
    q = randn(gen, 2, 4, L, 16, dtype=dtype)
    k, v = randn(gen, 2, 2, S, 16, dtype=dtype), randn(gen, 2, 2, S, 16, dtype=dtype)
    bias = torch_bias(variant, L, S)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    ours = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
    # sdpa.attention reads it as sdpa.masks.causal of the same alignment
    align = "top-left" if variant == "upper_left" else "bottom-right"
    out, w = sdpa.attention(q, k, v, bias)
    twin = sdpa.masks.causal(align).materialize(L, S)
    want_out, want_p = oracle(q, k, v, twin)
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=0)
    w_tol = 1e-5 if dtype == torch.float32 else 1e-4  # the fp16 kernel's LSE: ~5e-5
    torch.testing.assert_close(w[0, 1].double(), want_p[0, 1], atol=w_tol, rtol=0)


def test_causal_bias_with_is_causal_raises_torchs_error(gen):
    q = randn(gen, 1, 1, 4, 8)
    for call in (F.scaled_dot_product_attention, sdpa.scaled_dot_product_attention):
        with pytest.raises(ValueError, match=r"^CausalBias should not be used with causal=True$"):
            call(q, q, q, attn_mask=causal_upper_left(4, 4), is_causal=True)
    # sdpa.attention ANDs causal=True with the mask, as with any mask
    out, _ = sdpa.attention(q, q, q, causal_lower_right(4, 4), causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_flex_block_mask_is_refused_like_torch(gen):
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
    q = randn(gen, 1, 1, 128, 8)
    with pytest.raises(TypeError, match=r"must be Tensor, not BlockMask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=block_mask)
    with pytest.raises(TypeError, match=r"mask must be None, a torch.Tensor .* got BlockMask"):
        sdpa.scaled_dot_product_attention(q, q, q, attn_mask=block_mask)


class LoggedTensor(torch.Tensor):
    """A subclass whose meaning lives in __torch_function__ (here: every value is 0)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("where", ["mask", "query", "key", "value"])
def test_subclasses_with_their_own_torch_function_are_refused(gen, where):
    q = randn(gen, 1, 2, 4, 8)
    args = {"query": q, "key": q, "value": q, "mask": torch.zeros(4, 4)}
    args[where] = args[where].as_subclass(LoggedTensor)
    pattern = rf"{where} is a LoggedTensor, a tensor subclass with its own __torch_function__"
    with pytest.raises(TypeError, match=pattern):
        sdpa.attention(args["query"], args["key"], args["value"], args["mask"])
    with pytest.raises(TypeError, match=pattern):
        sdpa.scaled_dot_product_attention(args["query"], args["key"], args["value"], args["mask"])


def test_parameters_and_other_plain_subclasses_are_tensors(gen):
    q = torch.nn.Parameter(randn(gen, 1, 2, 4, 8))
    mask = torch.nn.Parameter(randn(gen, 4, 4), requires_grad=False)
    out = sdpa.scaled_dot_product_attention(q, q, q, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, mask))


def test_nested_tensors_are_refused_by_attention_with_the_way_out(gen):
    q = torch.nested.nested_tensor(
        [randn(gen, 3, 2, 8), randn(gen, 5, 2, 8)], layout=torch.jagged
    ).transpose(1, 2)
    with pytest.raises(TypeError, match=r"query is a nested tensor.*sdpa.masks.padding"):
        sdpa.attention(q, q, q)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "padding"])
def test_meta_tensors_give_shapes(mask_kind):
    q = torch.empty(2, 4, 6, 8, device="meta")
    k, v = torch.empty(2, 2, 6, 8, device="meta"), torch.empty(2, 2, 6, 5, device="meta")
    mask = {
        "none": None,
        "bool": torch.empty(2, 1, 1, 6, dtype=torch.bool, device="meta"),
        "float": torch.empty(6, 6, device="meta"),
        "causal": sdpa.masks.causal(),
        "padding": sdpa.masks.padding([3, 6]),
    }[mask_kind]
    if not isinstance(mask, sdpa.masks.Mask):
        theirs = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        ours = sdpa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        assert ours.shape == theirs.shape and ours.device.type == "meta"
    out, w = sdpa.attention(q, k, v, mask)
    assert out.shape == (2, 4, 6, 5) and out.device.type == "meta"
    answers = {
        "full": (w.full(), (2, 4, 6, 6)),
        "rows": (w[1, :, 2:4], (4, 2, 6)),
        "lse": (w.lse, (2, 4, 6)),
        "sum": (w.sum(dim=-2), (2, 4, 6)),
        "mean": (w.mean(dim=-2), (2, 4, 6)),
        "entropy": (w.entropy(), (2, 4, 6)),
        "amax": (w.amax(-1), (2, 4, 6)),
        "topk": (w.topk(3)[1], (2, 4, 6, 3)),
    }
    for name, (t, shape) in answers.items():
        assert t.shape == shape and t.device.type == "meta", name


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"is_causal": "yes"}, r"is_causal must be True or False, got 'yes' \(str\)"),
        ({"is_causal": 1}, r"is_causal must be True or False, got 1 \(int\)"),
        ({"is_causal": torch.tensor(True)}, r"is_causal must be True or False"),
        ({"enable_gqa": 1}, r"enable_gqa must be True or False, got 1 \(int\)"),
    ],
)
def test_flags_must_be_bools_like_torch(gen, kwargs, pattern):
    q = randn(gen, 1, 2, 4, 8)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, **kwargs)
    with pytest.raises(TypeError, match=pattern):
        sdpa.scaled_dot_product_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("causal", ["yes", 1, None, torch.tensor(True)])
def test_attention_causal_must_be_a_bool(gen, causal):
    q = randn(gen, 1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"causal must be True or False"):
        sdpa.attention(q, q, q, causal=causal)


@pytest.mark.parametrize("dropout_p", [0, True, False, torch.tensor(0.0)])
def test_drop_in_takes_the_dropout_values_torch_takes(gen, dropout_p):
    q = randn(gen, 1, 2, 4, 8)
    torch.manual_seed(0)
    theirs = F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p)
    ours = sdpa.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p)
    if float(dropout_p) == 0.0:
        torch.testing.assert_close(ours, theirs)
    else:  # p = 1 drops every weight
        assert ours.shape == theirs.shape and not ours.any()


@pytest.mark.parametrize("max_bytes", ["1GB", -1, 1.5, True])
def test_max_bytes_is_checked(gen, max_bytes):
    q = randn(gen, 1, 2, 4, 8)
    _, w = sdpa.attention(q, q, q)
    with pytest.raises(TypeError, match=r"max_bytes must be a non-negative int \(bytes\) or None"):
        w.full(max_bytes=max_bytes)
    with pytest.raises(TypeError, match=r"max_bytes must be a non-negative int"):
        sdpa.masks.causal().materialize(4, 4, max_bytes=max_bytes)


def refusals(gen):
    """One call per kind of refusal, each raising an sdpa error."""
    q = randn(gen, 1, 2, 4, 8)
    _, w = sdpa.attention(q, q, q)
    return {
        "shape": lambda: sdpa.attention(q, randn(gen, 1, 2, 4, 7), q),
        "dtype": lambda: sdpa.attention(q, q.double(), q),
        "mask type": lambda: sdpa.attention(q, q, q, "causal"),
        "mask broadcast": lambda: sdpa.attention(q, q, q, torch.ones(3, 4, dtype=torch.bool)),
        "causal L != S": lambda: sdpa.attention(q, q[..., :3, :], q[..., :3, :], causal=True),
        "scale": lambda: sdpa.attention(q, q, q, scale="big"),
        "dropout": lambda: sdpa.attention(q, q, q, dropout_p=2.0),
        "gqa": lambda: sdpa.scaled_dot_product_attention(q, q[:, :1].expand(1, 2, 4, 8)[:, :0], q),
        "backend": lambda: sdpa.attention(q, q, q, backend="flash"),
        "not supported": lambda: sdpa.attention(q, q, q, dropout_p=0.5, backend="fused"),
        "topk": lambda: w.topk(9),
        "budget": lambda: w.full(max_bytes=8),
        "mask arg": lambda: sdpa.masks.sliding_window(0),
        "module": lambda: sdpa.MultiHeadAttention(10, 3),
        "attn_mask with is_causal": lambda: sdpa.scaled_dot_product_attention(
            q, q, q, torch.ones(4, 4, dtype=torch.bool), is_causal=True
        ),
    }


def test_every_refusal_is_a_runtime_error_like_torchs(gen):
    """Code written for torch falls back on `except RuntimeError`; ours keep their
    Python class too (ValueError, TypeError, MemoryError)."""
    for name, call in refusals(gen).items():
        with pytest.raises(RuntimeError) as caught:
            call()
        assert type(caught.value).__module__ == "sdpa.errors", name
        assert isinstance(caught.value, ValueError | TypeError | MemoryError), name
