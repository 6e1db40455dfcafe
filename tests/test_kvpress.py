"""kvpress presses on sdpa's lazy weights against transformers' eager attention.

Runs in .venv-kvpress (kvpress 0.5 pins transformers < 5.3; `make test` builds it and
runs `pytest -m kvpress` there); skipped where kvpress is not importable. The model is
a tiny Llama with random weights, built from its config (nothing is downloaded).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
kvpress = pytest.importorskip("kvpress")
transformers = pytest.importorskip("transformers")

from kvpress.utils import compute_n_kept  # noqa: E402

import sdpa  # noqa: E402
import sdpa.integrations.kvpress as sdpa_kvpress  # noqa: E402
import sdpa.integrations.transformers as sdpa_hf  # noqa: E402
from sdpa import AttentionWeights  # noqa: E402

pytestmark = [pytest.mark.kvpress, pytest.mark.small_shapes]  # as users run them

L, QUESTION, NEW_TOKENS, VOCAB = 160, 4, 8, 256


@pytest.fixture(scope="module")
def name():
    return sdpa_kvpress.register()


@pytest.fixture(scope="module")
def model():
    # hidden 64, 4 query heads of 16 on 2 key/value heads (GQA), 2 layers; weights wide
    # enough (initializer_range) that attention is far from uniform and scores seldom tie
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, VOCAB, (1, L), generator=g)
    question = torch.randint(0, VOCAB, (1, QUESTION), generator=g)
    return context, question


def prefill(model, impl, press, context):
    """Run the press over the context on `impl`; returns the cache, the scores each layer
    computed and the attentions object each layer's press was handed."""
    model.set_attn_implementation(impl)
    scorer = getattr(press, "press", press)  # AdaKVPress wraps a ScorerPress
    scores, seen = [], []
    score = scorer.score

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        seen.append(attentions)
        out = score(module, hidden_states, keys, values, attentions, kwargs)
        scores.append(out.clone())  # AdaKVPress writes into the scores
        return out

    scorer.score = recording
    cache = transformers.DynamicCache()
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=context, past_key_values=cache)
    finally:
        del scorer.score  # the class's method again
    return cache, scores, seen


def generate(model, impl, cache, question):
    """Greedy decoding on `impl` after the context, as kvpress's pipeline does it (the
    press only prefills): the tokens and the logits of every step."""
    model.set_attn_implementation(impl)
    logits, tokens = [], []
    position = torch.arange(L, L + QUESTION)[None]
    step = question
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(input_ids=step, past_key_values=cache, position_ids=position)
            logits.append(out.logits[0, -1])
            tokens.append(int(out.logits[0, -1].argmax()))
            step, position = torch.tensor([[tokens[-1]]]), position[:, -1:] + 1
    return tokens, torch.stack(logits)


def kept(scores, ratio):
    """The kept key positions of each layer, as ScorerPress.compress picks them."""
    return [s.topk(compute_n_kept(s.shape[-1], ratio), dim=-1).indices for s in scores]


def in_position_order(cache, indices):
    """Each layer's kept keys and values, reordered by position (topk orders ties
    arbitrarily)."""
    out = []
    for layer, idx in zip(cache.layers, indices, strict=True):
        order = idx.argsort(dim=-1)[..., None].expand(*idx.shape, layer.keys.shape[-1])
        out.append((layer.keys.gather(2, order), layer.values.gather(2, order)))
    return out


PRESSES = {
    "observed": lambda: kvpress.ObservedAttentionPress(compression_ratio=0.5),
    "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=0.5, window_size=16),
    "tova": lambda: kvpress.TOVAPress(compression_ratio=0.5),
}


@pytest.mark.parametrize("press_name", list(PRESSES))
def test_press_keeps_eagers_cache_and_generates_eagers_tokens(name, model, ids, press_name):
    context, question = ids
    press = PRESSES[press_name]()
    eager_cache, eager_scores, eager_seen = prefill(model, "eager", press, context)
    our_cache, our_scores, our_seen = prefill(model, name, press, context)

    assert all(isinstance(a, torch.Tensor) for a in eager_seen)
    assert all(isinstance(a, AttentionWeights) for a in our_seen)  # lazy: no L x L
    assert all(a.shape == (1, 4, L, L) for a in our_seen)
    for a, b in zip(our_scores, eager_scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    ours, eager = kept(our_scores, 0.5), kept(eager_scores, 0.5)
    for a, b in zip(ours, eager, strict=True):
        assert a.shape == b.shape == (1, 2, L // 2)
        assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)
    pairs = zip(in_position_order(our_cache, ours), in_position_order(eager_cache, eager),
                strict=True)  # fmt: skip
    for layer, ((ka, va), (kb, vb)) in enumerate(pairs):
        assert ka.shape == kb.shape == (1, 2, L // 2, 16)
        # the first layer's keys are the same bits on both paths, so its kept cache is too
        tol = 0 if layer == 0 else 1e-5
        torch.testing.assert_close(ka, kb, atol=tol, rtol=tol)
        torch.testing.assert_close(va, vb, atol=tol, rtol=tol)

    eager_tokens, eager_logits = generate(model, "eager", eager_cache, question)
    our_tokens, our_logits = generate(model, name, our_cache, question)
    assert our_tokens == eager_tokens
    torch.testing.assert_close(our_logits, eager_logits, atol=1e-4, rtol=1e-4)


def test_observed_scores_are_the_handles_sums(name, model, ids):
    """What ObservedAttentionPress asks of the attentions, answered by the handle."""
    context, _ = ids
    press = kvpress.ObservedAttentionPress(compression_ratio=0.5)
    _, _, eager_seen = prefill(model, "eager", press, context)
    _, _, our_seen = prefill(model, name, press, context)
    for w, dense in zip(our_seen, eager_seen, strict=True):
        assert (w.device, w.dtype) == (dense.device, dense.dtype)
        torch.testing.assert_close(w.sum(2), dense.sum(2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w[..., -16:, :-16], dense[..., -16:, :-16], atol=1e-5, rtol=0)


def test_adakv_decoding_hides_pruned_keys_from_our_attention(name, model, ids):
    """AdaKVPress (which eager refuses) prunes per head by hiding keys from the attention
    while decoding: the function `register` installs is wrapped by kvpress's patch even
    though kvpress was imported first, and decodes as torch's sdpa does."""
    context, question = ids
    press = kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.5, window_size=16))
    runs = {}
    for impl in ("sdpa", name):
        cache, scores, _ = prefill(model, impl, press, context)
        runs[impl] = (scores, generate(model, impl, cache, question))
    (sdpa_scores, (sdpa_tokens, sdpa_logits)) = runs["sdpa"]
    (our_scores, (our_tokens, our_logits)) = runs[name]
    for a, b in zip(our_scores, sdpa_scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert our_tokens == sdpa_tokens
    torch.testing.assert_close(our_logits, sdpa_logits, atol=1e-4, rtol=1e-4)

    # the same function registered without the helper, after kvpress's import: unwrapped,
    # it attends the pruned keys and decodes something else
    plain = sdpa_hf.register("lse_attention_unpatched", lazy_weights=True)
    cache, _, _ = prefill(model, plain, press, context)
    _, plain_logits = generate(model, plain, cache, question)
    assert (plain_logits - sdpa_logits).abs().max() > 1e-2
    for layer in model.model.layers:  # AdaKVPress leaves its choice on the modules
        layer.self_attn.masked_key_indices = None


def test_register_wraps_once_whatever_the_import_order(name):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # kvpress imported first (this module), then register: wrapped once, by kvpress
    fn = ALL_ATTENTION_FUNCTIONS[name]
    assert fn.__wrapped__ is sdpa_hf.lazy_attention_forward
    assert sdpa_kvpress.register() == name
    assert ALL_ATTENTION_FUNCTIONS[name].__wrapped__ is sdpa_hf.lazy_attention_forward

    # our registration first, then kvpress's import (it wraps it), then register
    script = textwrap.dedent(
        """
        import sdpa.integrations.transformers as sdpa_hf
        name = sdpa_hf.register(lazy_weights=True)
        import kvpress
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
        assert fns[name] is not sdpa_hf.lazy_attention_forward  # kvpress wrapped it
        import sdpa.integrations.kvpress as sdpa_kvpress
        assert sdpa_kvpress.register() == name
        fn = fns[name]
        assert fn.__wrapped__ is sdpa_hf.lazy_attention_forward, fn
        assert [c.cell_contents for c in fn.__closure__] == [sdpa_hf.lazy_attention_forward]
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.parametrize(
    "Hq,Hkv,L,S,mask,dtype",
    [
        (4, 2, 97, 97, "causal", torch.float32),  # what a Llama prefill passes
        (4, 2, 97, 97, "causal flag", torch.bfloat16),
        (3, 3, 40, 130, None, torch.float32),
        (2, 1, 1, 33, None, torch.float64),
    ],
)
def test_observed_attention_equals_the_dense_sum(Hq, Hkv, L, S, mask, dtype):
    """The sum ObservedAttentionPress asks for, on what a Llama prefill passes, equals
    the dense weights' sum over the queries."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 40, generator=g).to(dtype)
               for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))  # fmt: skip
    m = sdpa.masks.causal("top-left") if mask == "causal" else None
    _, w = sdpa.attention(q, k, v, m, causal=mask == "causal flag")
    got = w.sum(dim=-2)
    assert got.shape == (2, Hq, S) and got.dtype == w.dtype
    torch.testing.assert_close(got, w.full().sum(dim=-2), atol=1e-5, rtol=1e-5)


def test_register_without_kvpress_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'sdpa\[kvpress\]'"):
        sdpa_kvpress.register()


@pytest.mark.parametrize(
    "taken", ["eager", "sdpa", "flash_attention_2", "flex_attention", "paged|eager", "org/kernel"]
)
def test_register_refuses_names_that_are_not_ours(taken, monkeypatch):
    """As sdpa.integrations.transformers.register: transformers' own implementations are
    not replaced (nor wrapped by kvpress's patch in their place), and the name is checked
    before kvpress is imported."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = dict(ALL_ATTENTION_FUNCTIONS.items())
    said = re.escape(f"name={taken!r} is not sdpa's to register")
    with pytest.raises(sdpa.SdpaValueError, match=rf"^{said}.*'lse_attention_lazy'"):
        sdpa_kvpress.register(taken)
    assert dict(ALL_ATTENTION_FUNCTIONS.items()) == before
    monkeypatch.setitem(sys.modules, "kvpress", None)  # as if not installed: the name first
    with pytest.raises(sdpa.SdpaValueError, match=said):
        sdpa_kvpress.register(taken)
