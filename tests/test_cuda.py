"""The fused backend and the Triton statistics on CUDA tensors, against the oracle.

Tests marked `cuda` skip without a device. The first tests run the CUDA glue's
device-independent parts (bias folding, rows with no key, GQA, the math path) on CPU
tensors, with torch's op choice forced to its math path, so they run everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import sdpa
from sdpa import masks, weights
from sdpa.backends import cuda

from conftest import MASK_KINDS, make_inputs, make_mask, randn
from oracle import oracle

# --- the CUDA glue on CPU tensors (math path) --------------------------------------


@pytest.fixture
def forced_math(monkeypatch):
    monkeypatch.setattr(cuda, "choice", lambda *args: cuda.MATH)


def _float_bias(mask, dtype):
    if mask is None or mask.is_floating_point():
        return mask
    zero = torch.zeros((), dtype=dtype)
    return torch.where(mask.bool(), zero, zero - torch.inf)


@pytest.mark.parametrize("mask_kind", ["none", "dead_rows", "float_inf", "key_padding"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_glue_math_path_matches_the_oracle(gen, forced_math, mask_kind, causal):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=9, S=9 if causal else 14, mask_kind=mask_kind)
    out, lse = cuda.kernel(q, k, v, _float_bias(mask, q.dtype), causal, 0.3)
    ref_out, ref_p = oracle(q, k, v, mask, causal=causal, scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    dead = ref_p.sum(-1) == 0
    assert lse.shape == (2, 4, 9) and (lse[dead] == 0).all() and (out[dead] == 0).all()


@pytest.mark.parametrize("mask_kind", ["bool", "dead_rows", "key_padding", "2d"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_glue_takes_a_bool_mask_as_it_is(gen, forced_math, mask_kind, causal):
    """The glue folds a bool keep-mask (and causality) into the bias itself: the same
    output and LSE as its additive form, rows that see no key 0."""
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=9, S=9 if causal else 14, mask_kind=mask_kind)
    out, lse = cuda.kernel(q, k, v, mask, causal, 0.3)
    out_f, lse_f = cuda.kernel(q, k, v, _float_bias(mask, q.dtype), causal, 0.3)
    torch.testing.assert_close(out, out_f, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, lse_f, atol=1e-6, rtol=0)
    ref_out, ref_p = oracle(q, k, v, mask, causal=causal, scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    dead = ref_p.sum(-1) == 0
    assert (lse[dead] == 0).all() and (out[dead] == 0).all()


def _naive_kernel(q, k, v, bias, causal, scale):
    """A kernel that does nothing for a row that sees no key: softmax of -inf is NaN."""
    s = (q @ k.mT) * scale + (0 if bias is None else bias)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def test_cuda_glue_keeps_a_kernels_nan_out_of_rows_that_see_no_key(gen, monkeypatch):
    """Such rows run unmasked (bias 0) and are zeroed after the op, so whatever the op
    does with an empty row, no NaN reaches the output, the LSE or the gradients."""
    monkeypatch.setattr(cuda, "choice", lambda *args: cuda.EFFICIENT)
    monkeypatch.setitem(cuda._RUN, cuda.EFFICIENT, _naive_kernel)
    q, k, v, mask = make_inputs(gen, L=12, S=10, mask_kind="dead_rows")
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = cuda.kernel(q, k, v, mask, False, 0.25)
    out.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oracle(*ref, mask, scale=0.25)[0].sum().backward()
    assert torch.isfinite(lse).all()
    for ours, theirs in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-10, rtol=0)


def test_cuda_glue_asks_torch_once_per_shape_class(gen, monkeypatch):
    """torch's choice is cached by what decides it (not the lengths): one question for
    the steps of a decoding loop, one more for another dtype or for causality."""
    asked = []
    monkeypatch.setattr(cuda, "choice", lambda *args: asked.append(args[0].dtype) or cuda.MATH)
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=1, S=30)
    cuda.kernel(q, k, v, None, False, 0.3)
    first = len(asked)  # (the math path asks again with the key heads repeated: 2)
    assert 1 <= first <= 2
    for S in (31, 32, 33):
        q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=1, S=S)
        cuda.kernel(q, k, v, None, False, 0.3)
    assert len(asked) == first
    cuda.kernel(q.double(), k.double(), v.double(), None, False, 0.3)
    assert len(asked) > first


def test_cuda_glue_folds_top_left_causal_for_l_not_s(gen, forced_math):
    q, k, v, _ = make_inputs(gen, L=5, S=8)
    out, _ = cuda.kernel(q, k, v, None, True, 0.25)
    ref = oracle(q, k, v, torch.ones(5, 8, dtype=torch.bool).tril(), scale=0.25)[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def test_cuda_glue_gradients_stay_finite_with_dead_rows(gen, forced_math):
    q, k, v, mask = make_inputs(gen, L=12, S=10, mask_kind="dead_rows")
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out, _ = cuda.kernel(q, k, v, _float_bias(mask, torch.float64), False, 0.25)
    out.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oracle(*ref, mask, scale=0.25)[0].sum().backward()
    for ours, theirs in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-10, rtol=0)


def test_cuda_glue_lse_loses_padding_and_trailing_dims():
    lse = torch.arange(2 * 3 * 32, dtype=torch.float32).view(2, 3, 32)  # padded along L
    assert torch.equal(cuda._lse(lse, 2, 3, 5), lse[..., :5])
    assert cuda._lse(lse[..., :5, None], 2, 3, 5).shape == (2, 3, 5)  # (B, H, L, 1)


# --- on a CUDA device ----------------------------------------------------------------

DEV = "cuda"


def _dev(*ts):
    return [None if t is None else t.to(DEV) for t in ts]


def _check_out(out, ref_out, low_out, dtype):
    err = (out.cpu().double() - ref_out).abs().max()
    if dtype == torch.float32:  # TF32 is off in torch's attention kernels
        assert err <= 1e-4, err
    else:  # the flash-attention rule
        assert err <= 2 * (low_out.double() - ref_out).abs().max() + 1e-6, err


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_fused_cuda_matches_the_oracle(gen, dtype, mask_kind):
    q, k, v, mask = make_inputs(
        gen, Hq=4, Hkv=2, L=97, S=130, E=40, Ev=24, dtype=dtype, mask_kind=mask_kind
    )
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)  # the fused kernels take the bias in the input dtype
    out, w = sdpa.attention(*_dev(q, k, v, mask), backend="fused")
    ref_out, ref_p = oracle(q, k, v, mask)
    _check_out(out, ref_out, oracle(q, k, v, mask, dtype=dtype)[0], dtype)
    torch.testing.assert_close(w.full().cpu().double(), ref_p, atol=5e-5, rtol=0)
    dead = ref_p.sum(-1) == 0
    assert (w.lse.cpu()[dead] == 0).all() and (out.cpu()[dead] == 0).all()


@pytest.mark.cuda
def test_fused_cuda_float32_mask_with_bf16_inputs_is_exact(gen):
    q, k, v, mask = make_inputs(gen, L=33, S=40, dtype=torch.bfloat16, mask_kind="float_inf")
    out, w = sdpa.attention(*_dev(q, k, v, mask))
    ref_out, ref_p = oracle(q, k, v, mask)
    _check_out(out, ref_out, oracle(q, k, v, mask, dtype=torch.bfloat16)[0], torch.bfloat16)
    torch.testing.assert_close(w.full().cpu().double(), ref_p, atol=5e-5, rtol=0)


SDP = torch.nn.attention.SDPBackend


@pytest.mark.cuda
@pytest.mark.parametrize(
    "backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
)
@pytest.mark.parametrize("mask_kind", ["none", "dead_rows"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_torch_op_gives_the_oracle(gen, backend, mask_kind, causal):
    """Under torch's sdpa_kernel(...) each op (or the math path where it can't) runs."""
    dtype = torch.bfloat16
    q, k, v, mask = make_inputs(gen, Hq=8, Hkv=2, L=256, S=256, E=64, dtype=dtype,
                                mask_kind=mask_kind)  # fmt: skip
    with torch.nn.attention.sdpa_kernel([getattr(SDP, backend)]):
        out, w = sdpa.attention(*_dev(q, k, v, mask), causal=causal, backend="fused")
    ref_out, ref_p = oracle(q, k, v, mask, causal=causal)
    _check_out(out, ref_out, oracle(q, k, v, mask, causal=causal, dtype=dtype)[0], dtype)
    # the weights, rebuilt from the op's LSE
    torch.testing.assert_close(w.full().cpu().double(), ref_p, atol=5e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("mask_kind", ["none", "bool", "dead_rows", "float_inf"])
def test_fused_cuda_gradients_match_the_oracle(gen, mask_kind):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=70, S=90, E=32, mask_kind=mask_kind)
    grad = randn(gen, 2, 4, 70, 32)
    qd, kd, vd = (t.to(DEV).requires_grad_() for t in (q, k, v))
    out, _ = sdpa.attention(qd, kd, vd, None if mask is None else mask.to(DEV))
    out.backward(grad.to(DEV))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    oracle(*ref, mask)[0].backward(grad.double())
    for ours, theirs in zip((qd, kd, vd), ref, strict=True):
        assert torch.isfinite(ours.grad).all()
        torch.testing.assert_close(ours.grad.cpu().double(), theirs.grad, atol=2e-4, rtol=0)


@pytest.mark.cuda
def test_fused_cuda_bf16_gradients_within_three_times_the_listings_error(gen):
    dtype = torch.bfloat16
    q, k, v, mask = make_inputs(gen, L=128, S=160, E=64, dtype=dtype, mask_kind="bool")
    grad = randn(gen, 2, 3, 128, 64, dtype=dtype)

    def grads(fn, dtype, device):
        # detach: a .to() that changes nothing returns the input itself, whose
        # requires_grad_ would then make the next call's copies non-leaves
        ts = [t.detach().to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
        m = mask.to(device)
        fn(*ts, m).backward(grad.to(device=device, dtype=dtype))
        return [t.grad.cpu().double() for t in ts]

    ours = grads(lambda *t: sdpa.attention(*t).output, dtype, DEV)
    low = grads(lambda *t: oracle(*t, dtype=dtype)[0], dtype, "cpu")
    ref = grads(lambda *t: oracle(*t)[0], torch.float64, "cpu")
    for o, lo, r in zip(ours, low, ref, strict=True):
        assert (o - r).abs().max() <= 3 * (lo - r).abs().max() + 1e-5


STRUCTURED = {
    "causal_bottom_right": masks.causal(),
    "causal_top_left": masks.causal("top-left"),
    "window_and_padding": masks.sliding_window(100) & masks.padding([600, 300]),
    "documents": masks.documents(torch.arange(700) // 230),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(STRUCTURED))
def test_block_skipping_on_cuda_matches_the_oracle(gen, name):
    L, S = (700, 700) if name == "documents" else (600, 700)
    mask = STRUCTURED[name]
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=L, S=S, E=64, dtype=torch.bfloat16)
    out, w = sdpa.attention(*_dev(q, k, v), mask)
    dense = mask.materialize(L, S)
    ref_out, ref_p = oracle(q, k, v, dense)
    low = oracle(q, k, v, dense, dtype=torch.bfloat16)[0]
    _check_out(out, ref_out, low, torch.bfloat16)
    torch.testing.assert_close(w[0, 1].cpu().double(), ref_p[0, 1], atol=5e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("L,S", [(1, 300), (300, 1), (77, 77)])
def test_dropin_matches_torch_on_cuda(gen, L, S):
    q, k, v, _ = make_inputs(gen, Hq=8, Hkv=2, L=L, S=S, E=64, dtype=torch.float16)
    q, k, v = _dev(q, k, v)
    ours = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)


# --- the Triton statistics on the device -----------------------------------------------


@pytest.fixture
def triton_kernels():
    from sdpa import kernels

    why = kernels.unavailable()
    if why is not None:
        pytest.skip(why)
    from sdpa.kernels.launch import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels would not run compiled")


def _chunked(fn):
    with weights.chunked_engine():
        return fn()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "dead_rows", "float", "window"])
def test_triton_statistics_match_the_oracle_on_cuda(gen, triton_kernels, dtype, mask_kind):
    L, S = (300, 300) if mask_kind == "causal" else (300, 500)
    q, k, v, _ = make_inputs(gen, Hq=8, Hkv=2, L=L, S=S, E=64, dtype=dtype)
    causal = mask_kind == "causal"
    if mask_kind == "window":
        mask = masks.sliding_window(64)
        dense = mask.materialize(L, S)
    else:
        dense = None if causal else make_mask(gen, mask_kind, 2, 8, L, S)
        mask = _dev(dense)[0]
    w = sdpa.attention(*_dev(q, k, v), mask, causal=causal).weights
    assert sdpa.weights._kernel_args(w) is not None  # the kernels serve these
    _, p = oracle(q, k, v, dense, causal=causal)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))
    got = {"entropy": w.entropy(), "amax": w.amax(-1), "sum": w.sum(dim=-2)}
    want = {"entropy": -plogp.sum(-1), "amax": p.amax(-1), "sum": p.sum(-2)}
    chunked = _chunked(lambda: {"entropy": w.entropy(), "amax": w.amax(-1), "sum": w.sum(-2)})
    for name in got:
        tol = 1e-4 * (L if name == "sum" else 1)
        torch.testing.assert_close(got[name].cpu().double(), want[name], atol=tol, rtol=1e-4)
        torch.testing.assert_close(got[name], chunked[name], atol=tol, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_forward_matches_the_oracle_on_cuda(gen, triton_kernels, dtype):
    from sdpa.kernels.stats import forward_stats

    q, k, v, mask = make_inputs(gen, Hq=8, Hkv=4, L=257, S=333, E=128, dtype=dtype,
                                mask_kind="dead_rows")  # fmt: skip
    out, lse, ent, top = forward_stats(*_dev(q, k, v, mask), scale=0.1)
    ref_out, p = oracle(q, k, v, mask, scale=0.1)
    _check_out(out, ref_out, oracle(q, k, v, mask, scale=0.1, dtype=dtype)[0], dtype)
    torch.testing.assert_close(top.cpu().double(), p.amax(-1), atol=1e-5, rtol=0)
    assert math.isfinite(ent.sum().item()) and (lse.cpu()[p.sum(-1) == 0] == 0).all()


# --- the single-pass statistics kernels, compiled with their pinned sm90 configs ------

ONE_PASS_CUDA = [  # (dtype, E, mask kind, L, S): every mask kind, awkward sizes, GQA below
    (torch.bfloat16, 128, "none", 300, 500),
    (torch.bfloat16, 128, "causal", 333, 333),
    (torch.bfloat16, 80, "dead_rows", 257, 190),
    (torch.float32, 64, "float_inf", 130, 97),
]


def _one_pass_inputs(gen, dtype, E, kind, L, S):
    q, k, v, _ = make_inputs(gen, B=2, Hq=8, Hkv=2, L=L, S=S, E=E, Ev=8, dtype=dtype)
    causal = kind == "causal"
    mask = None if kind in ("none", "causal") else make_mask(gen, kind, 2, 8, L, S)
    return q, k, v, mask, causal


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,E,kind,L,S", ONE_PASS_CUDA, ids=[c[2] for c in ONE_PASS_CUDA])
def test_one_pass_statistics_match_the_oracle_on_cuda(gen, triton_kernels, dtype, E, kind, L, S):
    """entropy_and_max, received and max_logits compiled for the device, against the
    float64 oracle, fed the LSE of our own fused call on the device."""
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k, v, mask, causal = _one_pass_inputs(gen, dtype, E, kind, L, S)
    scale = 0.7 / math.sqrt(E)
    lse = sdpa.attention(*_dev(q, k, v, mask), causal=causal, scale=scale).weights.lse
    qd, kd, md = _dev(q, k, mask)
    ent, top = entropy_and_max(qd, kd, lse, md, causal=causal, scale=scale)
    sums = received(qd, kd, lse, md, causal=causal, scale=scale)
    rows, heads = max_logits(qd, kd, md, causal=causal, scale=scale)
    _, p = oracle(q, k, v, mask, causal=causal, scale=scale)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))
    s = (q.double() @ k.double().repeat_interleave(4, dim=1).mT) * scale
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        s = s + mask.double() if mask.is_floating_point() else s.masked_fill(~mask, -math.inf)
    torch.testing.assert_close(ent.cpu().double(), -plogp.sum(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(top.cpu().double(), p.amax(-1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sums.cpu().double(), p.sum(-2), atol=1e-4 * L, rtol=1e-4)
    torch.testing.assert_close(rows.cpu().double(), s.amax(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(heads.cpu().double(), s.amax(-1).amax(-1), atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
def test_one_pass_statistics_never_sync_the_host(gen, triton_kernels):
    """No .item(), no data-dependent shape: the kernels and their glue run with the CUDA
    sync debug mode set to error."""
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.logits import max_logits
    from sdpa.kernels.received import received

    q, k, _, mask, _ = _one_pass_inputs(gen, torch.bfloat16, 80, "dead_rows", 257, 190)
    qd, kd, md = _dev(q, k, mask)
    lse = torch.zeros(2, 8, 257, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        entropy_and_max(qd, kd, lse, md, scale=0.1)
        received(qd, kd, lse, md, scale=0.1)
        max_logits(qd, kd, md, scale=0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["none", "causal"])
def test_the_other_loop_form_matches_on_cuda(gen, triton_kernels, kind):
    """The pinned configs pipeline the unmasked loop; the plain loop (what the bench
    times beside it) gives the same statistics."""
    from sdpa.kernels import configs
    from sdpa.kernels.entropy import entropy_and_max
    from sdpa.kernels.received import received

    q, k, v, _, causal = _one_pass_inputs(gen, torch.bfloat16, 128, kind, 333, 333)
    lse = sdpa.attention(*_dev(q, k, v), causal=causal, scale=0.1).weights.lse
    qd, kd = _dev(q, k)
    got = {}
    for pipelined in (True, False):
        with configs.use(configs.SM90["entropy"][0]._replace(pipelined=pipelined)):
            ent, top = entropy_and_max(qd, kd, lse, causal=causal, scale=0.1)
        with configs.use(configs.SM90["received"][0]._replace(pipelined=pipelined)):
            sums = received(qd, kd, lse, causal=causal, scale=0.1)
        got[pipelined] = (ent, top, sums)
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
