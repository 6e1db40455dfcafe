"""Prompt-to-prompt edits as fused calls against P2P's own math: materialise the maps,
edit them as P2P's controllers do (AttentionReplace, AttentionRefine, AttentionReweight,
self-attention replacement), multiply by the values. On raw tensors of awkward sizes
and on a tiny random UNet2DConditionModel (our processors + edit against a materialising
processor with P2P's controller, diffusers' attn.get_attention_scores)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers.models.attention_processor import AttnProcessor2_0

from sdpa.errors import NotSupportedError, SdpaValueError
from sdpa.integrations import diffusers as sdpa_diffusers
from sdpa.integrations import prompt2prompt as p2p
from test_diffusion_maps import tiny_tokenizer, tiny_unet

# -- P2P's math, on materialised maps (float64) -----------------------------------------


def probs(q, k, mask=None, scale=None):
    """softmax(scale q k^T + mask) in float64: (B, H, L, S)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q.double() @ k.double().mT * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return s.softmax(-1)


def p2p_cross(attn, kind, *, mapper=None, alphas=None, equalizer=None, prev=None):
    """P2P's replace_cross_attention on attn (1+T, H, L, S): base = attn[0]."""
    base, replace = attn[0], attn[1:]
    if kind == "replace":
        return torch.einsum("hpw,bwn->bhpn", base, mapper.double())
    if kind == "refine":
        a = alphas.double().reshape(alphas.shape[0], 1, 1, alphas.shape[1])
        return base[:, :, mapper].permute(2, 0, 1, 3) * a + replace * (1 - a)
    if kind == "reweight":
        if prev is not None:
            base = p2p_cross(attn, **prev)
            return base * equalizer.double()[:, None, None, :]
        return base[None] * equalizer.double()[:, None, None, :]
    raise AssertionError(kind)


def reference(q, k, v, mask=None, scale=None, **edit):
    """Targets' outputs (T, H, L, Dv) with P2P's edited maps, in float64."""
    attn = probs(q, k, mask, scale)
    return p2p_cross(attn, **edit) @ v[1:].double()


def random_refinement(gen, T, S):
    mapper = torch.randint(-1, S, (T, S), generator=gen)
    alphas = torch.rand(T, S, generator=gen) * (mapper >= 0)
    return mapper, alphas


SIZES = [(1, 1, 5, 3, 8, 8), (2, 3, 37, 11, 40, 24), (3, 2, 97, 77, 59, 80)]  # T, H, L, S, D, Dv


def qkv(gen, T, H, L, S, D, Dv, dtype=torch.float32):
    return (
        torch.randn(1 + T, H, L, D, generator=gen).to(dtype),
        torch.randn(1 + T, H, S, D, generator=gen).to(dtype),
        torch.randn(1 + T, H, S, Dv, generator=gen).to(dtype),
    )


@pytest.mark.parametrize("T,H,L,S,D,Dv", SIZES)
@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "float"])
def test_edits_match_p2p_math(gen, T, H, L, S, D, Dv, mask_kind):
    q, k, v = qkv(gen, T, H, L, S, D, Dv)
    mask = None
    if mask_kind == "key_padding":
        mask = torch.rand(1 + T, 1, 1, S, generator=gen) < 0.8
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(1 + T, H, L, S, generator=gen)
    swap = torch.rand(T, S, S, generator=gen)
    mapper, alphas = random_refinement(gen, T, S)
    eq = torch.rand(T, S, generator=gen) * 3
    cases = [
        (p2p.from_mappers(swap), dict(kind="replace", mapper=swap)),
        (p2p.from_mappers(mapper, alphas), dict(kind="refine", mapper=mapper, alphas=alphas)),
        (p2p.reweight(eq, targets=T, tokens=S), dict(kind="reweight", equalizer=eq)),
        (
            p2p.reweight(eq, base=p2p.from_mappers(mapper, alphas)),
            dict(
                kind="reweight",
                equalizer=eq,
                prev=dict(kind="refine", mapper=mapper, alphas=alphas),
            ),
        ),
    ]
    for edit, ref in cases:
        want = reference(q, k, v, mask, **ref)
        got = p2p.cross(q, k, v, mask, edit)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=ref["kind"])


@pytest.mark.parametrize("T,H,L,S,D,Dv", SIZES)
def test_renormalised_reweight_is_a_log_weight(gen, T, H, L, S, D, Dv):
    """softmax(s + log c) equals the source map with column j scaled by c_j, rows
    renormalised; c = 0 removes a token."""
    q, k, v = qkv(gen, T, H, L, S, D, Dv)
    c = torch.rand(T, S, generator=gen) * 3 + 0.1
    c[:, 0] = 0.0 if S > 1 else 1.0
    scaled = probs(q, k)[0][None] * c.double()[:, None, None, :]  # (T, H, L, S)
    want = (scaled / scaled.sum(-1, keepdim=True)) @ v[1:].double()
    got = p2p.cross(q, k, v, None, p2p.reweight(c, targets=T, tokens=S, renormalize=True))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_scale_and_bf16(gen):
    q, k, v = qkv(gen, 2, 2, 33, 9, 16, 16, dtype=torch.bfloat16)
    swap = torch.rand(2, 9, 9, generator=gen)
    want = reference(q, k, v, scale=0.3, kind="replace", mapper=swap)
    got = p2p.cross(q, k, v, None, p2p.from_mappers(swap), scale=0.3)
    assert got.dtype == torch.bfloat16
    # bf16: within a few times the error of the reference run in bf16
    ref_bf16 = (probs(q, k, scale=0.3).bfloat16().float()[0][None] @ swap.bfloat16().float()).to(
        torch.bfloat16
    ).float() @ v[1:].float()
    bound = 4 * (ref_bf16.double() - want).abs().max() + 1e-3
    assert (got.double() - want).abs().max() <= bound


def test_time_weights(gen):
    """at(alpha): P2P's blend alpha * M_edit + (1 - alpha) * M_target, per token."""
    q, k, v = qkv(gen, 2, 2, 20, 7, 8, 8)
    mapper, alphas = random_refinement(gen, 2, 7)
    aw = (torch.rand(2, 7, generator=gen) < 0.5).float()
    attn = probs(q, k)
    new = p2p_cross(attn, kind="refine", mapper=mapper, alphas=alphas)
    a = aw.double()[:, None, None, :]
    want = (new * a + attn[1:] * (1 - a)) @ v[1:].double()
    got = p2p.cross(q, k, v, None, p2p.from_mappers(mapper, alphas).at(aw))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_self_replace(gen):
    q, k, v = qkv(gen, 2, 3, 30, 30, 8, 8)
    want = probs(q, k)[0][None] @ v[1:].double()
    torch.testing.assert_close(p2p.self_replace(q, k, v, None).double(), want, atol=1e-5, rtol=0)


# -- mappers from a tokenizer ------------------------------------------------------------


def test_swap_mapper():
    tok = tiny_tokenizer()
    k = len(tok("zebra", add_special_tokens=False).input_ids)  # letters: several tokens
    assert k > 1 and len(tok("dog", add_special_tokens=False).input_ids) == 1
    edit = p2p.swap(tok, ["a cat on the beach", "a dog on the beach", "a zebra on the beach"])
    A = edit.values
    assert not edit.own.any()
    # same token count: one to one, identity elsewhere (start, words, end, padding)
    torch.testing.assert_close(A[0], torch.eye(77))
    # cat (position 2) -> zebra's k tokens (2 .. 2+k-1) with 1/k each; then shifted by k-1
    assert torch.allclose(A[1][2, 2 : 2 + k], torch.full((k,), 1 / k))
    assert A[1][2].sum() == 1 and A[1][:2, :2].equal(torch.eye(2))
    assert A[1][3, 2 + k] == 1 and A[1][4, 3 + k] == 1 and A[1][76 - k + 1, 76] == 1
    assert A[1].sum() == 77 - (k - 1)
    with pytest.raises(SdpaValueError, match="as many words"):
        p2p.swap(tok, ["a cat", "a big cat"])


def test_refine_mapper_is_p2p_alignment():
    tok = tiny_tokenizer()
    x = tok("a cat on the beach").input_ids
    y = tok("a red cat on the beach").input_ids
    edit = p2p.refine(tok, ["a cat on the beach", "a red cat on the beach"])
    # target tokens: <s> a red cat on the beach </s>; "red" (2) has no source token
    aligned = [0, 1, -1, 2, 3, 4, 5, 6]
    assert len(y) == len(aligned) and len(x) == 7
    for n, j in enumerate(aligned):
        if j < 0:
            assert edit.values[0][:, n].sum() == 0 and edit.own[0, n] == 1
        else:
            assert edit.values[0][j, n] == 1 and edit.values[0][:, n].sum() == 1
            assert edit.own[0, n] == 0
    assert edit.values[0][40, 40] == 1  # padding maps to itself


def test_refusals(gen):
    edit = p2p.from_mappers(torch.rand(1, 5, 5))
    q, k, v = qkv(gen, 2, 1, 4, 5, 8, 8)
    with pytest.raises(SdpaValueError, match="1 targets"):
        p2p.cross(q, k, v, None, edit)
    with pytest.raises(SdpaValueError, match="renormalize"):
        edit.reweighted(torch.ones(5), renormalize=True)
    with pytest.raises(SdpaValueError, match="prompts=3"):
        p2p.PromptToPrompt(edit, prompts=3, cross_steps=5)
    with pytest.raises(SdpaValueError, match="alpha 0"):
        p2p.from_mappers(torch.tensor([[0, -1]]), torch.tensor([[1.0, 0.5]]))
    with pytest.raises(SdpaValueError, match=r"\(T\|1, S\)"):
        edit.at(torch.ones(3, 5))


# -- on a tiny UNet: our processors + edit against a materialising P2P processor ----------


class P2PProcessor:
    """P2P's processor for diffusers (the community pipeline's P2PCrossAttnProcessor):
    materialise the probabilities (attn.get_attention_scores), let the controller edit
    the conditional half in place, multiply by the values."""

    def __init__(self, controller):
        self.controller = controller

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B = hidden_states.shape[0]
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        is_cross = encoder_hidden_states is not None
        context = encoder_hidden_states if is_cross else hidden_states
        key = attn.head_to_batch_dim(attn.to_k(context))
        value = attn.head_to_batch_dim(attn.to_v(context))
        probs_ = attn.get_attention_scores(query, key, None)  # (B*H, L, S)
        self.controller(probs_.view(B, attn.heads, *probs_.shape[1:]), is_cross)
        out = attn.batch_to_head_dim(torch.bmm(probs_, value))
        return attn.to_out[1](attn.to_out[0](out))


class Controller:
    """P2P's AttentionControlEdit.forward on the conditional half (batch (2n, H, L, S))."""

    def __init__(self, n, step, cross_steps, self_steps, self_max, alpha=None, **edit):
        self.n, self.step, self.edit, self.alpha = n, step, edit, alpha
        self.cross_steps, self.self_steps, self.self_max = cross_steps, self_steps, self_max

    def __call__(self, attn, is_cross):
        cond = attn[attn.shape[0] - self.n :]
        if is_cross and self.alpha is not None:  # P2P's per-word cross_replace_alpha
            a = self.alpha[self.step].double()[None, None, None, :]
            new = p2p_cross(cond.double(), **self.edit) * a + cond[1:].double() * (1 - a)
            cond[1:] = new.to(attn.dtype)
        elif is_cross and self.step in self.cross_steps:
            cond[1:] = p2p_cross(cond.double(), **self.edit).to(attn.dtype)
        elif not is_cross and self.step in self.self_steps and cond.shape[2] <= self.self_max:
            cond[1:] = cond[0][None].expand_as(cond[1:])


@pytest.mark.parametrize("kind", ["replace", "refine", "reweight"])
def test_tiny_unet_matches_p2p_processor(gen, kind):
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    n, S = 3, 77
    sample = torch.randn(2 * n, 4, 8, 12, generator=gen)
    text = torch.randn(2 * n, S, 32, generator=gen)
    mapper, alphas = random_refinement(gen, n - 1, S)
    swap = torch.rand(n - 1, S, S, generator=gen) / 4
    eq = torch.rand(n - 1, S, generator=gen) * 2
    edit, ref = {
        "replace": (p2p.from_mappers(swap), dict(kind="replace", mapper=swap)),
        "refine": (
            p2p.from_mappers(mapper, alphas),
            dict(kind="refine", mapper=mapper, alphas=alphas),
        ),
        "reweight": (p2p.reweight(eq, targets=n - 1), dict(kind="reweight", equalizer=eq)),
    }[kind]
    fn = p2p.PromptToPrompt(edit, prompts=n, cross_steps=(0, 3), self_steps=2, self_max_tokens=30)
    sdpa_diffusers.use_sdpa(unet)
    with torch.no_grad():
        plain = unet(sample, 10, text).sample
    for step in (0, 1, 4):  # cross and self edited; cross only; neither
        ctrl = Controller(n, step, range(0, 3), range(2), 30, **ref)
        unet.set_attn_processor(P2PProcessor(ctrl))
        with torch.no_grad():
            want = unet(sample, 10, text).sample
        unet.set_attn_processor(AttnProcessor2_0())
        sdpa_diffusers.use_sdpa(unet)
        with torch.no_grad(), sdpa_diffusers.edit(unet, fn) as session:
            session.step = step
            got = unet(sample, 10, text).sample
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {step}")
        torch.testing.assert_close(got[: n + 1], plain[: n + 1], atol=1e-6, rtol=0)
        changed = (got[n + 1 :] - plain[n + 1 :]).abs().max()
        assert changed > 1e-4 if step < 3 else changed < 1e-6, (step, changed)


def test_tiny_unet_token_steps(gen):
    """P2P's per-word cross_replace_steps: tokens 3 and 4 edited in steps 0..4, token 6 in
    none, the rest in steps 0..1: a step where only some tokens are edited blends."""
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    n, S = 2, 77
    sample = torch.randn(2 * n, 4, 8, 12, generator=gen)
    text = torch.randn(2 * n, S, 32, generator=gen)
    mapper, alphas = random_refinement(gen, n - 1, S)
    ref = dict(kind="refine", mapper=mapper, alphas=alphas)
    fn = p2p.PromptToPrompt(
        p2p.from_mappers(mapper, alphas), prompts=n, cross_steps=2,
        token_steps={3: 5, 4: (0, 5), 6: 0},
    )  # fmt: skip
    alpha = torch.zeros(6, S)
    alpha[:2] = 1
    alpha[:5, 3:5] = 1
    alpha[:, 6] = 0
    for step in (1, 3):
        unet.set_attn_processor(P2PProcessor(Controller(n, step, (), (), 0, alpha=alpha, **ref)))
        with torch.no_grad():
            want = unet(sample, 10, text).sample
        unet.set_attn_processor(AttnProcessor2_0())
        sdpa_diffusers.use_sdpa(unet)
        with torch.no_grad(), sdpa_diffusers.edit(unet, fn) as session:
            session.step = step
            got = unet(sample, 10, text).sample
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {step}")


def test_tiny_unet_edit_changes_only_targets(gen):
    torch.manual_seed(0)
    unet = sdpa_diffusers.use_sdpa(tiny_unet().eval())
    n = 2
    sample = torch.randn(2 * n, 4, 8, 12, generator=gen)
    text = torch.randn(2 * n, 77, 32, generator=gen)
    fn = p2p.PromptToPrompt(p2p.from_mappers(torch.eye(77)[None]), prompts=n, cross_steps=1)
    with torch.no_grad():
        plain = unet(sample, 10, text).sample
        with sdpa_diffusers.edit(unet, fn):
            got = unet(sample, 10, text).sample
    torch.testing.assert_close(got[:3], plain[:3], atol=1e-6, rtol=0)  # uncond + source
    assert (got[3] - plain[3]).abs().max() > 1e-3  # the target took the source's maps
    with (
        pytest.raises(SdpaValueError, match="the batch of"),
        torch.no_grad(),
        sdpa_diffusers.edit(unet, fn),
    ):
        unet(sample[:3], 10, text[:3])


def test_joint_calls_refused():
    fn = p2p.PromptToPrompt(p2p.identity(1, 5), prompts=2, cross_steps=1)
    info = type("Info", (), {"kind": "joint", "name": "transformer_blocks.0.attn", "step": 0})
    with pytest.raises(NotSupportedError, match="joint"):
        fn(info, *(torch.zeros(2, 1, 4, 8),) * 3, None)
