"""Dispatch: auto picks the first backend that fits; explicit ones never fall back."""

from __future__ import annotations

import pytest
import torch

import sdpa
from sdpa.backends import BACKENDS, PRIORITY, Backend, NotSupportedError, select
from sdpa.inputs import normalize

from conftest import make_inputs


class Refuses(Backend):
    def __init__(self, name, reason):
        self.name, self.reason = name, reason

    def not_supported_reasons(self, inputs):
        return [self.reason]


def test_auto_prefers_fused_and_falls_to_reference_for_dropout(gen):
    q, k, v, _ = make_inputs(gen)
    assert select(normalize(q, k, v)).name == "fused"
    assert select(normalize(q, k, v, dropout_p=0.2)).name == "reference"
    capped = normalize(q, k, v, sdpa.masks.softcap(5.0))
    assert select(capped).name == "chunked"  # the fused kernels cannot cap scores
    assert select(normalize(q, k, v, sdpa.masks.softcap(5.0), dropout_p=0.2)).name == "reference"
    # auto's order, pinned on purpose (tests/test_engines_listed.py allows this list)
    assert [b.name for b in PRIORITY] == ["small", "fused", "chunked", "reference"]
    assert set(BACKENDS) == {"small", "fused", "chunked", "reference"}


def test_none_fits_lists_every_backend_with_reasons(gen):
    q, k, v, _ = make_inputs(gen)
    priority = (Refuses("a", "no good reason"), Refuses("b", "inputs on a toaster"))
    with pytest.raises(
        NotSupportedError,
        match=r"no backend can run these inputs. "
        r"a: no good reason; b: inputs on a toaster",
    ):
        select(normalize(q, k, v), "auto", priority)


def test_explicit_backend_raises_with_its_reasons(gen):
    q, k, v, _ = make_inputs(gen)
    with pytest.raises(
        NotSupportedError,
        match=r"backend 'fused' cannot run these inputs "
        r"\(fused: dropout_p=0.5 > 0 on CPU .*\); backend='auto' picks one that can",
    ):
        sdpa.attention(q, k, v, dropout_p=0.5, backend="fused")


def test_not_supported_is_a_value_error_and_a_runtime_error():
    assert issubclass(NotSupportedError, ValueError)
    assert issubclass(NotSupportedError, RuntimeError)


def test_fused_names_the_devices_it_runs_on(gen):
    q, k, v = (t.to("meta") for t in make_inputs(gen)[:3])
    with pytest.raises(
        NotSupportedError, match=r"inputs on meta \(the fused backend runs on: cpu, cuda\)"
    ):
        sdpa.attention(q, k, v, backend="fused")


@pytest.mark.cuda
def test_cuda_inputs_match_the_oracle(gen):
    from oracle import oracle

    q, k, v, mask = make_inputs(gen, L=33, S=47, mask_kind="bool")
    out, w = sdpa.attention(q.cuda(), k.cuda(), v.cuda(), mask.cuda())
    ref_out, ref_p = oracle(q, k, v, mask)
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=1e-4, rtol=0)
    torch.testing.assert_close(w.full().cpu().double(), ref_p, atol=1e-4, rtol=0)
    torch.testing.assert_close(w.sum(-2).cpu().double(), ref_p.sum(-2), atol=1e-3, rtol=0)
    torch.testing.assert_close(w.topk(3)[0].cpu().double(), ref_p.topk(3)[0], atol=1e-4, rtol=0)
    assert w.entropy().device.type == "cuda"


def test_bool_mask_converts_only_its_distinct_entries():
    """A (B, 1, 1, S) key-padding mask must not become an O(B*H*L*S) float tensor."""
    from sdpa.tile import additive

    keep = (torch.arange(9) < torch.tensor([[5], [9]])).view(2, 1, 1, 9).expand(2, 3, 7, 9)
    bias = additive(keep, torch.float32)
    assert bias.stride() == (9, 0, 0, 1) and bias.shape == keep.shape
    assert torch.equal(bias == 0, keep)
