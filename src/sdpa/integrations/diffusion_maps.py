"""Heat maps of a diffusion model's attention, accumulated over layers and steps (DAAM).

    from sdpa.integrations import diffusers as sdpa_diffusers
    from sdpa.integrations.diffusion_maps import CrossMaps, PixelMaps, token_indices

    words = token_indices(pipe.tokenizer, prompt, ["cat", "hat"])   # [[5], [8, 9]]
    cross = CrossMaps(words, size=(64, 64), batch="cond")
    pixels = PixelMaps([(20, 30)], size=(64, 64), batch="cond")
    sdpa_diffusers.use_sdpa(pipe.unet)
    with sdpa_diffusers.capture(pipe.unet, on_call=lambda r: (cross(r), pixels(r))) as cap:
        pipe(prompt, callback_on_step_end=cap.on_step_end)
    cross.maps     # (B', words, 64, 64): each word's attention map, summed over layers and steps
    pixels.maps    # (B', pixels, 64, 64): what each pixel attends to, summed likewise

Each consumer reads from a call's lazy weights only what it needs, inside the call:
columns `w[b, :, :, J]` of the few prompt tokens (O(L x |J|)), or one row `w[b, :, i]`
per pixel (O(S)); heads are averaged, the layer's (h, w) map is resized to `size`
(bicubic and clamped at 0, as DAAM does) and added in place. Memory is the maps, whatever
the number of layers and steps; nothing of a call is kept.

Shapes: B' selected batch items, T tokens (or words), P pixels, (h, w) a layer's grid of
image tokens, size = (Hm, Wm) the maps' grid (the latent's, or the image's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sdpa.errors import SdpaTypeError, SdpaValueError

if TYPE_CHECKING:
    from sdpa.integrations.diffusers.calls import CallInfo, CallRecord

Batch = int | slice | str | None
MODES = ("bicubic", "bilinear", "nearest")


def token_indices(tokenizer, prompt: str, words: str | Sequence[str]) -> list[list[int]]:
    """Where each word's tokens sit in the prompt as the text encoder sees it (position 0
    is the start token): one list per word, every occurrence. A word may be several
    tokens ("zebra" -> [z, e, bra]); it is tokenized alone and found as a run of tokens
    in the prompt's tokens (CLIP lowercases, so case does not matter).

    >>> token_indices(pipe.tokenizer, "a cat in a hat", ["cat", "hat"])
    [[2], [5]]
    """
    words = [words] if isinstance(words, str) else list(words)
    limit = getattr(tokenizer, "model_max_length", None)
    limit = limit if isinstance(limit, int) and limit < 10**6 else None
    ids = tokenizer(prompt, truncation=limit is not None, max_length=limit).input_ids
    found = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise SdpaValueError(f"words must be non-empty strings, got {word!r}")
        run = tokenizer(word.strip(), add_special_tokens=False).input_ids
        at = [
            i + j
            for i in range(len(ids) - len(run) + 1)
            if ids[i : i + len(run)] == run
            for j in range(len(run))
        ]
        if not run or not at:
            raise SdpaValueError(
                f"word {word!r} (tokens {tokenizer.convert_ids_to_tokens(run)}) is not in the "
                f"prompt {prompt!r}, whose tokens are {tokenizer.convert_ids_to_tokens(ids)}; "
                f"pass a word as it is written in the prompt (a whole word, within the "
                f"first {limit} tokens)"
            )
        found.append(at)
    return found


class _Maps:
    """What both accumulators share: the batch items and calls they read, the grid they
    resize to, and the sum they add to in place."""

    kinds: tuple[str, ...] = ()

    def __init__(
        self,
        n: int,
        size: tuple[int, int] | None,
        batch: Batch,
        mode: str,
        where: Callable[[CallInfo], bool] | None,
    ) -> None:
        if mode not in MODES:
            raise SdpaValueError(f"mode must be one of {MODES}, got {mode!r}")
        if size is not None and (
            len(tuple(size)) != 2 or not all(isinstance(s, int) and s > 0 for s in size)
        ):
            raise SdpaValueError(f"size must be (rows, cols) of positive ints, got {size!r}")
        if not (batch is None or batch == "cond" or isinstance(batch, int | slice)):
            raise SdpaTypeError(
                f"batch must be None (every item), an int, a slice or 'cond' (the second half: "
                f"the conditional half under classifier-free guidance), got {batch!r}"
            )
        self.n = n
        self.size = None if size is None else tuple(size)
        self.batch = batch
        self.mode = mode
        self.where = where
        self.maps: torch.Tensor | None = None  # (B', n, Hm, Wm), float32
        self.calls = 0  # calls added to the maps

    def _batch(self, B: int) -> slice:
        if self.batch is None:
            return slice(0, B)
        if self.batch == "cond":
            if B % 2:
                raise SdpaValueError(
                    f"batch='cond' takes the second half of the batch (classifier-free "
                    f"guidance), but this call's batch is {B}, odd; pass batch=None or an index"
                )
            return slice(B // 2, B)
        if isinstance(self.batch, int):
            if not -B <= self.batch < B:
                raise SdpaValueError(f"batch={self.batch} is out of range for a batch of {B}")
            b = self.batch % B
            return slice(b, b + 1)
        return self.batch

    def _wanted(self, info: CallInfo) -> bool:
        if info.kind not in self.kinds or (self.where is not None and not self.where(info)):
            return False
        if info.grid is None:
            raise SdpaValueError(
                f"{info.name!r} does not know the grid of its image tokens (CallInfo.grid is "
                f"None): open the capture around the model's forward, so the latent's size is "
                f"seen"
            )
        if self.size is None:  # the first call's grid: the latent's, in a UNet
            self.size = tuple(info.grid)
        h, w = info.grid
        if h > self.size[0] or w > self.size[1]:
            raise SdpaValueError(
                f"{info.name!r} has a {h}x{w} grid, finer than the maps' size {self.size}; "
                f"pass size=(rows, cols) of the latent (or larger)"
            )
        return True

    def _add(self, maps: torch.Tensor) -> None:
        """maps (B', n, h, w) -> resized to size and added in place."""
        maps = maps.float()
        if tuple(maps.shape[-2:]) != self.size:
            maps = F.interpolate(maps, size=self.size, mode=self.mode)  # (B', n, Hm, Wm)
            if self.mode == "bicubic":  # bicubic overshoots below 0; DAAM clamps
                maps = maps.clamp_(min=0.0)
        if self.maps is None:
            self.maps = torch.zeros_like(maps)
        elif self.maps.shape != maps.shape:
            raise SdpaValueError(
                f"this call's maps are {tuple(maps.shape)}, the accumulated ones "
                f"{tuple(self.maps.shape)} (batch items, {self.n}, rows, cols): a batch of "
                f"another size; use one accumulator per pipeline run"
            )
        self.maps += maps
        self.calls += 1

    def reset(self) -> None:
        """Forget the sums (keeps size and the rest)."""
        self.maps, self.calls = None, 0


class CrossMaps(_Maps):
    """DAAM heat maps of chosen prompt tokens: for each call with text keys (UNet cross
    attention, or the image rows x text columns of a joint call) the columns
    w[b, :, image, J] (B', H, h*w, |J|) are read, heads averaged, each token's (h, w)
    map resized to `size` and added to `maps` (B', T, Hm, Wm) in place.

    tokens: one entry per map, an int (a token position, as token_indices gives) or a
        list of positions, averaged (a word of several tokens, as DAAM merges them).
    size: (Hm, Wm) of the maps; None takes the first call's grid (in a UNet, the
        latent's). batch: None (every item), an int, a slice, or "cond" (the second
        half: classifier-free guidance's conditional prompts). mode: how a layer's map is
        resized ("bicubic" clamped at 0 as DAAM, "bilinear", "nearest"). where: a filter
        on CallInfo (layers, steps).
    """

    kinds = ("cross", "joint")

    def __init__(
        self,
        tokens: Sequence[int | Sequence[int]],
        *,
        size: tuple[int, int] | None = None,
        batch: Batch = None,
        mode: str = "bicubic",
        where: Callable[[CallInfo], bool] | None = None,
    ) -> None:
        groups = [[t] if isinstance(t, int) else list(t) for t in tokens]
        if not groups or not all(g and all(isinstance(j, int) for j in g) for g in groups):
            raise SdpaValueError(
                f"tokens must be a non-empty list of token positions or lists of positions "
                f"(token_indices gives them), got {tokens!r}"
            )
        super().__init__(len(groups), size, batch, mode, where)
        self.groups = groups
        self._columns = sorted({j for g in groups for j in g})
        self._merge = torch.zeros(len(groups), len(self._columns))  # (T, |J|): each word's mean
        for t, g in enumerate(groups):
            for j in g:
                self._merge[t, self._columns.index(j)] += 1.0 / len(g)

    def __call__(self, record: CallRecord) -> None:
        info = record.info
        if not self._wanted(info):
            return
        text = info.text
        n_text = info.text_tokens
        if max(self._columns) >= n_text:
            raise SdpaValueError(
                f"token {max(self._columns)} is past the {n_text} text tokens of {info.name!r}"
            )
        w = record.weights
        cols = [text.start + j for j in self._columns]
        b = self._batch(w.shape[0])
        p = w[b, :, info.image, cols].float().mean(dim=1)  # (B', h*w, |J|), heads averaged
        p = p @ self._merge.to(p.device).T  # (B', h*w, T)
        self._add(p.transpose(1, 2).reshape(p.shape[0], self.n, *info.grid))  # (B', T, h, w)


class PixelMaps(_Maps):
    """What chosen pixels attend to: for each call with image keys (self attention, or
    the image part of a joint call) the pixel's row w[b, :, i, image] (B', H, h*w) is
    read, heads averaged, reshaped to the layer's (h, w) grid, resized to `size` and added
    to `maps` (B', P, Hm, Wm) in place. A pixel (y, x) of the size grid is, in a layer of
    grid (h, w), the token (y * h // Hm) * w + x * w // Wm.

    pixels: (y, x) positions on the maps' grid; size, batch, mode, where: as CrossMaps
    (size is needed up front unless every pixel lies in the first call's grid).
    """

    kinds = ("self", "joint")

    def __init__(
        self,
        pixels: Sequence[tuple[int, int]],
        *,
        size: tuple[int, int] | None = None,
        batch: Batch = None,
        mode: str = "bicubic",
        where: Callable[[CallInfo], bool] | None = None,
    ) -> None:
        pixels = [tuple(p) for p in pixels]
        if not pixels or not all(
            len(p) == 2 and all(isinstance(c, int) and c >= 0 for c in p) for p in pixels
        ):
            raise SdpaValueError(f"pixels must be a non-empty list of (y, x) ints, got {pixels!r}")
        super().__init__(len(pixels), size, batch, mode, where)
        self.pixels = pixels

    def __call__(self, record: CallRecord) -> None:
        info = record.info
        if not self._wanted(info):
            return
        (Hm, Wm), (h, w_) = self.size, info.grid
        bad = [p for p in self.pixels if p[0] >= Hm or p[1] >= Wm]
        if bad:
            raise SdpaValueError(f"pixels {bad} lie outside the maps' grid {self.size}")
        w = record.weights
        b = self._batch(w.shape[0])
        image = info.image
        rows = []
        for y, x in self.pixels:
            i = image.start + (y * h // Hm) * w_ + x * w_ // Wm
            rows.append(w[b, :, i, image].float().mean(dim=1))  # (B', h*w), heads averaged
        maps = torch.stack(rows, dim=1)  # (B', P, h*w)
        self._add(maps.reshape(maps.shape[0], self.n, h, w_))  # (B', P, h, w)
