"""TransformerLens on sdpa: a TransformerBridge at fused speed, patterns on demand.

    from transformer_lens.model_bridge import TransformerBridge
    import sdpa.integrations.transformer_lens as sdpa_tl
    bridge = TransformerBridge.boot_transformers(path, tokenizer=tok)
    sdpa_tl.use_sdpa(bridge)                          # every attention bridge on sdpa
    logits = bridge(tokens)                           # the fused kernel, no L x S tensor
    logits, cache = bridge.run_with_cache(tokens)     # patterns and scores kept lazily
    p = cache["pattern", 3]                           # LazyPattern (B, H, L, S)
    p[0, 5, -1]                                       # head 5, last query: O(S)
    p.sum(dim=-2); p.entropy(); p.topk(8); p.pairs(i, j)  # the weights' reads

How each attention bridge runs, per forward:
- No hook reads or writes `hook_attn_scores` / `hook_pattern`, or only
  run_with_cache's own caching hook does, or only sdpa edits (`sdpa.integrations.edits`):
  the bridge's forward runs under `deferred.Intercept`. Bridges that recompute attention
  themselves (position-embedding, joint-QKV and their subclasses) get a LazyScores from
  their `q @ k^T`, and their `pattern @ v` runs sdpa.attention with the mask they built
  (causal, sliding window, padding, softcap); bridges that delegate to the Hugging Face
  module reach transformers' attention interface, where this module's function runs sdpa
  and returns a LazyPattern of sdpa's weights. The caching hook stores those lazy
  tensors: a cache of every layer's patterns costs O(L) per layer.
- Any other hook on either (a user's own hook, backward hooks from
  `run_with_cache(incl_bwd=True)`, hooks wrapped by `remove_batch_dim=True`): the
  bridge runs TransformerLens' own code on dense tensors, so the hook gets exactly what
  eager gives and what it returns is used for the output (bridges that delegate to the
  Hugging Face module fire their pattern hooks after the fact, on eager and here alike:
  TransformerLens warns that an edit there is discarded). Gradients of the patterns
  are eager's own.

Bridges of TransformerLens' own architecture (`TransformerBridge.boot_native`,
"TransformerLensNative": its NativeAttention, every config switch of TransformerLens 4.3)
run the same way: NativeAttention's code runs under the interception, which also reads
its causal mask (a slice of its triu buffer) as sdpa's causal mask, its all-False mask
(bidirectional) as no mask, and the zeroing of the masked weights after its softmax as
sdpa's own zeros; hook_pattern fires inside the computation (an edit there re-weights
the output, on eager and here alike) and hook_attn_scores gets the pattern, as on eager.
use_sdpa checks each native attention fuses (one 3-token forward, its hooks set aside)
and refuses the bridge, naming the layer and the op, where one would run eagerly.

`cache["pattern", layer]` is a LazyPattern: a torch.Tensor subclass that answers as the
call's AttentionWeights (deferred.weights_of(p) is the handle; p.weights, deprecated,
too); where those weights are the pattern, every op on it, and every read of theirs
torch has no name for (p.pairs, p.kl, p.served_by), is
theirs (lazy reads, views and chains; sdpa.integrations.deferred). Code that needs a
dense tensor (circuitsvis, numpy) gets one from any op it applies, within
`max_dense_bytes` (default 1 GiB, per use_sdpa call; ops on the cached pattern itself),
else a WeightsTooLargeError that says what to read instead; `p.full(max_bytes=None)`
lifts the limit. Rows that see no key at all (padding)
have weights 0 here; TransformerLens' default mode gives them uniform weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sdpa.budget import DEFAULT_MAX_BYTES, check_max_bytes
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.integrations import deferred
from sdpa.integrations import transformers as sdpa_hf
from sdpa.integrations.deferred import LazyPattern, LazyScores, fallbacks

__all__ = [
    "NAME",
    "LazyPattern",
    "LazyScores",
    "attention_forward",
    "fallbacks",
    "is_on_sdpa",
    "restore",
    "unfused",
    "use_sdpa",
]

NAME = "lse_attention_tl"  # registered with transformers' attention and mask interfaces
EAGER_MASK_NAME = "lse_attention_tl_eager_mask"  # the same function with eager's float mask
HOOKS = ("hook_attn_scores", "hook_pattern")
# Attention bridges whose code reads only the 4-D float mask eager builds (they break on
# transformers' sdpa mask: None for plain causality, bool with padding): GLM-MoE-DSA
# adds its index mask to it and builds a wrongly broadcast causal mask when it is None.
EAGER_MASK_BRIDGES = frozenset({"GlmMoeDsaAttentionBridge"})

# Set by an attention bridge's forward for the Hugging Face attention call inside it.
_dense: contextvars.ContextVar[bool] = contextvars.ContextVar("sdpa_tl_dense", default=False)
_mode: contextvars.ContextVar[deferred.Intercept | None] = contextvars.ContextVar(
    "sdpa_tl_mode", default=None
)
_budget: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "sdpa_tl_budget", default=DEFAULT_MAX_BYTES
)


@dataclass
class State:
    """What use_sdpa changed on one bridge, for restore; and which attention bridges'
    last forward ran without any sdpa call (see unfused)."""

    budget: int | None
    implementation: dict[int, tuple[object, object]] = field(default_factory=dict)
    patched: list[torch.nn.Module] = field(default_factory=list)
    unfused: dict[str, str] = field(default_factory=dict)  # bridge name -> why
    # NativeAttention -> (its causal_mask buffer, the buffer's version, whether it is
    # triu(ones, 1)): checked once per buffer and version
    causal: dict[int, tuple[torch.Tensor, int, bool]] = field(default_factory=dict)

    def causal_buffer(self, attention: torch.nn.Module) -> torch.Tensor | None:
        """A NativeAttention's causal_mask buffer where it is triu(ones(n, n), 1) (True
        above the diagonal, masked), else None."""
        buf = getattr(attention, "causal_mask", None)
        if type(buf) is not torch.Tensor or buf.dtype != torch.bool or buf.ndim != 2:
            return None
        known = self.causal.get(id(attention))
        if known is None or known[0] is not buf or known[1] != buf._version:
            known = (buf, buf._version, torch.equal(buf, torch.ones_like(buf).triu(1)))
            self.causal[id(attention)] = known
        return buf if known[2] else None


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' attention-function contract for a model under a bridge on sdpa:
    sdpa.integrations.transformers' keyword handling, then as second output a LazyPattern
    of the call's weights (B, H, L, S), or the dense weights (float32 for 16-bit inputs)
    where a hook on the enclosing bridge's pattern needs them."""
    mode = _mode.get()
    with mode.bypass() if mode is not None else contextlib.nullcontext():
        out, weights = sdpa_hf.lazy_attention_forward(
            module, query, key, value, attention_mask, *args, **kwargs
        )
        deferred.FUSED[0] += 1
        if _dense.get():
            return out, weights.full(max_bytes=None)
    return out, deferred.weights_pattern(weights, _budget.get())


def _eager_mask(*args, **kwargs):
    from transformers.masking_utils import eager_mask

    return eager_mask(*args, **kwargs)


def _register(eager_mask: bool) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = EAGER_MASK_NAME if eager_mask else NAME
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _eager_mask if eager_mask else sdpa_hf.mask_function)
    return name


def _attention_bridges(bridge: torch.nn.Module) -> list[torch.nn.Module]:
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    return [m for m in bridge.modules() if isinstance(m, AttentionBridge)]


def unfused(bridge: torch.nn.Module) -> dict[str, str]:
    """The attention bridges of a bridge on sdpa whose last forward made no sdpa call
    (name -> why: a hook that needs dense tensors, or eager code the interception does
    not recognise); empty when every attention ran fused."""
    state = _STATES.get(bridge)
    if state is None:
        raise SdpaValueError("unfused: this bridge is not on sdpa (use_sdpa was not called)")
    return dict(state.unfused)


def is_on_sdpa(bridge: torch.nn.Module) -> bool:
    """Whether use_sdpa(bridge) is in effect."""
    return bridge in _STATES


def use_sdpa(bridge: torch.nn.Module, *, max_dense_bytes: int | None = DEFAULT_MAX_BYTES):
    """Put a TransformerBridge's attention on sdpa (in place); returns the bridge.

    max_dense_bytes: the largest dense tensor a lazy pattern or scores tensor of this
    bridge computes outside a forward (an op that needs every value, e.g. circuitsvis
    or numpy) before refusing with WeightsTooLargeError; None: no limit.
    Undo with restore(bridge). The Hugging Face model's attention implementation
    becomes "lse_attention_tl": sdpa's function and transformers' sdpa mask, so a plain
    causal mask reaches the bridges as None and they build it as causal (the tril that
    the fused kernel runs as its causal path); bridges in EAGER_MASK_BRIDGES get eager's
    float mask instead ("lse_attention_tl_eager_mask"). A boot_native bridge (no Hugging
    Face model) is checked instead: NotSupportedError, naming the layer and the op, where
    one of its attentions would not run fused.
    """
    if type(bridge).__name__ != "TransformerBridge" and not hasattr(bridge, "original_model"):
        raise SdpaTypeError(
            f"use_sdpa takes a transformer_lens TransformerBridge, got {type(bridge).__name__}"
        )
    max_dense_bytes = check_max_bytes(max_dense_bytes)
    if bridge in _STATES:
        _STATES[bridge].budget = max_dense_bytes
        return bridge
    attention = _attention_bridges(bridge)
    if not attention:
        raise SdpaValueError(
            f"{type(bridge).__name__} has no TransformerLens attention bridge to put on sdpa "
            f"(architecture {getattr(getattr(bridge, 'cfg', None), 'architecture', None)!r})"
        )
    state = State(max_dense_bytes)
    eager_mask = any(type(m).__name__ in EAGER_MASK_BRIDGES for m in attention)
    _set_implementation(bridge.original_model, _register(eager_mask), state)
    for module in attention:
        # object.__setattr__: a bridge component forwards other attributes to the
        # Hugging Face module it wraps
        object.__setattr__(
            module, "forward", functools.partial(_forward, module, type(module).forward, state)
        )
        state.patched.append(module)
    _STATES[bridge] = state
    refused = [(m, why) for m in attention if _native(m) and (why := _check(m, state))]
    if refused:
        restore(bridge)
        architecture = getattr(getattr(bridge, "cfg", None), "architecture", None)
        reasons = "; ".join(
            f"{_name(m)} ({type(m.original_component).__name__}): {why}" for m, why in refused
        )
        raise NotSupportedError(
            f"use_sdpa cannot fuse the attention of this {architecture} bridge: {reasons}. "
            f"Run it without use_sdpa (TransformerLens' own attention)"
        )
    return bridge


def restore(bridge: torch.nn.Module) -> torch.nn.Module:
    """Undo use_sdpa: the bridge's own forwards and the attention implementation it had."""
    state = _STATES.pop(bridge, None)
    if state is None:
        raise SdpaValueError("restore: this bridge is not on sdpa (use_sdpa was not called)")
    for module in state.patched:
        module.__dict__.pop("forward", None)
    for config, previous in state.implementation.values():
        config._attn_implementation = previous
    return bridge


def _set_implementation(model: torch.nn.Module, name: str, state: State) -> None:
    """config._attn_implementation = name on the model's configs (sub-models' too)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            continue
        configs = [config]
        for attr in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
            sub = getattr(config, attr, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                configs.append(sub)
        for c in configs:
            if id(c) not in state.implementation:
                state.implementation[id(c)] = (c, c._attn_implementation)
                c._attn_implementation = name


def _is_cache_hook(fn: object) -> bool:
    """run_with_cache's own forward hook (it stores value.detach())."""
    return getattr(fn, "__qualname__", "").endswith("make_cache_hook.<locals>.cache_hook")


def _is_sdpa_edit(fn: object) -> bool:
    from sdpa.integrations.edits import Edit

    return isinstance(fn, Edit)


def needs_dense(module: torch.nn.Module) -> bool:
    """Whether a hook on module's hook_attn_scores / hook_pattern needs the dense tensors:
    any hook but run_with_cache's caching hook and sdpa edits, any backward hook, a hook
    registered around TransformerLens' own handles, or a hook conversion."""
    for name in HOOKS:
        point = getattr(module, name, None)
        if point is None:
            continue
        handles = getattr(point, "fwd_hooks", [])
        if point._backward_hooks or point._backward_pre_hooks or point._forward_pre_hooks:
            return True
        if len(point._forward_hooks) != len(handles):
            return True
        if handles and point.hook_conversion is not None:
            return True
        for handle in handles:
            fn = getattr(handle, "user_hook", None)
            if not (_is_cache_hook(fn) or _is_sdpa_edit(fn)):
                return True
    return False


def _name(module: torch.nn.Module) -> str:
    """An attention bridge's name in its bridge (blocks.3.attn)."""
    point = getattr(getattr(module, "hook_pattern", None), "name", None) or ""
    return point.removesuffix(".hook_pattern") or getattr(module, "name", None) or "attention"


def _native(module: torch.nn.Module) -> bool:
    """Whether an attention bridge wraps TransformerLens' NativeAttention (or a subclass):
    a bridge of boot_native."""
    try:
        from transformer_lens.model_bridge.sources.native.model import NativeAttention
    except ImportError:  # a TransformerLens without the native architecture
        return False
    return isinstance(getattr(module, "original_component", None), NativeAttention)


def _check(module: torch.nn.Module, state: State) -> str | None:
    """Why a native attention bridge on sdpa would run eagerly, or None where it fuses:
    its forward run once on 3 positions, unpadded and padded, with its hooks set aside."""
    attention = module.original_component
    weight = next(attention.parameters(), torch.empty(0))
    n = max(1, min(3, attention.cfg.n_ctx))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, attention.cfg.d_model, generator=g).to(weight.device, weight.dtype)
    positions = torch.arange(n, device=weight.device)[None]  # (1, n), as NativeModel passes
    padded = torch.ones(1, n, dtype=torch.long, device=weight.device)
    padded[0, 0] = 0
    name = _name(module)
    for mask in (None, padded):
        fused, fell = deferred.FUSED[0], deferred.fallbacks()
        with _hooks_aside(module), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module(x, attention_mask=mask, position_ids=positions)
            except Exception as e:  # the reason the bridge is refused
                return f"its forward failed on a check input: {type(e).__name__}: {e}"
            finally:
                now, ran = deferred.fallbacks(), deferred.FUSED[0] - fused
                # the check leaves no trace: the counters as they were, and a fallback it
                # met still warns the first time a forward meets it
                deferred._FALLBACKS.clear()
                deferred._FALLBACKS.update(fell)
                deferred.FUSED[0] = fused
        ops = sorted(k for k, v in now.items() if v != fell.get(k, 0))
        why = state.unfused.pop(name, None)
        if ops:
            return (
                f"its code applies {', '.join(ops)}, which sdpa's interception does not "
                f"model (the attention would run eagerly)"
            )
        if why is not None or not ran:
            return why or "its code made no attention call sdpa recognises"
    return None


_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks",
)  # fmt: skip


@contextlib.contextmanager
def _hooks_aside(module: torch.nn.Module):
    """Inside: no hook of module or of its submodules runs (TransformerLens' and torch's
    own); after: every one is back."""
    saved = []
    for m in module.modules():
        d = m.__dict__
        for key in _HOOK_DICTS:
            if isinstance(d.get(key), dict):
                saved.append((d, key, d[key]))
                d[key] = OrderedDict()
        for key in ("fwd_hooks", "bwd_hooks"):
            if isinstance(d.get(key), list):
                saved.append((d, key, d[key]))
                d[key] = []
    try:
        yield
    finally:
        for d, key, value in saved:
            d[key] = value


class NativeIntercept(deferred.Intercept):
    """deferred.Intercept around a NativeAttention's forward, with its three mask idioms:

        scores.masked_fill(self.causal_mask[:L, :S], -inf)   sdpa's causal mask (top-left
                                                             block of its triu buffer)
        scores.masked_fill(torch.zeros(L, S, bool), -inf)    no mask (bidirectional)
        pattern.masked_fill(block_mask, 0.0)                 a no-op on sdpa's weights: 0
                                                             wherever that mask (the only
                                                             one) masked the scores
    Each is recorded as eager ran it, so a replay of the pattern stays exact."""

    def __init__(self, budget: int | None, causal: torch.Tensor | None) -> None:
        super().__init__(budget)
        self.causal = causal  # the module's causal_mask, checked to be triu(ones, 1)
        self.empty: dict[int, tuple[torch.Tensor, int]] = {}  # all-False masks made here
        self.dropped: dict[int, tuple[torch.Tensor, tuple]] = {}  # mask -> its score term

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.off:
            if func is torch.zeros and kwargs.get("dtype") is torch.bool:
                out = func(*args, **kwargs)
                self.empty[id(out)] = (out, out._version)
                return out
            if func in deferred.MASKED_FILL and len(args) == 3 and not kwargs:
                got = self._masked_fill(func, types, *args)
                if got is not NotImplemented:
                    return got
        return super().__torch_function__(func, types, args, kwargs)

    def _masked_fill(self, func, types, x, mask, value) -> object:
        node = getattr(x, "_node", None)
        if (
            not isinstance(node, deferred.Node) or x._lead is not None or x._to is not None
            or type(mask) is not torch.Tensor or mask.dtype != torch.bool
            or isinstance(value, torch.Tensor) or not isinstance(value, int | float)
        ):  # fmt: skip
            return NotImplemented
        empty = self.empty.get(id(mask))
        if empty is not None and empty[0] is mask and empty[1] == mask._version:
            return x  # nothing masked: x as it is
        if node.kind == "scores":
            term_mask = mask
            if self._causal_block(mask):
                L, S = mask.shape
                marker = deferred.Marker("not_tril", (L, S), torch.bool, mask.device)
                term_mask = deferred.make(marker, self.budget)  # ~tril(ones(L, S))
            out = super().__torch_function__(func, types, (x, term_mask, value), {})
            terms = getattr(getattr(out, "_node", None), "spec", node.spec).terms
            if len(terms) == len(node.spec.terms) + 1:
                self.dropped[id(mask)] = (mask, terms[-1])
            return out
        dropped = self.dropped.get(id(mask))
        spec = node.spec
        if (
            node.kind == "pattern" and value == 0 and node.replayable and dropped is not None
            and dropped[0] is mask and len(spec.terms) == 1 and spec.terms[0] is dropped[1]
            and not spec.dead and spec.sinks is None and node.dead != "pending"
        ):  # fmt: skip
            return deferred._record(x, func, (x, mask, value), {}, dead="sdpa")
        return NotImplemented

    def _causal_block(self, mask: torch.Tensor) -> bool:
        """Whether mask is the top-left (L, S) block of the triu(ones, 1) buffer."""
        buf = self.causal
        return (
            buf is not None and mask.ndim == 2 and mask.device == buf.device
            and mask.data_ptr() == buf.data_ptr() and mask.stride() == buf.stride()
            and mask.shape[0] <= buf.shape[0] and mask.shape[1] <= buf.shape[1]
        )  # fmt: skip


def _forward(module, original, state: State, *args, **kwargs):
    """An attention bridge's forward on sdpa: TransformerLens' own code, under the
    interception (or on dense tensors where a hook needs them)."""
    budget = _budget.set(state.budget)
    name = _name(module)
    state.unfused.pop(name, None)
    try:
        if needs_dense(module):
            state.unfused[name] = "a hook on its scores or pattern needs the dense tensors"
            token = _dense.set(True)
            try:
                return original(module, *args, **kwargs)
            finally:
                _dense.reset(token)
        if _native(module):
            causal = state.causal_buffer(module.original_component)
            mode = NativeIntercept(state.budget, causal)
        else:
            mode = deferred.Intercept(state.budget)
        token = _mode.set(mode)
        dense = _dense.set(False)
        before = deferred.FUSED[0]
        try:
            with mode:
                return original(module, *args, **kwargs)
        finally:
            if deferred.FUSED[0] == before:
                state.unfused[name] = "its eager code made no attention call sdpa recognises"
            _dense.reset(dense)
            _mode.reset(token)
    finally:
        _budget.reset(budget)
