"""Hugging Face transformers on sdpa: fused speed, and the attentions when asked.

    import sdpa.integrations.transformers as sdpa_hf
    name = sdpa_hf.register()                                  # "lse_attention"
    model = AutoModel.from_pretrained(path, attn_implementation=name)
    out = model(**batch, output_attentions=True)              # dense, from the LSE
    with sdpa_hf.capture(model) as cap:                       # lazy, no n^2 memory
        model(**batch)
    cap.weights[3].entropy()                                  # layer 3, per query
    with sdpa_hf.capture(model, stats=("received", "entropy")) as cap:
        model.generate(**batch, max_new_tokens=32)             # stats computed per call
    cap.received[3]                       # (B, Hkv, S): attention each key received

The dense attentions come wherever eager gives them: when the call passes
`output_attentions=True` to the attention function, and when transformers' output
collector is recording attentions (models that pop the flag or call the attention
function without it, such as GPT-2, OPT or SigLIP). `register(lazy_weights=True)`
registers a variant that returns the lazy AttentionWeights as every attention module's
second output (for tools that read it, such as kvpress presses).

Training: the attentions and every read of the weights are differentiable. With
`output_attentions=True` the dense attentions (B, H, L, S) per layer carry eager's
gradients (they cost what eager's do: L x S floats per head and layer, and their
backward takes an L x S gradient); they are the weights *before* dropout, where eager
returns them after it (equal at dropout 0). `capture`'s statistics and kept handles
carry gradients in O(L + S) per layer: an entropy regulariser or an attention KL
against a teacher's capture without L x S (docs/guide/training.md).

What each model passes is honoured exactly as its eager path does: attention sinks
(`s_aux`, `sinks`), `softcap`, relative-position bias (`position_bias`), top-k key
`indices`; a keyword this function does not know raises, naming it and the model.
Causality: where the mask function left the mask out, causal is decided as
transformers' own sdpa path decides it (`is_causal`, else `module.is_causal`, default
True; only for more than one query). For model families transformers does not run on
its sdpa path (`_supports_sdpa = False`), the mask function builds eager's float mask,
the only one their code is written for (their modules' `is_causal` is not kept for an
omitted mask, and some extend the mask with float blocks).

The name has no "sdpa" in it: transformers gates every name containing "sdpa" on
`_supports_sdpa`, which would refuse models this function runs. `register` refuses the
names of transformers' own implementations ("eager", "flash_attention_*",
"flex_attention", "paged|..." forms, Hub kernels "org/repo") and names registered to
other functions: registering one would replace it for every model. transformers 5 refuses
the config route to attentions (`config.output_attentions = True`) for every
implementation but "eager"; use the call argument or `capture`. Rows that see no key
at all (a fully padded query under causal masking) get weights 0 here; eager gives
them uniform weights over every key.

Caches: DynamicCache, StaticCache (`cache_implementation="static"`) and sliding-window
caches work as on eager (greedy tokens identical, tests/test_generation.py); where L < S
the mask function aligns causality bottom-right, and `causal` is used only for L == S.

Edits replace attention calls: `edit(model, fn)` hands each call's q, k, v and mask
to fn(info, q, k, v, mask), whose answer (an output, an AttentionResult, or None for
the call's own attention) the layer uses; sdpa.integrations.edits gives zero and mean
ablation, knock-outs, pattern zeroing, head scaling and pattern patching as such fns
(`edits.ZeroAblate([0]).on_layers(2)`), each computed without the L x S pattern.
Each call's EditInfo says where it is (layer, stack, kind "self" / "cross", path):
on an encoder-decoder, `on_layers(1, stack="decoder", kind="cross")` or
`on_modules("model.decoder.layers.1.encoder_attn")` chooses one module.

Captures belong to their model. `capture(model)` records the calls of the attention
modules inside `model` (a sub-model: only its layers), and of no other model, from
every thread while the block is open: a thread pool or DataParallel's replicas started
in the block are recorded. Captures nest, each recording every call of its model made
inside it (outermost first). A second capture of the same modules opened side by side
in another thread or task is refused, since each would record the other's calls. The
open captures live on the modules themselves (an entry of each module's __dict__, only
while a block is open): with none open a call reads one dict entry.

Under torch.compile the attention function traces with no graph break and the lazy
weights never leave the graph (nothing outside can read them). Inside a `capture` of
the compiled model each of its attention calls runs outside the graph instead, so that
the capture sees it; the guard is on each module's attribute, so an open capture on one
model neither breaks nor recompiles the graphs of another.
"""

from __future__ import annotations

import contextlib
import contextvars
import copyreg
import importlib
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sdpa import masks
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.functional import AttentionResult, attention, output_only
from sdpa.inputs import scale_of
from sdpa.integrations.edits import Layout, Site, answer_of
from sdpa.weights import AttentionWeights

NAME = "lse_attention"
LAZY_NAME = "lse_attention_lazy"
OLD_NAME = "sdpa_lse"  # before 0.2: transformers' sdpa gate refuses it for some models

# Keywords that reach the attention function and carry nothing for it, reviewed
# against every architecture in transformers' auto mappings (tests/test_model_zoo.py):
# the call-level kwargs models pass down (transformers' TransformersKwargs, input ids,
# labels), cache bookkeeping, flash-attention varlen metadata and flags that eager
# ignores too (packed sequences and images reach us through the mask), the sliding
# window (already inside the mask the mask function built), and rotary tables already
# applied to q and k.
HARMLESS = frozenset(
    {
        "output_hidden_states", "output_router_logits", "num_items_in_batch", "seq_idx",
        "position_ids", "cache_position", "past_key_values", "past_key_value", "cache",
        "use_cache",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "deterministic",
        "target_dtype", "return_dict", "layer_idx", "sliding_window",
        "encoder_hidden_states", "labels", "logits_to_keep", "input_ids",
        "position_embeddings", "grid_thw",
    }
)  # fmt: skip
# Families whose eager attentions are the softmax *before* the sink (the sink scales
# their output afterwards); elsewhere (gpt-oss, ...) eager's attentions include the
# sink's share, as sdpa's weights do.
ATTENTIONS_BEFORE_SINK = frozenset({"granite_swa", "granitemoe_swa"})
# Keywords that ask for nothing when None (or False) and are refused otherwise.
ONLY_WHEN_EMPTY = frozenset({"head_mask", "layer_head_mask", "block_indices"})

# The captures open on a module live in its __dict__ under this name, outermost first,
# only while one is open: a call reads one dict entry, and torch.compile guards on the
# attribute of each module it traces, so a capture on one model changes nothing in the
# graphs of another.
_OPEN = "_sdpa_open_captures"
# The captures and edits opened in this thread or task (read when one opens, never per
# call).
_here: contextvars.ContextVar[tuple[Capture | Edit, ...]] = contextvars.ContextVar(
    "sdpa_captures_here", default=()
)
_stamping = threading.Lock()  # opening and closing captures write modules' _OPEN

STATS = ("received", "entropy", "last_row", "max_logits")


class _Open(tuple):
    """The captures open on one module, outermost first (its __dict__[_OPEN]). A copy of
    the module (copy.deepcopy, pickle) gets none: it is another model. A DataParallel
    replica, which shares its original's __dict__ entries, shares them."""

    __slots__ = ()

    def __reduce__(self):
        return (tuple, ())


@dataclass(eq=False)
class Capture:
    """What `capture` collects, per attention call or accumulated per layer.

    weights: one lazy AttentionWeights (B, Hq, L, S) per call, in call order (when kept;
        calls from several threads in the order they finished). Each holds the call's
        q, k and v (`w.query`, `w.key`, `w.value`: the model's own tensors, heads split),
        what distillation's relations read (sdpa.losses).
    call_layers: the layer of each kept handle, parallel to weights.
    layers: the layers recorded (None: every layer); the others' calls are not kept and
        add no statistics.
    received: layer -> (B, Hkv, S) float32 (float64 for float64 models): attention each
        key received, summed over every query of every call (prefill and each decode
        step), averaged over the Hq / Hkv query heads that share each key/value head.
    entropy: layer -> one (B, Hq, L) tensor per call, in nats.
    last_row: layer -> one (B, Hq, S) tensor per call: the weights of the last query.
    max_logits: layer -> one (B, Hq) tensor per call: each head's largest raw score
        (after the scale and any float mask, before the softmax), as QK-clip reads it.
    B: batch, Hq / Hkv: query / key-value heads, L: queries of the call, S: keys.

    With grad enabled, where the call's q or k require grad (a model training),
    received, entropy and last_row carry their gradients, tile by tile (never L x S):
    a loss may use them. max_logits is forward only: computed without grad, it
    requires no grad (QK-clip reads it outside the loss).
    """

    weights: list[AttentionWeights] = field(default_factory=list)
    received: dict[int, torch.Tensor] = field(default_factory=dict)
    entropy: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    last_row: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    max_logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    call_layers: list[int] = field(default_factory=list)
    stats: tuple[str, ...] = ()
    on_call: Callable[[int, AttentionWeights], object] | None = field(default=None, repr=False)
    keep: bool = True
    layers: tuple[int, ...] | None = None
    # modules by weak reference: a capture kept after the block must not pin the model
    _layers: weakref.WeakKeyDictionary = field(  # module -> layer, without layer_idx
        default_factory=weakref.WeakKeyDictionary, repr=False
    )
    _owners: dict[int, weakref.ref] = field(default_factory=dict, repr=False)  # layer -> module
    _seen: dict[int, int] = field(default_factory=dict, repr=False)  # layer -> tokens
    _open: bool = field(default=False, repr=False)  # inside its block
    _modules: list[torch.nn.Module] = field(default_factory=list, repr=False)  # while open
    # one call at a time from worker threads (re-entrant: on_call may run the model)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __reduce_ex__(self, protocol: int):
        """pickle and torch.save keep what was collected (weights handles, statistics,
        detached), not the block's state or on_call (a closed capture calls nothing);
        torch.load(..., weights_only=True) loads it (sdpa allowlists the class)."""
        if self._open:
            raise NotSupportedError(
                "saving a capture inside its `with` block: save it after the block closes"
            )
        data = {name: getattr(self, name) for name in _SAVED}
        return copyreg.__newobj__, (Capture,), _detached(data)

    def __setstate__(self, state: dict) -> None:
        self.__init__(**{name: state[name] for name in _SAVED})

    def _record(
        self, module: torch.nn.Module, weights: AttentionWeights, kv_heads: int, sliding: bool
    ) -> None:
        """Inside the attention call: keep the handle, compute the statistics asked for
        from the fresh weights (with their gradients where grad is on), then call
        on_call. A call made while autograd runs a backward pass is activation
        checkpointing recomputing the layer: it was recorded when it first ran."""
        if _in_backward():
            return
        with self._lock:
            if not self._open:  # a replica kept after the block still names this capture
                return
            layer = self._layer(module)
            if self.layers is not None and layer not in self.layers:
                return
            if self.keep:
                self.weights.append(weights)
                self.call_layers.append(layer)
            if self.stats:
                self._add_stats(layer, module, weights, kv_heads, sliding)
            if self.on_call is not None:
                self.on_call(layer, weights)

    def _layer(self, module: torch.nn.Module) -> int:
        return _layer_of(module, self._layers)

    def _add_stats(
        self, layer: int, module: torch.nn.Module, w: AttentionWeights, kv_heads: int,
        sliding: bool,
    ) -> None:  # fmt: skip
        owner = self._owners.get(layer)
        if owner is None:
            self._owners[layer] = weakref.ref(module)
        elif owner() is not module:
            raise SdpaValueError(
                f"capture(stats=...) keeps statistics per layer index, and two attention "
                f"modules claim layer {layer} (the second a {type(module).__name__}; an "
                f"encoder-decoder numbers its stacks alike, and DataParallel replicas are "
                f"copies of one module); use on_call, or keep=True and read cap.weights, "
                f"which are per call"
            )
        if "entropy" in self.stats:
            self.entropy.setdefault(layer, []).append(w.entropy())  # (B, Hq, L)
        if "last_row" in self.stats:
            self.last_row.setdefault(layer, []).append(w[:, :, -1])  # (B, Hq, S)
        if "max_logits" in self.stats:
            with torch.no_grad():  # forward only
                self.max_logits.setdefault(layer, []).append(w.max_logits().head)  # (B, Hq)
        if "received" not in self.stats:
            return
        B, Hq, L, S = w.shape
        start = 0  # key j of the call is token j: Dynamic and Static caches
        if sliding:  # the cache dropped its oldest keys: its S keys are the last S tokens
            seen = L if S == L else self._seen.get(layer, 0) + L
            self._seen[layer] = seen
            start = max(0, seen - S)
        got = w.sum(dim=-2).reshape(B, kv_heads, Hq // kv_heads, S).sum(2)  # (B, Hkv, S)
        total = self.received.get(layer)
        if total is None:
            total = got.new_zeros(B, kv_heads, start + S)
        elif total.shape[:2] != (B, kv_heads):
            raise SdpaValueError(
                f"capture(stats=('received',)) sums one batch over the calls of a block, "
                f"but layer {layer} got (B, Hkv) = {(B, kv_heads)} after "
                f"{tuple(total.shape[:2])}; open one capture block per generate call"
            )
        elif total.shape[-1] < start + S:  # new keys start at 0
            total = torch.nn.functional.pad(total, (0, start + S - total.shape[-1]))
        share = kv_heads / Hq  # the mean over each group's query heads, as kvpress
        if got.requires_grad:  # out of place: the earlier sums stay in the autograd graph
            pad = (start, total.shape[-1] - start - S)
            total = total + torch.nn.functional.pad(got * share, pad)
        else:
            keys = total if start == 0 and total.shape[-1] == S else total[..., start : start + S]
            keys.add_(got, alpha=share)
        self.received[layer] = total


def _layer_of(module: torch.nn.Module, numbering: weakref.WeakKeyDictionary) -> int:
    """module.layer_idx, else the module's place among those without one in `numbering`,
    in the order of their first call (their position in a forward pass)."""
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int) and not isinstance(layer, bool):
        return layer
    return numbering.setdefault(module, len(numbering))


class EditInfo(NamedTuple):
    """What an `edit` function is told of the call it may replace."""

    layer: int  # module.layer_idx, or the module's place among its stack's in the forward pass
    module: torch.nn.Module  # the attention module making the call
    scale: float  # the scale the call uses (the model's scaling, else 1/sqrt(D))
    stack: str  # the layer list the module is in: "model.decoder.layers", "encoder.block"
    kind: str  # "self", or "cross" (keys and values from another sequence: encoder_attn)
    path: str  # the module's qualified name in the model: "model.decoder.layers.1.self_attn"
    layout: Layout  # every attention module of the model, by stack and kind


EditFn = Callable[..., "torch.Tensor | AttentionResult | None"]

# Names that mark an attention module as cross-attention: its attribute name in its layer
# (BART's and Whisper's encoder_attn, T5's EncDecAttention, BERT's crossattention,
# Mllama's cross_attn) or its class name (BertCrossAttention).
CROSS_NAMES = ("cross", "encoder_attn", "encdec", "enc_dec", "encoder_decoder")
_CALLS_ATTENTION: dict[type, bool] = {}  # module class -> its forward calls the interface


@dataclass(eq=False)
class Edit:
    """An open `edit` block: fn(info, q, k, v, mask) replaces the attention of the calls
    of its model where it returns something."""

    fn: EditFn
    calls: int = 0  # calls the block saw; answered: those fn replaced
    answered: int = 0
    layout: Layout = field(default_factory=Layout, repr=False)  # the model's, at open
    # id(module) -> Site, while open (the modules are held by _modules, ids stay theirs)
    _sites: dict[int, Site] = field(default_factory=dict, repr=False)
    _layers: dict[str, weakref.WeakKeyDictionary] = field(  # stack -> {module: layer}
        default_factory=dict, repr=False
    )
    _model: weakref.ref | None = field(default=None, repr=False)
    _open: bool = field(default=False, repr=False)
    _modules: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def _lay_out(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The layout of model's attention modules: those whose class's forward calls
        transformers' attention interface, each classified once, here. Returns
        model.modules(), from the same walk."""
        modules = []
        for path, m in model.named_modules():
            modules.append(m)
            if _calls_attention(m):
                self._sites[id(m)] = site = _site(path, m)
                self.layout.add(site)
        self._model = weakref.ref(model)
        return modules

    def _site(self, module: torch.nn.Module) -> Site:
        """module's Site (under the lock), for a module whose attention call the layout
        did not foresee: found and added to the layout at its first call."""
        site = self._sites.get(id(module))
        if site is None:
            model = self._model() if self._model is not None else None
            paths = {id(m): p for p, m in model.named_modules()} if model is not None else {}
            site = _site(paths.get(id(module), type(module).__name__), module)
            self._sites[id(module)] = site
            self.layout.add(site)
        return site


def _calls_attention(module: torch.nn.Module) -> bool:
    """Whether module's forward calls transformers' attention interface (it reads
    ALL_ATTENTION_FUNCTIONS, as every attention module of transformers 5 does); once per
    class."""
    kind = type(module)
    got = _CALLS_ATTENTION.get(kind)
    if got is None:
        code = getattr(_unwrapped(getattr(kind, "forward", None)), "__code__", None)
        got = _CALLS_ATTENTION[kind] = code is not None and "ALL_ATTENTION_FUNCTIONS" in (
            code.co_names
        )
    return got


def _site(path: str, module: torch.nn.Module) -> Site:
    """Where an attention module sits: its stack (the layer list holding it, the path up
    to the first index), its kind (the module's is_cross_attention, else cross where its
    name in its layer or its class name says so) and its layer_idx."""
    parts = path.split(".") if path else []
    at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    stack = ".".join(parts[:at] if at is not None else parts[:-1])
    inner = parts[at + 1 :] if at is not None else parts[-1:]
    flag = getattr(module, "is_cross_attention", None)
    if isinstance(flag, bool):
        cross = flag
    else:
        named = " ".join([*inner, type(module).__name__]).lower()
        cross = any(name in named for name in CROSS_NAMES)
    layer = getattr(module, "layer_idx", None)
    layer = layer if isinstance(layer, int) and not isinstance(layer, bool) else None
    return Site(path, stack, "cross" if cross else "self", layer)


def _edited(
    module: torch.nn.Module, edits: tuple[Edit, ...], need_weights: bool,
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, scale: float | None,
    dropout: float,
) -> tuple[torch.Tensor, AttentionWeights | None] | None:  # fmt: skip
    """The innermost open edit that answers this call: its output (B, Hq, L, Dv) and
    weights (None for a bare tensor), or None where no edit answers."""
    scale = scale_of(scale, query.shape[-1])
    for found in reversed(edits):
        with found._lock:
            found.calls += 1
            site = found._sites.get(id(module)) or found._site(module)
            layer = site.layer
            if layer is None:  # numbered in call order, within its stack
                numbering = found._layers.get(site.stack)
                if numbering is None:
                    numbering = found._layers[site.stack] = weakref.WeakKeyDictionary()
                layer = _layer_of(module, numbering)
        info = EditInfo(layer, module, scale, site.stack, site.kind, site.path, found.layout)
        got = found.fn(info, query, key, value, mask)
        if got is None:
            continue
        where = f"{_model_name(module)} layer {layer}"
        if dropout:
            raise NotSupportedError(
                f"the edit function replaced the attention of {where}, which runs with "
                f"attention dropout {dropout} (the model is in training mode), and the "
                f"edit's output has none; call model.eval(), or set the model's attention "
                f"dropout to 0"
            )
        out, weights = answer_of(got, query, value, where)
        if weights is None and need_weights:
            raise SdpaValueError(
                f"the edit function returned a bare tensor for {where}, whose weights are "
                f"asked for (output_attentions, a capture, or the lazy variant); return "
                f"the sdpa.attention(...) result (output, weights) instead"
            )
        with found._lock:
            found.answered += 1
        return out, weights
    return None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (where activation
    checkpointing, reentrant or not, reruns a layer's forward)."""
    return torch._C._current_graph_task_id() != -1


def _model_name(module: torch.nn.Module) -> str:
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return f"{type(module).__name__} ({model_type})" if model_type else type(module).__name__


def _check_keywords(module: torch.nn.Module, kwargs: dict) -> None:
    """Every keyword is honoured, harmless, or refused by name."""
    for key, value in kwargs.items():
        if key in HARMLESS or key == "output_attentions":
            continue
        if key in ONLY_WHEN_EMPTY and (value is None or value is False):
            continue
        raise NotSupportedError(
            f"{_model_name(module)} passed {key}={_describe(value)} to the attention "
            f"function, which {NAME!r} does not know how to honour; load this model with "
            f"attn_implementation='eager' (and report it, naming the model)"
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def _one_line(value: object, width: int = 60) -> str:
    """repr(value) in one short line, for error messages."""
    text = repr(value)
    line = text.splitlines()[0] if text else text
    return line[:width] + "..." if len(line) > width or line != text else line


def _attentions_wanted(kwargs: dict) -> bool:
    """Whether this call's weights are asked for: the `output_attentions` keyword, or
    transformers' output collector recording attentions (it hooks the attention
    modules' second output, whatever the model passed down)."""
    if kwargs.get("output_attentions"):
        return True
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    recording = collector.get() if collector is not None else None
    return bool(recording) and any("attentions" in key for key in recording)


def _mask(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool | None,
    position_bias: torch.Tensor | None,
    indices: torch.Tensor | None,
) -> torch.Tensor | masks.Mask | None:
    """The mask the model means, as transformers' sdpa path reads it."""
    L = query.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = L > 1 and attention_mask is None and bool(causal)
    # the mask function left causality to the kernel: top-left, as torch's
    mask = masks.TOP_LEFT if causal else attention_mask
    tensor, structured = masks.split(mask)
    if indices is not None:  # top-k sparse attention: only the listed keys take part
        S = key.shape[2]
        keep = torch.zeros(*indices.shape[:-1], S, dtype=torch.bool, device=indices.device)
        tensor = masks.combine(tensor, keep.scatter(-1, indices.long(), True)[:, None])
    if position_bias is not None:  # an additive float bias, masked positions -inf
        bias = position_bias.to(torch.float32 if query.dtype != torch.float64 else query.dtype)
        tensor = masks.combine(bias, tensor)
    return masks.join(tensor, structured)


def _sinks(s_aux: torch.Tensor | None, sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sink logits as sdpa.masks.sinks takes them, (..., Hq, L|1, 1): `s_aux` is one
    logit per query head (gpt-oss), `sinks` the eager extra column (B, Hq, L, 1)."""
    if s_aux is not None and sinks is not None:
        raise SdpaValueError("the model passed both s_aux and sinks; expected one of them")
    if s_aux is not None:
        return s_aux.reshape(-1, 1, 1)  # (Hq, 1, 1)
    return sinks


def _run(
    module: torch.nn.Module, lazy: bool, *args, **kwargs
) -> tuple[torch.Tensor, AttentionWeights | None]:
    """_attend, with the edits and captures open on `module` (lazy: the caller returns
    the weights). While torch.compile traces: with none open on this module the call
    traces whole; with one open it runs outside the graph (a graph break per call, so
    that the capture or edit sees it). The guard is on this module's attribute: a block
    open on another model changes nothing here."""
    if not torch.compiler.is_compiling():
        return _attend_seen(module, lazy, *args, **kwargs)
    if getattr(module, _OPEN, None):  # getattr: dynamo guards on it (on __dict__ it would not)
        return _attend_seen_eagerly(module, lazy, *args, **kwargs)
    return _attend(module, *args, **kwargs)


def _attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    _sdpa_edits: tuple[tuple[Edit, ...], bool] | None = None,
    _sdpa_weights: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, AttentionWeights | None]:
    """Output (B, L, H, D) and the lazy weights (B, H, L, S) of one attention call: what
    both registered functions take, each keyword honoured or checked. _sdpa_edits: the
    edits open on the module and whether the weights are needed; an edit that answers
    gives the output (and the weights, or None for a bare tensor). _sdpa_weights=False:
    no one reads this call's weights (none asked for, no capture or edit open): None,
    and no handle is made."""
    _check_keywords(module, kwargs)
    mask = _mask(module, query, key, attention_mask, is_causal, position_bias, indices)
    if softcap is not None:
        mask = masks.softcap(softcap, mask)
    logits = _sinks(s_aux, sinks)
    if logits is not None:
        mask = masks.sinks(logits, mask)
    got = None
    if _sdpa_edits is not None:
        edits, need_weights = _sdpa_edits
        got = _edited(module, edits, need_weights, query, key, value, mask, scaling, dropout)
    if got is None and not _sdpa_weights:
        got = output_only(query, key, value, mask, scale=scaling, dropout_p=dropout), None
    if got is None:
        got = attention(query, key, value, mask, scale=scaling, dropout_p=dropout)
    out, weights = got
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, D)


def _attend_seen(
    module: torch.nn.Module,
    lazy: bool,
    query: torch.Tensor,
    key: torch.Tensor,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, AttentionWeights | None]:
    """_attend, where the innermost open edit that answers replaces the attention, then
    each capture open on the module (outermost first) records the call."""
    opened = module.__dict__.get(_OPEN)  # one dict read when none is open
    if not opened:  # (the weights only where they are returned or asked for)
        wanted = lazy or _attentions_wanted(kwargs)
        return _attend(module, query, key, *args, _sdpa_weights=wanted, **kwargs)
    captures = [c for c in opened if isinstance(c, Capture)]
    edits = tuple(e for e in opened if isinstance(e, Edit))
    if edits:
        need = lazy or bool(captures) or _attentions_wanted(kwargs)
        kwargs["_sdpa_edits"] = (edits, need)
    out, weights = _attend(module, query, key, *args, **kwargs)
    if captures:
        sliding = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
        for found in captures:
            found._record(module, weights, key.shape[1], bool(sliding))
    return out, weights


_attend_seen_eagerly = torch.compiler.disable(_attend_seen)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function contract on sdpa.attention.

    query (B, H, L, D), key/value (B, Hkv, S, D) (grouped-query attention as is),
    attention_mask (B, 1, L, S) bool (True = takes part, from the registered mask
    function), float (added), or None; then dropout, scaling, is_causal, position_bias,
    softcap, s_aux, sinks, indices and the keywords in HARMLESS -> output (B, L, H, D)
    and the dense weights (B, H, L, S) when attentions are asked for (see the module
    docstring), else None. The weights carry gradients to q, k and a float mask where
    those require grad (before dropout: eager's after it).
    """
    out, weights = _run(module, False, query, key, value, attention_mask, *args, **kwargs)
    if weights is None or not _attentions_wanted(kwargs):  # (None: an edit's bare tensor)
        return out, None
    dense = weights.full(max_bytes=None)  # (B, H, L, S)
    if kwargs.get("s_aux") is not None and _family(module) in ATTENTIONS_BEFORE_SINK:
        dense = dense / dense.sum(-1, keepdim=True).clamp_min(torch.finfo(dense.dtype).tiny)
    return out, dense


def _family(module: torch.nn.Module) -> str:
    """The transformers model family a module's class comes from ("granite_swa")."""
    parts = type(module).__module__.split(".")  # transformers.models.<family>.modeling_x
    return parts[-2] if len(parts) >= 2 else ""


def lazy_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, AttentionWeights]:
    """attention_forward, returning the lazy AttentionWeights (B, H, L, S) as the second
    output of every call (rows, sums and statistics in O(S) memory per query row)."""
    return _run(module, True, query, key, value, attention_mask, *args, **kwargs)


_OURS: tuple[Callable, ...] = (attention_forward, lazy_attention_forward)
_SDPA_PATH_KEPT: dict[type, bool] = {}  # config class -> its models run on transformers' sdpa


def _sdpa_path_kept(config: object) -> bool:
    """Whether every model class of this config's family supports transformers' sdpa
    path, so its attention modules keep `is_causal` right for an omitted mask."""
    kind = type(config)
    if kind not in _SDPA_PATH_KEPT:
        from transformers import PreTrainedModel

        try:  # the family's modeling module (already imported when a model runs)
            modeling = importlib.import_module(
                kind.__module__.replace(".configuration_", ".modeling_")
            )
        except ImportError:  # no such module: treat the family as off the sdpa path
            modeling = None
        classes = [
            c
            for c in vars(modeling).values()
            if isinstance(c, type) and issubclass(c, PreTrainedModel)
            and getattr(c, "config_class", None) is kind
        ] if modeling is not None else []  # fmt: skip
        _SDPA_PATH_KEPT[kind] = bool(classes) and all(c._supports_sdpa for c in classes)
    return _SDPA_PATH_KEPT[kind]


def mask_function(*args, config=None, **kwargs):
    """transformers' sdpa_mask (a bool mask, or None where causality or no mask at all
    will do), except for families whose models do not run on transformers' sdpa path:
    those get eager's float mask, the only one their code is written and tested for
    (their modules' `is_causal` is not kept for an omitted mask, and some extend a
    float mask with float blocks, as deepseek-v4's compressed keys do)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    if config is None or not _sdpa_path_kept(config):
        return eager_mask(*args, config=config, **kwargs)
    return padding_view(sdpa_mask(*args, config=config, **kwargs), kwargs)


def padding_view(mask: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
    """An encoder's padding mask as what it is: transformers' sdpa_mask of a bidirectional
    model (its bidirectional_mask_function alone, no offsets) is the tokenizer's 2-D
    attention_mask (B, S) repeated over the queries, materialised (B, 1, L, S); here it
    is handed over as that 2-D mask expanded (stride 0 over the queries, the same
    values), so the weights' reads find the key padding from its B x S entries
    (sdpa.masks.key_spans) and skip it. Any other mask as it came."""
    from transformers import masking_utils

    bidirectional = getattr(masking_utils, "bidirectional_mask_function", None)  # (5.x)
    pad = kwargs.get("attention_mask")
    if (
        bidirectional is None
        or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 4
        or kwargs.get("mask_function") is not bidirectional
        or kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0
        or kwargs.get("local_size") is not None
        or not isinstance(pad, torch.Tensor) or pad.ndim != 2
        or tuple(pad.shape) != (mask.shape[0], mask.shape[3]) or mask.shape[1] != 1
    ):  # fmt: skip
        return mask
    keep = pad.to(device=mask.device, dtype=torch.bool, copy=True)  # (the caller's stays apart)
    return keep[:, None, None, :].expand(mask.shape)


def register(name: str | None = None, *, lazy_weights: bool = False) -> str:
    """Register sdpa with transformers (attention and mask functions) and return the
    name, for `from_pretrained(..., attn_implementation=name)`.

    name: defaults to "lse_attention" ("lse_attention_lazy" with lazy_weights), which
    also registers the old name "sdpa_lse" as an alias; or a new name of your own.
    Refused: transformers' own implementations ("eager", names containing "sdpa",
    "flash_attention_*", "flex_attention"), the "paged|..." forms, Hub kernel names
    ("org/repo"), and any name registered to another function (a wrapper of sdpa's,
    functools.wraps, counts as sdpa's): registering one would replace it for every
    model in the process.
    lazy_weights: every attention module returns the lazy AttentionWeights as its
    second output, instead of dense weights only when asked for.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if name is None:
        name = LAZY_NAME if lazy_weights else NAME
    _check_name(name)
    names = [name, OLD_NAME] if name == NAME else [name]  # the old name stays an alias
    for each in names:
        forward = lazy_attention_forward if lazy_weights else attention_forward
        AttentionInterface.register(each, forward)
        # without a mask function of the same name, padding would be silently ignored
        AttentionMaskInterface.register(each, mask_function)
    return name


def _check_name(name: object) -> None:
    """Refuse a name that is not sdpa's to take (see register), naming sdpa's."""
    ours = (
        f"register sdpa under its own names, {NAME!r} (the default) or {LAZY_NAME!r} "
        f"(lazy_weights=True), or under a new name of your own"
    )
    if not isinstance(name, str):
        raise SdpaTypeError(f"name must be a string or None, got {_describe(name)}; {ours}")
    why = _taken_because(name)
    if why is not None:
        raise SdpaValueError(f"name={name!r} is not sdpa's to register: {why}; {ours}")


def _taken_because(name: str) -> str | None:
    """Why `name` belongs to someone else (transformers, the Hub, another function), or
    None when sdpa may register under it."""
    if not name:
        return "it is empty"
    if "sdpa" in name and name != OLD_NAME:
        return (
            "names containing 'sdpa' are torch's SDPA to transformers, which gates them on "
            "_supports_sdpa and refuses models this function runs (use a name without 'sdpa')"
        )
    if name == "eager" or name.startswith(("flash_attention", "flex_attention")):
        return "it names one of transformers' own attention implementations"
    if "|" in name:
        return "transformers reads 'prefix|name' as its paged-attention forms ('paged|eager')"
    if "/" in name:
        return "transformers loads names with '/' ('org/repo') as attention kernels from the Hub"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    mapped = ((AttentionInterface, _OURS), (AttentionMaskInterface, (mask_function,)))
    for interface, mine in mapped:
        taken = getattr(interface, "_global_mapping", {}).get(name)
        if taken is not None and _unwrapped(taken) not in mine:
            where = f"{getattr(taken, '__module__', '?')}.{getattr(taken, '__qualname__', taken)}"
            return (
                f"transformers' {interface.__name__} has it for {where}, which it would "
                f"replace for every model in the process"
            )
    return None


def _unwrapped(fn: object) -> object:
    """fn, or the function it wraps (functools.wraps' __wrapped__, to the innermost)."""
    try:
        return inspect.unwrap(fn) if callable(fn) else fn
    except ValueError:  # a __wrapped__ cycle
        return fn


def _registered_as_ours(name: object) -> bool:
    """Whether transformers runs one of sdpa's attention functions (or a wrapper of one,
    such as a call recorder) for `name`."""
    if not isinstance(name, str):
        return False
    from transformers import AttentionInterface

    mapping = getattr(AttentionInterface, "_global_mapping", None)
    return isinstance(mapping, dict) and _unwrapped(mapping.get(name)) in _OURS


def _uses_ours(model: torch.nn.Module) -> bool:
    """Whether the model or any sub-model runs on an sdpa attention function."""
    configs = [getattr(m, "config", None) for m in model.modules()]
    return any(_registered_as_ours(getattr(c, "_attn_implementation", None)) for c in configs)


# What a saved capture keeps (Capture.__reduce_ex__).
_SAVED = (
    "weights", "received", "entropy", "last_row", "max_logits", "call_layers", "stats", "keep",
    "layers",
)  # fmt: skip

torch.serialization.add_safe_globals([Capture])


def _detached(x: object) -> object:
    """x with every tensor in it detached (lists and dicts walked; handles as they are:
    saving one detaches it)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, dict):
        return {key: _detached(value) for key, value in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_detached(value) for value in x)
    return x


@contextlib.contextmanager
def capture(
    model: torch.nn.Module,
    stats: str | tuple[str, ...] | list[str] = (),
    on_call: Callable[[int, AttentionWeights], object] | None = None,
    keep: bool | None = None,
    layers: Iterable[int] | None = None,
) -> Iterator[Capture]:
    """Collect what the attention calls of `model` made inside the block show: lazy
    weights, or statistics computed inside each call.

        with capture(model, stats=("received", "entropy")) as cap:
            model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
        cap.received[3]       # layer 3: (B, Hkv, S) attention each key received
        cap.entropy[3][-1]    # layer 3, last step: (B, Hq, 1)

    model: a torch.nn.Module that is, or holds, a transformers model on sdpa
    (`attn_implementation=register()`). The capture records the calls of the attention
    modules inside `model` (model.modules() when the block opens: a sub-model gives
    only its layers), from any thread, while the block is open; calls of other models
    are not recorded. Captures nest: each records every call of its model inside it,
    outermost first. Worker threads started in the block (a thread pool, DataParallel's
    replicas) are recorded too; a second capture of the same modules opened in another
    thread or task at the same time is refused (each would see the other's calls).

    stats: any of "received", "entropy", "last_row", "max_logits" (see Capture for
        shapes), computed from each call's fresh weights before the call returns: a
        StaticCache writes keys in place, after which lazy weights refuse to answer.
        received accumulates in O(S) memory per layer over every call of the block
        (prefill and each decode step: the H2O / kvpress "observed attention" score); it
        grows with a DynamicCache (new keys start at 0), has the cache length with a
        StaticCache, and is indexed by token position for sliding-window layers. Query
        rows that see no key (left padding) have weights 0: they add nothing to received
        and have entropy 0 (eager gives them uniform weights over every key). A block
        holds one batch: a second generate in the same block adds to the same sums,
        token position by token position. In training (grad enabled, parameters
        requiring grad) received, entropy and last_row carry their gradients in O(L + S)
        memory per layer; max_logits is forward only (it requires no grad). Under
        sdpa.frozen() with grad enabled they refuse, as every read of frozen weights
        does: keep=True and read the handles under torch.no_grad() instead.
    on_call: called as on_call(layer, weights) inside each attention call, before the
        next one (one call at a time, from the thread that made it); layer is
        module.layer_idx, or the module's position in the forward pass for modules
        without one.
    keep: append each call's lazy AttentionWeights (B, Hq, L, S) to cap.weights, in call
        order: rows, sums, entropy, top-k of any layer without the dense L x S tensors
        (default: only when neither stats nor on_call is given). Each handle pins that
        call's query and key tensors; over a long generation that adds up. Reads of
        kept handles carry gradients as every read does: attention distillation is
        `student.weights[-1].kl(teacher.weights[-1])` on two captures' handles (the
        teacher's taken under torch.no_grad()), KL(teacher || student) per query row.
    layers: record only the calls of these layers (layer numbers as on_call gets them):
        handles kept and statistics only for those, so a distillation loss that reads
        three layers of six pins three layers' q, k and v, not six.

    Activation checkpointing (transformers' activation_checkpointing_enable, formerly
    gradient_checkpointing_enable, or torch.utils.checkpoint) reruns each layer in the
    backward: those reruns are not recorded (each call is recorded once, when it first
    ran). With use_reentrant=True the first run is under torch.no_grad(), so what it
    records carries no gradient; use use_reentrant=False (transformers' default) to
    train on captured statistics.

    Under torch.compile, while a block is open, each attention call of `model` runs
    outside the compiled graph (one graph break per call), so that it is captured; a
    compiled model without an open capture keeps its graphs (no break, no recompile).
    """
    _check_model(model, "capture")
    names = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [n for n in names if n not in STATS]
    if unknown:
        raise SdpaValueError(
            f"stats must name statistics from {STATS}, got unknown {unknown} in stats={stats!r}"
        )
    if on_call is not None and not callable(on_call):
        raise SdpaValueError(
            f"on_call must be a callable taking (layer, weights), got {_describe(on_call)}"
        )
    if keep is not None and not isinstance(keep, bool):
        raise SdpaValueError(f"keep must be True, False or None, got {keep!r}")
    if keep is None:
        keep = not names and on_call is None
    chosen = _layer_list(layers)
    found = Capture(stats=names, on_call=on_call, keep=keep, layers=chosen)
    with _opened(found, model, "capture") as found:
        yield found


@contextlib.contextmanager
def edit(model: torch.nn.Module, fn: EditFn) -> Iterator[Edit]:
    """Replace the attention of chosen calls of `model` (on sdpa: register()) inside the
    block, as sdpa.integrations.diffusers.edit does for diffusers models.

        from sdpa.integrations import edits
        with sdpa_hf.edit(model, edits.ZeroAblate([0, 3]).on_layers(2)):
            logits = model(**batch).logits        # heads 0 and 3 of layer 2 output 0

    fn(info, q, k, v, mask) is called in every attention call of `model` inside the
    block, after the call's mask is built: info an EditInfo (layer: module.layer_idx, or
    the module's place among its stack's in the forward pass; module; scale: the scale
    the call uses; stack: the layer list holding the module, "model.decoder.layers";
    kind: "self" or "cross"; path: the module's name in `model`; layout: every
    attention module of `model`, worked out when the block opens), q (B, Hq, L, D),
    k / v (B, Hkv, S, D|Dv) as the model passes them (grouped-query heads as they are),
    mask in sdpa.attention's form (a bool / float tensor, a structured mask; sinks and
    softcap wrapped around it), or None. It returns the call's output (B, Hq, L, Dv) in
    q's dtype, an sdpa.AttentionResult (output and the weights: what output_attentions
    and captures then see), or None for the call's own attention. A bare tensor is
    refused where the weights are asked for (output_attentions, an open capture, the
    lazy variant), and any answer is refused in a call with attention dropout (a model
    in training mode). Edits nest: the innermost whose fn answers wins; captures open at
    the same time record the edited weights. Under torch.compile the calls of `model`
    run outside the graph while a block is open. ed.calls / ed.answered: the calls the
    block saw and those fn replaced.

    Layer numbers repeat across an encoder-decoder's stacks (BART's encoder
    self-attention, decoder self-attention and decoder cross-attention all carry
    layer_idx 1): there `on_layers(1)` raises at the first call, naming those calls, and
    `on_layers(1, stack="decoder", kind="self")` or `on_modules(path)` chooses one.
    """
    _check_model(model, "edit")
    if not callable(fn):
        raise SdpaTypeError(
            f"fn must be a callable (info, q, k, v, mask) -> output, an "
            f"sdpa.AttentionResult or None; got {_describe(fn)}"
        )
    found = Edit(fn)
    modules = found._lay_out(model)
    with _opened(found, model, "edit", modules) as found:
        yield found


def _layer_list(layers: object) -> tuple[int, ...] | None:
    """capture's layers as a tuple of ints, or None (every layer)."""
    if layers is None:
        return None
    items = [layers] if isinstance(layers, int) else layers
    try:
        chosen = tuple(items)
    except TypeError:
        chosen = None
    if chosen is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in chosen):
        raise SdpaTypeError(
            f"layers must be layer numbers (an int or an iterable of ints, as on_call gets "
            f"them: module.layer_idx), got {_describe(layers)}"
        )
    return chosen


def _check_model(model: object, what: str) -> None:
    """Refuse anything but a module that runs on sdpa's attention functions."""
    if not isinstance(model, torch.nn.Module):
        held = getattr(model, "model", None)
        hint = " (this one holds a model: pass its .model)" if isinstance(
            held, torch.nn.Module
        ) else ""  # fmt: skip
        raise SdpaTypeError(
            f"model must be a torch.nn.Module: a transformers model loaded with "
            f"attn_implementation=sdpa.integrations.transformers.register(), or a module "
            f"holding one; got {type(model).__name__} {_one_line(model)}{hint}"
        )
    if not _uses_ours(model):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise SdpaValueError(
            f"{what} needs a model on sdpa's attention, got attn_implementation={impl!r} "
            f"for the model and every sub-model; load it with "
            f"attn_implementation=sdpa.integrations.transformers.register()"
        )


@contextlib.contextmanager
def _opened(
    found: Capture | Edit, model: torch.nn.Module, what: str, modules: list | None = None
) -> Iterator[Capture | Edit]:
    """`found` open on the modules of `model` (and named in this thread's context) for
    the block (modules: model.modules(), where the caller has them)."""
    _open(found, model, what, modules)
    try:
        token = _here.set((*_here.get(), found))
        try:
            yield found
        finally:
            _here.reset(token)
    finally:
        _close(found)


def _open(
    found: Capture | Edit, model: torch.nn.Module, what: str, modules: list | None = None
) -> None:
    """Put `found` on every module of `model` (modules, where the caller listed them),
    after the captures and edits already open there; refused where one of those was
    opened in another thread or task."""
    modules = list(model.modules()) if modules is None else modules
    here = _here.get()
    with _stamping:
        for m in modules:
            for other in m.__dict__.get(_OPEN, ()):
                if other._open and not any(other is h for h in here):
                    kind = "a capture" if isinstance(other, Capture) else "an edit"
                    raise SdpaValueError(
                        f"{what}({_model_name(model)}): {kind} of its module "
                        f"{type(m).__name__} is open in another thread or task, and two "
                        f"blocks open side by side would each act on the other's calls; "
                        f"open one block around both (calls from worker threads are "
                        f"seen), or nest them: a thread started inside a block nests "
                        f"in it when it runs under contextvars.copy_context()"
                    )
        for m in modules:
            m.__dict__[_OPEN] = _Open((*m.__dict__.get(_OPEN, ()), found))
        found._modules, found._open = modules, True


def _close(found: Capture | Edit) -> None:
    """Take `found` off the modules it was put on; a module left with none loses the
    attribute, and torch.compile traces its calls whole again."""
    with found._lock:  # a call recording now finishes first; later ones are not recorded
        found._open = False
        if isinstance(found, Edit):
            found._sites = {}  # keyed by id: not past the modules' lifetime
    with _stamping:
        for m in found._modules:
            rest = tuple(c for c in m.__dict__.get(_OPEN, ()) if c is not found)
            if rest:
                m.__dict__[_OPEN] = _Open(rest)
            else:
                m.__dict__.pop(_OPEN, None)
        found._modules = []
