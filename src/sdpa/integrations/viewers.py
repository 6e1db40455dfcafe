"""Dense attentions for attention viewers (bertviz, circuitsvis) from captured lazy weights.

    import sdpa.integrations.transformers as sdpa_hf
    from sdpa.integrations.viewers import attentions
    from bertviz import head_view

    model = AutoModel.from_pretrained(path, attn_implementation=sdpa_hf.register())
    with sdpa_hf.capture(model) as cap:
        model(**batch)
    head_view(attentions(cap, batch=0), tokens)               # every layer and head
    head_view(attentions(cap, layers=[0, 5], heads=[3]), tokens)

    import circuitsvis as cv                                  # one layer, (H, L, S)
    cv.attention.attention_patterns(tokens=tokens, attention=attentions(cap, layers=2)[0][0])

The viewers take the tuple transformers returns with `output_attentions=True`: one
dense (1, H, L, S) tensor per layer. `attentions` builds it from the capture's lazy
weights, computing only the layers, heads and query rows selected (B batch, H heads,
L queries, S keys). bertviz's self-attention views need every row (L == S, one per
token); `rows` is for viewers and plots that show some queries only.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

import torch

from sdpa.budget import DEFAULT_MAX_BYTES, check_fits
from sdpa.errors import SdpaTypeError, SdpaValueError
from sdpa.weights import AttentionWeights

Selection = int | Sequence[int] | None


def attentions(
    capture: object,
    batch: int = 0,
    layers: Selection = None,
    heads: Selection = None,
    rows: int | slice | Sequence[int] | None = None,
    *,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> tuple[torch.Tensor, ...]:
    """The dense attentions of one batch element, as bertviz and circuitsvis take them:
    a tuple with one (1, H', n, S) tensor per selected layer, in the order selected.

    capture: what `sdpa.integrations.transformers.capture(model)` collected (its
        `.weights`: one lazy AttentionWeights (B, H, L, S) per attention call, in
        order), or a sequence of AttentionWeights (e.g. the lazy variant's attentions).
    batch: the batch element, 0 <= batch < B (negative counts from the end).
    layers: an index or a list of indices into the capture's calls; None: all.
    heads: an index or a list of head indices (H' of them); None: all H.
    rows: the query rows: an index, a slice (positive step) or a list (n of them); None:
        all L. The key dim is always whole.
    max_bytes: refuse, before computing anything, a result over this many bytes in all
        (default 1 GiB; None: no limit).

    Values are the weights' dtype (float32 for 16-bit models); rows that see no key are
    0 (eager gives them uniform weights).
    """
    found = _weights_of(capture)
    chosen = _indices("layers", layers, len(found), "attention calls captured")
    selected = []
    for layer in chosen:
        w = found[layer]
        if len(w.shape) != 4:
            raise SdpaValueError(
                f"layer {layer}'s weights have shape {tuple(w.shape)}; viewers need "
                f"(B, H, L, S) weights, as transformers' attention modules produce"
            )
        B, H, L, _ = w.shape  # (B, H, L, S)
        b = _index("batch", batch, B, "batch elements")
        h = _indices("heads", heads, H, f"heads in layer {layer}")
        r = _rows(rows, L, layer)
        selected.append((w, b, h, r))
    shapes = [(1, len(h), _count(r), w.shape[-1]) for w, _, h, r in selected]
    item = max(torch.finfo(w.dtype).bits // 8 for w, *_ in selected)
    if len(set(shapes)) == 1:  # (layers, 1, H', n, S)
        check_fits(f"{len(shapes)} layer(s) of dense attentions",
                   (len(shapes), *shapes[0]), item, max_bytes, _HINT)  # fmt: skip
    else:
        total = sum(math.prod(s) for s in shapes)
        check_fits(f"{len(shapes)} layers of dense attentions, elements in all",
                   (total,), item, max_bytes, _HINT)  # fmt: skip
    return tuple(_dense(w, b, h, r) for w, b, h, r in selected)


_HINT = (
    "Select less (layers=, heads=, rows=), or pass max_bytes=None; the lazy weights "
    "answer rows, sums, entropy and top-k of any size without the dense tensor"
)


def _weights_of(capture: object) -> list[AttentionWeights]:
    found = getattr(capture, "weights", capture)
    if isinstance(found, AttentionWeights) or not isinstance(found, Sequence):
        raise SdpaTypeError(
            f"capture must be what sdpa.integrations.transformers.capture(model) "
            f"collected (or a sequence of AttentionWeights), got {type(capture).__name__}"
        )
    found = list(found)
    for i, w in enumerate(found):
        if not isinstance(w, AttentionWeights):
            raise SdpaTypeError(
                f"capture's weights must all be AttentionWeights, got "
                f"{type(w).__name__} at index {i}"
            )
    if not found:
        raise SdpaValueError(
            "the capture holds no attention weights: run the model inside "
            "`with sdpa.integrations.transformers.capture(model) as cap:` on a model "
            "loaded with attn_implementation=sdpa.integrations.transformers.register()"
        )
    return found


def _index(name: str, value: object, size: int, what: str) -> int:
    """One index into `size` things, negative from the end."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise SdpaTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    i = operator.index(value)
    if not -size <= i < size:
        raise SdpaValueError(f"{name}={i} is out of range: there are {size} {what}")
    return i % size


def _indices(name: str, value: object, size: int, what: str) -> list[int]:
    """None (all), an int, or a list of ints (a tuple, range or 1-D tensor too)."""
    if value is None:
        return list(range(size))
    if isinstance(value, torch.Tensor) and value.ndim <= 1:
        value = value.tolist()
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        return [_index(name, value, size, what)]
    if isinstance(value, str | bytes | dict) or not isinstance(value, Iterable):
        raise SdpaTypeError(
            f"{name} must be None (all), an int or a list of ints, got {value!r} "
            f"({type(value).__name__})"
        )
    out = [_index(name, v, size, what) for v in value]
    if not out:
        raise SdpaValueError(f"{name} is empty; pass None for all {size} {what}")
    return out


def _rows(rows: object, L: int, layer: int) -> slice | list[int]:
    """The query rows, as a slice or a list of indices."""
    if rows is None:
        return slice(0, L, 1)
    if isinstance(rows, slice):
        if rows.step is not None and rows.step <= 0:
            raise SdpaValueError(f"rows: the slice's step must be positive, got {rows.step}")
        picked = slice(*rows.indices(L))
        if not range(L)[picked]:
            raise SdpaValueError(f"rows={rows} selects no query of layer {layer} (L={L})")
        return picked
    return _indices("rows", rows, L, f"query rows in layer {layer}")


def _count(rows: slice | list[int]) -> int:
    return len(rows) if isinstance(rows, list) else len(range(rows.start, rows.stop, rows.step))


def _dense(w: AttentionWeights, b: int, heads: list[int], rows: slice | list[int]):
    """(1, H', n, S): the selected heads and rows of batch element b."""
    if heads == list(range(heads[0], heads[-1] + 1)):  # a run: one call for all heads
        groups = [slice(heads[0], heads[-1] + 1)]
    else:
        groups = [slice(h, h + 1) for h in heads]
    parts = []
    for g in groups:
        if isinstance(rows, slice):
            parts.append(w[b, g, rows])  # (h, n, S)
        else:
            parts.append(torch.stack([w[b, g, r] for r in rows], dim=1))  # (h, n, S)
    return torch.cat(parts, dim=0)[None]  # (1, H', n, S)
