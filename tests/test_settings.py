"""sdpa.settings (one object for the tuning constants, changed per context) and the
rules each defined once: causal visibility, the compute dtype, a mask made 4-D, and the
fused backend's private torch ops looked up without failing."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import itertools
import os
import subprocess
import sys
import threading

import pytest
import torch

import sdpa
from engines import BACKEND_ENGINES, run_or_skip
from sdpa import masks, settings
from sdpa.backends import aten, select, select_fast
from sdpa.inputs import compute_dtype, fast_normalize, normalize

from conftest import make_inputs
from oracle import oracle

# -- the settings object ---------------------------------------------------------------


def test_defaults_are_the_documented_values():
    s = settings.Settings()
    assert s.chunk_bytes == 4 * 2**20 and s.mask_chunk_bytes == 16 * 2**20
    assert (s.exact_lse_limit, s.kernel_lse_limit) == (32.0, 1024.0)
    assert s.kernel_devices == frozenset({"cuda"})
    assert (s.small_weights, s.small_head, s.small_causal) == (2**21, 2**16, 2**14)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.chunk_bytes = 1  # type: ignore[misc]


def test_every_field_has_a_docstring_with_its_default():
    """Each field is followed by its docstring (what it trades, unit, default), which
    the API reference shows."""
    tree = ast.parse(inspect.getsource(settings.Settings))
    body = tree.body[0].body
    fields = {f.name for f in dataclasses.fields(settings.Settings)}
    documented = {
        node.target.id
        for node, doc in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(doc, ast.Expr)
        and "Default" in doc.value.value
    }
    assert documented == fields


@pytest.mark.small_shapes
def test_override_changes_then_restores_and_nests():
    before = settings.get()
    with settings.override(chunk_bytes=2**20, small_weights=0) as s:
        assert settings.get() is s and s.chunk_bytes == 2**20 and s.small_weights == 0
        assert s.small_head == before.small_head  # the others kept
        with settings.override(chunk_bytes=2**21):
            assert settings.get().chunk_bytes == 2**21 and settings.get().small_weights == 0
        assert settings.get() is s
    assert settings.get() == before


@pytest.mark.small_shapes
def test_override_restores_on_error():
    before = settings.get()
    with pytest.raises(RuntimeError, match="boom"), settings.override(small_head=1):
        raise RuntimeError("boom")
    assert settings.get() == before


@pytest.mark.parametrize(
    "changes, exc, pattern",
    [
        (
            {"chunk_size": 1},
            sdpa.SdpaTypeError,
            r"unknown setting\(s\) \['chunk_size'\].*chunk_bytes",
        ),
        (
            {"chunk_bytes": 0},
            sdpa.SdpaValueError,
            r"chunk_bytes must be an int >= 1 \(bytes\), got 0",
        ),
        ({"chunk_bytes": 2.5}, sdpa.SdpaTypeError, r"chunk_bytes must be an int >= 1.*float"),
        ({"small_weights": -1}, sdpa.SdpaValueError, r"small_weights must be an int >= 0"),
        ({"small_head": True}, sdpa.SdpaTypeError, r"small_head must be an int"),
        ({"exact_lse_limit": 0}, sdpa.SdpaValueError, r"exact_lse_limit must be a finite number"),
        ({"exact_lse_limit": float("inf")}, sdpa.SdpaValueError, r"exact_lse_limit .* got inf"),
        ({"kernel_devices": "cuda"}, sdpa.SdpaTypeError, r"kernel_devices must be a set"),
        ({"kernel_devices": {0}}, sdpa.SdpaTypeError, r"device type names \(str\)"),
        ({"exact_lse_limit": "16"}, sdpa.SdpaTypeError, r"exact_lse_limit must be a finite"),
    ],
)
def test_override_refuses_unknown_names_and_bad_values(changes, exc, pattern):
    before = settings.get()
    with pytest.raises(exc, match=pattern), settings.override(**changes):
        pass
    assert settings.get() == before  # nothing changed


def test_override_is_per_thread():
    """A thread sees its own override, never another thread's."""
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def worker():
        with settings.override(chunk_bytes=12345):
            inside.set()
            done.wait(5)
            seen["worker"] = settings.get().chunk_bytes

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    seen["main"] = settings.get().chunk_bytes  # while the worker's override is open
    done.set()
    t.join()
    assert seen == {"worker": 12345, "main": settings.Settings().chunk_bytes}


def test_override_is_per_asyncio_task():
    async def task(value, started, release):
        with settings.override(mask_chunk_bytes=value):
            started.set()
            await release.wait()
            return settings.get().mask_chunk_bytes

    async def main():
        events = [asyncio.Event() for _ in range(2)]
        release = asyncio.Event()
        tasks = [
            asyncio.create_task(task(v, e, release)) for v, e in zip((7, 8), events, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in events))  # both overrides open
        outside = settings.get().mask_chunk_bytes
        release.set()
        return await asyncio.gather(*tasks), outside

    values, outside = asyncio.run(main())
    assert values == [7, 8] and outside == settings.Settings().mask_chunk_bytes


def test_chunked_engine_is_an_override_of_the_kernel_devices():
    from sdpa import weights

    with weights.chunked_engine():
        assert settings.get().kernel_devices == frozenset()
    assert settings.get().kernel_devices == frozenset({"cuda"})


@pytest.mark.small_shapes
def test_the_small_backend_reads_the_settings(gen):
    """small_weights = 0 turns the small backend off, on the O(1) path and the full one."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=8, S=8)
    assert select_fast(fast_normalize(q, k, v)).name == "small"
    with settings.override(small_weights=0):
        assert select_fast(fast_normalize(q, k, v)).name == "fused"
        assert select(normalize(q, k, v)).name == "fused"
        with pytest.raises(sdpa.NotSupportedError, match=r"over small_weights = 0"):
            sdpa.attention(q, k, v, backend="small")


def test_the_weights_engine_reads_the_chunk_budget(gen):
    """A budget of a few rows cuts the weights into many tiles: a read's backward into
    tiles of the budget, its forward (the attention received, in the entropy's pieces:
    rows.pieces) into blocks of keys within it, each weight computed once; the same
    answers."""
    from sdpa import rows

    q, k, v, mask = make_inputs(gen, Hq=2, L=40, S=50, mask_kind="float")
    q.requires_grad_()
    w = sdpa.attention(q, k, v, mask).weights
    calls, pieces = [], []
    real, real_shifted = rows.Source.tile, rows._shifted

    def counting(source, t):
        calls.append((len(t.heads), t.at_r.stop - t.at_r.start))
        return real(source, t)

    def shifted(r, t, out):
        pieces.append(rows._size(r, t))
        return real_shifted(r, t, out)

    q64 = q.detach().double().requires_grad_()
    ref = oracle(q64, k.double(), v.double(), mask)[1].sum(-2)
    budget = 5 * 50 * 4
    with settings.override(chunk_bytes=budget), pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows.Source, "tile", counting)
        mp.setattr(rows, "_shifted", shifted)
        sums = w.sum(dim=-2)
        assert not calls  # (the forward reads no Source tile)
        mp.setattr(rows, "_shifted", real_shifted)
        sums.square().sum().backward()
    assert len(pieces) > 2 and max(pieces) * 4 <= budget, pieces
    assert sum(pieces) == w.numel()  # each weight once
    backward = [n for heads, n in calls if heads == 1]
    assert max(backward) == 5 and len(backward) == 2 * 2 * 8  # 5 rows of one head a tile
    torch.testing.assert_close(sums.double(), ref, atol=1e-4, rtol=0)
    (want,) = torch.autograd.grad(ref.square().sum(), q64)
    torch.testing.assert_close(q.grad.double(), want, atol=1e-4, rtol=1e-4)


# -- the rules, each in one place --------------------------------------------------------


@pytest.mark.parametrize("L, S", [(1, 1), (3, 5), (5, 3), (4, 4)])
def test_visible_is_the_causal_rule_of_every_alignment(L, S):
    """Key j is visible to query i when j <= i + offset: top-left offset 0, bottom-right
    S - L, against the drawn matrices (torch.tril with the offset as diagonal)."""
    i, j = torch.arange(L), torch.arange(S)
    for offset in (0, S - L, -2, 3):
        expected = torch.ones(L, S, dtype=torch.bool).tril(offset)
        assert torch.equal(masks.visible_grid(i, j, offset), expected)
        assert torch.equal(masks.visible(i[:, None], j[None, :], offset), expected)
    assert torch.equal(masks.top_left(L, S), torch.ones(L, S, dtype=torch.bool).tril())
    drawn = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(masks.causal().materialize(2, 5), drawn)  # bottom-right, offset 3
    assert torch.equal(masks.causal("top-left").materialize(2, 5), drawn.tril())


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("L, S", [(7, 7), (5, 9)])
def test_every_backend_and_the_weights_engine_agree_on_causality(gen, engine, L, S):
    """The causal flag (top-left) and the bottom-right causal mask, through each
    backend and the weights engine's rows, against the float64 oracle."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=L, S=S)
    cases = [(masks.causal(), False)] + ([(None, True)] if L == S else [])
    for mask, causal in cases:
        dense = torch.ones(L, S, dtype=torch.bool).tril(S - L)  # independent of visible
        ref_out, ref_p = oracle(q, k, v, dense)
        out, w, reads = run_or_skip(engine, q, k, v, mask, causal=causal)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
        with reads:
            rows = w[0, :, 2:4]
        torch.testing.assert_close(rows.double(), ref_p[0, :, 2:4], atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "dtype, want",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
     (torch.float32, torch.float32), (torch.float64, torch.float64)],
)  # fmt: skip
def test_compute_dtype_rule(dtype, want):
    assert compute_dtype(dtype) is want
    q = torch.zeros(1, 1, 2, 4, dtype=dtype)
    w = sdpa.attention(q, q, q).weights
    assert w.dtype is want and w.lse.dtype is want


def test_as_4d():
    keep = masks.causal().materialize(3, 4)  # (L, S)
    assert masks.as_4d(keep).shape == (1, 1, 3, 4)
    batched = masks.padding([1, 2]).materialize(3, 4)  # (B, 1, L, S)
    assert masks.as_4d(batched) is batched


# -- private torch ops ---------------------------------------------------------------------


def test_a_missing_private_op_makes_fused_unsupported_not_broken(gen, monkeypatch):
    """Where this torch lacks the CPU flash op (renamed), the fused backend says so in
    its reasons, an explicit backend='fused' raises naming the op, and 'auto' (the
    O(1) path included) runs another backend with the same result."""
    q, k, v, mask = make_inputs(gen, B=1, Hq=2, L=9, S=11, mask_kind="bool")
    real = aten.CPU_FLASH
    monkeypatch.setattr(aten, "CPU_FLASH", None)
    reasons = sdpa.backends.BACKENDS["fused"].not_supported_reasons(normalize(q, k, v))
    assert any(aten.CPU_FLASH_NAME in r for r in reasons), reasons
    with pytest.raises(sdpa.NotSupportedError, match=rf"{aten.CPU_FLASH_NAME}.*renamed"):
        sdpa.attention(q, k, v, backend="fused")
    assert select_fast(fast_normalize(q, k, v)).name == "chunked"
    out, w = sdpa.attention(q, k, v, mask)
    ref_out, ref_p = oracle(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(w.full().double(), ref_p, atol=2e-5, rtol=0)
    # without the backward op only the sinks' correction (differentiated by it) is lost
    monkeypatch.setattr(aten, "CPU_FLASH", real)
    monkeypatch.setattr(aten, "CPU_FLASH_BACKWARD", None)
    assert select_fast(fast_normalize(q, k, v)).name == "fused"
    sinks = masks.sinks(torch.zeros(2, 1, 1))
    reasons = sdpa.backends.BACKENDS["fused"].not_supported_reasons(normalize(q, k, v, sinks))
    assert any(f"{aten.CPU_FLASH_NAME}_backward" in r for r in reasons), reasons


def test_import_sdpa_survives_a_renamed_private_op():
    """In a fresh interpreter whose torch has no CPU flash op by that name, `import
    sdpa` works, the fused backend reports the op, and attention still runs."""
    code = f"""
import torch
name = {aten.CPU_FLASH_NAME!r}
for n in (name, name + "_backward"):
    if hasattr(torch, n):
        delattr(torch, n)
    torch.ops.aten.__dict__.pop(n, None)
ns = type(torch.ops.aten)
real = ns.__getattr__
def hide(self, n):
    if n.startswith(name):
        raise AttributeError(n)
    return real(self, n)
ns.__getattr__ = hide
import sdpa
from sdpa.inputs import normalize
q = torch.randn(1, 2, 300, 8)
print(sdpa.backends.BACKENDS["fused"].not_supported_reasons(normalize(q, q, q)))
out, w = sdpa.attention(q, q, q, causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
print(float((out - ref).abs().max()))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    reasons, err = done.stdout.strip().splitlines()
    assert aten.CPU_FLASH_NAME in reasons
    assert float(err) < 1e-5
