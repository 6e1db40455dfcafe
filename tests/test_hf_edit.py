"""sdpa.integrations.transformers.edit: pattern edits as fused calls inside a transformers
model, against the same model on a reference attention function that applies the edit
to the materialised pattern (eager's math: fp32 softmax of the masked scores)."""

from __future__ import annotations

import copy
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
_dense_edit: dict = {}  # the edit the reference function applies, and on which layer


def _reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Eager attention with _dense_edit applied to layer LAYER's pattern (or scores, for
    an edit whose point is the scores)."""
    n = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
    s = (query @ k.mT) * scaling
    if attention_mask is not None:
        s = s + attention_mask
    edit = _dense_edit.get("edit") if module.layer_idx == _dense_edit.get("layer") else None
    if edit is not None and edit.point == "hook_attn_scores":
        s = edit.dense(s)
    p = torch.softmax(s.float(), dim=-1).to(query.dtype)
    if edit is not None and edit.point == "hook_pattern":
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


def make(name: str, source: torch.Tensor) -> edits.Edit:
    return {
        "zero": lambda: edits.ZeroAblate([1, 3]),
        "scale": lambda: edits.ScaleHeads({0: 0.5, 2: 3.0}),
        "knock": lambda: edits.KnockOut([36, 20, 12], [9, 10, 11], heads=[1, 2]),
        "zero_pattern": lambda: edits.ZeroPattern(slice(20, None), [9, 12, 30]),
        "mean": lambda: edits.MeanAblate([2], source),
        "patch": lambda: edits.PatchPattern(source[:1], heads=[0, 3]),
    }[name]()


def _rows_that_see_keys(batch) -> torch.Tensor:
    """(B, L) bool: query rows of real tokens (padded rows differ by convention)."""
    return batch["attention_mask"].bool()


@pytest.mark.parametrize("name", ["zero", "scale", "knock", "zero_pattern", "mean", "patch"])
def test_edit_equals_eager_with_the_edit_on_the_pattern(models, batch, name):
    ours, ref = models
    if name in ("mean", "patch"):  # another run's pattern weighs this run's padded keys,
        batch = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
        # whose rows differ by convention (sdpa 0, eager uniform): no padding here
    g = torch.Generator().manual_seed(2)
    other = {**batch, "input_ids": torch.randint(0, 97, (2, L), generator=g)}
    source = _pattern(ref, other, LAYER)  # another run's pattern of the layer (dense)
    edit = make(name, source)
    _dense_edit.update(edit=edit, layer=LAYER)
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


def test_an_attention_result_gives_output_attentions_and_captures_the_edited_weights(
    models, batch
):
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

    _dense_edit.update(edit=knock, layer=LAYER)
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
