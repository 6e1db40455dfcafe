"""Attend-and-Excite on sdpa: a Stable Diffusion run whose latent is pushed, at each of
the first steps, so that every subject word gets a strong cross-attention peak, the
gradient taken through sdpa's processors (no self-attention map materialised).

    python examples/attend_and_excite.py --model PATH --prompt "a cat and a frog" \
        --words cat,frog --out ae/ [--steps 50] [--height 512 --width 512] [--attn-res 16,16]
        [--max-refinement 20]

PATH is a local diffusers pipeline folder (with model_index.json and a UNet; nothing is
downloaded). The loop is diffusers' StableDiffusionAttendAndExcitePipeline's (its
defaults: max_iter_to_alter=25, thresholds {0: 0.05, 10: 0.5, 20: 0.8}, scale_factor=20,
attn_res=(16, 16)), with its loss from sdpa.integrations.attend_excite.AttendExcite.
Writes attend_and_excite.png: the image and each word's map at the last step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

from sdpa import plot
from sdpa.errors import SdpaValueError
from sdpa.integrations import diffusers as sdpa_diffusers
from sdpa.integrations.attend_excite import AttendExcite
from sdpa.integrations.diffusion_maps import token_indices

THRESHOLDS = {0: 0.05, 10: 0.5, 20: 0.8}  # step -> the max attention refinement aims for


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
    if getattr(pipe, "unet", None) is None or not callable(getattr(pipe, "encode_prompt", None)):
        raise SdpaValueError(
            f"--model {str(model)!r} holds a {type(pipe).__name__}, not a Stable "
            f"Diffusion-style pipeline (a UNet and encode_prompt)"
        )
    return pipe


def subject_tokens(tokenizer, prompt: str, words: list[str]) -> list[int]:
    """One token position per word (A&E excites one token per subject)."""
    tokens = []
    for word, at in zip(words, token_indices(tokenizer, prompt, words), strict=True):
        if len(at) != 1:
            raise SdpaValueError(
                f"word {word!r} is at token positions {at} of the prompt (several tokens or "
                f"occurrences); A&E excites one token per subject: pass a word that is one "
                f"token and occurs once"
            )
        tokens.append(at[0])
    return tokens


def run(
    model: str | Path,
    prompt: str,
    words: list[str],
    out: str | Path,
    steps: int = 50,
    size: tuple[int, int] | None = None,
    seed: int = 0,
    guidance: float = 7.5,
    max_iter_to_alter: int = 25,
    scale_factor: float = 20.0,
    attn_res: tuple[int, int] = (16, 16),
    max_refinement: int = 20,
    thresholds: dict[int, float] | None = None,
) -> dict:
    """Generate `prompt` with A&E guidance on `words`; write attend_and_excite.png.
    max_refinement: the refinement iterations at most (the pipeline's
    max_refinement_steps, 20); thresholds: {step: the max attention that step's
    refinement aims for} (None: the pipeline's {0: 0.05, 10: 0.5, 20: 0.8}).

    Returns {"latents": (1, C, h, w) the final latent, "image": (H, W, 3), "losses":
    the loss of each step's last A&E forward, "forwards": A&E forwards per step, "maps":
    (words, h, w) at the last step, "path"}."""
    pipe = load(model)
    sdpa_diffusers.use_sdpa(pipe.unet)
    tokens = subject_tokens(pipe.tokenizer, prompt, words)
    factor = pipe.vae_scale_factor
    height, width = size or (pipe.unet.config.sample_size * factor,) * 2
    device = pipe.unet.device
    cfg = guidance > 1.0
    cond, uncond = pipe.encode_prompt(prompt, device, 1, cfg)
    text = torch.cat([uncond, cond]) if cfg else cond  # [uncond, cond]
    pipe.scheduler.set_timesteps(steps, device=device)
    timesteps = pipe.scheduler.timesteps
    generator = torch.Generator().manual_seed(seed)
    latents = pipe.prepare_latents(
        1, pipe.unet.config.in_channels, height, width, cond.dtype, device, generator
    )  # (1, C, h, w)
    step_size = scale_factor * np.sqrt(np.linspace(1.0, 0.5, len(timesteps)))
    ae = AttendExcite(tokens, grid=attn_res)
    thresholds = THRESHOLDS if thresholds is None else thresholds

    def excite(latent: torch.Tensor, t) -> tuple[torch.Tensor, torch.Tensor]:
        """One A&E forward on the conditional prompt: (the latent requiring grad, loss)."""
        latent = latent.detach().requires_grad_(True)
        ae.reset()
        with sdpa_diffusers.capture(pipe.unet, on_call=ae):
            pipe.unet(latent, t, encoder_hidden_states=cond)
        return latent, ae.loss()[0]

    losses, forwards = [], []
    for i, t in enumerate(timesteps):
        with torch.enable_grad():
            latent, loss = excite(latents, t)
            forwards.append(1)
            if i in thresholds and loss > 1.0 - thresholds[i]:  # iterative refinement
                for _ in range(max_refinement):  # as the pipeline: step, then test the
                    reached = loss <= 1.0 - thresholds[i]  # loss from before that step
                    if loss != 0:
                        latent = ae.step(latent, step_size[i])
                    latent, loss = excite(latent, t)
                    forwards[-1] += 1
                    if reached:
                        break
            if i < max_iter_to_alter and loss != 0:
                latent = ae.step(latent, step_size[i])
            losses.append(float(loss.detach()))
            maps = ae.token_maps()[0].detach()  # (words, h, w)
        with torch.no_grad():
            x = torch.cat([latent] * 2) if cfg else latent
            x = pipe.scheduler.scale_model_input(x, t)
            noise = pipe.unet(x, t, encoder_hidden_states=text).sample
            if cfg:
                uncond_noise, cond_noise = noise.chunk(2)
                noise = uncond_noise + guidance * (cond_noise - uncond_noise)
            latents = pipe.scheduler.step(noise, t, latent.detach()).prev_sample
    with torch.no_grad():
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    image = pipe.image_processor.postprocess(image, output_type="pt")[0]
    image = image.permute(1, 2, 0).float().cpu()  # (H, W, 3) in [0, 1]
    path = plot.heat_maps(
        image, maps, words, Path(out) / "attend_and_excite.png",
        title=f"{prompt!r}: Attend-and-Excite, each word's map at the last step",
    )  # fmt: skip
    return {"latents": latents, "image": image, "losses": losses, "forwards": forwards,
            "maps": maps, "path": path}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local diffusers pipeline folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--words", required=True, help="comma-separated subject words")
    parser.add_argument("--out", required=True, type=Path, help="folder for the PNG")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attn-res", default="16,16", help="rows,cols of the layers whose maps are averaged"
    )
    parser.add_argument("--max-refinement", type=int, default=20, help="iterations at most")
    args = parser.parse_args(argv)
    if (args.height is None) != (args.width is None):
        parser.error("--height and --width go together")
    size = None if args.height is None else (args.height, args.width)
    words = [w.strip() for w in args.words.split(",") if w.strip()]
    try:
        attn_res = tuple(int(n) for n in args.attn_res.split(","))
    except ValueError:
        parser.error(f"--attn-res must be rows,cols, got {args.attn_res!r}")
    try:
        result = run(
            args.model, args.prompt, words, args.out, args.steps, size, args.seed,
            attn_res=attn_res, max_refinement=args.max_refinement,
        )  # fmt: skip
    except SdpaValueError as e:
        parser.error(str(e))
    print(result["path"])


if __name__ == "__main__":
    main(sys.argv[1:])
