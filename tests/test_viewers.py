"""sdpa.integrations.viewers: dense attentions for bertviz and circuitsvis from a capture.

A tiny BERT with random weights, built from its config (nothing is downloaded), batch 2
with padding, against transformers' eager attentions.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")

import sdpa  # noqa: E402
import sdpa.integrations.transformers as sdpa_hf  # noqa: E402
from sdpa.integrations.viewers import attentions  # noqa: E402

pytestmark = pytest.mark.small_shapes  # the engines as users run them on these shapes

LAYERS, HEADS, LENGTH = 3, 4, 9
TOKENS = ["[CLS]", "how", "are", "you", "?", "[SEP]", "fine", "!", "[SEP]"]


@pytest.fixture(scope="module")
def model():
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=64, max_position_embeddings=32, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, LENGTH), generator=g)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, 6:] = 0  # the second sentence is padded
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def run(model, batch):
    """The capture on sdpa and eager's dense attentions, for the same batch."""
    model.set_attn_implementation(sdpa_hf.register())
    with torch.no_grad(), sdpa_hf.capture(model) as cap:
        model(**batch)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(**batch, output_attentions=True).attentions
    return cap, eager


@pytest.mark.parametrize("b", [0, 1, -1])
def test_matches_eagers_attentions(run, b):
    cap, eager = run
    got = attentions(cap, batch=b)
    assert isinstance(got, tuple) and len(got) == LAYERS
    for ours, theirs in zip(got, eager, strict=True):
        assert ours.shape == (1, HEADS, LENGTH, LENGTH) and ours.dtype == torch.float32
        i = b % 2
        torch.testing.assert_close(ours, theirs[i : i + 1], atol=1e-5, rtol=0)


def test_selects_layers_heads_and_rows(run):
    cap, _ = run
    full = attentions(cap, batch=1)
    got = attentions(cap, batch=1, layers=[2, 0], heads=[3, 1], rows=slice(2, 8, 2))
    assert [g.shape for g in got] == [(1, 2, 3, LENGTH)] * 2
    for g, f in zip(got, (full[2], full[0]), strict=True):
        torch.testing.assert_close(g, f[:, [3, 1], 2:8:2], atol=1e-6, rtol=0)
    (one,) = attentions(cap, batch=1, layers=1, heads=2, rows=[5, 0, 5])
    torch.testing.assert_close(one, full[1][:, 2:3, [5, 0, 5]], atol=1e-6, rtol=0)
    (run_,) = attentions(cap, layers=torch.tensor(1), heads=range(1, 4), rows=3)
    torch.testing.assert_close(run_, attentions(cap)[1][:, 1:4, 3:4], atol=1e-6, rtol=0)


def test_takes_a_sequence_of_weights(run):
    cap, _ = run
    got = attentions(list(cap.weights), layers=[0])
    torch.testing.assert_close(got[0], attentions(cap, layers=0)[0], atol=0, rtol=0)


def test_bertviz_head_view_renders_our_numbers(run):
    bertviz = pytest.importorskip("bertviz")
    cap, _ = run
    att = attentions(cap, batch=0)
    html = bertviz.head_view(att, TOKENS, html_action="return").data
    assert "bertviz" in html
    # bertviz writes every weight into the page as JSON: find ours there, digit for digit
    picks = [(0, 0, 0, 0), (1, 2, 3, 4), (2, 3, 8, 5), (2, 1, 7, 7)]  # (layer, head, i, j)
    numbers = {json.dumps(float(att[layer][0, h, i, j])) for layer, h, i, j in picks}
    for n in numbers:
        assert len(n) > 8 and n in html, n
    params = json.loads(_params(html))
    torch.testing.assert_close(torch.tensor(params["attention"][0]["attn"]),
                               torch.cat(att).squeeze(1), atol=0, rtol=0)  # fmt: skip


def _params(html: str) -> str:
    """The JSON bertviz substituted for PYTHON_PARAMS in its script."""
    start = html.index('{"attention"')
    depth = 0
    for at in range(start, len(html)):
        depth += {"{": 1, "}": -1}.get(html[at], 0)
        if depth == 0:
            return html[start : at + 1]
    raise AssertionError("no parameters in the page")


def test_refuses_what_it_cannot_honour(run):
    cap, _ = run
    cases = [
        (dict(capture=sdpa_hf.Capture()), sdpa.SdpaValueError, "holds no attention weights"),
        (dict(capture=object()), sdpa.SdpaTypeError, "capture must be"),
        (dict(capture=[1, 2]), sdpa.SdpaTypeError, "must all be AttentionWeights"),
        (dict(batch=2), sdpa.SdpaValueError, r"batch=2 is out of range: there are 2 batch"),
        (dict(batch=0.5), sdpa.SdpaTypeError, "batch must be an int"),
        (dict(layers=3), sdpa.SdpaValueError, "layers=3 is out of range: there are 3"),
        (dict(layers=[]), sdpa.SdpaValueError, "layers is empty"),
        (dict(layers="0"), sdpa.SdpaTypeError, "layers must be None"),
        (dict(heads=[0, 4]), sdpa.SdpaValueError, "heads=4 is out of range"),
        (dict(heads=True), sdpa.SdpaTypeError, "heads must be"),
        (dict(rows=LENGTH), sdpa.SdpaValueError, "rows=9 is out of range"),
        (dict(rows=slice(None, None, -1)), sdpa.SdpaValueError, "step must be positive"),
        (dict(rows=slice(5, 5)), sdpa.SdpaValueError, "selects no query"),
        (dict(max_bytes=-1), sdpa.SdpaTypeError, "max_bytes must be"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            attentions(**{"capture": cap, **kwargs})


def test_refuses_a_result_over_the_budget_before_computing(run):
    cap, _ = run
    need = LAYERS * HEADS * LENGTH * LENGTH * 4
    with pytest.raises(sdpa.WeightsTooLargeError, match=rf"\(3, 1, 4, 9, 9\) need {need:,}"):
        attentions(cap, max_bytes=need - 1)
    assert len(attentions(cap, max_bytes=need)) == LAYERS
    with pytest.raises(sdpa.WeightsTooLargeError, match="layers="):
        attentions(cap, layers=[0, 1], heads=0, rows=0, max_bytes=2 * LENGTH * 4 - 1)


def test_layers_of_different_shapes():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    short, long = sdpa.attention(q, k, k).weights, sdpa.attention(k, k, k).weights
    got = attentions([short, long], heads=1)
    assert [g.shape for g in got] == [(1, 1, 3, 7), (1, 1, 7, 7)]
    torch.testing.assert_close(got[1], long.full()[:, 1:2], atol=0, rtol=0)
    with pytest.raises(sdpa.WeightsTooLargeError, match=r"elements in all \(70,\)"):
        attentions([short, long], heads=1, max_bytes=70 * 4 - 1)


def test_refuses_weights_without_heads():
    q = torch.randn(2, 5, 8)  # (B, L, E): no head dim
    _, w = sdpa.attention(q, q, q)
    with pytest.raises(sdpa.SdpaValueError, match=r"\(2, 5, 5\); viewers need \(B, H, L, S\)"):
        attentions([w])
