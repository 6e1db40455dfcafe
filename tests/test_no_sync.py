"""No CUDA call path asks the host for a value: the output, the weights handle, the reads.

On this CPU-only machine the CUDA tensors are fake (torch._subclasses.FakeTensorMode:
shapes, dtypes and devices, no data), so any read of data raises there (`.item()`,
`bool(t)`, `.nonzero()`, a boolean index, `.tolist()`, `.cpu()` of device memory); a
TorchDispatchMode also records every `_local_scalar_dense`, `is_nonzero`, `item` and
`nonzero` it sees, and the test asserts it saw none. Around: `attention()` of every mask
kind (none, causal, bool, key padding, float, 2-D; causal, sliding windows, padding,
documents, their `&`; softcap), with each op torch may pick (flash, efficient, cuDNN,
the math path), the handle's creation, and the reads rows, sums, entropy, amax, max
logits. A test marked `cuda` runs the same calls under torch.cuda.set_sync_debug_mode
("error") where a GPU is present.

The CPU-only build has no device guard for CUDA, which a few of torch's Python methods
take before they dispatch (indexing, ~, copy_, contiguous, to): `fake_cuda` sends those to
the same aten ops for the length of a test, so the library runs unchanged.
"""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

import sdpa
from sdpa import masks, rows, weights
from sdpa.backends import BACKENDS, blocks, cuda

from conftest import make_inputs

aten = torch.ops.aten
HOST_READS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "nonzero_static"}


class HostReads(TorchDispatchMode):
    """Records the ops that hand a tensor's value to the host."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


# -- the shim: torch's device-guarded Python methods, by aten ops --------------------


def _index_parts(t: torch.Tensor, index: object):
    """(t after ints, slices, None and Ellipsis, the tensor indices as aten.index takes
    them or None): torch's own order (basic indexing first, then the tensors at the
    dims they stand for)."""
    items = index if isinstance(index, tuple) else (index,)

    def width(i):
        if i is None or i is Ellipsis:
            return 0
        return i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1

    used = sum(width(i) for i in items)
    out, dim, tensors = t, 0, {}
    for i in items:
        if i is Ellipsis:
            dim += t.ndim - used
        elif i is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif isinstance(i, slice):
            step = 1 if i.step is None else i.step
            out, dim = aten.slice.Tensor(out, dim, i.start, i.stop, step), dim + 1
        elif isinstance(i, torch.Tensor) and (i.ndim or i.dtype == torch.bool):
            tensors[dim] = i
            dim += width(i)
        else:
            out = out.select(dim, operator.index(i))
    if not tensors:
        return out, None
    indices, d = [], 0
    while d <= max(tensors):
        x = tensors.get(d)
        indices.append(x)
        d += 1 if x is None else width(x)
    return out, indices


def _needs_shim(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeTensorMode (real CPU tensors may come in: masks made outside it), with
    torch's device-guarded Python methods routed to aten ops for fake tensors."""
    base = torch.Tensor
    names = ("__getitem__", "__setitem__", "__invert__", "copy_", "contiguous", "to")
    real = {n: getattr(base, n) for n in names}

    def getitem(self, index):
        if not _needs_shim(self):
            return real["__getitem__"](self, index)
        out, indices = _index_parts(self, index)
        return out if indices is None else aten.index.Tensor(out, indices)

    def setitem(self, index, value):
        if not _needs_shim(self):
            return real["__setitem__"](self, index, value)
        out, indices = _index_parts(self, index)
        if indices is not None:
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=self.dtype, device=self.device)
            aten.index_put_.default(out, indices, value, False)
        elif isinstance(value, torch.Tensor):
            aten.copy_.default(out, value)
        else:
            aten.fill_.Scalar(out, value)

    def invert(self):
        if not _needs_shim(self):
            return real["__invert__"](self)
        return aten.bitwise_not.default(self)

    def copy_(self, src, non_blocking=False):
        if not _needs_shim(self):
            return real["copy_"](self, src, non_blocking)
        return aten.copy_.default(self, src, non_blocking)

    def contiguous(self, memory_format=torch.contiguous_format):
        if not _needs_shim(self) or self.is_contiguous(memory_format=memory_format):
            return real["contiguous"](self, memory_format=memory_format)
        return aten.clone.default(self, memory_format=memory_format)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if not _needs_shim(self) and (device is None or device.type != "cuda"):
            return real["to"](self, *args, **kwargs)
        same_device = device is None or device == self.device
        if same_device and (dtype is None or dtype == self.dtype) and not kwargs.get("copy"):
            return self
        return aten._to_copy.default(
            self, dtype=dtype or self.dtype, device=device or self.device,
            non_blocking=non_blocking, memory_format=memory_format or torch.preserve_format,
        )  # fmt: skip

    shims = (getitem, setitem, invert, copy_, contiguous, to)
    for name, fn in zip(names, shims, strict=True):
        monkeypatch.setattr(base, name, fn)
    # a fake device has no kernels for torch to choose from: its math path, unless a
    # test picks an op (`picked`)
    monkeypatch.setattr(cuda, "choice", lambda *args: cuda.MATH)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@pytest.fixture(params=["math", "flash", "efficient", "cudnn"])
def picked(request, monkeypatch):
    """The op torch's choice names (a fake device has no kernels to choose from)."""
    value = {"math": cuda.MATH, "flash": cuda.FLASH, "efficient": cuda.EFFICIENT,
             "cudnn": cuda.CUDNN}[request.param]  # fmt: skip
    monkeypatch.setattr(cuda, "choice", lambda *args: value)
    return request.param


# -- the calls -----------------------------------------------------------------------

MASKS = [
    "none", "causal", "bool", "key padding", "float", "2-D bool", "causal()", "top-left",
    "sliding window", "padding (CPU lengths)", "padding (device lengths)", "documents",
    "window & padding", "softcap",
]  # fmt: skip


# structured masks whose data is on the host are made outside the fake mode, as a user
# makes them (their lengths are real CPU tensors, read on the host when planned)
HOST_MASKS = {
    "causal()": masks.causal(),
    "top-left": masks.causal("top-left"),
    "sliding window": masks.sliding_window(100),
    "padding (CPU lengths)": masks.padding([600, 200]),
    "window & padding": masks.sliding_window(100) & masks.padding([600, 90]),
    "softcap": masks.softcap(30.0),
}


def _mask(kind: str, B: int, Hq: int, L: int, S: int, device: str):
    """(mask, causal) of one kind for a (B, Hq, L, S) call on `device`."""
    if kind in HOST_MASKS:
        return HOST_MASKS[kind], False
    if kind == "padding (device lengths)":
        return masks.padding(torch.full((B,), S // 2, device=device)), False
    if kind == "documents":
        return masks.documents(torch.arange(L, device=device) // 100), False
    ones = {"device": device, "dtype": torch.bool}
    tensors = {
        "none": lambda: None,
        "causal": lambda: None,
        "bool": lambda: torch.ones(B, Hq, L, S, **ones),
        "key padding": lambda: torch.ones(B, 1, 1, S, **ones),
        "float": lambda: torch.zeros(B, 1, L, S, device=device),
        "2-D bool": lambda: torch.ones(L, S, **ones),
    }
    return tensors[kind](), kind == "causal"


def _calls(device: str, kind: str, dtype, L: int, S: int):
    """attention() of one mask kind, then each read that can stay on the device."""
    B, Hq, Hkv, E = 2, 4, 2, 64
    if kind in ("causal", "top-left", "documents"):
        S = L
    q = torch.zeros(B, Hq, L, E, dtype=dtype, device=device)
    k = torch.zeros(B, Hkv, S, E, dtype=dtype, device=device)
    v = torch.zeros(B, Hkv, S, E, dtype=dtype, device=device)
    mask, causal = _mask(kind, B, Hq, L, S, device)
    out, w = sdpa.attention(q, k, v, mask, causal=causal)
    assert out.shape == (B, Hq, L, E) and out.device.type == device
    reads = {
        "rows": lambda: w[0, 1, : min(L, 3)],  # (batch ranges laid out in plain Python)
        "rows of the engine": lambda: rows.dense(
            rows.Rows(w._inputs, w._log_sum_exp(), range(1), range(1, 2), slice(0, min(L, 3)))
        ),
        "lse": lambda: w.lse,
        "w @ x": lambda: w @ v.new_zeros(B, Hq, S, 3),
        "u @ w": lambda: v.new_zeros(B, Hq, 2, L) @ w,
        "sum": lambda: w.sum(dim=-2),
        "entropy": w.entropy,
        "amax": w.amax,
        "topk": lambda: w.topk(min(2, S))[0],
        "kl": lambda: w.kl(w, reverse=True),
        "max logits": lambda: w.max_logits().row,
        "row sums": lambda: w.sum(-1),
        # views over the leading dims, then a read (their rows are laid out in Python)
        "a batch view's rows": lambda: w[1][2, : min(L, 3)],
        "a head view's sums": lambda: w[:, 3].sum(dim=-2),
        "a stepped view": lambda: w[1:][:, ::2].amax(-1),
        "a flattened view": lambda: w.flatten(0, 1)[5].amax(-1),
        "a stack of handles": lambda: torch.stack([w, w])[1, 0, 2, : min(L, 3)],
    }
    with torch.no_grad():
        for name, read in reads.items():
            got = read()
            assert got.device.type == device, name
    return w


SHAPES = {"decode": (1, 128), "prefill": (300, 600)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", MASKS)
def test_no_call_path_reads_the_device_on_the_host(fake_cuda, picked, shape, kind):
    """(The Triton kernels are launched on data, which a fake device has none of: the
    reads here run the rows engine; the kernels' own test in test_cuda.py runs them
    under the sync debug mode, and their providers' rules are checked below.)"""
    L, S = SHAPES[shape]
    with HostReads() as seen, weights.chunked_engine():
        _calls("cuda", kind, torch.bfloat16, L, S)
    assert seen.calls == [], seen.calls


GRAD_KINDS = ["none", "key padding", "causal()", "window & padding"]


def _float32_calls(grad: bool):
    """float32 (the efficient op or the math path), q requiring grad where asked: the
    output, its graph and backward, the handle and three reads."""
    for kind in GRAD_KINDS:
        q = torch.zeros(2, 4, 300, 64, device="cuda", requires_grad=grad)
        kv = torch.zeros(2, 2, 300, 64, device="cuda")
        mask, causal = _mask(kind, 2, 4, 300, 300, "cuda")
        out, w = sdpa.attention(q, kv, kv, mask, causal=causal)
        if grad:
            out.sum().backward()
        with torch.no_grad():
            w.sum(dim=-2), w.entropy(), w.max_logits()


def test_no_sync_in_float32(fake_cuda):
    """(Autograd on fake CUDA tensors aborts a CPU-only build: gradients are checked by
    the CUDA test below.)"""
    with HostReads() as seen, weights.chunked_engine():
        _float32_calls(grad=False)
    assert seen.calls == [], seen.calls


def test_the_fake_device_catches_a_host_read(fake_cuda):
    """The harness itself: a read of device data raises, a host read is recorded."""
    x = torch.zeros(3, device="cuda")
    with HostReads() as seen, contextlib.suppress(Exception):
        bool((x > 0).any())
    assert seen.calls, "a read of a fake CUDA tensor went unnoticed"
    with pytest.raises(Exception):  # noqa: B017 (FakeTensorMode's data-dependent error)
        (x > 0).nonzero()


def test_the_lean_cuda_call_asks_torch_once_per_shape_class(fake_cuda, monkeypatch):
    """torch._fused_sdp_choice is asked once for the calls of one shape class (here:
    decoding steps whose S grows), again for another class."""
    asked = []

    def choice(*args):
        asked.append(args[0].shape)
        return cuda.FLASH

    monkeypatch.setattr(cuda, "choice", choice)
    cuda._choices.clear()
    for S in (100, 101, 102):
        q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16, device="cuda")
        kv = torch.zeros(1, 2, S, 64, dtype=torch.bfloat16, device="cuda")
        sdpa.attention(q, kv, kv)
    assert len(asked) == 1
    q = torch.zeros(1, 8, 5, 64, dtype=torch.float16, device="cuda")  # another class
    sdpa.attention(q, q, q, causal=True)
    assert len(asked) == 2


def test_tensor_masks_on_a_gpu_go_whole(fake_cuda):
    """A tensor mask on a GPU is never planned from its data: one call with the mask."""
    q = torch.zeros(1, 2, 600, 64, dtype=torch.bfloat16, device="cuda")
    mask = torch.ones(1, 1, 600, 600, dtype=torch.bool, device="cuda")
    w = sdpa.attention(q, q, q, mask).weights
    assert w.served_by == "fused: one call of torch's fused CUDA op with the mask"
    assert blocks.whole(mask, 600, on_cpu=False) and not blocks.whole(mask, 600)


# -- host-side spans: the block plan a GPU call makes, held to the CPU's -------------

SPAN_MASKS = {
    "causal": lambda L, S: masks.causal(),
    "top-left": lambda L, S: masks.causal("top-left"),
    "window 1": lambda L, S: masks.sliding_window(1),
    "window 64": lambda L, S: masks.sliding_window(64, "top-left"),
    "window 300": lambda L, S: masks.sliding_window(300),
    "padding": lambda L, S: masks.padding([S, 0, 1, 64, 65, S - 1, 2 * S]),
    "window & padding": lambda L, S: masks.sliding_window(200) & masks.padding([S, 100, 0]),
    "padding, queries": lambda L, S: masks.padding(
        [S, 0, 1, 255, 257, L - 1, 2 * max(L, S)], queries=True
    ),
}


def _pieces_both_ways(mask, L, S):
    """The plan from host spans, and from the occupancy (what a CPU call reads)."""
    spans = mask.spans(L, S, blocks.BLOCK_Q, blocks.BLOCK_K)
    occ = mask.blocks(L, S, blocks.BLOCK_Q, blocks.BLOCK_K)
    return blocks.plan_spans(spans, L, S), blocks.plan(occ, L, S)


@pytest.mark.parametrize("name", list(SPAN_MASKS))
@pytest.mark.parametrize(
    "L,S", [(1, 1), (1, 700), (255, 256), (256, 256), (257, 320), (600, 700), (700, 600)]
)
def test_spans_make_the_plan_the_occupancy_makes(name, L, S):
    """Exact masks give the same pieces both ways (block edges: 1, 255/256/257, 64)."""
    from_spans, from_blocks = _pieces_both_ways(SPAN_MASKS[name](L, S), L, S)
    if name == "window & padding":  # & is sound, not exact: the same spans, masked as much
        assert [p[:5] for p in from_spans] == [p[:5] for p in from_blocks]
        assert all(a.masked or not b.masked for a, b in zip(from_spans, from_blocks, strict=True))
    else:
        assert from_spans == from_blocks


def test_spans_of_the_or_documents_and_device_data_are_none():
    L = S = 300
    assert (masks.causal() | masks.sliding_window(3)).spans(L, S, 256, 64) is None
    assert masks.documents(torch.arange(L) // 100).spans(L, S, 256, 64) is None
    with FakeTensorMode():
        lengths = torch.full((2,), 5, device="cuda")
        assert masks.padding(lengths).spans(L, S, 256, 64) is None


@pytest.mark.parametrize("name", list(SPAN_MASKS))
def test_a_gpu_plan_keeps_every_visible_key(gen, name):
    """The pieces a GPU call makes from spans, run on CPU tensors through the same
    driver, give the oracle's output (every key a query sees is in its piece)."""
    from oracle import oracle

    L, S = 600, 700
    mask = SPAN_MASKS[name](L, S)
    q, k, v, _ = make_inputs(gen, B=7 if "padding" in name else 1, Hq=2, L=L, S=S, E=16)
    if name == "window & padding":
        q, k, v = q[:3], k[:3], v[:3]
    inputs = sdpa.inputs.normalize(q, k, v, mask)
    spans = mask.spans(L, S, blocks.BLOCK_Q, blocks.BLOCK_K)
    pieces = blocks.plan_spans(spans, L, S)
    from sdpa.backends import fused

    out, _ = fused._run_pieces(inputs, pieces, q, k, v, fused._cpu_kernel)
    dense = mask.materialize(L, S)
    torch.testing.assert_close(out.double(), oracle(q, k, v, dense)[0], atol=2e-5, rtol=0)


# -- the rows engine off CPU decides without the host --------------------------------


def test_the_rows_engine_decides_without_reading_a_device_lse(fake_cuda):
    lse = torch.zeros(2, 3, 5, device="cuda")
    with HostReads() as seen:
        assert rows._inexact(lse) is True  # the row max: exact, whatever the LSE
        assert rows.needs_every_key(lse) is False
    assert seen.calls == []


def test_the_weights_providers_decide_without_reading_a_device_lse(fake_cuda):
    """Every provider rule of every read, on a fake GPU handle with each kind of mask."""
    for kind in ("none", "float", "key padding", "causal()"):
        q = torch.zeros(1, 2, 300, 64, dtype=torch.bfloat16, device="cuda")
        mask, causal = _mask(kind, 1, 2, 300, 300, "cuda")
        w = sdpa.attention(q, q, q, mask, causal=causal).weights
        with HostReads() as seen, torch.no_grad():
            for providers in weights.PROVIDERS.values():
                for provider in providers:
                    provider.serves(w)
        assert seen.calls == [], (kind, seen.calls)


# -- on a GPU ------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", [k for k in MASKS if k != "padding (device lengths)"])
def test_no_sync_on_cuda(shape, kind):
    """The same calls, with torch.cuda.set_sync_debug_mode('error'): any sync raises."""
    L, S = SHAPES[shape]
    _calls("cuda", kind, torch.bfloat16, L, S)  # warm: caches, lazy imports, the choice
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w = _calls("cuda", kind, torch.bfloat16, L, S)
        with torch.no_grad():
            w[0, 1, : min(L, 3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_with_gradients_on_cuda():
    _float32_calls(grad=True)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _float32_calls(grad=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fused_reasons_are_empty_for_the_lean_cuda_call(fake_cuda):
    q = torch.zeros(1, 2, 3, 64, device="cuda")
    assert BACKENDS["fused"].not_supported_reasons(sdpa.inputs.fast_normalize(q, q, q)) == []
