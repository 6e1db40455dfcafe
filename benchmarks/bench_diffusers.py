"""diffusers on sdpa: one denoising step of an SD-1.5-shaped UNet and a small Flux-style
transformer, random weights, float32, no autograd (issue 16).

1. unet: UNet2DConditionModel with SD-1.5's layout (blocks 320/640/1280/1280, 8 heads,
   cross_attention_dim 768), batch 2 (classifier-free guidance), 77 text tokens, a
   64 x 64 latent (32 x 32 with --quick): one UNet forward with `use_sdpa` against
   diffusers' default processors (AttnProcessor2_0).
2. unet maps: the same step while a `capture` reads DAAM-style maps of every
   cross-attention layer (per call: the (B, H, L, 77) weights from w.full(), averaged
   over heads, upsampled bicubically to the latent grid and summed into (B, 77, h, w)),
   against ours without capture.
3. unet maps vs materialising: that step against diffusers' AttnProcessor, the route
   that materialises the softmax (what DAAM and prompt-to-prompt processors build on).
4. flux / flux maps: FluxTransformer2DModel, 2 double-stream + 4 single-stream blocks,
   8 heads of 64, 64 x 64 latent packed to 32 x 32 = 1024 image tokens (16 x 16 with
   --quick) + 128 text tokens, rotary: ours against diffusers' default (dispatch
   "native"); then with a capture reading each call's text columns w[..., J] (J the 128
   text positions), heads averaged, summed over image queries, against ours plain.

Each model is built once and shared by both sides: a side sets its processors, then runs
the step. Before timing, each case checks once that both sides give the same output.

    HF_HUB_OFFLINE=1 python benchmarks/bench_diffusers.py [--quick] [--no-memory] [--json FILE]

The latent side can be set with SDPA_BENCH_LATENT=N (default 64, 32 with --quick).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--quick" in sys.argv:  # the peak-memory subprocesses inherit it through the environment
    os.environ.setdefault("SDPA_BENCH_LATENT", "32")

import torch
import torch.nn.functional as F

import sdpa.integrations.diffusers as sdpa_diffusers
from sdpa.benchmark import Comparison, main

LATENT = int(os.environ.get("SDPA_BENCH_LATENT", "64"))
CHECK = "--peak" not in sys.argv  # the peak-memory runs only set up and call once
TEXT, FLUX_TEXT = 77, 128
_MODELS: dict[str, tuple] = {}


def unet():
    """(model, inputs, diffusers' default processors, sdpa's processors), built once."""
    if "unet" not in _MODELS:
        from diffusers import UNet2DConditionModel

        torch.manual_seed(0)
        model = UNet2DConditionModel(
            block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
            attention_head_dim=8, sample_size=LATENT,
        ).eval()  # fmt: skip
        g = torch.Generator().manual_seed(1)
        inputs = {
            "sample": torch.randn(2, 4, LATENT, LATENT, generator=g),
            "timestep": torch.tensor([500, 500]),
            "encoder_hidden_states": torch.randn(2, TEXT, 768, generator=g),
        }
        default = model.attn_processors
        ours = sdpa_diffusers.use_sdpa(model).attn_processors
        _MODELS["unet"] = (model, inputs, default, ours)
    return _MODELS["unet"]


def flux():
    if "flux" not in _MODELS:
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
            attention_head_dim=64, num_attention_heads=8, joint_attention_dim=512,
            pooled_projection_dim=256, axes_dims_rope=(16, 24, 24),
        ).eval()  # fmt: skip
        side = LATENT // 2  # 2 x 2 latent patches per token, as Flux packs them
        ids = torch.zeros(side, side, 3)
        ids[..., 1] = torch.arange(side)[:, None]
        ids[..., 2] = torch.arange(side)[None]
        g = torch.Generator().manual_seed(1)
        inputs = {
            "hidden_states": torch.randn(2, side * side, 64, generator=g),
            "encoder_hidden_states": torch.randn(2, FLUX_TEXT, 512, generator=g),
            "pooled_projections": torch.randn(2, 256, generator=g),
            "timestep": torch.tensor([0.5, 0.5]),
            "img_ids": ids.reshape(-1, 3),
            "txt_ids": torch.zeros(FLUX_TEXT, 3),
        }
        default = model.attn_processors
        ours = sdpa_diffusers.use_sdpa(model).attn_processors
        _MODELS["flux"] = (model, inputs, default, ours)
    return _MODELS["flux"]


def daam(maps: dict):
    """on_call for capture: DAAM's cross-attention heat map of every text token,
    accumulated in maps["sum"] (B, 77, LATENT, LATENT)."""

    def add(record):
        if record.kind != "cross":
            return
        w = record.weights.full()  # (B, H, L, 77): one product for the 77 keys
        B, _, _, T = w.shape
        h, wd = record.info.grid
        m = w.mean(1).transpose(1, 2).reshape(B, T, h, wd)  # (B, 77, h, w) heads averaged
        m = F.interpolate(m, size=(LATENT, LATENT), mode="bicubic")
        maps["sum"] = m if "sum" not in maps else maps["sum"].add_(m)

    return add


def flux_text_maps(maps: dict):
    """on_call for capture: each joint call's attention from image tokens to the text
    tokens, heads averaged, summed over calls into maps["sum"] (B, N, 128)."""

    def add(record):
        if record.kind != "joint":
            return
        text, image = record.info.text, record.info.image
        cols = record.weights[..., list(range(text.start, text.stop))]  # (B, H, L, 128)
        m = cols[:, :, image].mean(1)  # (B, N, 128)
        maps["sum"] = m if "sum" not in maps else maps["sum"].add_(m)

    return add


def step(which: str, processors: str, maps=None):
    """A side: set the model's processors ("default", "ours", "materialising"), then
    one forward (under a capture calling `maps` when given)."""

    def setup():
        model, inputs, default, ours = unet() if which == "unet" else flux()
        if processors == "materialising":
            from diffusers.models.attention_processor import AttnProcessor

            chosen = {name: AttnProcessor() for name in default}
        else:
            chosen = default if processors == "default" else ours

        def call():
            model.set_attn_processor(dict(chosen))
            with torch.no_grad():
                if maps is None:
                    return model(**inputs).sample
                found = {}
                with sdpa_diffusers.capture(model, on_call=maps(found)):
                    out = model(**inputs).sample
                assert "sum" in found
                return out

        return call

    return setup


def checked(ours, peer, atol: float = 1e-4):
    """ours with a setup that first runs both sides once and compares the outputs."""

    def setup():
        fn = ours()
        if CHECK:
            got, want = fn(), peer()()
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
        return fn

    return setup


def comparisons() -> list[Comparison]:
    shape = f"SD-1.5 UNet, batch 2, {LATENT}x{LATENT} latent, 77 tokens, one step"
    flux_shape = (f"Flux-style 2+4 blocks, 8x64 heads, {(LATENT // 2) ** 2} image + "
                  f"{FLUX_TEXT} text tokens, one step")  # fmt: skip
    default = ("diffusers AttnProcessor2_0", step("unet", "default"))
    plain = ("sdpa use_sdpa", step("unet", "ours"))
    maps = ("sdpa + capture DAAM maps (every cross layer)", step("unet", "ours", daam))
    materialising = ("diffusers AttnProcessor (materialises)", step("unet", "materialising"))
    flux_default = ("diffusers FluxAttnProcessor", step("flux", "default"))
    flux_plain = ("sdpa use_sdpa (flux)", step("flux", "ours"))
    flux_maps = ("sdpa + capture text columns (flux)", step("flux", "ours", flux_text_maps))
    return [
        Comparison("unet", shape, "float32",
                   (plain[0], checked(plain[1], default[1])), default, target=1.02),
        Comparison("unet maps", shape, "float32",
                   (maps[0], checked(maps[1], plain[1])), plain, target=1.3),
        Comparison("unet maps vs materialising", shape, "float32",
                   (maps[0], checked(maps[1], materialising[1])), materialising),
        Comparison("flux", flux_shape, "float32",
                   (flux_plain[0], checked(flux_plain[1], flux_default[1])), flux_default,
                   target=1.02),
        Comparison("flux maps", flux_shape, "float32",
                   (flux_maps[0], checked(flux_maps[1], flux_plain[1])), flux_plain,
                   target=1.3),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
