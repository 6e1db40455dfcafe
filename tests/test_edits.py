"""Pattern edits as fused calls against the same edit applied to the materialised pattern
(the listing's math in float64), on every mask kind, with grouped-query heads; as
TransformerLens hooks on a bridge on sdpa against the same hooks on eager."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import sdpa
from sdpa import masks
from sdpa.integrations import edits

B, H, HKV, L, S, E = 2, 4, 2, 300, 300, 16  # 300 x 300: torch's fused kernel, not small
ATOL = 1e-5
MASKS = ["none", "causal", "padding", "bias", "softcap"]


def sdpa_mask(kind: str, g: torch.Generator):
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "padding":
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        keep[0, ..., 250:] = False
        return keep
    if kind == "bias":
        return torch.randn(B, 1, L, S, generator=g)
    return masks.softcap(3.0, masks.causal())


def dense_scores(q, k, mask, scale=None):
    """The listing's masked scores (B, H, L, S) in float64, mask in sdpa's form."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = scale * (q.double() @ k.double().mT)
    softcap = None
    if isinstance(mask, masks.ScoreMod):
        mask, softcap = mask.mask, mask.softcap
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if isinstance(mask, masks.Mask):
        mask = mask.materialize(L, S)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    return s


def listing(q, k, v, mask, edit, scale=None):
    """The edit applied to the materialised pattern (or scores, for a knock-out), by
    `edit(scores, pattern)` returning the edited pattern."""
    s = dense_scores(q, k, mask, scale)
    p = edit(s)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return p @ v


def _softmax(s):
    return torch.softmax(s, dim=-1)


def _set(p, heads, value):
    p = p.clone()
    p[:, heads] = value
    return p


def references(ref: torch.Tensor) -> dict:
    """Each edit written out on the dense pattern, independently of sdpa's code."""

    def knock(s):
        s = s.clone()
        for h in (1, 2):
            for i in (299, 200, 5):
                s[:, h, i, [0, 3, 17]] = -math.inf
        return _softmax(s)

    def zero_pattern(s):
        p = _softmax(s).clone()
        p[:, :, 100:, [0, 1, 2, 77]] = 0
        return p

    def scale(s):
        p = _softmax(s).clone()
        p[:, 0] *= 0.5
        p[:, 2] *= 3.0
        return p

    return {
        "zero": lambda s: _set(_softmax(s), [1, 3], 0.0),
        "scale": scale,
        "knock": knock,
        "zero_pattern": zero_pattern,
        "mean": lambda s: _set(_softmax(s), [2], ref[:, 2].double().mean(0)),
        "patch": lambda s: _set(_softmax(s), [0, 3], ref[:1, [0, 3]].double()),
    }


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g)
    k = torch.randn(B, HKV, S, E, generator=g)
    v = torch.randn(B, HKV, S, E, generator=g)
    return q, k, v, g


def _reference_pattern(g):
    """A reference run's pattern: (3, H, L, S) LazyPattern-free, from its own q and k."""
    qr = torch.randn(3, H, L, E, generator=g)
    kr = torch.randn(3, HKV, S, E, generator=g)
    p = torch.softmax(dense_scores(qr, kr, masks.causal()), dim=-1).float()
    return p


def make_edits(g):
    ref = _reference_pattern(torch.Generator().manual_seed(0))
    return {
        "zero": edits.ZeroAblate([1, 3]),
        "scale": edits.ScaleHeads({0: 0.5, 2: 3.0}),
        "knock": edits.KnockOut([299, 200, 5], [0, 3, 17], heads=[1, 2]),
        "zero_pattern": edits.ZeroPattern(slice(100, None), [0, 1, 2, 77]),
        "mean": edits.MeanAblate([2], ref),
        "patch": edits.PatchPattern(ref[:1], heads=[0, 3]),
    }


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("name", ["zero", "scale", "knock", "zero_pattern", "mean", "patch"])
def test_fused_equals_dense_edit(name, mask_kind, qkv):
    q, k, v, g = qkv
    edit = make_edits(g)[name]
    ref = _reference_pattern(torch.Generator().manual_seed(0))
    mask = sdpa_mask(mask_kind, g)
    want = listing(q, k, v, mask, references(ref)[name])
    if edit.point == "hook_attn_scores":
        dense = listing(q, k, v, mask, lambda s: _softmax(edit.dense(s)))
    else:
        dense = listing(q, k, v, mask, lambda s: edit.dense(_softmax(s)))
    torch.testing.assert_close(dense, want, atol=1e-6, rtol=0)  # the edit on the pattern
    got = edit.fused(q, k, v, mask)
    plain = sdpa.attention(q, k, v, mask).output
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    assert (got - plain).abs().max() > 1e-3  # the edit changes the output


def test_zero_pattern_carries_gradients(qkv):
    q, k, v, _ = qkv
    q, k, v = (t.double().requires_grad_() for t in (q[:, :, :50], k[:, :, :50], v[:, :, :50]))
    edit = edits.ZeroPattern(slice(10, None), [0, 4])
    mask = masks.causal()

    def ref(q, k, v):
        s = (E**-0.5) * (q @ k.repeat_interleave(2, 1).mT)
        s = s.masked_fill(~mask.materialize(50, 50), -math.inf)
        return edit.dense(torch.softmax(s, -1)) @ v.repeat_interleave(2, 1)

    w = torch.randn(B, H, 50, E, dtype=torch.float64)
    grads = torch.autograd.grad((edit.fused(q, k, v, mask) * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref(q, k, v) * w).sum(), (q, k, v))
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=0)


def test_edits_refuse_bad_arguments(qkv):
    q, k, v, _ = qkv
    with pytest.raises(sdpa.SdpaTypeError, match="heads"):
        edits.ZeroAblate(True).fused(q, k, v)
    with pytest.raises(sdpa.SdpaValueError, match="out of range"):
        edits.ZeroAblate([7]).fused(q, k, v)
    with pytest.raises(sdpa.SdpaValueError, match="one factor per head"):
        edits.ScaleHeads([1.0, 2.0]).fused(q, k, v)
    with pytest.raises(sdpa.SdpaTypeError, match="1-D"):
        edits.KnockOut(torch.ones(2, 2, dtype=torch.long), [0]).fused(q, k, v)


def test_on_layers_is_an_edit_fn(qkv):
    q, k, v, _ = qkv
    fn = edits.ZeroAblate([0]).on_layers(3)
    info = type("Info", (), {"layer": 3, "scale": None})()
    other = type("Info", (), {"layer": 2, "scale": None})()
    assert fn(other, q, k, v, None) is None
    out = fn(info, q, k, v, None)
    assert out.shape == (B, H, L, E) and out[:, 0].abs().max() == 0


def test_on_layers_and_on_modules_check_their_arguments(qkv):
    q, k, v, _ = qkv
    with pytest.raises(sdpa.SdpaTypeError, match=r"layer numbers as ints.*\[\[1, 2\]\]"):
        edits.ZeroAblate([0]).on_layers([1, 2])
    with pytest.raises(sdpa.SdpaValueError, match="kind must be 'self' or 'cross'"):
        edits.ZeroAblate([0]).on_layers(1, kind="encoder")
    with pytest.raises(sdpa.SdpaTypeError, match="module paths"):
        edits.ZeroAblate([0]).on_modules()
    info = type("Info", (), {"layer": 1, "scale": None})()  # an info of another host
    with pytest.raises(sdpa.SdpaTypeError, match=r"info.stack, info.kind"):
        edits.ZeroAblate([0]).on_layers(1, stack="decoder")(info, q, k, v, None)
    with pytest.raises(sdpa.SdpaTypeError, match=r"info.path"):
        edits.ZeroAblate([0]).on_modules("model.layers.1")(info, q, k, v, None)


def test_a_layout_chooses_one_stack_or_refuses():
    """The choice on_layers makes among a model's stacks (as an encoder-decoder's are),
    and two modules of one stack that share a layer number (both would be replaced)."""
    sites = [edits.Site(f"model.{part}.layers.{i}.{name}", f"model.{part}.layers", kind, i)
             for part, name, kind in [("encoder", "self_attn", "self"),
                                      ("decoder", "self_attn", "self"),
                                      ("decoder", "encoder_attn", "cross")]
             for i in range(2)]  # fmt: skip
    layout = edits.Layout(sites)
    assert layout.choose((1,), "decoder", "cross", "f") == {("model.decoder.layers", "cross")}
    assert layout.choose((), "decoder", None, "f") == {
        ("model.decoder.layers", "self"), ("model.decoder.layers", "cross")
    }  # fmt: skip
    assert layout.choose((), None, None, "f") is None  # every call
    assert layout.short("model.decoder.layers") == "decoder"
    with pytest.raises(sdpa.SdpaValueError, match=r"f is ambiguous.*3 calls"):
        layout.choose((1,), None, None, "f")
    with pytest.raises(sdpa.SdpaValueError, match="names no attention stack"):
        layout.choose((1,), "decoder.layers.1", "self", "f")
    assert layout.modules(("model.decoder.layers.0",), "f") == {
        "model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"
    }  # fmt: skip
    single = edits.Layout([edits.Site("h.0.attn", "h", "self", 0)])
    assert single.choose((0,), None, None, "f") is None  # one stack: every call's
    single.add(edits.Site("h.0.attn2", "h", "self", 0))  # a module the model showed late
    with pytest.raises(sdpa.SdpaValueError, match=r"2 attention modules of stack 'h'"):
        single.choose((0,), None, None, "f")


# ---- composition ----


class _Halve(edits.Edit):
    """An edit of one's own, with a dense form only: head 0's pattern halved."""

    def dense(self, p, where=None):
        at = self._where(p, where)
        return p * torch.where(at.h == 0, 0.5, 1.0).to(p.dtype)[:, None, None]


def chains(ref: torch.Tensor) -> dict:
    """Chains of edits, each a list applied in order."""
    return {
        "scale_zero": [edits.ScaleHeads({0: 0.5, 2: 3.0}), edits.ZeroAblate([2, 3])],
        "knock_zero_pattern_scale": [
            edits.KnockOut([299, 200, 5], [0, 3, 17], heads=[1, 2]),
            edits.KnockOut([6, 7], [0, 1]),
            edits.ZeroPattern(slice(100, None), [0, 1, 2, 77]),
            edits.ScaleHeads({1: 2.0}),
        ],
        "overlapping_zeros": [
            edits.ZeroPattern(slice(100, None), [0, 1, 2, 77]),
            edits.ZeroPattern(slice(50, 150), [1, 2, 5], heads=[0, 1]),
        ],
        "zero_mean_scale": [
            edits.ZeroPattern(slice(100, None), [0, 1], heads=[2]),  # undone by the mean
            edits.MeanAblate([2], ref),
            edits.ScaleHeads({2: 2.0, 0: 0.5}),
        ],
        "patch_ablate_zero": [
            edits.PatchPattern(ref[:1], heads=[0, 3]),
            edits.ZeroAblate([3]),
            edits.ZeroPattern(slice(10, None), [4], heads=[1]),
        ],
        "zeros_in_a_patch": [  # the dense route: entries zeroed in a replaced pattern
            edits.PatchPattern(ref[:1], heads=[0]),
            edits.ZeroPattern(slice(100, None), [0, 1]),
        ],
        "freeze_scale": [edits.FreezePattern([1]), edits.ScaleHeads({1: 2.0, 0: 0.0})],
        "own_edit": [edits.ScaleHeads({1: 3.0}), _Halve()],  # the dense route
    }


def chain_dense(chain):
    """The chain on the dense scores s: its knock-outs on s, the softmax, then each
    pattern edit's dense form, in order."""

    def apply(s):
        for e in chain:
            if e.point == "hook_attn_scores":
                s = e.dense(s)
        p = _softmax(s)
        for e in chain:
            if e.point != "hook_attn_scores":
                p = e.dense(p)
        return p

    return apply


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("name", list(chains(torch.zeros(1))))
def test_composed_fused_equals_the_dense_composition(name, mask_kind, qkv, monkeypatch):
    q, k, v, g = qkv
    ref = _reference_pattern(torch.Generator().manual_seed(0))
    chain = chains(ref)[name]
    mask = sdpa_mask(mask_kind, g)
    want = listing(q, k, v, mask, chain_dense(chain))
    calls = []
    counted = lambda *a, **kw: calls.append(1) or attention(*a, **kw)  # noqa: E731
    attention = edits.attention
    monkeypatch.setattr(edits, "attention", counted)
    got = edits.Compose(*chain).fused(q, k, v, mask)
    monkeypatch.undo()
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    if name in ("scale_zero", "knock_zero_pattern_scale", "overlapping_zeros"):
        assert len(calls) == 1  # the whole chain: one fused call
    plain = sdpa.attention(q, k, v, mask).output
    assert (got - plain).abs().max() > 1e-3
    nested = edits.Compose(chain[0], edits.Compose(*chain[1:]))  # nesting: the same chain
    torch.testing.assert_close(nested.fused(q, k, v, mask), got, atol=1e-6, rtol=0)


def test_composed_gradients_equal_the_dense_composition(qkv):
    """Freezing after a head scale holds that factor too, as p.detach() does."""
    q, k, v, _ = qkv
    q, k, v = (t.double()[:, :, :50].requires_grad_() for t in (q, k, v))
    a = torch.tensor([2.0, 0.5, 1.5, 1.0], dtype=torch.float64, requires_grad=True)
    chain = [
        edits.KnockOut([40, 41], [0, 1]),
        edits.ScaleHeads(a),
        edits.FreezePattern([1]),
        edits.ZeroPattern(slice(10, None), [0, 4]),
    ]
    mask = masks.causal()

    def ref(q, k, v):
        s = (E**-0.5) * (q @ k.repeat_interleave(2, 1).mT)
        s = s.masked_fill(~mask.materialize(50, 50), -math.inf)
        return chain_dense(chain)(s) @ v.repeat_interleave(2, 1)

    w = torch.randn(B, H, 50, E, dtype=torch.float64)
    got = torch.autograd.grad((edits.Compose(*chain).fused(q, k, v, mask) * w).sum(), (q, k, v, a))
    want = torch.autograd.grad((ref(q, k, v) * w).sum(), (q, k, v, a))
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-8, rtol=0)
    assert got[3][1] == 0 and got[3][0] != 0  # head 1's factor frozen with its pattern


def test_compose_refuses_what_it_cannot_mean():
    with pytest.raises(sdpa.SdpaValueError, match="put the knock-outs first"):
        edits.Compose(edits.ZeroAblate([0]), edits.KnockOut([1], [0]))
    with pytest.raises(sdpa.SdpaTypeError, match=r"Compose\(a, b\).on_layers\(1\)"):
        edits.Compose(edits.ZeroAblate([0]).on_layers(1))
    mixed = edits.Compose(edits.KnockOut([1], [0]), edits.ZeroAblate([0]))
    with pytest.raises(sdpa.SdpaValueError, match=r"\.scores\.dense\(scores\)"):
        mixed.dense(torch.zeros(B, H, L, S))
    assert [name for name, _ in mixed.hooks(1)] == [
        "blocks.1.attn.hook_attn_scores", "blocks.1.attn.hook_pattern"
    ]  # fmt: skip


# ---- as TransformerLens hooks ----


@pytest.fixture(scope="module")
def bridges(tmp_path_factory):
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import LlamaConfig, LlamaForCausalLM

    import sdpa.integrations.transformer_lens as sdpa_tl
    import tl_zoo

    tl_zoo.no_installs()
    tok = tl_zoo.tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("edits_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = TransformerBridge.boot_transformers(str(path), tokenizer=tok, device="cpu")
        ours = TransformerBridge.boot_transformers(str(path), tokenizer=tok, device="cpu")
    return eager, sdpa_tl.use_sdpa(ours)


def test_edits_as_transformer_lens_hooks(bridges):
    from sdpa.integrations import deferred

    eager, ours = bridges
    ids = torch.randint(1000, 20000, (2, L), generator=torch.Generator().manual_seed(3))
    other = torch.randint(1000, 20000, (2, L), generator=torch.Generator().manual_seed(4))
    names = lambda n: n.endswith("hook_pattern")  # noqa: E731
    with torch.no_grad():
        _, c0 = eager.run_with_cache(other, names_filter=names)
        _, c1 = ours.run_with_cache(other, names_filter=names)
        base = eager(ids)
    pairs = {
        "zero": (edits.ZeroAblate([1, 3]),) * 2,
        "scale": (edits.ScaleHeads({0: 0.5}),) * 2,
        "knock": (edits.KnockOut([L - 1, 200], [0, 5, 17], heads=[1]),) * 2,
        "zero_pattern": (edits.ZeroPattern(slice(100, None), [0, 1, 2]),) * 2,
        "mean": (edits.MeanAblate([2], c0["pattern", 1]), edits.MeanAblate([2], c1["pattern", 1])),
        "patch": (
            edits.PatchPattern(c0["pattern", 1], heads=[0, 3]),
            edits.PatchPattern(c1["pattern", 1], heads=[0, 3]),
        ),
        "compose": (
            edits.Compose(edits.ScaleHeads({0: 0.5}), edits.ZeroPattern(slice(100, None), [0, 1])),
        )
        * 2,
        "compose_scores_and_pattern": (  # two hooks: hook_attn_scores, then hook_pattern
            edits.Compose(edits.KnockOut([L - 1, 200], [0, 5], heads=[1]), edits.ZeroAblate([2])),
        )
        * 2,
        "compose_knock_outs": (
            edits.Compose(edits.KnockOut([L - 1, 200], [0, 5, 17]), edits.KnockOut([100], [3])),
        )
        * 2,
    }
    for name, (e0, e1) in pairs.items():
        before = deferred.fallbacks()
        with torch.no_grad():
            want = eager.run_with_hooks(ids, fwd_hooks=e0.hooks(1))
            got = ours.run_with_hooks(ids, fwd_hooks=e1.hooks(1))
        assert deferred.fallbacks() == before, name  # stayed one fused call
        assert (want - base).abs().max() > 1e-4, name
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=name)


def test_freeze_pattern_holds_the_pattern_in_the_backward(qkv):
    q, k, v, _ = qkv
    q, k, v = (t.double().requires_grad_() for t in (q[:, :, :60], k[:, :, :60], v[:, :, :60]))
    edit = edits.FreezePattern(heads=[1, 2])

    def ref(q, k, v):
        s = (E**-0.5) * (q @ k.repeat_interleave(2, 1).mT)
        s = s.masked_fill(~masks.causal().materialize(60, 60), -math.inf)
        p = torch.softmax(s, -1).clone()
        p[:, [1, 2]] = p[:, [1, 2]].detach()
        return p @ v.repeat_interleave(2, 1)

    w = torch.randn(B, H, 60, E, dtype=torch.float64)
    got = edit.fused(q, k, v, masks.causal())
    torch.testing.assert_close(got, sdpa.attention(q, k, v, masks.causal()).output, atol=1e-12,
                               rtol=0)  # fmt: skip
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref(q, k, v) * w).sum(), (q, k, v))
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=0)
    assert grads[0][:, 1:3].abs().max() == 0  # q gets nothing through the frozen heads
    assert grads[0][:, 0].abs().max() > 0  # and its share through the others


def test_freeze_pattern_as_a_transformer_lens_hook(bridges):
    eager, ours = bridges
    ids = torch.randint(1000, 20000, (1, L), generator=torch.Generator().manual_seed(5))
    hooks = edits.FreezePattern([0, 2]).hooks(1)
    grads = []
    for bridge in (eager, ours):
        bridge.zero_grad()
        bridge.run_with_hooks(ids, return_type="loss", fwd_hooks=hooks).backward()
        q = bridge.blocks[1].attn.q.original_component.weight.grad.clone()
        v = bridge.blocks[1].attn.v.original_component.weight.grad.clone()
        grads.append((q, v))
    (q0, v0), (q1, v1) = grads
    torch.testing.assert_close(q1, q0, atol=1e-6, rtol=0)
    torch.testing.assert_close(v1, v0, atol=1e-6, rtol=0)


# Reads people make of a cached pattern, on an edited one (as each bridge caches it)
EDITED_READS = {
    "a row": lambda p: p[0, 1, 5],
    "row sums": lambda p: p.sum(-1),
    "attention received": lambda p: p.sum(-2),
    "head mean": lambda p: p.mean(1),
    "top 3": lambda p: p.topk(3).values,
    "previous token": lambda p: torch.diagonal(p[0], -1, -2, -1),
    "numpy": lambda p: torch.from_numpy(p[1].numpy()),
    "a head": lambda p: p[0, 1],
    "bfloat16 row": lambda p: p.to(torch.bfloat16).float()[1, 0, 7],
}


def test_a_cached_edited_pattern_reads_as_eagers(bridges):
    """run_with_cache under an edit's hooks caches the edited pattern; each read of it
    equals eager's. ZeroAblate, ScaleHeads and a Compose of them are lazy expressions of
    the call's weights (Edit.on_weights: every lazy read); the others read replayed
    rows (LazyRows). Either way sdpa.lazy's reads answer."""
    from sdpa.integrations import deferred
    from sdpa.lazy import LazyExpr
    from sdpa.lazy_rows import LazyRows

    eager, ours = bridges
    ids = torch.randint(1000, 20000, (2, L), generator=torch.Generator().manual_seed(3))
    names = lambda n: n.endswith("hook_pattern")  # noqa: E731
    with torch.no_grad():
        _, r0 = eager.run_with_cache(ids.flip(0), names_filter=names)
        _, r1 = ours.run_with_cache(ids.flip(0), names_filter=names)
    pairs = {
        "zero": ((edits.ZeroAblate([1, 3]),) * 2, True),
        "scale": ((edits.ScaleHeads({0: 0.5, 2: 2.0}),) * 2, True),
        "compose": ((edits.Compose(edits.ScaleHeads({0: 0.5}), edits.ZeroAblate([2])),) * 2, True),
        "zero_pattern": ((edits.ZeroPattern(slice(100, None), [0, 1, 2]),) * 2, False),
        "patch": (
            (
                edits.PatchPattern(r0["pattern", 1], heads=[0, 3]),
                edits.PatchPattern(r1["pattern", 1], heads=[0, 3]),
            ),
            False,
        ),
    }
    for name, ((e0, e1), lazy) in pairs.items():
        with torch.no_grad():
            with eager.hooks(fwd_hooks=e0.hooks(1)):
                _, c0 = eager.run_with_cache(ids, names_filter=names)
            with ours.hooks(fwd_hooks=e1.hooks(1)):
                _, c1 = ours.run_with_cache(ids, names_filter=names)
        want, got = c0["pattern", 1], c1["pattern", 1]
        assert isinstance(got, deferred.LazyPattern) and got._node.edits, name
        view = got[0, 1]  # (a view of the weights, or of replayed rows that shares them)
        view = view if isinstance(view, LazyExpr) else deferred._lazy_view(view)
        assert isinstance(view, LazyExpr) and isinstance(view, LazyRows) != lazy, name
        for read_name, read in EDITED_READS.items():
            torch.testing.assert_close(deferred.dense_of(read(got), None), read(want),
                                       atol=ATOL, rtol=0, msg=f"{name}: {read_name}")  # fmt: skip
