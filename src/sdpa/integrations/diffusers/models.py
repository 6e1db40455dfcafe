"""Putting a diffusers model on sdpa (`use_sdpa`) and opening captures and edits on it.

Which diffusers processors are replaced (COVERED) and which are refused (every other
class: REFUSED names the ones reviewed, with the reason).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.integrations.diffusers.calls import (
    ACTIVE,
    CallRecord,
    Capture,
    Edit,
    EditFn,
    ModelState,
    Session,
)
from sdpa.integrations.diffusers.processors import (
    SdpaAttnProcessor,
    SdpaFluxAttnProcessor,
    SdpaJointAttnProcessor,
    _Processor,
)

# diffusers processor class name -> how to make ours: (class, keyword arguments)
COVERED: dict[str, tuple[type[_Processor], dict]] = {
    "AttnProcessor2_0": (SdpaAttnProcessor, {}),
    "AttnProcessor": (SdpaAttnProcessor, {"module_scale": True}),
    "JointAttnProcessor2_0": (SdpaJointAttnProcessor, {}),
    "FluxAttnProcessor": (SdpaFluxAttnProcessor, {}),
    # deprecated aliases: constructing them returns a FluxAttnProcessor
    "FluxAttnProcessor2_0": (SdpaFluxAttnProcessor, {}),
    "FluxSingleAttnProcessor2_0": (SdpaFluxAttnProcessor, {}),
}
# Families reviewed and refused, by what their processors do beyond q, k, v -> attention.
REFUSED_BECAUSE: dict[str, str] = {
    "Added": "added key/value projections concatenated to the keys (AttnAddedKV*)",
    "Fused": "fused QKV projections (call model.unfuse_qkv_projections() first)",
    "XFormers": "xFormers' own kernel",
    "XLA": "torch_xla's flash kernel",
    "NPU": "torch_npu's kernel",
    "Sliced": "attention sliced over the batch (sdpa needs no slicing: nothing L x S is kept)",
    "IPAdapter": "IP-Adapter's second attention over image-prompt tokens",
    "CustomDiffusion": "trained key/value projections inside the processor",
    "PAG": "perturbed-attention guidance (an identity attention for part of the batch)",
    "LoRA": "a deprecated LoRA processor",
    "Linear": "linear attention (no softmax)",
    "Multiscale": "multiscale linear attention (no softmax)",
}
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ModelState


def refusal_reason(processor: object) -> str | None:
    """Why sdpa does not replace this processor, or None for the COVERED ones."""
    name = type(processor).__name__
    if isinstance(processor, _Processor) or name in COVERED:
        return None
    for part, why in REFUSED_BECAUSE.items():
        if part in name:
            return why
    return "its attention is not diffusers' default for this module (not reviewed for sdpa)"


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The diffusers attention modules of `model` (those with a swappable processor),
    by processor name: "<module path>.processor", the model.attn_processors keys."""
    return {
        f"{name}.processor": m
        for name, m in model.named_modules()
        if callable(getattr(m, "set_processor", None)) and hasattr(m, "processor")
    }


def use_sdpa(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every attention processor of a diffusers model with sdpa's, keeping each
    one's name (the model.attn_processors keys); returns the model.

    Covered: AttnProcessor2_0 and AttnProcessor (diffusers' Attention: UNet2DConditionModel,
    UNet2DModel, AutoencoderKL, ...), JointAttnProcessor2_0 (SD3Transformer2DModel) and
    FluxAttnProcessor (FluxTransformer2DModel). Any other processor is refused by name
    before anything changes. model: any module holding diffusers attention modules.
    Outputs equal diffusers' (torch's fused kernel, as theirs); captures and edits see
    each call. Calling it twice is harmless.
    """
    if not isinstance(model, torch.nn.Module):
        raise SdpaTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = attention_modules(model)
    if not modules:
        raise SdpaTypeError(
            f"model must hold diffusers attention modules (UNet2DConditionModel, "
            f"SD3Transformer2DModel, FluxTransformer2DModel, ...); {type(model).__name__} "
            f"has none with a processor"
        )
    current = {name: m.processor for name, m in modules.items()}
    refused = {n: (type(p).__name__, refusal_reason(p)) for n, p in current.items()}
    refused = {n: why for n, why in refused.items() if why[1] is not None}
    if refused:
        lines = "; ".join(f"{n}: {kind} ({why})" for n, (kind, why) in list(refused.items())[:4])
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        raise NotSupportedError(
            f"use_sdpa covers {sorted(COVERED)}; {type(model).__name__} has {len(refused)} "
            f"other processors: {lines}{more}. Nothing was changed"
        )
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = ModelState()
        model.register_forward_pre_hook(_note_inputs(state), with_kwargs=True)
    new = {}
    for name, proc in current.items():
        if isinstance(proc, _Processor) and proc.state is state and proc.name == name:
            continue
        if isinstance(proc, _Processor):
            raise SdpaValueError(
                f"{name} holds {proc!r} from another model; call use_sdpa on each model "
                f"once, before sharing modules between models"
            )
        maker, kwargs = COVERED[type(proc).__name__]
        new[name] = maker(name, state, **kwargs)
        state.replaced[name] = proc
    for name, proc in new.items():
        modules[name].set_processor(proc)
    return model


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Put back the processors use_sdpa replaced (diffusers' set_default_attn_processor
    refuses processors it does not know); returns the model."""
    state = _STATES.get(model)
    if state is None:
        raise SdpaValueError(f"{type(model).__name__} was not put on sdpa by use_sdpa")
    for name, module in attention_modules(model).items():
        if isinstance(module.processor, _Processor) and name in state.replaced:
            module.set_processor(state.replaced.pop(name))
    return model


def _note_inputs(state: ModelState) -> Callable:
    """A forward pre-hook: while a session is open, note the latent's (H, W) and Flux's
    text length; otherwise one context-variable read."""

    def hook(module, args, kwargs):
        if not ACTIVE.get():
            return None
        sample = kwargs.get("sample", kwargs.get("hidden_states", args[0] if args else None))
        state.latent, state.text_tokens = None, None
        if isinstance(sample, torch.Tensor) and sample.ndim == 4:  # (B, C, H, W)
            state.latent = (sample.shape[-2], sample.shape[-1])
        ids = kwargs.get("img_ids", args[4] if len(args) > 4 else None)
        if isinstance(ids, torch.Tensor) and ids.ndim in (2, 3) and ids.shape[-1] == 3:  # Flux
            ids = ids[0] if ids.ndim == 3 else ids  # (N, 3): (0, row, col) per image token
            rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
            state.latent = (rows, cols) if rows * cols == ids.shape[0] else None
            text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            if isinstance(text, torch.Tensor):
                state.text_tokens = text.shape[1]
        return None

    return hook


def _layers(model: torch.nn.Module, what: str) -> frozenset[int]:
    """ids of the attention modules on sdpa in this model; refused when none are."""
    layers = frozenset(
        id(m) for m in model.modules() if isinstance(getattr(m, "processor", None), _Processor)
    )
    if not layers:
        raise SdpaValueError(
            f"{what} needs a model on sdpa's processors, and {type(model).__name__} has "
            f"none; call sdpa.integrations.diffusers.use_sdpa(model) first"
        )
    return layers


@contextlib.contextmanager
def _open(session: Session) -> Iterator[Session]:
    token = ACTIVE.set((*ACTIVE.get(), session))
    try:
        yield session
    finally:
        ACTIVE.reset(token)


@contextlib.contextmanager
def capture(
    model: torch.nn.Module,
    on_call: Callable[[CallRecord], object] | None = None,
    keep: bool = False,
) -> Iterator[Capture]:
    """See every attention call of `model` (on sdpa: use_sdpa) made inside the block.

        with capture(unet, on_call=add_maps) as cap:
            pipe(prompt, callback_on_step_end=cap.on_step_end)

    Per call a CallRecord (info: name, kind, step, grid, text tokens, layer; weights: the
    lazy AttentionWeights (B, H, L, S), rows and statistics on demand) is handed to
    on_call(record) before the next call runs. keep=True also appends each record to
    cap.records (each pins that call's q and k: 16 layers x 50 steps adds up to GBs).
    cap.step: the denoising step (set it, or pass callback_on_step_end=cap.on_step_end);
    cap.calls: the calls seen. Calls of other models are not captured.
    """
    if on_call is not None and not callable(on_call):
        raise SdpaTypeError(f"on_call must be a callable taking a CallRecord, got {on_call!r}")
    if not isinstance(keep, bool):
        raise SdpaTypeError(f"keep must be True or False, got {keep!r}")
    with _open(Capture(_layers(model, "capture"), on_call, keep)) as cap:
        yield cap


@contextlib.contextmanager
def edit(model: torch.nn.Module, fn: EditFn) -> Iterator[Edit]:
    """Replace the attention of chosen calls of `model` (on sdpa: use_sdpa) inside the block.

        def swap(info, q, k, v, mask):           # q (B, H, L, D), k/v (B, H, S, D)
            if info.kind != "cross":
                return None                      # None: the default attention
            return sdpa.attention(q, k_src, v, mask, scale=info.scale)

    fn(info, q, k, v, mask) returns the output (B, H, L, Dv) in q's dtype, an
    sdpa.AttentionResult (which a capture open at the same time records), or None.
    The edit's own step counter is info.step (set ed.step or pass
    callback_on_step_end=ed.on_step_end). Edits nest: the innermost that answers wins.
    """
    if not callable(fn):
        raise SdpaTypeError(f"fn must be a callable (info, q, k, v, mask) -> output, got {fn!r}")
    with _open(Edit(_layers(model, "edit"), fn)) as session:
        yield session
