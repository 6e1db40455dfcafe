"""nnsight on sdpa: sdpa's weights at the attention-interface call site, and pattern
edits as a replacement of that call's output.

    import sdpa.integrations.transformers as sdpa_hf
    from sdpa.integrations import edits, nnsight as sdpa_nn
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=sdpa_hf.register())
    lm = nnsight.NNsight(model)
    call = sdpa_nn.call_site(lm.model.layers[0].self_attn)   # .source.attention_interface_1
    with lm.trace(ids, output_attentions=True):
        pattern = call.output[1].save()                  # dense (B, H, L, S), as eager's
    with lm.trace(ids):                                  # an edit: the call's output replaced
        call.output = sdpa_nn.edited_output(edits.ScaleHeads({0: 0.5}), call.inputs)
    # two edits in order, one fused call: [edits.KnockOut([5], [0]), edits.ZeroAblate([1])]

What the call site shows as its second output: with `register()`, the dense weights
when attentions are asked for (`output_attentions=True`, or transformers' output
collector recording them) and None otherwise (eager returns them on every call); with
`register(lazy_weights=True)`, sdpa's lazy AttentionWeights on every call (rows, sums,
entropy, top-k without the L x S tensor).

Editing: on eager, users patch the softmax inside the attention function
(`.source.attention_interface_1.source.nn_functional_softmax_0.output`). sdpa's
function has no softmax call to patch: the fused kernel never forms the pattern.
Instead replace the call's output with an edit computed from the call's own inputs
(`edited_output`, built on sdpa.integrations.edits). Writing `.output[1]` changes
nothing, on eager as on sdpa: the attention module uses only the first output.
"""

from __future__ import annotations

import torch

from sdpa import masks
from sdpa.errors import NotSupportedError, SdpaTypeError
from sdpa.integrations import edits

# Keywords of the attention-interface call that carry nothing for an edit.
HARMLESS = frozenset(
    {
        "position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values",
        "cache", "layer_idx", "sliding_window", "position_embeddings", "input_ids",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "target_dtype",
        "output_hidden_states", "return_dict", "num_items_in_batch",
    }
)  # fmt: skip


def call_site(envoy):
    """The attention-interface call of an attention module's nnsight Envoy: the last
    `attention_interface_N` of its `.source` (the first is the function's lookup)."""
    source = envoy.source
    names = [n for n in getattr(source, "names", ()) if n.startswith("attention_interface_")]
    if not names:
        raise SdpaTypeError(
            f"{type(envoy).__name__} {getattr(envoy, 'path', '')!r} has no attention-interface "
            f"call in its source (an attention module of transformers 5 calls "
            f"attention_interface(self, query, key, value, attention_mask, ...))"
        )
    return getattr(source, names[-1])


def call_mask(module: torch.nn.Module, query, key, attention_mask, kwargs: dict):
    """The mask of one attention-interface call in sdpa.attention's form, as
    transformers' sdpa path reads it: None with causality left to the kernel becomes
    the top-left causal mask (for more than one query, unless the module or the call
    says is_causal=False); a softcap keyword wraps it."""
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    mask = attention_mask
    if mask is None and is_causal and query.shape[-2] > 1:
        mask = masks.TOP_LEFT
    if kwargs.get("softcap") is not None:
        mask = masks.softcap(kwargs["softcap"], mask)
    return mask


def edited_output(edit, inputs) -> tuple[torch.Tensor, None]:
    """The attention-interface call's output with sdpa edits applied: (output
    (B, L, H, Dv) as the call returns it, None), for `call.output = ...` inside a trace.

    edit: an sdpa.integrations.edits.Edit, or a list / tuple of them applied in order,
    each to the pattern the one before left (edits.Compose: one fused call where it
    can); inputs: the call's `.inputs` ((module, query, key, value, attention_mask, ...),
    keywords). Keywords other than scaling, dropout (0 only), softcap, is_causal and
    HARMLESS are refused by name."""
    if isinstance(edit, list | tuple):
        edit = edits.Compose(*edit)
    elif not isinstance(edit, edits.Edit):
        inner = getattr(edit, "edit", None)  # an on_layers / on_modules function
        hint = f"; pass its edit, {inner!r}" if isinstance(inner, edits.Edit) else ""
        raise SdpaTypeError(
            f"edit must be an sdpa.integrations.edits.Edit or a list of them (applied in "
            f"order), got {edit!r}{hint}"
        )
    args, kwargs = inputs
    module, query, key, value, attention_mask = args[:5]
    known = HARMLESS | {"scaling", "dropout", "softcap", "is_causal"}
    unknown = sorted(set(kwargs) - known)
    if unknown or len(args) > 5:
        raise NotSupportedError(
            f"edited_output does not honour {unknown or 'extra positional arguments'} "
            f"passed to {type(module).__name__}'s attention call; edit a dense pattern of "
            f"this model on eager instead"
        )
    if kwargs.get("dropout", 0.0):
        raise NotSupportedError(
            f"dropout={kwargs['dropout']} in the attention call: edits run without dropout "
            f"(call model.eval())"
        )
    mask = call_mask(module, query, key, attention_mask, kwargs)
    out = edit.fused(query, key, value, mask, scale=kwargs.get("scaling"))  # (B, H, L, Dv)
    return out.transpose(1, 2).contiguous(), None
