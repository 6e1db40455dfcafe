"""DAAM heat maps of a Stable Diffusion run, at fused-kernel speed: what each prompt word
attends to over the image (cross attention, summed over layers and steps), and what a few
pixels attend to (self attention).

    python examples/diffusion_maps.py --model PATH --prompt "a cat on the beach" \
        --words cat,beach --out maps/ [--steps 20] [--height 512 --width 512]

PATH is a local diffusers pipeline folder (with model_index.json and a UNet; nothing is
downloaded). Writes words.png and pixels.png: the generated image and one map per word
or pixel over it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from sdpa import plot
from sdpa.errors import SdpaValueError
from sdpa.integrations import diffusers as sdpa_diffusers
from sdpa.integrations.diffusion_maps import CrossMaps, PixelMaps, token_indices


def load(model: str | Path):
    """The pipeline in a local diffusers folder; a clear error for anything else."""
    folder = Path(model)
    if not (folder / "model_index.json").is_file():
        raise SdpaValueError(
            f"--model {str(model)!r} is not a diffusers model folder (no model_index.json); "
            f"pass a folder saved by pipe.save_pretrained(...) or a downloaded snapshot of "
            f"one (e.g. stable-diffusion-v1-5)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None)
    if getattr(pipe, "unet", None) is None or getattr(pipe, "tokenizer", None) is None:
        raise SdpaValueError(
            f"--model {str(model)!r} holds a {type(pipe).__name__} without a UNet and a "
            f"tokenizer; this example maps Stable Diffusion-style pipelines"
        )
    return pipe


def run(
    model: str | Path,
    prompt: str,
    words: list[str],
    out: str | Path,
    steps: int = 20,
    size: tuple[int, int] | None = None,
    seed: int = 0,
    guidance: float = 7.5,
) -> dict:
    """Generate `prompt` with the pipeline in `model`, accumulating the maps of `words`
    and of three pixels; write words.png and pixels.png under `out`.

    Returns {"image": (H, W, 3), "cross": (words, h, w), "pixels": (3, h, w), "paths"},
    maps on the latent's (h, w) grid, the conditional half of guidance."""
    pipe = load(model)
    sdpa_diffusers.use_sdpa(pipe.unet)
    tokens = token_indices(pipe.tokenizer, prompt, words)
    factor = pipe.vae_scale_factor
    height, width = size or (pipe.unet.config.sample_size * factor,) * 2
    latent = (height // factor, width // factor)
    pixels = [(latent[0] // 4, latent[1] // 4), (latent[0] // 2, latent[1] // 2),
              (3 * latent[0] // 4, 3 * latent[1] // 4)]  # fmt: skip
    batch = "cond" if guidance > 1 else None  # classifier-free guidance: [uncond, cond]
    cross = CrossMaps(tokens, size=latent, batch=batch)
    pix = PixelMaps(pixels, size=latent, batch=batch)
    generator = torch.Generator().manual_seed(seed)
    with (
        torch.no_grad(),
        sdpa_diffusers.capture(pipe.unet, on_call=lambda r: (cross(r), pix(r))) as cap,
    ):
        image = pipe(
            prompt, num_inference_steps=steps, height=height, width=width,
            guidance_scale=guidance, generator=generator, output_type="pt",
            callback_on_step_end=cap.on_step_end,
        ).images[0]  # fmt: skip
    image = image.permute(1, 2, 0).float().cpu()  # (H, W, 3) in [0, 1]
    out = Path(out)
    paths = [
        plot.heat_maps(image, cross.maps[0], words, out / "words.png",
                       title=f"{prompt!r}: each word's cross-attention, {steps} steps"),
        plot.heat_maps(image, pix.maps[0], [f"pixel (y={y}, x={x})" for y, x in pixels],
                       out / "pixels.png", title="what each pixel attends to (self attention)"),
    ]  # fmt: skip
    return {"image": image, "cross": cross.maps[0], "pixels": pix.maps[0], "paths": paths}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local diffusers pipeline folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--words", required=True, help="comma-separated words of the prompt")
    parser.add_argument("--out", required=True, type=Path, help="folder for the PNGs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.height is None) != (args.width is None):
        parser.error("--height and --width go together")
    size = None if args.height is None else (args.height, args.width)
    words = [w.strip() for w in args.words.split(",") if w.strip()]
    try:
        result = run(args.model, args.prompt, words, args.out, args.steps, size, args.seed)
    except SdpaValueError as e:
        parser.error(str(e))
    for path in result["paths"]:
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
