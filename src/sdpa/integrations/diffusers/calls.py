"""One attention call of a diffusers model on sdpa: what the call is (CallInfo), the one
function every processor ends in (`attend`), and the open captures and edits it serves.

Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv) -> output (B, H, L, Dv).
B: batch (both halves of classifier-free guidance), H: heads, L: queries, S: keys.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from sdpa.errors import SdpaValueError
from sdpa.functional import AttentionResult, attention
from sdpa.integrations.edits import answer_of
from sdpa.weights import AttentionWeights

Kind = Literal["self", "cross", "joint"]


@dataclass(frozen=True, eq=False)
class CallInfo:
    """What one attention call is, for captures and edits.

    name: the processor's key in model.attn_processors ("...attn2.processor").
    kind: "self" (image tokens attend to image tokens), "cross" (image queries, text keys:
        UNet attn2) or "joint" (text and image tokens in one sequence, as queries and as
        keys: SD3's MMDiT and Flux).
    step: the denoising step of the session that sees the call (its `step` counter).
    tokens: L, the queries of the call (= S for self and joint).
    grid: (rows, cols) of the image tokens: those tokens, taken in order, reshape
        row-major to this grid of the latent (downsampled as the layer sees it);
        None where it cannot be known (no capture or edit saw the model's input).
    text_tokens: how many tokens are text: S for cross, the text part for joint, else None.
    text_start: where the text tokens start among the joint sequence (0 for Flux, after
        the image tokens for SD3), 0 for cross (the keys), None for self.
    scale: the score scale the layer uses (None: 1/sqrt(D), as sdpa.attention's default);
        an edit that calls sdpa.attention passes scale=info.scale.
    layer: the attention module (diffusers' Attention or FluxAttention).
    """

    name: str
    kind: Kind
    step: int
    tokens: int
    grid: tuple[int, int] | None
    text_tokens: int | None
    text_start: int | None
    scale: float | None
    layer: torch.nn.Module = field(repr=False)

    @property
    def text(self) -> slice | None:
        """Positions of the text tokens: among the keys for cross, the joint sequence for
        joint; None for self."""
        if self.text_tokens is None or self.text_start is None:
            return None
        return slice(self.text_start, self.text_start + self.text_tokens)

    @property
    def image(self) -> slice:
        """Positions of the image tokens among the queries."""
        if self.kind != "joint" or self.text_tokens is None or self.text_start is None:
            return slice(0, self.tokens)
        if self.text_start == 0:
            return slice(self.text_tokens, self.tokens)
        return slice(0, self.text_start)


@dataclass(frozen=True, eq=False)
class CallRecord:
    """A captured call: its CallInfo and its lazy weights (B, H, L, S), nothing L x S kept.
    Keeping a record pins the call's q and k."""

    info: CallInfo
    weights: AttentionWeights

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def kind(self) -> Kind:
        return self.info.kind

    @property
    def step(self) -> int:
        return self.info.step


class ModelState:
    """What a model's forward tells about its image and text tokens, noted by a forward
    pre-hook only while a capture or edit is open: the latent's (H, W) (UNet `sample`,
    SD3 `hidden_states`, Flux `img_ids`) and Flux's text length; and the processors
    use_sdpa replaced, for `restore`."""

    def __init__(self) -> None:
        self.latent: tuple[int, int] | None = None
        self.text_tokens: int | None = None
        self.replaced: dict[str, object] = {}  # name -> the diffusers processor use_sdpa took

    def grid(self, n: int) -> tuple[int, int] | None:
        """(rows, cols) with rows * cols == n: the latent downsampled by 1, 2, 4, ...
        (ceil, as stride-2 convolutions and patch embeddings do), else None."""
        if self.latent is None or n <= 0:
            return None
        H, W = self.latent
        f = 1
        while True:
            rows, cols = math.ceil(H / f), math.ceil(W / f)
            if rows * cols == n:
                return rows, cols
            if rows * cols < n or (rows == 1 and cols == 1):
                return None
            f *= 2


class Session:
    """An open capture or edit on one model: its step counter and the attention modules
    (by id) of the model it serves."""

    def __init__(self, layers: frozenset[int]) -> None:
        self.layers = layers
        self.step = 0
        self.calls = 0  # attention calls seen in this block

    def on_step_end(self, pipe, step_index: int, timestep, callback_kwargs: dict) -> dict:
        """A diffusers `callback_on_step_end`: step becomes step_index + 1, the step the
        next UNet / transformer call denoises. Returns callback_kwargs unchanged."""
        self.step = step_index + 1
        return callback_kwargs


class Capture(Session):
    """What `capture` collects: records (when keep=True), one per attention call, in call
    order; on_call(record) runs inside each call, before the next one."""

    def __init__(
        self, layers: frozenset[int], on_call: Callable[[CallRecord], object] | None, keep: bool
    ) -> None:
        super().__init__(layers)
        self.on_call = on_call
        self.keep = keep
        self.records: list[CallRecord] = []

    def _see(self, info: CallInfo, weights: AttentionWeights) -> None:
        record = CallRecord(replace(info, step=self.step), weights)
        if self.keep:
            self.records.append(record)
        if self.on_call is not None:
            self.on_call(record)


EditFn = Callable[..., "torch.Tensor | AttentionResult | None"]


class Edit(Session):
    """An open `edit`: fn(info, q, k, v, mask) replaces the attention of the calls where it
    returns a tensor (B, H, L, Dv) or an AttentionResult; None keeps the default."""

    def __init__(self, layers: frozenset[int], fn: EditFn) -> None:
        super().__init__(layers)
        self.fn = fn


# The open sessions, innermost last: the one mechanism captures and edits share.
ACTIVE: contextvars.ContextVar[tuple[Session, ...]] = contextvars.ContextVar(
    "sdpa_diffusers_sessions", default=()
)


def default(q, k, v, mask, scale: float | None = None) -> torch.Tensor:
    """The attention of a call no edit replaces, with no capture open: the fused kernel."""
    return attention(q, k, v, mask, scale=scale).output


def attend(info: CallInfo, q, k, v, mask) -> torch.Tensor:
    """The one function every sdpa processor calls: q (B, H, L, D), k (B, H, S, D),
    v (B, H, S, Dv), mask (broadcasting to (B, H, L, S); bool True = takes part, float
    added) or None -> output (B, H, L, Dv).

    With no session open on the layer's model this is sdpa.attention's output. Otherwise
    the innermost edit whose fn returns something gives the output (an AttentionResult
    also gives the weights captures see); then every open capture receives the lazy
    weights of the call (from one sdpa.attention call where no edit answered)."""
    sessions = [s for s in ACTIVE.get() if id(info.layer) in s.layers]
    if not sessions:
        return default(q, k, v, mask, info.scale)
    call = info
    for session in sessions:
        session.calls += 1
    result = None
    for session in reversed(sessions):
        if isinstance(session, Edit):
            got = session.fn(replace(call, step=session.step), q, k, v, mask)
            if got is not None:
                result = _checked(got, call, q, v)
                break
    captures = [s for s in sessions if isinstance(s, Capture)]
    if result is None:
        if not captures:
            return default(q, k, v, mask, call.scale)
        result = attention(q, k, v, mask, scale=call.scale)
    if isinstance(result, torch.Tensor):
        if captures:
            raise SdpaValueError(
                f"the edit function returned a bare tensor for {call.name!r} while a capture "
                f"is open, so the capture cannot see the edited weights; return the "
                f"sdpa.attention(...) result (output, weights) instead"
            )
        return result
    for cap in captures:
        cap._see(call, result.weights)
    return result.output


def _checked(got, info: CallInfo, q, v):
    """An edit's answer, refused unless it is a tensor or an AttentionResult of the
    call's output shape and dtype (edits.answer_of)."""
    answer_of(got, q, v, repr(info.name))
    return got
