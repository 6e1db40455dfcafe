"""Attend-and-Excite (Chefer et al. 2023) on sdpa: the loss of a UNet's cross-attention
maps, differentiable with respect to the latent, read from each call's lazy weights;
no self-attention map is materialised (those calls stay in torch's fused kernel,
forward and backward).

    from sdpa.integrations import diffusers as sdpa_diffusers
    from sdpa.integrations.attend_excite import AttendExcite

    sdpa_diffusers.use_sdpa(unet)
    ae = AttendExcite([2, 5])                          # subject tokens: A&E's token_indices
    latent = latent.detach().requires_grad_(True)
    with torch.enable_grad(), sdpa_diffusers.capture(unet, on_call=ae):
        unet(latent, t, encoder_hidden_states=cond)    # the conditional prompt only, as A&E
        latent = ae.step(latent, step_size)            # latent - step_size * d loss / d latent
    ae.reset()                                         # before the next forward

What is computed, per batch item, as diffusers' StableDiffusionAttendAndExcitePipeline
does (AttentionStore, _compute_max_attention_per_index, _compute_loss, _update_latent,
which that pipeline runs on one latent at a time):

    maps[b]      the cross-attention weights of every call whose image grid is `grid`
                 (A&E's attn_res, 16 x 16), averaged over all heads of those calls
                 (each head counts once)                                   (h, w, T)
    a[b]         softmax over the text tokens of 100 * maps[b][..., 1:T-1]
                 (the start token and the last token left out)             (h, w, T-2)
    max_att[b,n] max over pixels of a 3 x 3 Gaussian (sigma 0.5, reflect padding) of
                 a[b][..., tokens[n] - 1]
    loss[b]      max over n of max(0, 1 - max_att[b, n])

Cost per call read: its whole cross weights w[:, :, :, :] (B, H, h*w, T), since the
softmax over text tokens needs every column: O(h*w x T) (T = 77 for CLIP), as much as
diffusers' own cross-attention probabilities of that layer, differentiable as every
read of sdpa's weights. Self-attention calls are not read: their (B, H, N, N) maps
are never made (at most sdpa's small backend computes a call of up to 2**16 scores
per head, a 16 x 16 layer, in one product: sdpa.settings' small_head).

Shapes: B batch items, H heads, (h, w) = grid, T text tokens (keys), n subject tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError

if TYPE_CHECKING:
    from sdpa.integrations.diffusers.calls import CallRecord

SOFTMAX_SCALE = 100.0  # A&E multiplies the averaged maps by 100 before the token softmax
SIGMA, KERNEL = 0.5, 3  # A&E's GaussianSmoothing defaults (its pipeline passes no others)


def _gaussian_kernel() -> torch.Tensor:
    """A&E's 2-D smoothing kernel (KERNEL, KERNEL), summing to 1, by its own formula
    (exp(-((x - mean) / (2 sigma))^2) per axis: its GaussianSmoothing, as written)."""
    axis = torch.arange(KERNEL, dtype=torch.float64)
    g = torch.exp(-(((axis - (KERNEL - 1) / 2) / (2 * SIGMA)) ** 2))
    kernel = g[:, None] * g[None, :]  # (KERNEL, KERNEL)
    return (kernel / kernel.sum()).float()


def token_maps(maps: torch.Tensor, tokens: Sequence[int], *, smooth: bool = True) -> torch.Tensor:
    """A&E's map of each subject token: maps (B, h, w, T) averaged cross attention ->
    (B, n, h, w), differentiable.

    a = softmax(100 * maps[..., 1:T-1], dim=-1), the text tokens' share of each pixel
    (start and last token left out); token t's map is a[..., t - 1], smoothed (3 x 3
    Gaussian, sigma 0.5, reflect padding) where smooth. Tokens are positions among the T
    text tokens, 1 <= t <= T - 2."""
    if not isinstance(maps, torch.Tensor) or maps.ndim != 4:
        raise SdpaValueError(
            f"maps must be a (B, h, w, T) tensor of averaged cross attention, got "
            f"{tuple(maps.shape) if isinstance(maps, torch.Tensor) else type(maps).__name__}"
        )
    T = maps.shape[-1]
    tokens = _tokens(tokens)
    bad = [t for t in tokens if not 1 <= t <= T - 2]
    if bad:
        raise SdpaValueError(
            f"tokens {bad} are outside 1..{T - 2}: A&E leaves out the start token (0) and the "
            f"last of the {T} text tokens; pass positions of words in the prompt"
        )
    B, h, w = maps.shape[:3]
    if smooth and (h < 2 or w < 2):
        raise SdpaValueError(f"smooth=True needs a grid of at least 2 x 2, got {h} x {w}")
    a = (maps[..., 1 : T - 1] * SOFTMAX_SCALE).softmax(dim=-1)  # (B, h, w, T-2)
    a = a[..., [t - 1 for t in tokens]]  # (B, h, w, n)
    a = a.permute(0, 3, 1, 2).reshape(B * len(tokens), 1, h, w)  # (B*n, 1, h, w)
    if smooth:
        a = F.pad(a, (1, 1, 1, 1), mode="reflect")  # (B*n, 1, h+2, w+2)
        kernel = _gaussian_kernel().to(device=a.device, dtype=a.dtype)
        a = F.conv2d(a, kernel[None, None])  # (B*n, 1, h, w)
    return a.reshape(B, len(tokens), h, w)  # (B, n, h, w)


def max_attention(
    maps: torch.Tensor, tokens: Sequence[int], *, smooth: bool = True
) -> torch.Tensor:
    """A&E's max attention of each subject token (its _compute_max_attention_per_index):
    the maximum over pixels of token_maps, (B, n)."""
    return token_maps(maps, tokens, smooth=smooth).flatten(2).amax(dim=-1)  # (B, n)


def attend_and_excite_loss(max_att: torch.Tensor) -> torch.Tensor:
    """A&E's loss from max_attention's (B, n): max over tokens of max(0, 1 - max_att),
    (B,). Where every token is at 1 the loss is 0 with gradient 0 (A&E skips that update)."""
    return torch.relu(1.0 - max_att).amax(dim=-1)  # relu: no gradient at 0, as A&E's max(0, .)


def _tokens(tokens: Sequence[int]) -> list[int]:
    if isinstance(tokens, int | str) or not isinstance(tokens, Sequence):
        raise SdpaTypeError(
            f"tokens must be a list of token positions (A&E's token_indices), got {tokens!r}"
        )
    tokens = list(tokens)
    if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise SdpaTypeError(
            f"tokens must be a non-empty list of int token positions, one per subject (A&E "
            f"takes one token each; for a word of several, pick one of token_indices' "
            f"positions), got {tokens!r}"
        )
    return tokens


class AttendExcite:
    """An `on_call` consumer for sdpa.integrations.diffusers.capture that collects A&E's
    averaged cross-attention maps during one UNet forward, differentiably, and gives
    the A&E loss of each batch item.

    tokens: the subject tokens (A&E's token_indices: positions in the prompt, the start
        token is 0), the same for every batch item.
    grid: (h, w) of the layers whose maps are averaged (A&E's attn_res; its pipeline's
        default (16, 16)). A cross call with h * w image tokens on another grid (A&E would
        reshape it to `grid`) is refused.
    smooth: A&E's Gaussian smoothing of each token's map before its maximum.

    After the forward: maps (B, h, w, T), max_attention() (B, n), loss() (B,) (A&E's
    loss of each item; the items are independent, so d loss.sum() / d latent[b] is
    item b's own gradient), step(latent, step_size). reset() before the next forward:
    a layer seen twice is refused. Joint calls (SD3 / Flux: no A&E reference) are
    refused; self-attention calls are not read.
    """

    def __init__(
        self, tokens: Sequence[int], *, grid: tuple[int, int] = (16, 16), smooth: bool = True
    ) -> None:
        self.tokens = _tokens(tokens)
        grid = tuple(grid) if isinstance(grid, Sequence) else grid
        if not (
            isinstance(grid, tuple)
            and len(grid) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in grid)
        ):
            raise SdpaValueError(f"grid must be (h, w) of positive ints, got {grid!r}")
        if not isinstance(smooth, bool):
            raise SdpaTypeError(f"smooth must be True or False, got {smooth!r}")
        if smooth and min(grid) < 2:
            raise SdpaValueError(f"smooth=True needs a grid of at least 2 x 2, got {grid}")
        self.grid = grid
        self.smooth = smooth
        self.reset()

    def reset(self) -> None:
        """Forget the maps: call it between forwards (and between guidance iterations)."""
        self._sum: torch.Tensor | None = None  # (B, h*w, T): heads and layers summed
        self._heads = 0
        self._seen: set[str] = set()

    @property
    def calls(self) -> int:
        """The cross-attention calls averaged into the maps."""
        return len(self._seen)

    def __call__(self, record: CallRecord) -> None:
        info = record.info
        if info.kind == "self":
            return
        if info.kind != "cross":
            raise NotSupportedError(
                f"{info.name!r} is a {info.kind!r} call (text and image tokens in one "
                f"sequence: SD3, Flux); AttendExcite follows diffusers' Attend-and-Excite "
                f"pipeline, defined on a UNet's cross attention only"
            )
        h, w = self.grid
        if info.grid != self.grid:
            if info.tokens != h * w:
                return  # not A&E's layers (it keeps the calls of h * w image tokens)
            if info.grid is None:
                raise SdpaValueError(
                    f"{info.name!r} does not know the grid of its {info.tokens} image tokens: "
                    f"open the capture around the UNet's forward, so the latent's size is seen"
                )
            raise SdpaValueError(
                f"{info.name!r} has {info.tokens} image tokens on grid {info.grid}, not "
                f"{self.grid}: A&E would average it as a {h} x {w} map; pass "
                f"grid={info.grid} to use that layer, or a latent whose layers match"
            )
        if info.name in self._seen:
            raise SdpaValueError(
                f"{info.name!r} was seen twice: the maps are of one UNet forward, as A&E's; "
                f"call reset() before the next forward"
            )
        weights = record.weights
        B, H, _, T = weights.shape
        if self._sum is not None and self._sum.shape != (B, h * w, T):
            raise SdpaValueError(
                f"{info.name!r} has batch {B} and {T} text tokens, earlier calls "
                f"{tuple(self._sum.shape[::2])}: one forward's calls only (reset() between)"
            )
        p = weights[:, :, :, :].float().sum(dim=1)  # (B, h*w, T): every column, heads summed
        self._sum = p if self._sum is None else self._sum + p
        self._heads += H
        self._seen.add(info.name)

    @property
    def maps(self) -> torch.Tensor:
        """The cross attention of the `grid` calls averaged over their heads, (B, h, w, T):
        A&E's aggregate_attention, per item; differentiable."""
        if self._sum is None:
            raise SdpaValueError(
                f"no cross-attention call on grid {self.grid} was seen: run the UNet inside "
                f"capture(unet, on_call=this) (use_sdpa(unet) first), with a latent whose "
                f"layers include a {self.grid[0]} x {self.grid[1]} grid"
            )
        B, _, T = self._sum.shape
        return (self._sum / self._heads).reshape(B, *self.grid, T)  # (B, h, w, T)

    def token_maps(self) -> torch.Tensor:
        """Each subject token's map, softmaxed over the text tokens and smoothed as A&E
        does, (B, n, h, w): what max_attention takes the maximum of."""
        return token_maps(self.maps, self.tokens, smooth=self.smooth)

    def max_attention(self) -> torch.Tensor:
        """Each subject token's smoothed maximum, (B, n) (A&E's max_attention_per_index)."""
        return self.token_maps().flatten(2).amax(dim=-1)  # (B, n)

    def loss(self) -> torch.Tensor:
        """A&E's loss of each batch item, (B,)."""
        return attend_and_excite_loss(self.max_attention())

    def step(
        self, latent: torch.Tensor, step_size: float, loss: torch.Tensor | None = None
    ) -> torch.Tensor:
        """latent - step_size * d loss.sum() / d latent (A&E's _update_latent; each item
        gets its own loss's gradient). latent: the tensor the UNet was called with,
        requiring grad; loss: this forward's loss() unless given (e.g. from max_attention
        of some items). Returns a new tensor in the graph; detach it for the next step."""
        if not isinstance(latent, torch.Tensor) or not latent.requires_grad:
            seen = "a tensor without grad" if isinstance(latent, torch.Tensor) else latent
            raise SdpaValueError(
                "latent must be the tensor the UNet was called with, requiring grad "
                "(latent = latent.detach().requires_grad_(True) before the forward), got "
                f"{seen!r}"
            )
        loss = self.loss() if loss is None else loss
        if loss.grad_fn is None:
            raise SdpaValueError(
                "the loss carries no gradient: the UNet ran under torch.no_grad() (a "
                "diffusers pipeline's __call__ does; wrap the forward in torch.enable_grad()) "
                "or the latent did not require grad"
            )
        (grad,) = torch.autograd.grad(loss.sum(), [latent], allow_unused=True)
        if grad is None:
            raise SdpaValueError(
                "the loss does not depend on this latent: pass the tensor the UNet was "
                "called with in this forward"
            )
        return latent - step_size * grad
