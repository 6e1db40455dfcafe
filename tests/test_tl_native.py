"""TransformerLens' own architecture (TransformerBridge.boot_native) on sdpa.

`boot_native` builds TransformerLens' NativeModel (architecture "TransformerLensNative")
from a config; its features are config switches. One tiny config (2 layers, d_model 32,
4 heads of 8, seeded) per feature set that TransformerLens' own tests and demos boot:
GPT-2 style (LN, GELU, learned positions: test_boot_native, test_native_training, the
telemetry demo, the legacy NeelNanda checkpoints), Llama style (RMS, gated SiLU MLP,
rotary, grouped-query heads), partial rotary with llama3 rope scaling, Gemma style soft
caps, attention-only without norms, Tracr's (bidirectional, ReLU, no norm), SoLU-LN with
LNPre, and a custom attn_scale. Each runs on sdpa and on eager: values equal at 1e-5,
every attention fused (counted), no dense fallback.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("transformer_lens")

import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.sources.native.model import NativeAttention

import sdpa
from sdpa.integrations import deferred, edits
from sdpa.integrations import transformer_lens as sdpa_tl

pytestmark = pytest.mark.small_shapes  # the engines as users get them
ATOL = 1e-5
N_LAYERS = 2

VARIANTS = {
    "gpt2": {},
    "llama": dict(normalization_type="RMS", gated_mlp=True, act_fn="silu", final_rms=True,
                  positional_embedding_type="rotary", n_key_value_heads=2),
    "rope-llama3": dict(positional_embedding_type="rotary", rotary_dim=4,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "original_max_position_embeddings": 16}),
    "softcap": dict(attn_scores_soft_cap=2.0, output_logits_soft_cap=10.0),
    "attn-only": dict(attn_only=True, normalization_type=None),
    "tracr": dict(attention_dir="bidirectional", normalization_type=None, act_fn="relu",
                  d_vocab_out=7),
    "solu": dict(act_fn="solu_ln", normalization_type="LNPre"),
    "attn-scale": dict(use_attn_scale=True, attn_scale=2.5),
}  # fmt: skip


def config(**overrides) -> TransformerBridgeConfig:
    base = dict(n_layers=N_LAYERS, d_model=32, d_head=8, n_heads=4, n_ctx=320, d_vocab=64,
                act_fn="gelu", normalization_type="LN", seed=0)  # fmt: skip
    rope_scaling = overrides.pop("rope_scaling", None)  # an attribute, as TL's tests set it
    cfg = TransformerBridgeConfig(**{**base, **overrides})
    if rope_scaling is not None:
        cfg.rope_scaling = rope_scaling
    return cfg


def boot(on_sdpa: bool, **overrides):
    overrides = dict(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_native(config(**overrides))
    return sdpa_tl.use_sdpa(bridge) if on_sdpa else bridge


def tokens(B=2, L=24, seed=1):
    return torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=ATOL):
    torch.testing.assert_close(deferred.dense_of(a, None), deferred.dense_of(b, None),
                               atol=atol, rtol=0)  # fmt: skip


PATTERNS = lambda name: name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


class Counted:
    """How many eager attentions sdpa ran fused, and which ops fell back to dense."""

    def __enter__(self):
        self.fused0, self.fell0 = deferred.FUSED[0], deferred.fallbacks()
        return self

    def __exit__(self, *exc):
        self.fused = deferred.FUSED[0] - self.fused0
        now = deferred.fallbacks()
        self.fell = {k: v - self.fell0.get(k, 0) for k, v in now.items() if v != self.fell0.get(k)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_variant_fuses_and_matches_eager(variant):
    """Logits and every cached pattern / score equal eager's, with and without left
    padding; each layer's attention is one fused sdpa call."""
    eager, ours = boot(False, **VARIANTS[variant]), boot(True, **VARIANTS[variant])
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: query rows 0-4 of batch 0 see no key
    for kwargs in ({}, {"attention_mask": mask}):
        with torch.no_grad():
            want = eager(ids, **kwargs)
            with Counted() as n:
                got = ours(ids, **kwargs)
            assert sdpa_tl.unfused(ours) == {}
            assert (n.fused, n.fell) == (N_LAYERS, {})
            close(got, want)  # padded rows too: eager zeroes their weights, as sdpa does
            l0, c0 = eager.run_with_cache(ids, names_filter=PATTERNS, **kwargs)
            with Counted() as n:
                l1, c1 = ours.run_with_cache(ids, names_filter=PATTERNS, **kwargs)
        assert (n.fused, n.fell) == (N_LAYERS, {})
        close(l1, l0)
        assert sorted(c0) == sorted(c1) and len(list(c0)) == 2 * N_LAYERS
        for name in c0:
            assert isinstance(c1[name], sdpa_tl.LazyPattern), name
            close(c1[name], c0[name])
        p, want_p = c1["pattern", 1], c0["pattern", 1]
        close(p[1, 2, -1], want_p[1, 2, -1])
        close(p.sum(dim=-2), want_p.sum(-2))
        close(p[0, :, 3], want_p[0, :, 3])  # a padded row of batch 0: 0 on both


def test_patterns_hooks_and_edits_match_eager():
    """A user's hook on hook_pattern (inside the computation on native bridges) and on
    hook_attn_scores (fired after it, with the pattern) get eager's dense tensors; sdpa's
    ScaleHeads edit stays fused and gives eager's output."""
    eager, ours = boot(False, **VARIANTS["llama"]), boot(True, **VARIANTS["llama"])
    ids = tokens()
    seen = []

    def flip(pattern, hook):
        seen.append(type(pattern))
        out = pattern.clone()
        out[:, 1] = out[:, 1].flip(-1).tril()
        return out

    def look(scores, hook):
        seen.append(type(scores))

    hooks = [("blocks.0.attn.hook_pattern", flip), ("blocks.1.attn.hook_attn_scores", look)]
    with torch.no_grad():
        plain = eager(ids)
        want = eager.run_with_hooks(ids, fwd_hooks=hooks)
        got = ours.run_with_hooks(ids, fwd_hooks=hooks)
    assert seen == [torch.Tensor] * 4
    assert (want - plain).abs().max() > 1e-3  # the edit re-weights the output
    close(got, want)
    assert sorted(sdpa_tl.unfused(ours)) == ["blocks.0.attn", "blocks.1.attn"]
    scale = edits.ScaleHeads({0: 0.5, 3: 0.0})
    with torch.no_grad():
        want = eager.run_with_hooks(ids, fwd_hooks=scale.hooks(0, 1))
        with Counted() as n:
            got = ours.run_with_hooks(ids, fwd_hooks=scale.hooks(0, 1))
    assert (want - plain).abs().max() > 1e-3
    close(got, want)
    assert (n.fused, n.fell, sdpa_tl.unfused(ours)) == (N_LAYERS, {}, {})


class _Scores(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that make a tensor as large as every score of the call (B, H, L, S)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.shape, self.made = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-2:] == self.shape[-2:]:
                self.made += t.numel() >= math.prod(self.shape)
        return out


@pytest.mark.parametrize("variant", ["gpt2", "tracr"])
def test_long_forward_forms_no_scores(variant):
    """At 300 tokens (torch's fused kernel) no op allocates the (B, H, L, L) scores;
    eager allocates them in every layer. The causal mask runs as sdpa's causal mask
    (not the dense (L, L) buffer), bidirectional attention unmasked."""
    eager, ours = boot(False, **VARIANTS[variant]), boot(True, **VARIANTS[variant])
    ids = tokens(B=1, L=300)
    shape = (1, 4, 300, 300)
    with torch.no_grad():
        with _Scores(*shape) as seen_eager:
            want = eager(ids)
        with _Scores(*shape) as seen, Counted() as n:
            got, cache = ours.run_with_cache(ids, names_filter=PATTERNS)
        _, want_cache = eager.run_with_cache(ids, names_filter=PATTERNS)
    close(got, want)
    close(cache["pattern", 0], want_cache["pattern", 0])
    assert seen_eager.made >= 2 * N_LAYERS and seen.made == 0
    assert (n.fused, n.fell) == (N_LAYERS, {})
    served = cache["pattern", 0].served_by  # a dense mask goes through a block plan
    want = "causal path" if variant == "gpt2" else "one call of torch's CPU flash kernel"
    assert served.startswith("fused: ") and served.endswith(want), served


def test_gradients_match_eager():
    grads = []
    for bridge in (boot(False, **VARIANTS["softcap"]), boot(True, **VARIANTS["softcap"])):
        loss = bridge(tokens(B=1, L=40), return_type="loss")
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in bridge.original_model.parameters()]))
    (l0, g0), (l1, g1) = grads
    close(l1, l0)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1, strict=True):
        close(b, a)


def test_a_native_attention_sdpa_cannot_fuse_is_refused(monkeypatch):
    """An attention whose code sdpa's interception does not model is refused at use_sdpa,
    by architecture, layer and op, and the bridge is left as it was."""
    original = NativeAttention.forward

    def exp_normalized(self, hidden_states, *args, **kwargs):
        B, L, _ = hidden_states.shape
        q = self.q(hidden_states).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        k = self.k(hidden_states).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        v = self.v(hidden_states).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        s = torch.exp(torch.matmul(q, k.transpose(-2, -1)) / self.scale)  # not a softmax
        out = torch.matmul(s / s.sum(-1, keepdim=True), v)
        return self.o(out.transpose(1, 2).reshape(B, L, -1)), s

    bridge = boot(False)
    calls = []
    bridge.blocks[0].attn.hook_in.add_hook(lambda x, hook: calls.append(hook.name))
    monkeypatch.setattr(NativeAttention, "forward", exp_normalized)
    before = (deferred.FUSED[0], deferred.fallbacks())
    with pytest.raises(sdpa.NotSupportedError) as e:
        sdpa_tl.use_sdpa(bridge)
    assert (deferred.FUSED[0], deferred.fallbacks()) == before  # the check left no trace
    message = str(e.value)
    for part in ("TransformerLensNative", "blocks.0.attn", "NativeAttention", "exp",
                 "without use_sdpa"):  # fmt: skip
        assert part in message, (part, message)
    assert not sdpa_tl.is_on_sdpa(bridge) and "forward" not in vars(bridge.blocks[0].attn)
    assert calls == []  # the check ran no user hook
    monkeypatch.setattr(NativeAttention, "forward", original)
    with torch.no_grad():
        bridge(tokens())
    assert calls == ["blocks.0.attn.hook_in"]  # and the hooks are back
    assert sdpa_tl.is_on_sdpa(sdpa_tl.use_sdpa(bridge))
