"""The transformers model zoo: every architecture, tiny, on eager and on sdpa.

    import zoo
    name = zoo.register()                        # sdpa's attention, with a call recorder
    for model_type in zoo.architectures():
        result = zoo.run(model_type, name, new_tokens=3)
        result.status                            # one of STATUSES

Every model type that transformers' auto mappings give a model class is built from its
own config class with random weights, shrunk (hidden 64, 2 layers, 4 heads of 16, 2
key/value heads where the config has them, vocabulary 128, sliding windows of 4, images
of 32 x 32), float32, eval mode, fixed seed. It runs once on sdpa's registered
attention and once on transformers' "eager" with the same weights, with
`output_attentions=True`; the outputs and every attention tensor are compared on valid
query rows (eager gives fully masked query rows uniform weights, sdpa gives 0), and for
decoders the greedy `generate` tokens too. Inputs: a batch of 2, text with one padded
row (left padding for decoders, right for encoders), images, video, audio features or
waveforms, or flattened patches with their grid for packed vision towers. A config the
generic shrink (`shrink`) cannot build gets a family tweak (TWEAKS); every call into
sdpa's attention is recorded with the keywords the model passes (`Result.kwargs`).

Statuses:
    match          outputs, attentions (and generated tokens) equal eager's
    mismatch       something differs (detail names it, with the max abs diff)
    attentions missing   sdpa returns fewer attention tensors than eager
    refused        sdpa refused the call (detail: its message)
    error          the run on sdpa failed with an error that is not sdpa's refusal
    not routed     the model never calls transformers' attention interface, so the
                   implementation chosen does not reach it (nothing to compare)
    cannot apply   the model cannot be built tiny or run generically on CPU, or eager
                   gives no reference (reason in detail; reviewed in CANNOT_APPLY)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import os
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import torch

SEED = 0
BATCH = 2
TEXT_LEN = 8  # encoder / decoder prompt length; row 1 has 3 padding tokens
PAD = 3
DECODER_LEN = 5  # decoder length of encoder-decoder models (!= TEXT_LEN: rows stay apart)
VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 128
WINDOW = 4
IMAGE = 32
ATOL = 1e-4

STATUSES = (
    "match",
    "mismatch",
    "attentions missing",
    "refused",
    "error",
    "not routed",
    "cannot apply",
)

# Roles, in the order a model type's class is chosen.
ROLES = (
    ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("seq2seq_lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("speech_seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("base", "MODEL_MAPPING_NAMES"),
)
GENERATING_ROLES = {"causal_lm", "seq2seq_lm", "speech_seq2seq"}


@functools.cache
def architectures() -> dict[str, tuple[str, str]]:
    """model_type -> (model class name, role), one class per model type, sorted.

    The class: the causal-LM class for decoders (so generate can be compared), the
    seq2seq-LM class for encoder-decoders, else the base model class, else the first
    class of any other auto mapping (task heads of models without a base class).
    Encoder families (those with a masked-LM class) take the base class: their
    causal-LM class is the encoder run as a decoder.
    """
    from transformers.models.auto import modeling_auto as auto

    encoders = set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    others = sorted(
        n
        for n in dir(auto)
        if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES") and n not in {m for _, m in ROLES}
    )
    found: dict[str, tuple[str, str]] = {}
    for role, mapping in [
        *ROLES,
        *((m.removeprefix("MODEL_FOR_")[:-14].lower(), m) for m in others),
    ]:
        for model_type, names in getattr(auto, mapping).items():
            if model_type in found or (role == "causal_lm" and model_type in encoders):
                continue
            found[model_type] = (names if isinstance(names, str) else names[0], role)
    return dict(sorted(found.items()))


# ---------------------------------------------------------------- tiny configs

_HIDDEN = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "n_embed"}
_LAYERS = {
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
}
_HEADS = {
    "num_attention_heads",
    "n_head",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_heads",
}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_key_value_groups"}
_FFN = {
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "n_inner",
    "d_ff",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_intermediate_size",
    "ffn_hidden_size",
    "expert_ffn_hidden_size",
}
_EXPERTS = {
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "zero_expert_num",
}
_TOP_K = {"num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"}
_IMAGE = {"image_size", "img_size"}
_SMALL = {"hidden_size_per_layer_input", "mamba_d_state", "state_size", "ssm_state_size", "d_state"}
_MAX_POS = {"max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"}


def _token_key(key) -> bool:
    return isinstance(key, str) and key.endswith(("_token_id", "_token_index", "_token_ids"))


def _layer_types(types: list, n: int) -> list:
    """n layer types that keep each kind the original mixes (first appearance order)."""
    kinds = list(dict.fromkeys(map(repr, types)))
    first = {repr(t): t for t in reversed(types)}
    kinds = [first[k] for k in kinds]
    return (kinds + [kinds[-1]] * n)[:n] if len(kinds) <= n else kinds[:n]


def _derived(config_cls) -> set[str]:
    """Fields whose default is None: __post_init__ derives them (layer_types, head_dim,
    ...), so a shrunk config leaves them out and lets them be derived again."""
    fields = getattr(config_cls, "__dataclass_fields__", {})
    return {k for k, f in fields.items() if f.default is None}


def _hidden_map(d: dict, found: dict[int, int] | None = None) -> dict[int, int]:
    """Every hidden size in a config tree -> its tiny size (see `_tiny_hidden`)."""
    found = {} if found is None else found
    for key, value in d.items():
        if isinstance(value, dict):
            _hidden_map(value, found)
        elif key in _HIDDEN and isinstance(value, int) and not isinstance(value, bool):
            found.setdefault(value, _tiny_hidden(d))
    return found


def _tiny_hidden(d: dict) -> int:
    """HIDDEN, or HEADS heads of the original head size where multimodal rope sections
    are sized for a head size the model derives from hidden_size / heads."""
    if not _has_mrope(d) or isinstance(d.get("head_dim"), int):
        return HIDDEN
    heads = next((v for k, v in d.items() if k in _HEADS and isinstance(v, int)), None)
    hidden = next((v for k, v in d.items() if k in _HIDDEN and isinstance(v, int)), None)
    return HEADS * (hidden // heads) if heads and hidden else HIDDEN


def _has_mrope(d: dict) -> bool:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return isinstance(rope, dict) and "mrope_section" in json.dumps(rope)


def shrink(d: dict, hidden_map: dict[int, int] | None = None, derive: bool = True) -> dict:
    """A config dict (from `to_dict()`, sub-configs nested as dicts) made tiny.

    Sizes by name (hidden 64, 2 layers, 4 heads of 16, ...); any other `*hidden*` or
    `*dim*` size equal to an original hidden size becomes 64 too (projections that must
    match it); per-layer lists keep each kind of layer. Models with multimodal rope
    sections keep their head size (the sections are sized for it); multi-head latent
    attention keeps one key/value head per query head. With `derive`, what
    __post_init__ derives (fields defaulting to None, keys that are not fields) is left
    out to be derived again from the shrunk sizes; without, it is shrunk like the rest.
    """
    from transformers import CONFIG_MAPPING

    if hidden_map is None:
        hidden_map = _hidden_map(d)
    config_cls = None
    with contextlib.suppress(KeyError):
        config_cls = CONFIG_MAPPING[d.get("model_type")]
    derived = _derived(config_cls) if config_cls is not None else set()
    fields = getattr(config_cls, "__dataclass_fields__", None)
    old_layers = next((v for k, v in d.items() if k in _LAYERS and isinstance(v, int)), None)
    heads = next((v for k, v in d.items() if k in _HEADS and isinstance(v, int)), None)
    hidden = next((v for k, v in d.items() if k in _HIDDEN and isinstance(v, int)), None)
    old_head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else None
    if old_head_dim is None and heads and hidden:
        old_head_dim = hidden // heads
    mrope = _has_mrope(d)
    latent = isinstance(d.get("kv_lora_rank"), int)
    n_layers = LAYERS
    out_features = d.get("out_features")
    if isinstance(out_features, list) and out_features:
        n_layers = max(LAYERS, len(out_features))
    out = {}
    for key, value in d.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        per_layer = isinstance(value, list) and bool(value) and len(value) == old_layers
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink(value, hidden_map, derive)
        elif key == "out_features" and isinstance(value, list) and value:
            first = n_layers - len(value) + 1
            out[key] = [
                f"stage{i}" if isinstance(value[0], str) else i for i in range(first, n_layers + 1)
            ]
        elif key == "out_indices" and isinstance(value, list) and value:
            out[key] = list(range(n_layers - len(value) + 1, n_layers + 1))
        elif per_layer and all(isinstance(v, str) for v in value):
            out[key] = _layer_types(value, n_layers)  # layer types: keep each kind
        elif key in ("rope_parameters", "rope_scaling") and isinstance(value, dict):
            out[key] = value  # mrope sections fit the head size, which stays
        elif derive and key in derived and isinstance(value, list | dict):
            continue  # derived again from the shrunk sizes
        elif (
            derive
            and fields is not None
            and key not in fields
            and key not in ("id2label", "label2id")
        ):
            continue  # set by __post_init__ (derived, or from its keyword arguments)
        elif key in ("head_dim", "qk_rope_head_dim") and mrope:
            out[key] = value if is_int else old_head_dim
        elif key == "head_dim" and value is None:
            out[key] = HEAD_DIM  # modules that read config.head_dim without a fallback
        elif key == "vocab_size" and value is None:
            out[key] = VOCAB
        elif key in _KV_HEADS and value is None and heads:
            out[key] = HEADS if latent else KV_HEADS  # modules that divide by it
        elif key in _TOP_K and value is None and any(k in d for k in _EXPERTS):
            out[key] = 2
        elif key == "num_kv_shared_layers" and isinstance(value, int) and value:
            out[key] = n_layers if value == old_layers else 0
        elif value is None or isinstance(value, bool):
            out[key] = value
        elif key in _HIDDEN and is_int:
            out[key] = _tiny_hidden(d)
        elif key in _LAYERS and is_int:
            out[key] = n_layers
        elif key in _HEADS and is_int:
            out[key] = HEADS
        elif key in _HEADS and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = [HEADS] * len(value)
        elif key in _KV_HEADS and is_int:
            out[key] = HEADS if latent else 1 if value == 1 else KV_HEADS
        elif key == "head_dim" and is_int and latent and value == d.get("qk_rope_head_dim"):
            out[key] = HEAD_DIM // 2  # latent attention whose head_dim is its rope size
        elif (
            key in ("head_dim", "d_head", "attention_head_dim", "v_head_dim", "qk_head_dim")
            and is_int
        ):
            out[key] = HEAD_DIM
        elif key in ("qk_rope_head_dim", "qk_nope_head_dim") and is_int:
            out[key] = HEAD_DIM // 2 if value else 0  # 0: no rope (NoPE layers)
        elif key in ("q_lora_rank", "kv_lora_rank") and is_int:
            out[key] = 32
        elif key == "rotary_dim" and is_int:
            out[key] = HEAD_DIM // 2
        elif key in _FFN and is_int:
            out[key] = FFN
        elif key in _FFN and per_layer:
            out[key] = [FFN] * n_layers
        elif key in ("vocab_size", "vocab_size_per_layer_input") and is_int:
            out[key] = VOCAB
        elif key in _SMALL and is_int:
            out[key] = min(value, 16)
        elif key in _MAX_POS and is_int:
            out[key] = min(value, 512)
        elif key in ("sliding_window", "sliding_window_size", "attention_window_size") and is_int:
            out[key] = WINDOW
        elif key == "max_window_layers" and is_int:
            out[key] = 1  # qwen2 family: layers from this index on use the window
        elif key in _EXPERTS and is_int:
            out[key] = min(value, 4)
        elif key in _TOP_K and is_int:
            out[key] = min(value, 2)
        elif key in ("n_group", "topk_group", "num_expert_group") and is_int:
            out[key] = 1
        elif key in ("attn_layer_period", "expert_layer_period") and is_int:
            out[key] = 2  # hybrids (jamba): one attention / expert layer of the two
        elif key in ("attn_layer_offset", "expert_layer_offset") and is_int:
            out[key] = 1
        elif key in _IMAGE and is_int:
            out[key] = IMAGE
        elif key in _IMAGE and isinstance(value, list | tuple) and len(value) == 2:
            out[key] = [IMAGE, IMAGE]
        elif key == "depths" and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = [1] * (n_layers if per_layer else len(value))  # one block per stage
        elif key == "num_filters" and is_int:
            out[key] = min(value, 4)  # conv codecs double it per stage
        elif key == "num_frames" and is_int:
            out[key] = 2
        elif key == "max_source_positions" and is_int:
            out[key] = min(value, 32)  # audio encoders that want exactly 2x this many frames
        elif per_layer:
            out[key] = _layer_types(value, n_layers)  # one entry per layer
        elif (
            is_int
            and value in hidden_map
            and value > HIDDEN
            and ("hidden" in key or "dim" in key or key.endswith("_size"))
        ):
            out[key] = hidden_map[value]  # a size that must match some hidden size
        else:
            out[key] = value
    if "use_sliding_window" in out and isinstance(out.get("sliding_window"), int):
        out["use_sliding_window"] = True
    # token ids beyond the small vocabulary move to its top, each to its own slot
    top = VOCAB - 1
    for key in sorted(out):
        if not _token_key(key):
            continue
        value = out[key]
        if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[key] = top
            top -= 1
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = [v if v < VOCAB else (top := top - 1) + 1 for v in value]
    return out


def _update(d: dict, changes: dict) -> dict:
    """d with `changes` merged in (nested dicts merged, other values replaced)."""
    d = dict(d)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            d[key] = _update(d[key], value)
        else:
            d[key] = value
    return d


# model_type -> changes to the shrunk config dict (keys as in to_dict; a dict value
# updates that sub-config or dict). Each is a fix found when the generic shrink could
# not build or run the model, or lost what the model is about (a hybrid's attention
# layers, KV sharing).
TWEAKS: dict[str, dict] = {}


def _tweak(changes: dict, *model_types: str, sub: str | None = None) -> None:
    for t in model_types:
        TWEAKS[t] = _update(TWEAKS.get(t, {}), {sub: changes} if sub else changes)


# multimodal rope: the modeling code's default sections fit heads of 128, not 16
_MROPE_8 = {"rope_parameters": {"mrope_section": [2, 3, 3]}}
_MROPE_4 = {"rope_parameters": {"mrope_section": [1, 1, 2]}}
_tweak(
    _MROPE_8,
    "qwen2_vl",
    "qwen2_5_vl",
    "paddleocr_vl",
    "glm4v",
    "glm46v",
    "glmga",
    "glm_image",
    "glm_ocr",
    sub="text_config",
)
_tweak(_MROPE_8, "qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text", "glm_image_text", "glm_ocr_text")
_tweak({"vlm_config": {"text_config": _MROPE_8}}, "colqwen2")
_tweak(_MROPE_4, "glm4v_moe", sub="text_config")
_tweak(_MROPE_4, "glm4v_moe_text")
# hybrids and layer patterns that 2 layers would lose
_tweak({"block_types": ["recurrent", "attention"]}, "recurrent_gemma")
# gemma3n: 4 layers, the last 2 reusing the first 2's keys and values (one of each type)
_GEMMA3N = {
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,
    "intermediate_size": [FFN] * 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
}
_tweak(_GEMMA3N, "gemma3n_text")
_tweak(_GEMMA3N, "gemma3n", sub="text_config")
_tweak({"hidden_size_per_layer_input": 0}, "gemma4_assistant")
_tweak({"mamba_n_heads": 8, "mamba_d_head": 16}, "bamba", "granitemoehybrid")
_tweak({"num_heads": 8}, "mamba2")
_tweak({"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0}}, "dbrx")
# Swin family: 2 stages of 1 block, windows of 4 on the 8 x 8 patch grid of a 32 x 32 image
_SWIN = {"depths": [1, 1], "num_heads": [4, 4], "window_size": 4, "embed_dim": 64}
_tweak(_SWIN, "swin", "donut-swin", "maskformer-swin", "swinv2")
_tweak(
    {
        "axial_pos_shape": [4, 4],
        "axial_pos_embds_dim": [16, 48],
        "attn_layers": ["local", "lsh"],
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 2,
        "max_position_embeddings": 16,
    },
    "reformer",
)
_tweak({"pad_token_id": 1, "mask_token_id": 4}, "esm")
_tweak({"coordinate_size": 12, "shape_size": 8}, "layoutlmv3")  # 4 x 12 + 2 x 8 = 64
_tweak({"layer_types": ["linear_attention", "full_attention"]}, "granitemoehybrid")
_tweak({"attn_layer_indices": [1]}, "bamba")
_tweak({"layer_types": ["conv", "full_attention"], "num_dense_layers": 1}, "lfm2_moe")
_tweak({"attn_config": {"clip_qkv": 8.0}}, "dbrx")
_tweak({"num_key_value_heads": 4}, "esmc")  # ESMC has no grouped-query attention
_tweak({"rope_parameters": {"mrope_section": [2, 2, 2, 2]}}, "hunyuan_vl_text")
_tweak({"rope_parameters": {"mrope_section": [2, 2, 2, 2]}}, "hunyuan_vl", sub="text_config")
_COMPASS_ROPE = {
    "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0}
        for t in ("full_attention", "sliding_attention")
    }
}
_tweak(_COMPASS_ROPE, "cohere_compass_text")
_tweak(_COMPASS_ROPE, "cohere_compass", sub="text_config")
_tweak({"mlp_layer_types": ["dense", "sparse"]}, "deepseek_ocr2", sub="text_config")
_tweak({"index_num_heads": 1}, "kolibri1_1")  # its indexer's heads within one key head's group


STRATEGIES = ("derive", "shrink all")


def tiny_config(model_type: str, strategy: str = "derive"):
    """The model type's config, tiny (see `shrink`; `strategy` one of STRATEGIES)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    d = shrink(config_cls().to_dict(), derive=strategy == "derive")
    d = _update(d, TWEAKS.get(model_type, {}))
    for key in ("transformers_version", "_name_or_path", "architectures", "model_type"):
        d.pop(key, None)
    return config_cls(**d)


# ---------------------------------------------------------------- registering sdpa


@dataclass
class Calls:
    """What the recorder saw: calls into sdpa's attention and the keywords passed."""

    count: int = 0
    kwargs: Counter = field(default_factory=Counter)


_calls = Calls()


def register() -> str:
    """sdpa's attention registered with transformers (its own name), wrapped once so the
    zoo sees each call and the keywords the model passes."""
    from transformers import AttentionInterface

    import sdpa.integrations.transformers as sdpa_hf

    name = sdpa_hf.register()
    fn = AttentionInterface._global_mapping[name]
    if getattr(fn, "_zoo_recorder", False):
        return name

    @functools.wraps(fn)
    def recorded(module, query, key, value, attention_mask, *args, **kwargs):
        _calls.count += 1
        _calls.kwargs.update(k if v is not None else f"{k}=None" for k, v in kwargs.items())
        try:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        except Exception as e:
            e._zoo_in_attention = True
            raise

    recorded._zoo_recorder = True
    AttentionInterface.register(name, recorded)
    return name


def unregister(name: str) -> None:
    """Put sdpa's own attention function back under `name` (undo `register`'s wrapper)."""
    from transformers import AttentionInterface

    fn = AttentionInterface._global_mapping.get(name)
    if getattr(fn, "_zoo_recorder", False):
        AttentionInterface.register(name, fn.__wrapped__)


# ---------------------------------------------------------------- inputs and runs


def _config_value(config, *keys, default=None):
    """The first of `keys` found on config or any sub-config (breadth first)."""
    todo = [config]
    while todo:
        c = todo.pop(0)
        for k in keys:
            v = getattr(c, k, None)
            if v is not None:
                return v
        todo.extend(getattr(c, s, None) for s in getattr(c, "sub_configs", {}) or {})
        todo = [t for t in todo if t is not None]
    return default


def _special_ids(config) -> set[int]:
    ids: set[int] = set()
    todo = [config.to_dict()]
    while todo:
        d = todo.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                todo.append(v)
            elif _token_key(k) and isinstance(v, int) and not isinstance(v, bool):
                ids.add(v)
            elif _token_key(k) and isinstance(v, list):
                ids.update(x for x in v if isinstance(x, int))
    return ids


@dataclass
class Inputs:
    kwargs: dict
    valid: torch.Tensor | None  # (B, L) bool: real text tokens, or None (no padding)
    padding_side: str = "right"


LAYOUTS = ("channels first", "channels last")  # input layouts tried, in order


def make_inputs(model, config, role: str, layout: str = "channels first") -> Inputs:
    """A batch of 2 for what the model's forward needs: text with one padded row (left
    padding for decoders, right for encoders), images, video, audio features or
    waveforms, flattened image patches with their grid (packed vision towers).

    Dual encoders (CLIP-like: a vision sub-config and no image token) get text and
    images; vision-language models that merge image tokens get text only. `layout`
    picks between the two conventions of audio inputs: features (B, mels, T) or
    (B, T, mels), waveforms (B, T) or (B, 1, T); images become video (B, T, C, H, W)
    in the second when the config has frames.
    """
    g = torch.Generator().manual_seed(SEED)
    first = layout == "channels first"
    name = model.main_input_name
    params = inspect.signature(model.forward).parameters
    required = {
        k for k, p in params.items() if p.default is p.empty and k not in ("args", "kwargs")
    }
    flat = json.dumps(config.to_dict(), default=str)
    dual = (
        "pixel_values" in params
        and "image_token" not in flat
        and ("vision_config" in flat or name == "input_ids")
    )
    kwargs: dict = {}
    valid = None
    side = "right"
    grid = next((k for k in ("grid_thw", "image_grid_thw") if k in required), None)
    text = (
        (name == "input_ids" and grid is None)
        or "input_ids" in required
        or dual
        or any(k.endswith("_input_ids") for k in required)
    )
    if text and "input_ids" in params:
        allowed = torch.tensor(sorted(set(range(3, VOCAB)) - _special_ids(config)))
        ids = allowed[torch.randint(len(allowed), (BATCH, TEXT_LEN), generator=g)]
        valid = torch.ones(BATCH, TEXT_LEN, dtype=torch.bool)
        side = "left" if role == "causal_lm" else "right"
        if side == "left":
            valid[1, :PAD] = False
        else:
            valid[1, -PAD:] = False
        pad = _config_value(config, "pad_token_id", default=0)
        kwargs["input_ids"] = ids.masked_fill(~valid, pad)
        if "attention_mask" in params:
            kwargs["attention_mask"] = valid.long()
        for k in required - kwargs.keys():
            if k.endswith("_input_ids"):  # a second text input (Q-Former's, ...)
                kwargs[k] = kwargs["input_ids"]
                if k.replace("_input_ids", "_attention_mask") in params:
                    kwargs[k.replace("_input_ids", "_attention_mask")] = valid.long()
        if "bbox" in params:  # layout models: one box per token, (x0, y0, x1, y1) in 0..1000
            xy = torch.randint(0, 500, (BATCH, TEXT_LEN, 2), generator=g)
            kwargs["bbox"] = torch.cat([xy, xy + 100], dim=-1)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        allowed = torch.tensor(sorted(set(range(3, VOCAB)) - _special_ids(config)))
        dec = allowed[torch.randint(len(allowed), (BATCH, DECODER_LEN), generator=g)]
        kwargs["decoder_input_ids"] = dec  # generate drops these
    if grid is not None:  # packed vision towers: 2 images of 4 x 4 patches, flattened
        patch = _config_value(config, "patch_size", default=14)
        patch = patch[0] if isinstance(patch, list | tuple) else patch
        dim = (
            _config_value(config, "in_channels", "num_channels", default=3)
            * _config_value(config, "temporal_patch_size", default=1)
            * patch
            * patch
        )
        kwargs[grid] = torch.tensor([[1, 4, 4]] * BATCH)
        key = next((k for k in ("hidden_states", "pixel_values") if k in required), name)
        kwargs[key] = torch.randn(BATCH * 16, dim, generator=g)  # (patches, C * T * P * P)
        if "merge_sizes" in required:
            kwargs["merge_sizes"] = torch.tensor([1] * BATCH)
    elif name in ("pixel_values", "pixel_values_videos") or "pixel_values" in required or dual:
        channels = _config_value(config, "num_channels", "in_channels", default=3)
        size = _config_value(config, "image_size", default=IMAGE)
        size = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        frames = _config_value(config, "num_frames", default=None)
        key = "pixel_values_videos" if name == "pixel_values_videos" else "pixel_values"
        if (frames and not first) or key == "pixel_values_videos":
            shape = (BATCH, frames or 2, channels, *size)  # video (B, T, C, H, W)
        else:
            shape = (BATCH, channels, *size)
        kwargs[key] = torch.randn(*shape, generator=g)
    if "visual_feats" in params:  # LXMERT: region features and boxes
        feats = _config_value(config, "visual_feat_dim", default=2048)
        kwargs["visual_feats"] = torch.randn(BATCH, 4, feats, generator=g)
        kwargs["visual_pos"] = torch.rand(BATCH, 4, 4, generator=g)
    if "spatial_shapes" in params and ("pixel_values" in kwargs or "spatial_shapes" in required):
        # NaFlex (SigLIP 2): patches of a 4 x 4 grid, all valid
        patch = _config_value(config, "patch_size", default=16)
        channels = _config_value(config, "num_channels", default=3)
        kwargs["pixel_values"] = torch.randn(BATCH, 16, channels * patch * patch, generator=g)
        kwargs["pixel_attention_mask"] = torch.ones(BATCH, 16, dtype=torch.long)
        kwargs["spatial_shapes"] = torch.tensor([[4, 4]] * BATCH)
    if name == "input_features":
        mels = _config_value(
            config, "num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels", default=80
        )
        frames = 2 * min(_config_value(config, "max_source_positions", default=32), 64)
        shape = (BATCH, mels, frames) if first else (BATCH, frames, mels)
        kwargs["input_features"] = torch.randn(*shape, generator=g)
        if "input_features_mask" in params:
            kwargs["input_features_mask"] = torch.ones(BATCH, frames, dtype=torch.long)
    if name == "input_values":
        shape = (BATCH, 1600) if first else (BATCH, 1, 1600)
        kwargs["input_values"] = torch.randn(*shape, generator=g)
    if not kwargs:
        raise NotImplementedError(
            f"forward takes none of the inputs made here (main input {name!r})"
        )
    return Inputs(kwargs, valid, side)


@dataclass
class Result:
    model_type: str
    cls: str
    role: str
    status: str
    detail: str = ""
    max_diff: float | None = None
    attention_calls: int = 0
    kwargs: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _flatten(out, prefix="") -> dict[str, torch.Tensor]:
    """Named tensors of a model output, nested outputs and tuples included."""
    items = out.items() if hasattr(out, "items") else enumerate(out)
    flat = {}
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            flat[name] = v
        elif isinstance(v, tuple | list) or hasattr(v, "items"):
            flat.update(_flatten(v, name + "."))
    return flat


_SKIP_OUTPUTS = ("past_key_values", "router_logits", "aux_loss", "hidden_states")


def _is_attention(name: str) -> bool:
    return any(part.endswith("attentions") for part in name.split("."))


def compare(ours, eager, valid: torch.Tensor | None) -> tuple[str, str, float]:
    """(status, detail, max abs diff) of ours against eager, on valid query rows."""
    a, b = _flatten(ours), _flatten(eager)
    att_a = {k: v for k, v in a.items() if _is_attention(k)}
    att_b = {k: v for k, v in b.items() if _is_attention(k)}
    if len(att_a) < len(att_b):
        missing = sorted({k.rsplit(".", 1)[0] for k in set(att_b) - set(att_a)})
        return "attentions missing", f"{len(att_a)} of {len(att_b)} ({', '.join(missing)})", 0.0
    worst, where = 0.0, ""
    problems = []
    for k, y in b.items():
        if any(s in k for s in _SKIP_OUTPUTS) or not y.is_floating_point():
            continue
        x = a.get(k)
        if x is None:
            problems.append(f"{k} missing")
            continue
        if x.shape != y.shape:
            problems.append(f"{k} shape {tuple(x.shape)} != eager {tuple(y.shape)}")
            continue
        rows = None
        if valid is not None:
            if _is_attention(k) and y.ndim == 4 and y.shape[-2] == valid.shape[1]:
                rows = valid[:, None, :, None].expand_as(y)  # (B, H, L, S)
            elif y.ndim >= 2 and tuple(y.shape[:2]) == tuple(valid.shape):
                rows = valid.view(*valid.shape, *[1] * (y.ndim - 2)).expand_as(y)
        x, y = (x, y) if rows is None else (x[rows], y[rows])
        if x.numel() == 0:
            continue
        same = (x == y) | (x.isnan() & y.isnan())  # equal infinities, NaN in both
        diff = (x.double() - y.double()).abs().masked_fill(same, 0)
        d = math.inf if diff.isnan().any() else diff.max().item()
        if d > worst:
            worst, where = d, k
    if problems:
        return "mismatch", "; ".join(problems), worst
    if worst > ATOL:
        return "mismatch", f"{where} differs", worst
    return "match", "", worst


def _short(e: BaseException) -> str:
    if os.environ.get("ZOO_DEBUG"):
        traceback.print_exception(e)
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:400]


def _is_sdpa_error(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] == "sdpa"


def build(model_type: str, config, impl: str):
    """The model type's class from `config` (copied) on attention `impl`, seeded, eval."""
    import transformers

    cls = getattr(transformers, architectures()[model_type][0])
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):  # a text class of a composite
        subs = [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
        config = next((c for c in subs if isinstance(c, wanted)), config)
    torch.manual_seed(SEED)
    model = cls._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.float32)
    return model.eval()


def _forward(model, inputs: Inputs):
    params = inspect.signature(model.forward).parameters
    asks = "output_attentions" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    with torch.no_grad():  # a model without the argument has no attention to return
        return model(**inputs.kwargs, **({"output_attentions": True} if asks else {}))


def _generate(model, inputs: Inputs, new_tokens: int):
    kwargs = {k: v for k, v in inputs.kwargs.items() if k != "decoder_input_ids"}
    config = model.generation_config
    if getattr(model.config, "is_encoder_decoder", False) and config.decoder_start_token_id is None:
        start = config.bos_token_id if config.bos_token_id is not None else config.pad_token_id
        kwargs["decoder_start_token_id"] = start if start is not None else 0
    with torch.no_grad():
        return model.generate(
            **kwargs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
        )


@contextlib.contextmanager
def _quiet():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            transformers.logging.set_verbosity(level)


def run(model_type: str, name: str, new_tokens: int = 3) -> Result:
    """Build `model_type` tiny on sdpa (`name`) and on eager with the same weights, and
    compare them. Never raises for a model's failure: the Result says what happened."""
    cls_name, role = architectures()[model_type]
    res = Result(model_type, cls_name, role, "match")
    start = time.perf_counter()
    try:
        with _quiet():
            _run(res, name, new_tokens)
    except Exception as e:  # the harness itself
        res.status, res.detail = "cannot apply", "harness: " + _short(e)
    res.seconds = round(time.perf_counter() - start, 3)
    return res


def _attempt(model_type: str, role: str, impl: str, strategy: str, layout: str, state=None):
    config = tiny_config(model_type, strategy)
    model = build(model_type, config, impl)
    if state is not None:
        model.load_state_dict(state)  # the same weights as the other run
    inputs = make_inputs(model, model.config, role, layout)
    return config, model, inputs, _forward(model, inputs)


def _ours_failed(e: BaseException) -> bool:
    """The failure is sdpa's (a refusal, or an error inside the attention function)."""
    return _is_sdpa_error(e) or getattr(e, "_zoo_in_attention", False)


def _run(res: Result, name: str, new_tokens: int) -> None:
    """Ours first (a model that never calls the attention function needs no eager run),
    with the first config strategy and input layout that builds and runs; then eager
    with the same config, inputs and weights."""
    model_type, role = res.model_type, res.role
    tries = [(s, lay) for s in STRATEGIES for lay in LAYOUTS]
    errors: list[BaseException] = []
    ours_error = found = None
    for strategy, layout in tries:
        _calls.count = 0
        _calls.kwargs.clear()
        try:
            _, ours, inputs, out_ours = _attempt(model_type, role, name, strategy, layout)
            found = strategy, layout
            break
        except Exception as e:
            errors.append(e)
            if _ours_failed(e):
                ours_error, found = e, (strategy, layout)
                break
    res.attention_calls = _calls.count
    res.kwargs = sorted(_calls.kwargs)
    if found is not None and ours_error is None and _calls.count == 0:
        res.status = "not routed"
        res.detail = "the model never calls transformers' attention interface"
        return
    eager_errors = []
    state = ours.state_dict() if found and ours_error is None else None
    for strategy, layout in [found] if found else tries:
        try:
            _, eager, inputs, out_eager = _attempt(
                model_type, role, "eager", strategy, layout, state
            )
            found = strategy, layout
            break
        except Exception as e:
            eager_errors.append(_short(e))
    else:  # eager fails with every config tried: say why, first one
        res.status, res.detail = "cannot apply", "eager fails: " + eager_errors[0]
        return
    if ours_error is None and len(errors) > tries.index(found):
        ours_error = errors[tries.index(found)]  # eager runs where ours failed
    if isinstance(ours_error, KeyError) and ours_error.args == (name,):
        res.status = "cannot apply"  # transformers' limit, not sdpa's
        res.detail = (
            "transformers picks this model's attention class from a dict keyed by "
            f"'eager'/'sdpa'/...: KeyError {name!r} at init for any registered name"
        )
        return
    if ours_error is not None:
        res.status = "refused" if _is_sdpa_error(ours_error) else "error"
        if not _ours_failed(ours_error):
            where = traceback.extract_tb(ours_error.__traceback__)[-1]
            res.detail = f"outside the attention function ({where.name}): "
        res.detail += _short(ours_error)
        return
    ours_flat = _flatten(out_ours)
    bad = [
        k
        for k, v in _flatten(out_eager).items()
        if v.is_floating_point()
        and not _is_attention(k)
        and k in ours_flat
        and ours_flat[k].shape == v.shape
        and (v.isnan() & ~ours_flat[k].isnan()).any()
    ]
    if bad:  # eager's NaN where ours is a number: no reference to compare with
        res.status, res.detail = "cannot apply", f"eager gives NaN in {bad[0]} (sdpa does not)"
        return
    res.status, res.detail, res.max_diff = compare(out_ours, out_eager, inputs.valid)
    if res.status != "match" or res.role not in GENERATING_ROLES or new_tokens == 0:
        return
    try:
        tokens_eager = _generate(eager, copy.copy(inputs), new_tokens)
    except Exception as e:
        res.detail = f"generate not compared (eager fails: {_short(e)})"
        return
    try:
        tokens_ours = _generate(ours, inputs, new_tokens)
    except Exception as e:
        res.status = "refused" if _is_sdpa_error(e) else "error"
        res.detail = "generate: " + _short(e)
        return
    if tokens_ours.shape != tokens_eager.shape or not torch.equal(tokens_ours, tokens_eager):
        res.status = "mismatch"
        res.detail = f"generate: {tokens_ours.tolist()} != eager {tokens_eager.tolist()}"


# ---------------------------------------------------------------- the reviewed lists

# model_type -> why it cannot run here, from tests/model_zoo.py's sweep and reviewed:
# every entry was tried with the generic shrink, both config strategies, both input
# layouts and the family tweaks in TWEAKS where one could help. Kinds: eager itself
# fails on the tiny config (the error says where); a package this machine lacks (timm,
# natten, detectron2, torchaudio); a forward that needs inputs the harness does not make
# (boxes with prompts, time series, inference sessions, ...); eager gives NaN where
# sdpa gives numbers (no reference); transformers picks the model's attention class from
# a dict keyed by implementation name, so any registered name fails at init (its limit,
# not sdpa's). "[no attention interface]": the model's code never calls transformers'
# attention interface, so sdpa could not reach it even if it ran. The zoo test fails on
# any model type that neither matches nor is listed here, in NOT_ROUTED or in
# EXPECTED_REFUSALS.
CANNOT_APPLY: dict[str, str] = {
    "pi05": (
        "eager fails tiny: TypeError: PI05Model.forward() missing 1 required positional "
        "argument: 'action_embeds' (a robot policy's action inputs, which the harness "
        "does not make)"
    ),
    "apertus1p5": (
        "eager fails tiny: ValueError: The audio token range ends at 262408, beyond the "
        "vocabulary (`text_config.vocab_size` = 128)."
    ),
    "audio-spectrogram-transformer": (
        "eager fails tiny: IndexError: Dimension out of range (expected to be in range of "
        "[-3, 2], but got 3)"
    ),
    "autoformer": (
        "[no attention interface] eager fails tiny: ValueError: The `prediction_length` "
        "config needs to be specified."
    ),
    "bark": (
        "[no attention interface] forward takes none of the inputs the harness makes (main "
        "input 'input_ids')"
    ),
    "blip-2": "eager fails tiny: AttributeError: 'bool' object has no attribute 'unsqueeze'",
    "blip_2_qformer": "forward takes none of the inputs the harness makes (main input 'input_ids')",
    "blt": (
        "eager fails tiny: AttributeError: 'BltConfig' object has no attribute 'num_hidden_layers'"
    ),
    "chameleon": "eager fails tiny: AttributeError: 'NoneType' object has no attribute 'get'",
    "clap": "eager fails tiny: AttributeError: 'NoneType' object has no attribute 'transpose'",
    "clvp": (
        "[no attention interface] eager fails tiny: TypeError: conv1d() received an invalid "
        "combination of arguments - got (NoneType, Parameter, Parameter, tuple, tuple, tuple,"
        " int), but expected one of"
    ),
    "conditional_detr": "needs timm, not installed here",
    "csm": "eager fails tiny: ValueError: in_channels must be divisible by groups",
    "d_fine": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 128, 8, 8] to have 256 channels, but got 128 channels instead"
    ),
    "dab-detr": "[no attention interface] needs timm, not installed here",
    "data2vec-vision": (
        "[no attention interface] transformers picks its attention class from a dict keyed by"
        " 'eager'/'sdpa'/...: KeyError for any registered name"
    ),
    "decision_transformer": (
        "forward takes none of the inputs the harness makes (main input 'states')"
    ),
    "deepseek_ocr2": (
        "transformers picks its attention class from a dict keyed by 'eager'/'sdpa'/...: "
        "KeyError for any registered name"
    ),
    "deepseek_vl_hybrid": (
        "transformers picks its attention class from a dict keyed by 'eager'/'sdpa'/...: "
        "KeyError for any registered name"
    ),
    "deformable_detr": "needs timm, not installed here",
    "deimv2": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 128, 8, 8] to have 256 channels, but got 128 channels instead"
    ),
    "depth_pro": (
        "eager fails tiny: ValueError: Image size 384x384 is too small to be scaled with "
        "scaled_images_ratios=[0.25, 0.5, 1] when patch_size=384."
    ),
    "detr": "needs timm, not installed here",
    "dia": "eager fails tiny: RuntimeError: shape '[2, 9, -1]' is invalid for input of size 10",
    "diffusion_gemma": (
        "eager fails tiny: TypeError: empty(): argument 'size' (position 1) must be tuple of "
        "ints, but found element of type NoneType at pos 0"
    ),
    "dinat": "[no attention interface] needs natten, not installed here",
    "dory": (
        "eager fails tiny: ValueError: n_input_layers + n_recurrent_layers + n_output_layers "
        "must equal num_hidden_layers"
    ),
    "dots1": "eager fails tiny: TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'",
    "edgetam": "needs timm, not installed here",
    "edgetam_video": "forward needs 'inference_session': not inputs the harness makes",
    "edgetam_vision_model": "needs timm, not installed here",
    "efficientloftr": (
        "eager fails tiny: ValueError: hidden_size should be equal to the last value in "
        "out_features. hidden_size = 64, out_features = 4"
    ),
    "efficientnet": (
        "[no attention interface] eager fails tiny: RuntimeError: running_mean should contain"
        " 2560 elements not 64"
    ),
    "eomt": (
        "eager fails tiny: RuntimeError: Given transposed=1, weight of size [64, 64, 2, 2], "
        "expected input[2, 0, 2, 2] to have 64 channels, but got 0 channels instead"
    ),
    "eomt_dinov3": (
        "eager fails tiny: RuntimeError: Given transposed=1, weight of size [64, 64, 2, 2], "
        "expected input[2, 0, 2, 2] to have 64 channels, but got 0 channels instead"
    ),
    "ernie4_5_vl_moe": (
        "eager fails tiny: RuntimeError: The expanded size of the tensor (8) must match the "
        "existing size (0) at non-singleton dimension 0. Target sizes: [8]. Tensor sizes: [0]"
    ),
    "falcon": (
        "[no attention interface] transformers picks its attention class from a dict keyed by"
        " 'eager'/'sdpa'/...: KeyError for any registered name"
    ),
    "fast_vlm": "needs timm, not installed here",
    "fun_asr_nano": (
        "eager fails tiny: ValueError: `adaptor_config.intermediate_size` (128) must equal "
        "`text_config.hidden_size // 4` (16)."
    ),
    "fun_asr_nano_encoder": (
        "eager fails tiny: RuntimeError: The size of tensor a (64) must match the size of "
        "tensor b (560) at non-singleton dimension 2"
    ),
    "gemma3n": "needs timm, not installed here",
    "gemma3n_audio": "forward takes none of the inputs the harness makes (main input 'audio_mel')",
    "gemma3n_vision": "[no attention interface] needs timm, not installed here",
    "gemma4_assistant": (
        "eager fails tiny: ValueError: hidden_size_per_layer_input must be 0, got 256"
    ),
    "gemma4_audio": (
        "eager fails tiny: RuntimeError: mat1 and mat2 shapes cannot be multiplied (40x512 "
        "and 1024x64)"
    ),
    "gemma4_unified_assistant": (
        "eager fails tiny: ValueError: inputs_embeds and shared_kv_states cannot be None."
    ),
    "gemma4_vision": "forward needs 'pixel_position_ids': not inputs the harness makes",
    "git": (
        "transformers picks its attention class from a dict keyed by 'eager'/'sdpa'/...: "
        "KeyError for any registered name"
    ),
    "glm_image_vqmodel": (
        "forward takes none of the inputs the harness makes (main input 'input_ids')"
    ),
    "gpt_neo": (
        "[no attention interface] transformers picks its attention class from a dict keyed by"
        " 'eager'/'sdpa'/...: KeyError for any registered name"
    ),
    "granite4_vision": "eager fails tiny: TypeError: object of type 'NoneType' has no len()",
    "granite_docling_vision": (
        "eager fails tiny: RuntimeError: shape '[2, 2, 0, 256]' is invalid for input of size 512"
    ),
    "granite_speech5_ctc": (
        "eager fails tiny: RuntimeError: mat1 and mat2 shapes cannot be multiplied (160x64 "
        "and 320x64)"
    ),
    "granite_speech5_encoder": (
        "eager fails tiny: RuntimeError: mat1 and mat2 shapes cannot be multiplied (160x64 "
        "and 320x64)"
    ),
    "grounding-dino": "eager fails tiny: RuntimeError: selected index k out of range",
    "higgs_audio_v2_tokenizer": "needs torchaudio, not installed here",
    "hrm_text": "eager fails tiny: IndexError: list index out of range",
    "idefics": "eager fails tiny: ValueError: not enough values to unpack (expected 4, got 3)",
    "informer": (
        "eager fails tiny: ValueError: The `prediction_length` config needs to be specified."
    ),
    "inkling2_vision": (
        "eager fails tiny: RuntimeError: shape '[-1, 2, 20, 2, 20, 1200]' is invalid for "
        "input of size 38400"
    ),
    "inkling_mm_model": "too slow or too big to run tiny: worker died (exit -9) after 72 s",
    "instructblip": "eager fails tiny: AttributeError: 'bool' object has no attribute 'unsqueeze'",
    "instructblipvideo": (
        "eager fails tiny: ValueError: not enough values to unpack (expected 5, got 4)"
    ),
    "jev": (
        "forward needs 'marks', 'num_options', and 'question_type_ids': not inputs the "
        "harness makes"
    ),
    "kimi_k25_vision": (
        "eager fails tiny: RuntimeError: Expected 3D (unbatched) or 4D (batched) input to "
        "conv2d, but got input of size: [32, 588]"
    ),
    "kosmos-2": "eager fails tiny: AttributeError: 'NoneType' object has no attribute 'to'",
    "kyutai_speech_to_text": (
        "eager fails tiny: ValueError: in_channels must be divisible by groups"
    ),
    "layoutlmv2": "[no attention interface] needs detectron2, not installed here",
    "layoutlmv3": (
        "eager fails tiny: RuntimeError: The size of tensor a (5) must match the size of "
        "tensor b (197) at non-singleton dimension 1"
    ),
    "lightglue": (
        "eager fails tiny: ValueError: Input must be a 5D tensor of shape (batch_size, 2, "
        "num_channels, height, width)"
    ),
    "lilt": (
        "[no attention interface] eager fails tiny: RuntimeError: mat1 and mat2 shapes cannot"
        " be multiplied (16x60 and 64x16)"
    ),
    "lw_detr": (
        "eager fails tiny: ValueError: `image_size` has to be divisible by `num_windows`, "
        "where image_size / num_windows % math.sqrt(num_windows) != 0,but got 32 and 16."
    ),
    "lw_detr_vit": (
        "eager fails tiny: ValueError: `image_size` has to be divisible by `num_windows`, "
        "where image_size / num_windows % math.sqrt(num_windows) != 0,but got 32 and 16."
    ),
    "maskformer-swin": (
        "[no attention interface] eager fails tiny: TypeError: 'NoneType' object is not "
        "subscriptable"
    ),
    "mimi": "eager fails tiny: ValueError: in_channels must be divisible by groups",
    "mimi_decoder": "eager fails tiny: ValueError: in_channels must be divisible by groups",
    "minicpm_ocr_vision": (
        "eager fails tiny: AttributeError: 'NoneType' object has no attribute 'device'"
    ),
    "minicpmv4_7_vision": (
        "eager fails tiny: AttributeError: 'NoneType' object has no attribute 'device'"
    ),
    "mm-grounding-dino": "eager fails tiny: RuntimeError: selected index k out of range",
    "mobilevitv2": (
        "[no attention interface] eager fails tiny: RuntimeError: Given input with spatial "
        "size (1, 1), kernel_size=(2, 2), dilation=(1, 1), padding=(0, 0), calculated shape "
        "of the array of sliding bloc"
    ),
    "molmo2": (
        "eager fails tiny: ValueError: `adapter_config.vision_feature_layer` [24, 18] must "
        "index the 2 layers of `vision_config`."
    ),
    "moonshine_streaming": (
        "eager fails tiny: AttributeError: 'MoonshineStreamingConfig' object has no attribute"
        " 'num_key_value_heads'"
    ),
    "muse_glimmer_assistant": (
        "forward takes none of the inputs the harness makes (main input 'noise_embeds')"
    ),
    "muse_glimmer_vision": (
        "eager fails tiny: RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x588 "
        "and 1176x64)"
    ),
    "muse_spark_audio": (
        "eager fails tiny: ValueError: `input_values` length 1600 is not a multiple of 96. "
        "Prepare the audio with `MuseSparkFeatureExtractor`, which pads up to a multiple of "
        "it."
    ),
    "muse_spark_vision": (
        "eager fails tiny: RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x588 "
        "and 1176x64)"
    ),
    "musicgen": (
        "eager fails tiny: RuntimeError: shape '[-1, 4, 8]' is invalid for input of size 16"
    ),
    "musicgen_melody": (
        "eager fails tiny: RuntimeError: shape '[-1, 4, 8]' is invalid for input of size 16"
    ),
    "nemotron3_5_asr": "eager gives NaN in last_hidden_state (sdpa does not)",
    "nemotron3_5_transcribe_asr_audio": (
        "eager fails tiny: RuntimeError: The size of tensor a (4) must match the size of "
        "tensor b (8) at non-singleton dimension 1"
    ),
    "nemotron3_5_transcribe_audio": (
        "eager fails tiny: RuntimeError: The size of tensor a (4) must match the size of "
        "tensor b (8) at non-singleton dimension 1"
    ),
    "nemotron3_5_transcribe_word_timestamp": (
        "forward takes none of the inputs the harness makes (main input 'inputs_embeds')"
    ),
    "nemotron3_diarization": (
        "eager fails tiny: RuntimeError: The size of tensor a (4) must match the size of "
        "tensor b (8) at non-singleton dimension 1"
    ),
    "nemotron3_diarization_audio": (
        "eager fails tiny: RuntimeError: The size of tensor a (4) must match the size of "
        "tensor b (8) at non-singleton dimension 1"
    ),
    "nemotron_asr_streaming": "eager gives NaN in last_hidden_state (sdpa does not)",
    "nemotron_asr_streaming_encoder": "eager gives NaN in last_hidden_state (sdpa does not)",
    "neucodec": "forward needs 'input_features': not inputs the harness makes",
    "omdet-turbo": "needs timm, not installed here",
    "oneformer": "forward needs 'task_inputs': not inputs the harness makes",
    "patchtsmixer": "forward takes none of the inputs the harness makes (main input 'past_values')",
    "patchtst": "forward takes none of the inputs the harness makes (main input 'past_values')",
    "pe_audio": "forward needs 'input_values': not inputs the harness makes",
    "pe_audio_encoder": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 1, 7], expected "
        "input[1, 2, 1600] to have 1 channels, but got 2 channels instead"
    ),
    "pe_audio_video": "needs timm, not installed here",
    "pe_audio_video_encoder": "needs timm, not installed here",
    "pe_video": "needs timm, not installed here",
    "pe_video_encoder": "needs timm, not installed here",
    "perceiver": (
        "[no attention interface] forward takes none of the inputs the harness makes (main "
        "input 'inputs')"
    ),
    "perception_lm": "needs timm, not installed here",
    "pi0": "forward takes none of the inputs the harness makes (main input 'state')",
    "pix2struct": "eager fails tiny: ValueError: You have to specify flattened_patches",
    "pocket_tts_audio_tokenizer": (
        "eager fails tiny: ValueError: in_channels must be divisible by groups"
    ),
    "pocket_tts_audio_tokenizer_decoder": (
        "eager fails tiny: ValueError: in_channels must be divisible by groups"
    ),
    "pp_doclayout_v2": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 128, 8, 8] to have 256 channels, but got 128 channels instead"
    ),
    "pp_doclayout_v3": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 64, 4, 4] to have 256 channels, but got 64 channels instead"
    ),
    "pp_doclayout_v4": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 128, 8, 8] to have 256 channels, but got 128 channels instead"
    ),
    "pp_ocrv5_mobile_det": (
        "[no attention interface] eager fails tiny: RuntimeError: Given groups=1, weight of "
        "size [12, 24, 1, 1], expected input[2, 32, 16, 16] to have 24 channels, but got 32 "
        "channels instead"
    ),
    "pp_ocrv5_mobile_rec": (
        "eager fails tiny: RuntimeError: Given input size: (192x2x2). Calculated output size:"
        " (192x0x1). Output size is too small"
    ),
    "pp_ocrv5_server_det": (
        "[no attention interface] eager fails tiny: TypeError: 'NoneType' object is not "
        "subscriptable"
    ),
    "pp_ocrv5_server_rec": (
        "eager fails tiny: RuntimeError: Given input size: (2048x2x8). Calculated output "
        "size: (2048x0x4). Output size is too small"
    ),
    "pp_ocrv6_medium_det": (
        "[no attention interface] eager fails tiny: TypeError: 'NoneType' object is not "
        "subscriptable"
    ),
    "pp_ocrv6_small_det": (
        "[no attention interface] eager fails tiny: RuntimeError: Given groups=1, weight of "
        "size [96, 12, 1, 1], expected input[2, 96, 8, 8] to have 12 channels, but got 96 "
        "channels instead"
    ),
    "pvt_v2": (
        "[no attention interface] eager fails tiny: ValueError: out_features and out_indices "
        "should correspond to the same stages if both are set"
    ),
    "qwen2_5_omni": "forward takes none of the inputs the harness makes (main input 'input_ids')",
    "qwen2_5_omni_thinker": (
        "eager fails tiny: AttributeError: 'Qwen2_5OmniThinkerConfig' object has no attribute"
        " 'vision_start_token_id'"
    ),
    "qwen3_asr_encoder": (
        "eager fails tiny: ValueError: Qwen3ASREncoder expects `padded_feature_length` to be "
        "a multiple of `n_window * 2` (100), but got 64."
    ),
    "qwen3_omni_moe": (
        "eager fails tiny: AttributeError: 'Qwen3OmniMoeTalkerTextConfig' object has no "
        "attribute 'shared_expert_intermediate_size'"
    ),
    "qwen3_omni_moe_thinker": (
        "eager fails tiny: AttributeError: 'Qwen3OmniMoeThinkerConfig' object has no "
        "attribute 'vision_start_token_id'"
    ),
    "qwen4_exp": (
        "eager fails tiny: TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'"
    ),
    "qwen4_exp_text": (
        "eager fails tiny: TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'"
    ),
    "rf_detr": (
        "eager fails tiny: RuntimeError: shape '[2, 4, 0, 4, 0, -1]' is invalid for input of "
        "size 512"
    ),
    "rf_detr_dinov2": (
        "eager fails tiny: RuntimeError: shape '[2, 4, 0, 4, 0, -1]' is invalid for input of "
        "size 512"
    ),
    "rt_detr": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 64, 8, 8] to have 256 channels, but got 64 channels instead"
    ),
    "rt_detr_v2": (
        "eager fails tiny: RuntimeError: Given groups=1, weight of size [64, 256, 1, 1], "
        "expected input[2, 64, 8, 8] to have 256 channels, but got 64 channels instead"
    ),
    "sam": (
        "eager fails tiny: RuntimeError: The size of tensor a (256) must match the size of "
        "tensor b (64) at non-singleton dimension 1"
    ),
    "sam2": (
        "eager fails tiny: RuntimeError: Given normalized_shape=[96], expected input with "
        "shape [*, 96], but got input of size[2, 8, 8, 64]"
    ),
    "sam2_hiera_det_model": (
        "eager fails tiny: RuntimeError: Given normalized_shape=[96], expected input with "
        "shape [*, 96], but got input of size[2, 256, 256, 64]"
    ),
    "sam2_video": "forward needs 'inference_session': not inputs the harness makes",
    "sam2_vision_model": (
        "eager fails tiny: RuntimeError: Given normalized_shape=[96], expected input with "
        "shape [*, 96], but got input of size[2, 256, 256, 64]"
    ),
    "sam3_lite_text_text_model": (
        "eager fails tiny: TypeError: embedding(): argument 'indices' (position 2) must be "
        "Tensor, not NoneType"
    ),
    "sam3_tracker": (
        "eager fails tiny: RuntimeError: shape '[2, -1, 288, 288]' is invalid for input of "
        "size 1024"
    ),
    "sam3_tracker_video": "forward needs 'inference_session': not inputs the harness makes",
    "sam3_video": "forward needs 'inference_session': not inputs the harness makes",
    "sam_hq": (
        "eager fails tiny: RuntimeError: Given transposed=1, weight of size [64, 16, 2, 2], "
        "expected input[2, 256, 2, 2] to have 64 channels, but got 256 channels instead"
    ),
    "sam_hq_vision_model": (
        "transformers picks its attention class from a dict keyed by 'eager'/'sdpa'/...: "
        "KeyError for any registered name"
    ),
    "sam_vision_model": (
        "transformers picks its attention class from a dict keyed by 'eager'/'sdpa'/...: "
        "KeyError for any registered name"
    ),
    "seggpt": (
        "[no attention interface] forward needs 'prompt_pixel_values' and 'prompt_masks': not"
        " inputs the harness makes"
    ),
    "shieldgemma2": (
        "eager fails tiny: IndexError: index 10784 is out of bounds for dimension 0 with size 128"
    ),
    "slanet": (
        "[no attention interface] eager fails tiny: RuntimeError: Given groups=1, weight of "
        "size [96, 64, 1, 1], expected input[2, 32, 16, 16] to have 64 channels, but got 32 "
        "channels instead"
    ),
    "speech-encoder-decoder": (
        "eager fails tiny: ValueError: You have to specify either input_values or input_features"
    ),
    "step3p7": (
        "eager fails tiny: ValueError: Could not find a `sliding_window` argument in the "
        "config, or it is not set"
    ),
    "superglue": (
        "[no attention interface] eager fails tiny: ValueError: Input must be a 5D tensor of "
        "shape (batch_size, 2, num_channels, height, width)"
    ),
    "t5gemma2_encoder": (
        "eager fails tiny: AttributeError: 'T5Gemma2TextConfig' object has no attribute "
        "'dropout_rate'"
    ),
    "table-transformer": "[no attention interface] needs timm, not installed here",
    "time_series_transformer": (
        "eager fails tiny: ValueError: The `prediction_length` config needs to be specified."
    ),
    "timesfm": "forward takes none of the inputs the harness makes (main input 'past_values')",
    "timesfm2_5": "forward takes none of the inputs the harness makes (main input 'past_values')",
    "timm_backbone": "[no attention interface] needs timm, not installed here",
    "timm_wrapper": "[no attention interface] needs timm, not installed here",
    "tvp": (
        "[no attention interface] eager fails tiny: RuntimeError: The size of tensor a (32) "
        "must match the size of tensor b (448) at non-singleton dimension 3"
    ),
    "unlimited_ocr": (
        "eager fails tiny: RuntimeError: The size of tensor a (4) must match the size of "
        "tensor b (2) at non-singleton dimension 1"
    ),
    "uvdoc": (
        "[no attention interface] eager fails tiny: RuntimeError: Given groups=1, weight of "
        "size [128, 768, 1, 1], expected input[2, 128, 2, 2] to have 768 channels, but got "
        "128 channels instead"
    ),
    "vibevoice_acoustic_tokenizer": (
        "[no attention interface] eager fails tiny: RuntimeError: Given groups=1, weight of "
        "size [4, 1, 7], expected input[1, 2, 1606] to have 1 channels, but got 2 channels "
        "instead"
    ),
    "vibevoice_acoustic_tokenizer_decoder": (
        "[no attention interface] forward needs 'hidden_states': not inputs the harness makes"
    ),
    "vibevoice_acoustic_tokenizer_encoder": (
        "[no attention interface] forward needs 'hidden_states': not inputs the harness makes"
    ),
    "voxtral_realtime": (
        "eager fails tiny: ValueError: You must specify exactly one of input_features or "
        "encoder_inputs_embeds"
    ),
    "voxtral_realtime_text": (
        "[no attention interface] eager fails tiny: AttributeError: module transformers has "
        "no attribute VoxtralRealtimeTextModel"
    ),
    "wav2vec2-bert": (
        "eager fails tiny: RuntimeError: Given normalized_shape=[160], expected input with "
        "shape [*, 160], but got input of size[2, 80, 64]"
    ),
    "xcodec": "eager fails tiny: ValueError: Audio must be mono, but got 1600",
    "xcodec2": "forward needs 'input_features': not inputs the harness makes",
    "xlstm": (
        "[no attention interface] eager fails tiny: ValueError: matC_old has wrong shape, got"
        " torch.Size([2, 4, 16, 16])"
    ),
    "xmod": (
        "eager fails tiny: ValueError: Input language unknown. Please call "
        "`XmodPreTrainedModel.set_default_language()`"
    ),
    "zamba": (
        "eager fails tiny: ValueError: There is an issue with your definition of "
        "`tie_weights_keys` for ^layers.1.shared_transf:^layers.(?!1\\.)\\d+.shared_transf. We "
        "found ['laye"
    ),
}

# Model types whose forward never reaches transformers' attention interface (no
# attention, or attention of their own), so the implementation chosen changes nothing.
NOT_ROUTED: set[str] = {
    "big_bird",
    "bit",
    "blip",
    "bloom",
    "bros",
    "canine",
    "convbert",
    "convnext",
    "convnextv2",
    "cpmant",
    "cvt",
    "dac",
    "deberta",
    "deberta-v2",
    "dinov3_convnext",
    "donut-swin",
    "encodec",
    "falcon_mamba",
    "fastspeech2_conformer",
    "fastspeech2_conformer_with_hifigan",
    "flaubert",
    "flava",
    "fnet",
    "focalnet",
    "fsmt",
    "funnel",
    "glpn",
    "gpt_neox_japanese",
    "groupvit",
    "hgnet_v2",
    "hiera",
    "ibert",
    "imagegpt",
    "led",
    "levit",
    "longformer",
    "luke",
    "lxmert",
    "mamba",
    "mamba2",
    "megatron-bert",
    "mgp-str",
    "mobilenet_v1",
    "mobilenet_v2",
    "mobilevit",
    "mpnet",
    "mpt",
    "mra",
    "mvp",
    "nystromformer",
    "openai-gpt",
    "poolformer",
    "pp_lcnet",
    "pp_lcnet_v3",
    "pp_lcnet_v4",
    "pp_ocrv6_small_rec",
    "pp_ocrv6_tiny_rec",
    "prophetnet",
    "pvt",
    "reformer",
    "regnet",
    "rembert",
    "resnet",
    "roformer",
    "rt_detr_resnet",
    "rwkv",
    "sew-d",
    "slanext",
    "speecht5",
    "squeezebert",
    "superpoint",
    "swiftformer",
    "swin2sr",
    "swinv2",
    "tapas",
    "textnet",
    "timesformer",
    "trocr",
    "univnet",
    "upernet",
    "uvdoc_backbone",
    "vilt",
    "visual_bert",
    "vitdet",
    "vitmatte",
    "vits",
    "wavlm",
    "wavtokenizer",
    "wavtokenizer_encoder",
    "xglm",
    "xlm",
    "xlnet",
    "yoso",
}

# model_type -> a fragment of the message sdpa refuses it with (a refusal by name is an
# honest answer; an unexpected one is a failure).
EXPECTED_REFUSALS: dict[str, str] = {}

# model_type -> (bound, why): its attention calls on sdpa agree with eager's to float32
# rounding, and layers outside attention amplify that rounding to near the zoo's ATOL, so
# the status flips with the machine's summation order (threads, load): the test takes
# "match", or "mismatch" on values only with the max abs diff within the bound, reviewed.
AMPLIFIES: dict[str, tuple[float, str]] = {
    "mask2former": (
        1e-3,
        "its 4 attention calls on sdpa (the pixel decoder's) agree with eager's to float32 "
        "rounding (4.8e-7 at the pixel decoder's output); its transformer decoder, on "
        "nn.MultiheadAttention, amplifies that to 1.6e-4 on values up to 3.5 (4.5e-5 "
        "relative) through its predicted masks, or leaves it under 1e-4 (transformers 5.25)",
    ),
}

# model_type -> (status, why): a difference from eager that is not sdpa's to fix, reviewed.
KNOWN_DIFFERENCES: dict[str, tuple[str, str]] = {
    "bridgetower": (
        "attentions missing",
        "its cross-modal layers collect the attention modules' second output by hand, "
        "asked for or not, without passing output_attentions down or recording through "
        "transformers' output collector: no signal reaches the attention function (torch's "
        "sdpa returns None there too); sdpa.integrations.transformers.capture() gets them",
    ),
}
