"""The fast lane held to the full path by a property, on CPU and on (fake) CUDA tensors.

`inputs.fast_normalize` must return None or exactly the record `inputs.normalize`
returns (every field: the same tensors as the same views, the same numbers), and
`backends.select_fast` must pick the backend `backends.select` picks. Hypothesis draws
across the fast lane's domain and its edges: sizes 1 and the block edges (63/64/65,
255/256/257), every float dtype and some that are not, masks of every accepted shape
and dtype and some that are not, causal with L == S and L != S, scales (0, tiny, huge,
int, inf, nan), grouped-query heads with and without gqa, requires_grad, transposed
views, autocast, the small backend's thresholds at the call's own size. CUDA tensors
are fake (torch._subclasses.FakeTensorMode: shapes, dtypes and devices, no data), so
this runs on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch._subclasses import FakeTensorMode

import sdpa
from sdpa import listing, masks
from sdpa import settings as sdpa_settings
from sdpa.backends import BACKENDS, aten, select, select_fast
from sdpa.inputs import fast_normalize, normalize
from sdpa.tile import additive

from oracle import oracle

pytestmark = pytest.mark.small_shapes  # the small backend at its real thresholds

EXAMPLES = 300  # per device: 600 in all

SIZES = st.sampled_from([1, 2, 3, 5, 63, 64, 65, 255, 256, 257])
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def mostly(inside: list, outside: list, weight: int = 12) -> st.SearchStrategy:
    """Values inside the fast lane's domain, and now and then one outside it (about 1
    in 3 calls has at least one value outside, so both sides are drawn often)."""
    return st.sampled_from(inside * weight * max(1, len(outside)) + outside * len(inside))


@pytest.fixture(scope="module")
def fake_mode():
    """One FakeTensorMode for every example (making one costs tens of milliseconds)."""
    return FakeTensorMode()


@st.composite
def calls(draw):
    """Keyword arguments of one call, as plain Python values: sizes, dtypes, flags."""
    B, Hkv = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
    L, S = draw(SIZES), draw(SIZES)
    if draw(st.booleans()):
        S = L  # causal calls need L == S
    group = draw(st.sampled_from([1, 1, 2, 3]))
    E = draw(st.sampled_from([1, 8, 16]))
    Hq = Hkv * group + draw(mostly([0], [1]))  # not a multiple of Hkv now and then
    kind = draw(mostly(["none", "tensor"], ["structured", "on cpu", "list"]))
    mask = None
    if kind == "tensor":
        mask = {
            "dtype": draw(mostly([torch.bool, "input", "compute"], [torch.float64, torch.int64])),
            "shape": (
                draw(st.sampled_from([1, B])),
                draw(st.sampled_from([1, Hq])),
                draw(st.sampled_from([1, L])),
                draw(mostly([S], [1])),
            ),
            "ndim": draw(mostly([4], [2, 3])),
            "grad": draw(mostly([False], [True])),
        }
    else:
        mask = None if kind == "none" else kind
    return {
        "B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "S": S, "E": E,
        "Ev": draw(st.sampled_from([E, E, 4])), "E_k": draw(mostly([E], [E + 1])),
        "dtype": draw(mostly(DTYPES, [torch.int32])),
        "k_dtype": draw(mostly(["same"], ["float64"])), "mask": mask,
        "causal": draw(mostly([False, True], [1])),
        "scale": draw(mostly([None, 0.0, 1e-3, 0.3, 2.0, 1e6], [1, True, math.inf, math.nan])),
        "dropout_p": draw(mostly([0.0], [0, 0.1])), "gqa": draw(st.booleans()),
        "grad": draw(st.booleans()), "transposed": draw(mostly([False], [True])),
        "autocast": draw(mostly([False], [True])),
        "small": draw(st.sampled_from(["default", "edge", "edge-1", "off"])),
    }  # fmt: skip


def _tensors(c: dict, device: str):
    """(q, k, v, mask) for the drawn call on `device` (a fake device under the mode)."""
    dt = c["dtype"]
    compute = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
    if c["transposed"]:  # the same shape, another layout: a view of (B, L, Hq, E)
        q = torch.zeros(c["B"], c["L"], c["Hq"], c["E"], dtype=dt, device=device).transpose(1, 2)
    else:
        q = torch.zeros(c["B"], c["Hq"], c["L"], c["E"], dtype=dt, device=device)
    k_dtype = torch.float64 if c["k_dtype"] == "float64" else dt
    k = torch.zeros(c["B"], c["Hkv"], c["S"], c["E_k"], dtype=k_dtype, device=device)
    v = torch.zeros(c["B"], c["Hkv"], c["S"], c["Ev"], dtype=dt, device=device)
    if c["grad"] and q.is_floating_point():
        q.requires_grad_()
    m = c["mask"]
    if m == "structured":
        mask = masks.causal()
    elif m == "on cpu":
        mask = torch.ones(c["L"], c["S"], dtype=torch.bool)
    elif m == "list":
        mask = [[True] * c["S"]] * c["L"]
    elif m is not None:
        mdt = {"input": dt, "compute": compute}.get(m["dtype"], m["dtype"])
        shape = m["shape"][4 - m["ndim"] :]
        mask = torch.zeros(shape, dtype=mdt, device=device)
        if m["grad"] and mask.is_floating_point():
            mask.requires_grad_()
    else:
        mask = None
    return q, k, v, mask


def _same(a: object, b: object) -> bool:
    """Field equality: tensors as the same view of the same data, values of one type."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and type(a) is type(b) and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype and a.device == b.device
            and a.requires_grad == b.requires_grad and torch._C._is_alias_of(a, b)
        )  # fmt: skip
    if isinstance(a, masks.TensorAnd):  # causal=True with a tensor mask: its parts
        return (
            type(b) is masks.TensorAnd
            and _same(a.tensor, b.tensor)
            and (a.structured is b.structured)
        )
    return type(a) is type(b) and a == b


def _thresholds(c: dict) -> dict:
    """The small backend's thresholds at, just under or far from the call's own size."""
    n = c["B"] * c["Hq"] * c["L"] * c["S"]
    per_head = c["L"] * c["S"]
    if c["small"] == "edge":
        return {"small_weights": n, "small_head": per_head, "small_causal": per_head}
    if c["small"] == "edge-1":
        return {"small_weights": n, "small_head": per_head, "small_causal": per_head - 1}
    if c["small"] == "off":
        return {"small_weights": 0}
    return {}


def _check(c: dict, device: str) -> None:
    q, k, v, mask = _tensors(c, device)
    args = (q, k, v, mask, c["causal"], c["scale"], c["dropout_p"], c["gqa"])
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if c["autocast"] and device == "cpu"
        else contextlib.nullcontext()
    )
    with sdpa_settings.override(**_thresholds(c)), autocast:
        fast = fast_normalize(*args)
        event("taken by the fast lane" if fast is not None else "left to normalize")
        if fast is None:
            return
        slow = normalize(
            q, k, v, mask, causal=c["causal"], scale=c["scale"], dropout_p=c["dropout_p"],
            gqa=c["gqa"],
        )  # fmt: skip
        assert type(fast) is type(slow)
        differ = [f for f, a, b in zip(fast._fields, fast, slow, strict=True) if not _same(a, b)]
        assert not differ, (differ, fast, slow)
        assert select_fast(fast) is select(slow), (select_fast(fast), select(slow))


FAST_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@FAST_SETTINGS
@given(c=calls())
def test_fast_lane_is_normalize_on_cpu(c):
    _check(c, "cpu")


@FAST_SETTINGS
@given(c=calls())
def test_fast_lane_is_normalize_on_cuda(fake_mode, c):
    with fake_mode:
        _check(c, "cuda")


def test_the_lane_takes_what_it_claims(fake_mode):
    """The property above would hold for a lane that takes nothing: the calls made
    most must be taken, on both devices, with every accepted kind of mask."""
    for device in ("cpu", "cuda"):
        with fake_mode if device == "cuda" else contextlib.nullcontext():
            q = torch.zeros(2, 4, 1, 8, device=device)
            k = v = torch.zeros(2, 2, 7, 8, device=device)
            for mask in (
                None,
                torch.ones(2, 1, 1, 7, dtype=torch.bool, device=device),  # key padding
                torch.zeros(1, 4, 1, 7, device=device),  # float, per head
            ):
                assert fast_normalize(q, k, v, mask) is not None, (device, mask)
            sq = torch.zeros(1, 2, 5, 8, dtype=torch.bfloat16, device=device)
            assert fast_normalize(sq, sq, sq, None, True, 0.5) is not None
            assert fast_normalize(q, k, v, None, False, None, 0.0, False) is None  # no gqa


def test_on_cuda_the_lane_asks_the_fused_backend(fake_mode, monkeypatch):
    """select_fast on CUDA asks the fused backend's reasons (O(1)) and goes where
    select goes when it refuses."""
    fused = BACKENDS["fused"]
    real = type(fused).not_supported_reasons

    def refusing(self, inputs):
        return ["a reason for this test", *real(self, inputs)]

    with fake_mode:
        q = torch.zeros(1, 2, 3, 8, device="cuda")
        inputs = fast_normalize(q, q, q)
        assert select_fast(inputs) is fused
        monkeypatch.setattr(type(fused), "not_supported_reasons", refusing)
        assert select_fast(inputs) is select(normalize(q, q, q)) is BACKENDS["chunked"]


# -- the lean entry on CPU: the kernel called directly ------------------------------

LEAN_CASES = [  # (dtype, mask kind, Hq, Hkv, S)
    (torch.float32, "none", 4, 2, 128),
    (torch.float32, "bool", 4, 2, 128),
    (torch.float32, "float", 8, 8, 37),
    (torch.bfloat16, "bool", 4, 1, 300),
    (torch.float16, "none", 2, 2, 1),
    (torch.float64, "bool", 4, 2, 64),
]


def _lean_inputs(gen, dtype, kind, Hq, Hkv, S):
    q = torch.randn(2, Hq, 1, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, Hkv, S, 16, generator=gen).to(dtype) for _ in range(2))
    keep = torch.rand(2, 1, 1, S, generator=gen) < 0.7
    keep[0, ..., 0] = True
    keep[1] = False  # batch element 1 sees no key: output 0, weights 0, LSE 0
    mask = {"none": None, "bool": keep}.get(kind)
    if kind == "float":
        mask = torch.randn(2, 1, 1, S, generator=gen).to(dtype).masked_fill(~keep, -math.inf)
    return q, k, v, mask


@pytest.mark.parametrize("dtype,kind,Hq,Hkv,S", LEAN_CASES)
def test_a_decoding_step_is_the_kernels_call_bit_for_bit(gen, dtype, kind, Hq, Hkv, S):
    """One query row through the lean entry: the output and the LSE are those of one
    call of the CPU flash kernel (torch's binding of the op that also returns the LSE,
    which costs what F.scaled_dot_product_attention costs), and every read is right."""
    q, k, v, mask = _lean_inputs(gen, dtype, kind, Hq, Hkv, S)
    out, w = sdpa.attention(q, k, v, mask)
    assert w.served_by.startswith("fused: one call of torch's CPU flash kernel"), w.served_by
    kernel_out, kernel_lse = aten.CPU_FLASH(
        q, k, v, 0.0, False, attn_mask=additive(mask, dtype), scale=16**-0.5
    )
    assert torch.equal(out, kernel_out) and torch.equal(w.lse, kernel_lse)
    ref_out, ref_p = oracle(q, k, v, mask)
    tol = 2e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(w.full().double(), ref_p, atol=2e-5, rtol=0)
    torch.testing.assert_close(w[0, :, 0].double(), ref_p[0, :, 0], atol=2e-5, rtol=0)
    torch.testing.assert_close(w.sum(dim=-2).double(), ref_p.sum(-2), atol=2e-5, rtol=0)
    if kind == "bool":  # the row that sees no key: 0 output, 0 weights, LSE 0
        assert (out[1] == 0).all() and (w.lse[1] == 0).all() and (w.full()[1] == 0).all()


def test_the_lean_entry_keeps_the_convention_under_sdpa_kernel(gen):
    """torch.nn.attention.sdpa_kernel([MATH]) would make torch's own F.sdpa give NaN to
    a row that sees no key: the lean entry calls the kernel itself, so the row is 0."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, mask = _lean_inputs(gen, torch.float32, "bool", 4, 2, 50)
    with sdpa_kernel([SDPBackend.MATH]):
        out, w = sdpa.attention(q, k, v, mask)
    assert (out[1] == 0).all() and not out.isnan().any() and (w.lse[1] == 0).all()


def test_attention_and_the_handle_compile_without_a_graph_break(gen):
    """torch.compile (mode="reduce-overhead" on CUDA graphs) traces attention() and the
    handle's creation in one graph, for a decoding step and a short text, every mask."""
    for L, S in ((1, 64), (5, 5)):
        q = torch.randn(1, 4, L, 16, generator=gen)
        k, v = (torch.randn(1, 2, S, 16, generator=gen) for _ in range(2))
        for mask in (None, torch.rand(1, 1, 1, S, generator=gen) < 0.8):

            def step(q, k, v, mask):
                out, _weights = sdpa.attention(q, k, v, mask)  # the handle made in the graph
                return out

            torch._dynamo.reset()
            explained = torch._dynamo.explain(step)(q, k, v, mask)
            reasons = [str(b.reason) for b in explained.break_reasons]
            assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


def test_a_call_whose_weights_no_one_reads_makes_no_handle(gen, monkeypatch):
    """The lean entry's result makes the weights' handle on first access: an output-only
    call makes none (a decoding step's microseconds); `.weights`, `r[1]`, unpacking and
    iteration make the same one, once."""
    import sdpa.functional as functional

    made = []
    real = functional.new_handle
    monkeypatch.setattr(functional, "new_handle", lambda *a: made.append(1) or real(*a))
    q, k, v = (torch.randn(1, 4, 1, 32, generator=gen) for _ in range(3))
    out = sdpa.attention(q, k, v).output
    assert made == [] and torch.equal(out, sdpa.attention(q, k, v)[0])
    r = sdpa.attention(q, k, v)
    o, w = r
    assert made == [1] and isinstance(w, sdpa.AttentionWeights)
    assert r.weights is w and r[1] is w and r[-1] is w and list(r) == [o, w] and r[0] is o
    assert made == [1] and isinstance(r, sdpa.AttentionResult) and len(r) == 2
    torch.testing.assert_close(w.full(), listing.attention(q, k, v)[1])


@pytest.mark.parametrize("module", ["mha", "spatial"])
def test_a_modules_output_alone_makes_no_handle(gen, monkeypatch, module):
    """The modules hand the call's lazy result on with their projected output
    (functional.with_output): reading only the output makes no handle; the weights read
    afterwards are the call's."""
    import sdpa.functional as functional

    made = []
    real = functional.new_handle
    monkeypatch.setattr(functional, "new_handle", lambda *a: made.append(1) or real(*a))
    if module == "mha":
        m, x = sdpa.MultiHeadAttention(32, 4).eval(), torch.randn(2, 5, 32, generator=gen)
    else:
        m, x = sdpa.SpatialSelfAttention(32, 4).eval(), torch.randn(1, 32, 3, 3, generator=gen)
    with torch.no_grad():
        r = m(x)
        out = r.output
        assert made == [] and isinstance(r, sdpa.AttentionResult)
        o, w = r
        assert made == [1] and o is out and isinstance(w, sdpa.AttentionWeights)
        assert w.shape == (x.shape[0], 4, *(w.shape[-2:]))
        torch.testing.assert_close(w.full().sum(-1), torch.ones(w.shape[:-1]))


def test_the_lazy_result_answers_as_the_named_tuple(gen):
    """repr, pickle, deepcopy, _asdict, _replace, slicing and torch's pytree see the
    weights' handle, as with the NamedTuple the result stands for."""
    import copy
    import pickle

    import torch.utils._pytree as pytree

    q, k, v = (torch.randn(1, 2, 3, 8, generator=gen) for _ in range(3))
    r = sdpa.attention(q, k, v)
    plain = sdpa.AttentionResult(r.output, r.weights)
    assert repr(r) == repr(plain) and r == plain
    for twin in (pickle.loads(pickle.dumps(r)), copy.deepcopy(r)):
        assert type(twin) is sdpa.AttentionResult
        torch.testing.assert_close(twin.weights.full(), r.weights.full())
    assert r._asdict()["weights"] is r.weights and r[:2] == (r.output, r.weights)
    assert r._replace(output=q).weights is r.weights
    leaves, spec = pytree.tree_flatten(r)
    assert leaves[1] is r.weights and pytree.tree_unflatten(leaves, spec) == plain


def test_a_change_in_place_before_the_first_access_still_makes_the_weights_stale(gen):
    """The handle made on first access keeps the version counters of the call."""
    q, k, v = (torch.randn(1, 2, 3, 8, generator=gen) for _ in range(3))
    r = sdpa.attention(q, k, v)
    k.mul_(2)
    with pytest.raises(sdpa.StaleWeightsError, match="key changed in place"):
        r.weights[0, 0, 0]
