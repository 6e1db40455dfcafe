"""nnsight on a model registered on sdpa: the attention-interface call site shows sdpa's
weights (dense when attentions are asked for, lazy with the lazy variant), and a
pattern edit written to the call's output equals eager's softmax patched the same way."""

from __future__ import annotations

import pytest
import torch

import sdpa
import sdpa.integrations.transformers as sdpa_hf
from sdpa.integrations import edits
from sdpa.integrations import nnsight as sdpa_nn

nnsight = pytest.importorskip("nnsight")
pytestmark = pytest.mark.small_shapes


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


IDS = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))


def traced(model, impl):
    model.set_attn_implementation(impl)
    lm = nnsight.NNsight(model)
    return lm, sdpa_nn.call_site(lm.model.layers[0].self_attn)


def test_call_site_shows_sdpa_weights(model):
    lm, call = traced(model, "eager")
    with lm.trace(IDS):
        want = call.output[1].save()
        want_logits = lm.output.logits.save()
    lm, call = traced(model, sdpa_hf.register())
    with lm.trace(IDS, output_attentions=True):
        dense = call.output[1].save()
        logits = lm.output.logits.save()
    with lm.trace(IDS):
        absent = call.output[1].save()
    assert type(dense) is torch.Tensor
    torch.testing.assert_close(dense, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    assert absent is None  # eager returns the weights on every call; sdpa when asked
    lm, call = traced(model, sdpa_hf.register(lazy_weights=True))
    with lm.trace(IDS):
        lazy = call.output[1].save()
    assert isinstance(lazy, sdpa.AttentionWeights)
    torch.testing.assert_close(lazy[1, 2, -1], want[1, 2, -1], atol=1e-6, rtol=0)
    torch.testing.assert_close(lazy.sum(dim=-2), want.sum(-2), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "edit",
    [
        edits.ScaleHeads({0: 0.5, 3: 2.0}),
        edits.ZeroPattern(slice(5, None), [0, 1]),
        edits.KnockOut([19], [0, 2, 4]),
        edits.ZeroAblate([2]),
    ],
    ids=repr,
)
def test_edit_route_equals_eager_softmax_patch(model, edit):
    lm, call = traced(model, "eager")
    with lm.trace(IDS):
        if edit.point == "hook_pattern":  # eager users patch the softmax's output
            softmax = call.source.nn_functional_softmax_0
            softmax.output = edit.dense(softmax.output)
        else:  # or, for scores, the sum before it
            scores = call.source.attn_weights_1
            scores.output = edit.dense(scores.output)
        want = lm.output.logits.save()
    with lm.trace(IDS):
        plain = lm.output.logits.save()
    lm, call = traced(model, sdpa_hf.register())
    with lm.trace(IDS):
        call.output = sdpa_nn.edited_output(edit, call.inputs)
        got = lm.output.logits.save()
    assert (want - plain).abs().max() > 1e-4
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "chain",
    [
        [edits.ScaleHeads({0: 0.5, 3: 2.0}), edits.ZeroPattern(slice(5, None), [0, 1])],
        [edits.KnockOut([19, 12], [0, 2, 4]), edits.ZeroAblate([2]), edits.ScaleHeads([2.0] * 4)],
        [edits.ZeroAblate([1])],  # one edit in a list: as the edit alone
    ],
    ids=lambda chain: " then ".join(map(repr, chain)),
)
def test_composed_edits_equal_eager_with_each_edit_patched_in_order(model, chain):
    """Several edits on one call: the scores edits on the scores, the softmax, then the
    pattern edits in order, on eager; on sdpa one edited_output of the list (and of
    edits.Compose, the same)."""
    lm, call = traced(model, "eager")
    with lm.trace(IDS):
        if any(e.point == "hook_attn_scores" for e in chain):
            scores = call.source.attn_weights_1
            s = scores.output
            for e in chain:
                s = e.dense(s) if e.point == "hook_attn_scores" else s
            scores.output = s
        softmax = call.source.nn_functional_softmax_0
        p = softmax.output
        for e in chain:
            p = e.dense(p) if e.point == "hook_pattern" else p
        softmax.output = p
        want = lm.output.logits.save()
    with lm.trace(IDS):
        plain = lm.output.logits.save()
    lm, call = traced(model, sdpa_hf.register())
    with lm.trace(IDS):
        call.output = sdpa_nn.edited_output(chain, call.inputs)
        got = lm.output.logits.save()
    with lm.trace(IDS):
        call.output = sdpa_nn.edited_output(edits.Compose(*chain), call.inputs)
        composed = lm.output.logits.save()
    assert (want - plain).abs().max() > 1e-4
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(composed, got, atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_writing_the_weights_changes_nothing(model, impl):
    lm, call = traced(model, "eager" if impl == "eager" else sdpa_hf.register())
    with lm.trace(IDS, output_attentions=True):
        out = call.output
        call.output = (out[0], torch.zeros_like(out[1]))
        edited = lm.output.logits.save()
    with lm.trace(IDS):
        plain = lm.output.logits.save()
    torch.testing.assert_close(edited, plain, atol=0, rtol=0)


def test_edited_output_refuses_what_it_does_not_honour(model):
    q = k = v = torch.randn(1, 4, 5, 16)
    module = model.model.layers[0].self_attn
    with pytest.raises(sdpa.NotSupportedError, match="s_aux"):
        sdpa_nn.edited_output(edits.ZeroAblate([0]), ((module, q, k, v, None), {"s_aux": q}))
    with pytest.raises(sdpa.NotSupportedError, match="dropout"):
        sdpa_nn.edited_output(edits.ZeroAblate([0]), ((module, q, k, v, None), {"dropout": 0.1}))
    with pytest.raises(sdpa.SdpaTypeError, match="attention-interface"):
        sdpa_nn.call_site(nnsight.NNsight(model).model.embed_tokens)
    with pytest.raises(
        sdpa.SdpaTypeError, match=r"Edit or a list of them.*pass its edit, ZeroAblate"
    ):
        sdpa_nn.edited_output(edits.ZeroAblate([0]).on_layers(0), ((module, q, k, v, None), {}))
    with pytest.raises(sdpa.SdpaValueError, match="knock-outs first"):
        sdpa_nn.edited_output(
            [edits.ZeroAblate([0]), edits.KnockOut([1], [0])], ((module, q, k, v, None), {})
        )
