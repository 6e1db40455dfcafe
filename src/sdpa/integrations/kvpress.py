"""kvpress (NVIDIA's KV-cache compression presses) on sdpa's lazy attention weights.

    from kvpress import ObservedAttentionPress
    from sdpa.integrations import kvpress as sdpa_kvpress

    name = sdpa_kvpress.register()                        # "lse_attention_lazy"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    cache = DynamicCache()
    with ObservedAttentionPress(compression_ratio=0.5)(model):
        model.model(input_ids=ids, past_key_values=cache)  # prefill: the cache is pruned

kvpress's presses read the attention module's second output, which only transformers'
eager path fills, with the dense (B, H, L, S) weights of every layer. The attention
registered here returns sdpa's lazy `AttentionWeights` there instead, on every call,
and each press asks it only for what it uses (B batch, H query heads, L queries,
S keys, w a window):

    ObservedAttentionPress    attentions.sum(2), .device, .dtype  -> (B, H, S): one fused call
                                                                   (on CPU, see
                                                                   AttentionWeights.sum)
    SnapKVPress, FinchPress   attentions[..., -w:, :-w]           -> (B, H, w, S - w): w rows
    TOVAPress                 attentions[..., -1:, :-1]           -> (B, H, 1, S - 1): 1 row
    KVComposePress            attentions[:, h, :, :n]             -> (B, L, n) per head

`benchmarks/bench_kvpress.py`: an ObservedAttentionPress prefill of L = 8192 tokens on
a small random Llama takes 0.23x eager's time and adds 0.064x its memory (154 MiB
against 2.4 GiB), keeping the same key positions. The kept cache equals eager's up to
the order of tied scores (topk orders equal values arbitrarily) and float rounding in
the layers after the first.

Presses that assert `attentions is None` (BlockPress, ChunkPress, ChunkKVPress,
EntropyGatedChunkKVPress) refuse this variant: load those models with
`sdpa.integrations.transformers.register()`, whose second output is None unless
attentions are asked for. AdaKVPress, which eager refuses, runs here on observed
attention (e.g. `AdaKVPress(SnapKVPress(...))`).

Import order. At its import kvpress wraps every attention function then registered in
transformers' ALL_ATTENTION_FUNCTIONS (`kvpress.attention_patch`: while decoding it
swaps the keys that head-wise presses such as AdaKVPress pruned for keys no query
sees). A function registered after that import would run unwrapped, and the pruned keys
would still be attended. `register` imports kvpress first, then puts kvpress's own
wrapper around sdpa's function where kvpress puts it, once: the same result whichever
of the two was imported first, and however often `register` is called.
"""

from __future__ import annotations

from collections.abc import Callable

from sdpa.integrations import transformers as sdpa_hf


def register(name: str | None = None) -> str:
    """Register sdpa's lazy-weights attention for kvpress and return its name, for
    `from_pretrained(..., attn_implementation=name)` or `model.set_attn_implementation`.

    name: defaults to "lse_attention_lazy", as `sdpa.integrations.transformers.register(
    lazy_weights=True)`, which this calls; the function the models run is its
    `lazy_attention_forward`, wrapped by kvpress's `attention_patch` (head-wise key
    masking while decoding) exactly once. Names that are not sdpa's to take (transformers'
    own implementations, "paged|..." forms, Hub kernel names, names registered to other
    functions) are refused as `register` of that module refuses them, before kvpress is
    imported.
    """
    sdpa_hf._check_name(sdpa_hf.LAZY_NAME if name is None else name)
    attention_patch = _kvpress_attention_patch()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = sdpa_hf.register(name, lazy_weights=True)
    # kvpress writes its wrappers into this instance's local mapping, which shadows the
    # class-wide registry: a wrapper of an older registration must not outlive it
    ALL_ATTENTION_FUNCTIONS[name] = _patched(attention_patch, sdpa_hf.lazy_attention_forward)
    return name


def _kvpress_attention_patch() -> Callable[[Callable], Callable]:
    """kvpress's attention_patch decorator, after importing kvpress (whose import wraps
    the attention functions registered so far)."""
    try:
        import kvpress  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "kvpress":
            raise
        raise ModuleNotFoundError(
            "sdpa.integrations.kvpress.register needs kvpress: pip install 'sdpa[kvpress]' "
            "(kvpress 0.5 pins transformers < 5.3: give it an environment of its own, as "
            "the Makefile's .venv-kvpress does); for the lazy weights without kvpress, use "
            "sdpa.integrations.transformers.register(lazy_weights=True)",
            name="kvpress",
        ) from None
    from kvpress.attention_patch import attention_patch

    return attention_patch


def _patched(attention_patch: Callable[[Callable], Callable], forward: Callable) -> Callable:
    """forward wrapped by kvpress's attention_patch, marked with what it wraps."""
    wrapped = attention_patch(forward)
    wrapped.__wrapped__ = forward  # type: ignore[attr-defined]
    wrapped.__name__ = f"kvpress_{forward.__name__}"
    return wrapped
