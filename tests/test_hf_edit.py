"""sdpa.integrations.transformers.edit: pattern edits as fused calls inside a transformers
model, against the same model on a reference attention function that applies the edit
to the materialised pattern (eager's math: fp32 softmax of the masked scores)."""

from __future__ import annotations

import copy
import re
import threading

import pytest
import torch

import sdpa
import sdpa.integrations.transformers as sdpa_hf
from sdpa.integrations import edits

pytestmark = pytest.mark.small_shapes  # models run as users get them

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

H, HKV, L, LAYER = 4, 2, 37, 1  # 37 tokens: no block edge lines up with it
REFERENCE = "sdpa_test_edited_eager"
_dense_edit: dict = {}  # the edits the reference function applies, in order, and where


def _reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Eager attention with the edits of _dense_edit["chain"] applied in order to layer
    LAYER's pattern (to its scores, for those whose point is the scores)."""
    n = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
    s = (query @ k.mT) * scaling
    if attention_mask is not None:
        s = s + attention_mask
    here = module.layer_idx == _dense_edit.get("layer")
    chain = _dense_edit.get("chain", []) if here else []
    for edit in chain:
        if edit.point == "hook_attn_scores":
            s = edit.dense(s)
    p = torch.softmax(s.float(), dim=-1).to(query.dtype)
    for edit in chain:
        if edit.point == "hook_pattern":
            p = edit.dense(p)
    return (p @ v).transpose(1, 2).contiguous(), p


@pytest.fixture(scope="module")
def models():
    AttentionInterface.register(REFERENCE, _reference)
    AttentionMaskInterface.register(REFERENCE, eager_mask)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=128,
    )  # fmt: skip
    ours = LlamaForCausalLM._from_config(
        copy.deepcopy(config), attn_implementation=sdpa_hf.register()
    ).eval()
    ref = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=REFERENCE)
    ref.eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, :9] = 0  # left padding: row 1's first keys take no part
    return {"input_ids": ids, "attention_mask": mask}


def _pattern(model, batch, layer):
    """layer's dense pattern (B, H, L, S) from a run with output_attentions."""
    with torch.no_grad():
        return model(**batch, output_attentions=True).attentions[layer]


def make(name: str, source: torch.Tensor) -> list[edits.Edit]:
    """The edits of a case, in order (two or more: composed)."""
    return {
        "zero": lambda: [edits.ZeroAblate([1, 3])],
        "scale": lambda: [edits.ScaleHeads({0: 0.5, 2: 3.0})],
        "knock": lambda: [edits.KnockOut([36, 20, 12], [9, 10, 11], heads=[1, 2])],
        "zero_pattern": lambda: [edits.ZeroPattern(slice(20, None), [9, 12, 30])],
        "mean": lambda: [edits.MeanAblate([2], source)],
        "patch": lambda: [edits.PatchPattern(source[:1], heads=[0, 3])],
        "compose": lambda: [
            edits.KnockOut([36, 20], [9, 10], heads=[1]),
            edits.ZeroPattern(slice(20, None), [9, 12, 30]),
            edits.ScaleHeads({0: 0.5, 2: 3.0}),
        ],
    }[name]()


def _rows_that_see_keys(batch) -> torch.Tensor:
    """(B, L) bool: query rows of real tokens (padded rows differ by convention)."""
    return batch["attention_mask"].bool()


@pytest.mark.parametrize(
    "name", ["zero", "scale", "knock", "zero_pattern", "mean", "patch", "compose"]
)
def test_edit_equals_eager_with_the_edit_on_the_pattern(models, batch, name):
    ours, ref = models
    if name in ("mean", "patch"):  # another run's pattern weighs this run's padded keys,
        batch = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
        # whose rows differ by convention (sdpa 0, eager uniform): no padding here
    g = torch.Generator().manual_seed(2)
    other = {**batch, "input_ids": torch.randint(0, 97, (2, L), generator=g)}
    source = _pattern(ref, other, LAYER)  # another run's pattern of the layer (dense)
    chain = make(name, source)
    edit = chain[0] if len(chain) == 1 else edits.Compose(*chain)
    _dense_edit.update(chain=chain, layer=LAYER)
    try:
        with torch.no_grad():
            want = ref(**batch).logits
            plain = ours(**batch).logits
            with sdpa_hf.edit(ours, edit.on_layers(LAYER)) as ed:
                got = ours(**batch).logits
    finally:
        _dense_edit.clear()
    rows = _rows_that_see_keys(batch)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    assert (got - plain)[rows].abs().max() > 1e-3  # the edit changed something
    assert (ed.calls, ed.answered) == (3, 1)  # every layer seen, one replaced
    with torch.no_grad():  # closed: the model is itself again
        torch.testing.assert_close(ours(**batch).logits, plain, atol=0, rtol=0)


def test_an_attention_result_gives_output_attentions_and_captures_the_edited_weights(models, batch):
    ours, ref = models
    knock = edits.KnockOut([36, 20], [9, 10])

    def fn(info, q, k, v, mask):
        if info.layer != LAYER:
            return None
        kept = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
        kept[36, 9] = kept[36, 10] = kept[20, 9] = kept[20, 10] = False
        both = mask & kept if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool else None
        assert both is not None, f"Llama's sdpa mask is a bool tensor here, got {mask!r}"
        return sdpa.attention(q, k, v, both, scale=info.scale)

    _dense_edit.update(chain=[knock], layer=LAYER)
    try:
        with torch.no_grad():
            want = ref(**batch, output_attentions=True)
            with sdpa_hf.capture(ours) as cap, sdpa_hf.edit(ours, fn):
                got = ours(**batch, output_attentions=True)
    finally:
        _dense_edit.clear()
    rows = _rows_that_see_keys(batch)
    torch.testing.assert_close(got.logits[rows], want.logits[rows], atol=1e-5, rtol=1e-5)
    dense = got.attentions[LAYER]
    assert dense[:, :, 36, 9].abs().max() == 0  # the edited weights, dense
    torch.testing.assert_close(
        dense.transpose(1, 2)[rows], want.attentions[LAYER].transpose(1, 2)[rows],
        atol=1e-6, rtol=1e-5,
    )  # fmt: skip
    assert cap.weights[LAYER][:, :, 36, 9].abs().max() == 0  # the capture saw them too


def test_a_bare_tensor_is_refused_where_weights_are_asked_for(models, batch):
    ours, _ = models
    fn = edits.ZeroAblate([0]).on_layers(LAYER)
    with torch.no_grad(), sdpa_hf.edit(ours, fn):
        with pytest.raises(sdpa.SdpaValueError, match=r"bare tensor for LlamaAttention.* layer 1"):
            ours(**batch, output_attentions=True)
        with sdpa_hf.capture(ours), pytest.raises(sdpa.SdpaValueError, match="bare tensor"):
            ours(**batch)


def test_bad_answers_and_dropout_are_refused(models, batch):
    ours, _ = models
    with pytest.raises(TypeError, match="fn must be a callable"):
        sdpa_hf.edit(ours, "not a function").__enter__()
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        sdpa_hf.edit(object(), lambda *a: None).__enter__()
    wrong_dtype = lambda info, q, k, v, mask: torch.zeros(q.shape, dtype=torch.float64)  # noqa: E731
    with (
        torch.no_grad(),
        sdpa_hf.edit(ours, wrong_dtype),
        pytest.raises(sdpa.SdpaValueError, match=r"returned \(2, 4, 37, 16\) torch.float64"),
    ):
        ours(**batch)
    with (
        torch.no_grad(),
        sdpa_hf.edit(ours, lambda *a: "no"),
        pytest.raises(sdpa.SdpaTypeError, match="must return a tensor"),
    ):
        ours(**batch)
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.1
    ours.train()
    try:
        with (
            sdpa_hf.edit(ours, edits.ZeroAblate([0]).on_layers(LAYER)),
            pytest.raises(sdpa.NotSupportedError, match=r"attention dropout 0.1"),
        ):
            ours(**batch)
    finally:
        ours.eval()
        for layer in ours.model.layers:
            layer.self_attn.attention_dropout = 0.0


def test_a_model_off_sdpa_is_refused(models):
    _, ref = models
    with pytest.raises(ValueError, match=r"edit needs a model on sdpa's attention"):
        sdpa_hf.edit(ref, lambda *a: None).__enter__()


def test_edits_nest_the_innermost_answer_wins(models, batch):
    ours, _ = models
    seen = []

    def outer(info, q, k, v, mask):
        seen.append(("outer", info.layer))
        return edits.ZeroAblate(None).fused(q, k, v, mask, info.scale)

    def inner(info, q, k, v, mask):
        seen.append(("inner", info.layer))
        return None if info.layer != 0 else edits.ScaleHeads([2.0] * H).fused(q, k, v, mask)

    with torch.no_grad(), sdpa_hf.edit(ours, outer) as a, sdpa_hf.edit(ours, inner) as b:
        ours(**batch)
    assert seen[:3] == [("inner", 0), ("inner", 1), ("outer", 1)]
    assert (a.answered, b.answered) == (2, 1)  # layer 0 by inner; 1 and 2 by outer


def test_an_edit_in_another_thread_side_by_side_is_refused(models, batch):
    ours, _ = models
    opened, release, errors = threading.Event(), threading.Event(), []

    def hold():
        with sdpa_hf.edit(ours, lambda *a: None):
            opened.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    opened.wait(10)
    try:
        with sdpa_hf.capture(ours):
            pass
    except sdpa.SdpaValueError as e:
        errors.append(str(e))
    finally:
        release.set()
        t.join()
    assert errors and "an edit of its module" in errors[0]


def test_freeze_pattern_holds_the_layers_pattern_in_the_backward(models, batch):
    """FreezePattern: the forward unchanged, and no gradient reaches layer 1's q and k
    projections through its pattern (the values still get theirs)."""
    ours, _ = models
    attn = ours.model.layers[LAYER].self_attn
    ours.zero_grad()
    ours(**batch).logits.sum().backward()
    live = attn.q_proj.weight.grad.abs().max()
    ours.zero_grad()
    with sdpa_hf.edit(ours, edits.FreezePattern().on_layers(LAYER)):
        ours(**batch).logits.sum().backward()
    frozen = [attn.q_proj.weight.grad, attn.k_proj.weight.grad]
    assert live > 0 and all(g is None or g.abs().max() == 0 for g in frozen)
    assert attn.v_proj.weight.grad.abs().max() > 0
    ours.zero_grad()


def test_edit_under_torch_compile_runs_the_calls_eagerly(models, batch):
    ours, _ = models
    torch._dynamo.reset()
    try:
        compiled = torch.compile(ours, backend="eager")
        with torch.no_grad():
            plain = compiled(**batch).logits
            with sdpa_hf.edit(ours, edits.ZeroAblate(None).on_layers(LAYER)) as ed:
                got = compiled(**batch).logits
            again = compiled(**batch).logits
        want = None
        with torch.no_grad(), sdpa_hf.edit(ours, edits.ZeroAblate(None).on_layers(LAYER)):
            want = ours(**batch).logits
    finally:
        torch._dynamo.reset()
    assert ed.answered == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, plain, atol=1e-5, rtol=1e-5)


# ---- models with more than one attention stack: encoder-decoders, self and cross ----

# (encoder stack, decoder stack, self-attention and cross-attention paths in a layer)
STACKS = {
    "bart": ("model.encoder.layers", "model.decoder.layers", "self_attn", "encoder_attn"),
    "t5": ("encoder.block", "decoder.block", "layer.0.SelfAttention", "layer.1.EncDecAttention"),
    "whisper": ("model.encoder.layers", "model.decoder.layers", "self_attn", "encoder_attn"),
}
CHOICES = [("encoder", "self"), ("decoder", "self"), ("decoder", "cross")]


@pytest.fixture(scope="module")
def enc_dec():
    """Tiny random BART, T5 and Whisper on sdpa (2 + 2 layers, 4 heads), each with its
    inputs: a batch of 2."""
    import transformers as tf

    name = sdpa_hf.register()
    small = dict(vocab_size=61, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                 decoder_ffn_dim=32, init_std=0.2)  # fmt: skip
    tokens = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
    configs = {
        "bart": (tf.BartForConditionalGeneration,
                 tf.BartConfig(**small, max_position_embeddings=32)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(
            vocab_size=61, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
            num_heads=4)),
        "whisper": (tf.WhisperForConditionalGeneration, tf.WhisperConfig(
            **small, **tokens, num_mel_bins=8, max_source_positions=8, max_target_positions=16)),
    }  # fmt: skip
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(4, 61, (2, 9), generator=g), torch.randint(4, 61, (2, 6), generator=g)
    feats = torch.randn(2, 8, 16, generator=g)  # Whisper: 16 frames -> 8 positions
    out = {}
    for key, (cls, config) in configs.items():
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation=name).eval()
        inputs = {"input_features": feats} if key == "whisper" else {"input_ids": ids}
        out[key] = (model, {**inputs, "decoder_input_ids": dec})
    return out


def _run(model, inputs, fn=None):
    """The model's first output (logits), run inside an edit block of fn if given; and
    that block."""
    with torch.no_grad():
        if fn is None:
            return model(**inputs)[0], None
        with sdpa_hf.edit(model, fn) as ed:
            return model(**inputs)[0], ed


class Noting:
    """An edit function that notes the paths of the calls its fn answers."""

    def __init__(self, fn):
        self.fn, self.answered = fn, []

    def __call__(self, info, q, k, v, mask):
        got = self.fn(info, q, k, v, mask)
        if got is not None:
            self.answered.append(info.path)
        return got


@pytest.mark.parametrize("key", list(STACKS))
def test_edit_info_says_which_stack_kind_and_module_each_call_is(enc_dec, key):
    model, inputs = enc_dec[key]
    enc, dec, self_attn, cross_attn = STACKS[key]
    seen = []

    def record(info, q, k, v, mask):
        assert info.module is model.get_submodule(info.path)
        seen.append((info.layer, info.stack, info.kind, info.path))

    _run(model, inputs, record)
    want = [(i, enc, "self", f"{enc}.{i}.{self_attn}") for i in range(2)]
    for i in range(2):
        want += [(i, dec, "self", f"{dec}.{i}.{self_attn}")]
        want += [(i, dec, "cross", f"{dec}.{i}.{cross_attn}")]
    assert seen == want  # Whisper's encoder has no layer_idx: numbered within its stack


@pytest.mark.parametrize("key", list(STACKS))
def test_on_layers_without_a_stack_is_refused_where_layer_numbers_repeat(enc_dec, key):
    model, inputs = enc_dec[key]
    enc, dec, self_attn, cross_attn = STACKS[key]
    paths = [f"{enc}.1.{self_attn}", f"{dec}.1.{self_attn}", f"{dec}.1.{cross_attn}"]
    noting = Noting(edits.ZeroAblate([0]).on_layers(1))
    with pytest.raises(sdpa.SdpaValueError, match=r"stack='encoder', kind='self'") as got:
        _run(model, inputs, noting)
    assert all(p in str(got.value) for p in paths)  # the three calls it would replace
    assert noting.answered == []  # refused at the first call, before any was replaced
    with pytest.raises(sdpa.SdpaValueError, match="is ambiguous") as got:
        _run(model, inputs, edits.ZeroAblate([0]).on_layers(1, kind="self"))
    assert paths[0] in str(got.value) and paths[1] in str(got.value)  # encoder and decoder
    with pytest.raises(sdpa.SdpaValueError, match="is ambiguous") as got:
        _run(model, inputs, edits.ZeroAblate([0]).on_layers(1, stack="decoder"))
    assert paths[1] in str(got.value) and paths[2] in str(got.value)  # self and cross
    assert paths[0] not in str(got.value)
    with pytest.raises(sdpa.SdpaValueError, match=r"stack='decodr'.* names no attention stack"):
        _run(model, inputs, edits.ZeroAblate([0]).on_layers(1, stack="decodr", kind="self"))
    with pytest.raises(sdpa.SdpaValueError, match=r"'decoder.1.self' is no attention module"):
        _run(model, inputs, edits.ZeroAblate([0]).on_modules("decoder.1.self"))
    child = next(model.get_submodule(paths[1]).named_children())[0]
    inside = f"{paths[1]}.{child}"  # a projection inside an attention module: not one
    with pytest.raises(sdpa.SdpaValueError, match=rf"'{re.escape(inside)}' is no attention"):
        _run(model, inputs, edits.ZeroAblate([0]).on_modules(inside))


@pytest.mark.parametrize("key", list(STACKS))
def test_a_stack_and_kind_or_a_path_choose_exactly_one_module(enc_dec, key):
    """Each of layer 1's three attention modules, chosen by stack and kind and by path,
    against the same edit on the module picked by identity."""
    model, inputs = enc_dec[key]
    enc, dec, self_attn, cross_attn = STACKS[key]
    edit = edits.ZeroAblate([0])
    plain, _ = _run(model, inputs)
    paths = {
        ("encoder", "self"): f"{enc}.1.{self_attn}",
        ("decoder", "self"): f"{dec}.1.{self_attn}",
        ("decoder", "cross"): f"{dec}.1.{cross_attn}",
    }
    outs = []
    for stack, kind in CHOICES:
        target = model.get_submodule(paths[stack, kind])

        def by_identity(info, q, k, v, mask, target=target):
            return edit.fused(q, k, v, mask, info.scale) if info.module is target else None

        want, _ = _run(model, inputs, by_identity)
        noting = Noting(edit.on_layers(1, stack=stack, kind=kind))
        got, ed = _run(model, inputs, noting)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert (ed.calls, ed.answered, noting.answered) == (6, 1, [paths[stack, kind]])
        by_path, ed = _run(model, inputs, edit.on_modules(paths[stack, kind]))
        torch.testing.assert_close(by_path, want, atol=0, rtol=0)
        full = (enc, dec)[stack == "decoder"]  # the stack's whole name
        by_full_name, _ = _run(model, inputs, edit.on_layers(1, stack=full, kind=kind))
        torch.testing.assert_close(by_full_name, want, atol=0, rtol=0)
        assert ed.answered == 1 and (got - plain).abs().max() > 0.1
        outs.append(got)
    for i, j in ((0, 1), (0, 2), (1, 2)):  # three different modules: three different edits
        assert (outs[i] - outs[j]).abs().max() > 0.1
    noting = Noting(edit.on_modules(f"{dec}.1"))  # a block: its attention modules
    _run(model, inputs, noting)
    assert noting.answered == [paths["decoder", "self"], paths["decoder", "cross"]]
    noting = Noting(edit.on_layers(stack="decoder"))  # no layers: every call of the stack
    _run(model, inputs, noting)
    assert len(noting.answered) == 4 and all(p.startswith(dec) for p in noting.answered)


def test_self_and_cross_attention_in_one_block_and_single_stack_models(models, batch):
    """BERT as a decoder with cross-attention: two kinds in one stack; and single-stack
    models (BERT, GPT-2, Llama) keep on_layers(l) as it was."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    name = sdpa_hf.register()
    torch.manual_seed(0)
    small = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=32, initializer_range=0.2)  # fmt: skip
    bert = BertModel._from_config(
        BertConfig(**small, is_decoder=True, add_cross_attention=True), attn_implementation=name
    ).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 61, (2, 7), generator=g)
    inputs = {"input_ids": ids, "encoder_hidden_states": torch.randn(2, 5, 32, generator=g)}
    with pytest.raises(sdpa.SdpaValueError, match=r"encoder.layer.1.crossattention.self"):
        _run(bert, inputs, edits.ZeroAblate([0]).on_layers(1))
    plain, _ = _run(bert, inputs)
    noting = Noting(edits.ZeroAblate([0]).on_layers(1, kind="cross"))
    got, ed = _run(bert, inputs, noting)
    assert (ed.calls, noting.answered) == (4, ["encoder.layer.1.crossattention.self"])
    assert (got - plain).abs().max() > 0.01
    gpt2 = GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4)
    single = [
        (BertModel._from_config(BertConfig(**small), attn_implementation=name).eval(),
         {"input_ids": ids}, "encoder.layer", "encoder.layer.1.attention.self"),
        (GPT2LMHeadModel._from_config(gpt2, attn_implementation=name).eval(),
         {"input_ids": ids}, "transformer.h", "transformer.h.1.attn"),
        (models[0], batch, "model.layers", "model.layers.1.self_attn"),
    ]  # fmt: skip
    for model, inp, stack, path in single:
        seen = []
        _run(model, inp, lambda info, *a, seen=seen: seen.append((info.stack, info.kind)))
        assert set(seen) == {(stack, "self")}
        noting = Noting(edits.ZeroAblate([0]).on_layers(1))
        _run(model, inp, noting)
        assert noting.answered == [path]
