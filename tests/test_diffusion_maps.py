"""DAAM heat maps from sdpa's lazy weights against the same maps from materialised
weights (diffusers' attn.get_attention_scores, as DAAM reads them) on tiny random
UNet2DConditionModels built from configs; memory that does not grow with steps; the
word -> token mapping; examples/diffusion_maps.py on a tiny random pipeline."""

from __future__ import annotations

import math
import os
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loader import load_file

pytest.importorskip("diffusers")
from diffusers.models.attention_processor import AttnProcessor2_0

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sdpa.errors import SdpaValueError
from sdpa.integrations import diffusers as sdpa_diffusers
from sdpa.integrations.diffusion_maps import CrossMaps, PixelMaps, token_indices

ROOT = Path(__file__).parent.parent
VOCAB_WORDS = ["cat", "dog", "photo", "of", "on", "the", "beach", "red", "car", "hat", "in"]

# -- tiny random models, built from configs (no downloads) -------------------------------


def tiny_tokenizer():
    """A CLIPTokenizer over a tiny vocabulary: single letters (a word it does not know
    becomes several tokens) and merges that make VOCAB_WORDS one token each."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    merges = []
    for word in VOCAB_WORDS:
        prev = word[0]
        for i, c in enumerate(word[1:], 1):
            piece = c + ("</w>" if i == len(word) - 1 else "")
            merges.append((prev, piece))
            prev += piece
            vocab.setdefault(prev, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def tiny_unet():
    """Cross attention at two resolutions (the latent's and half) and in the mid block."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=4, attention_head_dim=2,
    )  # fmt: skip


def tiny_pipeline():
    """A StableDiffusionPipeline of tiny random parts (VAE factor 2)."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 8), in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=16,
    )  # fmt: skip
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text, tokenizer=tok, unet=tiny_unet(),
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


# -- the reference: maps from materialised weights ----------------------------------------


class Materialising:
    """diffusers' AttnProcessor path (attn.get_attention_scores), handing each call's
    probabilities (B, H, L, S) to `seen(is_cross, probs)`."""

    def __init__(self, seen):
        self.seen = seen

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B = hidden_states.shape[0]
        is_cross = encoder_hidden_states is not None
        context = encoder_hidden_states if is_cross else hidden_states
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(context))
        value = attn.head_to_batch_dim(attn.to_v(context))
        p = attn.get_attention_scores(query, key, None)  # (B*H, L, S)
        self.seen(is_cross, p.view(B, attn.heads, *p.shape[1:]))
        out = attn.batch_to_head_dim(torch.bmm(p, value))
        return attn.to_out[1](attn.to_out[0](out))


def grid_of(L, latent):
    f = round(math.sqrt(latent[0] * latent[1] / L))
    return latent[0] // f, latent[1] // f


def resize(m, size):
    """DAAM's upsampling: bicubic to the latent's grid, clamped at 0."""
    return F.interpolate(m, size=size, mode="bicubic").clamp(min=0)


class ReferenceMaps:
    """DAAM's cross maps and pixel maps from materialised probabilities, in float64."""

    def __init__(self, groups, pixels, latent, cond):
        self.groups, self.pixels, self.latent, self.cond = groups, pixels, latent, cond
        self.cross = 0
        self.self_ = 0

    def __call__(self, is_cross, p):
        p = p[self.cond].double().mean(1)  # (B', L, S): conditional half, heads averaged
        h, w = grid_of(p.shape[1], self.latent)
        if is_cross:
            maps = torch.stack([p[..., g].mean(-1) for g in self.groups], 1)  # (B', T, L)
            self.cross = self.cross + resize(maps.view(*maps.shape[:2], h, w), self.latent)
        else:
            Hm, Wm = self.latent
            rows = [p[:, (y * h // Hm) * w + x * w // Wm] for y, x in self.pixels]
            maps = torch.stack(rows, 1)  # (B', P, L)
            self.self_ = self.self_ + resize(maps.view(*maps.shape[:2], h, w), self.latent)


GROUPS = [[2], [3, 4], [0], [76]]  # a token, a word of two tokens, the start, padding
PIXELS = [(0, 0), (5, 7), (7, 11), (3, 2)]


def run_unet(unet, steps, gen, B=4, latent=(8, 12)):
    inputs = [
        (torch.randn(B, 4, *latent, generator=gen), torch.randn(B, 77, 32, generator=gen))
        for _ in range(steps)
    ]
    return inputs


@pytest.mark.parametrize("latent", [(8, 12), (6, 6)])
def test_maps_equal_materialised(gen, latent):
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    steps = run_unet(unet, 2, gen, latent=latent)
    pixels = [(y % latent[0], x % latent[1]) for y, x in PIXELS]
    ref = ReferenceMaps(GROUPS, pixels, latent, slice(2, 4))
    unet.set_attn_processor(Materialising(ref))
    with torch.no_grad():
        for t, (sample, text) in enumerate(steps):
            unet(sample, 10 * t, text)
    unet.set_attn_processor(AttnProcessor2_0())
    sdpa_diffusers.use_sdpa(unet)
    cross = CrossMaps(GROUPS, batch="cond")  # size: the first call's grid, the latent's
    pix = PixelMaps(pixels, size=latent, batch="cond")
    with torch.no_grad(), sdpa_diffusers.capture(unet, on_call=lambda r: (cross(r), pix(r))) as c:
        for t, (sample, text) in enumerate(steps):
            c.step = t
            unet(sample, 10 * t, text)
    assert cross.size == latent and cross.maps.shape == (2, len(GROUPS), *latent)
    assert cross.calls == 2 * 7  # 7 cross-attention layers per step
    torch.testing.assert_close(cross.maps.double(), ref.cross, atol=1e-6, rtol=0)
    torch.testing.assert_close(pix.maps.double(), ref.self_, atol=1e-6, rtol=0)
    assert cross.maps.amax() > 1e-2 and pix.maps.amax() > 1e-2


@pytest.mark.small_shapes
def test_maps_equal_materialised_small_backend(gen):
    """The same with the small backend and one-product weights on (as users get them at
    these sizes): the columns come from the weights that backend keeps."""
    test_maps_equal_materialised(gen, (8, 12))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_joint_maps_equal_float64_oracle(gen, family):
    """MMDiT (SD3: image tokens, then text) and Flux (text, then image; single-stream
    blocks too): the image rows x text columns of each joint call, against maps from
    softmax(q k^T) in float64, computed from the q and k an edit hook sees."""
    from test_diffusers import flux_inputs, sd3_inputs, tiny_flux, tiny_sd3

    model, kw, n_text = (
        (tiny_sd3(), sd3_inputs(), 9) if family == "sd3" else (tiny_flux(), flux_inputs(), 7)
    )
    sdpa_diffusers.use_sdpa(model)
    grid, tokens, pixels = (6, 5), [[1], [2, 3], [n_text - 1]], [(0, 0), (3, 4), (5, 1)]
    n_img = grid[0] * grid[1]
    text = slice(n_img, n_img + n_text) if family == "sd3" else slice(0, n_text)
    image = slice(0, n_img) if family == "sd3" else slice(n_text, n_text + n_img)
    want = {"cross": 0, "pixels": 0, "calls": 0, "self": 0}

    def oracle(info, q, k, v, mask):
        scale = q.shape[-1] ** -0.5 if info.scale is None else info.scale
        p = (q.double() @ k.double().mT * scale).softmax(-1)[1:].mean(1)  # (1, N, N)
        if info.kind == "self":  # SD3's second attention of a dual-attention block
            assert q.shape[-2] == n_img and family == "sd3"
            rows = torch.stack([p[:, y * grid[1] + x] for y, x in pixels], 1)
            want["pixels"] = want["pixels"] + rows.view(1, 3, *grid)
            want["self"] += 1
            return
        assert info.kind == "joint" and q.shape[-2] == n_img + n_text
        keys = p[:, image][:, :, text]  # (1, h*w, T)
        maps = torch.stack([keys[..., g].mean(-1) for g in tokens], 1)  # (1, 3, h*w)
        want["cross"] = want["cross"] + maps.view(1, 3, *grid)
        rows = torch.stack([p[:, image.start + y * grid[1] + x, image] for y, x in pixels], 1)
        want["pixels"] = want["pixels"] + rows.view(1, 3, *grid)
        want["calls"] += 1

    cross = CrossMaps(tokens, batch="cond")
    pix = PixelMaps(pixels, batch="cond")
    with (
        torch.no_grad(),
        sdpa_diffusers.edit(model, oracle),
        sdpa_diffusers.capture(model, on_call=lambda r: (cross(r), pix(r))),
    ):
        model(**kw)
    joint = 2 if family == "sd3" else 3  # SD3: 2 blocks; Flux: 1 double + 2 single-stream
    assert want["calls"] == joint and cross.calls == joint and cross.size == grid
    assert pix.calls == joint + want["self"] and want["self"] == (family == "sd3")
    torch.testing.assert_close(cross.maps.double(), want["cross"], atol=1e-6, rtol=0)
    torch.testing.assert_close(pix.maps.double(), want["pixels"], atol=1e-6, rtol=0)


def test_batch_selection_and_filters(gen):
    torch.manual_seed(0)
    unet = sdpa_diffusers.use_sdpa(tiny_unet().eval())
    ((sample, text),) = run_unet(unet, 1, gen)
    everyone = CrossMaps([1, 2], size=(8, 12))
    second = CrossMaps([1, 2], size=(8, 12), batch=1)
    coarse = CrossMaps([1, 2], size=(8, 12), where=lambda info: info.grid == (4, 6))
    with (
        torch.no_grad(),
        sdpa_diffusers.capture(unet, on_call=lambda r: (everyone(r), second(r), coarse(r))),
    ):
        unet(sample, 10, text)
    assert everyone.maps.shape == (4, 2, 8, 12)
    torch.testing.assert_close(second.maps, everyone.maps[1:2], atol=0, rtol=0)
    assert coarse.calls == 4  # down 1, mid, up 0 (2): the 4 x 6 layers
    assert (coarse.maps < everyone.maps + 1e-6).all()


def test_memory_does_not_grow_with_steps(gen):
    """The sums are added in place: the same storage after 1 and 5 steps, and no lazy
    weights (each pins a call's q and k) outlive the calls."""
    torch.manual_seed(0)
    unet = sdpa_diffusers.use_sdpa(tiny_unet().eval())
    cross = CrossMaps([1, 2, 3], batch="cond")
    pix = PixelMaps([(1, 1)], batch="cond")
    pinned = []  # weak references to each call's query: lazy weights would pin it

    def on_call(record):
        cross(record)
        pix(record)
        pinned.append(weakref.ref(record.weights._inputs.query))

    with torch.no_grad(), sdpa_diffusers.capture(unet, on_call=on_call) as c:
        for t, (sample, text) in enumerate(run_unet(unet, 5, gen)):
            c.step = t
            unet(sample, 10 * t, text)
            if t == 0:
                first = (cross.maps.data_ptr(), pix.maps.data_ptr(), cross.maps.nbytes)
            assert all(r() is None for r in pinned), "a call's q outlived the call"
    assert (cross.maps.data_ptr(), pix.maps.data_ptr(), cross.maps.nbytes) == first
    assert cross.calls == 5 * 7 and pix.calls == 5 * 7 and len(pinned) == 5 * 14


def test_refusals(gen):
    torch.manual_seed(0)
    unet = sdpa_diffusers.use_sdpa(tiny_unet().eval())
    ((sample, text),) = run_unet(unet, 1, gen, B=3)
    small = CrossMaps([1], size=(4, 4))
    with (
        pytest.raises(SdpaValueError, match="finer than the maps' size"),
        torch.no_grad(),
        sdpa_diffusers.capture(unet, on_call=small),
    ):
        unet(sample, 10, text)
    odd = CrossMaps([1], batch="cond")
    with (
        pytest.raises(SdpaValueError, match="odd"),
        torch.no_grad(),
        sdpa_diffusers.capture(unet, on_call=odd),
    ):
        unet(sample, 10, text)
    with pytest.raises(SdpaValueError, match="mode"):
        CrossMaps([1], mode="area")
    with pytest.raises(SdpaValueError, match="outside"):
        far = PixelMaps([(9, 0)], size=(8, 12))
        with torch.no_grad(), sdpa_diffusers.capture(unet, on_call=far):
            unet(sample, 10, text)


def test_token_indices():
    tok = tiny_tokenizer()
    zebra = tok("zebra", add_special_tokens=False).input_ids
    assert len(zebra) > 1
    prompt = "a photo of a Cat and a zebra on the beach with a cat"
    ids = tok(prompt).input_ids
    found = token_indices(tok, prompt, ["cat", "zebra", "beach"])
    cat = tok("cat", add_special_tokens=False).input_ids[0]
    assert found[0] == [i for i, t in enumerate(ids) if t == cat] and len(found[0]) == 2
    assert [ids[i] for i in found[1]] == zebra and found[1] == list(
        range(found[1][0], found[1][0] + len(zebra))
    )
    assert tok.convert_ids_to_tokens([ids[found[2][0]]]) == ["beach</w>"]
    with pytest.raises(SdpaValueError, match="'horse'"):
        token_indices(tok, prompt, ["horse"])


def test_heat_maps_picture(tmp_path):
    from sdpa import plot

    path = plot.heat_maps(
        torch.rand(16, 24, 3), torch.rand(2, 4, 6), ["a", "b"], tmp_path / "m.png"
    )
    assert path.stat().st_size > 5000
    with pytest.raises(SdpaValueError, match="2 labels"):
        plot.heat_maps(torch.rand(16, 24, 3), torch.rand(3, 4, 6), ["a", "b"], tmp_path / "x.png")


# -- the example ---------------------------------------------------------------------------


def load_example():
    return load_file("examples/diffusion_maps.py")


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd")
    tiny_pipeline().save_pretrained(folder)
    return folder


def test_example_writes_maps(pipeline_folder, tmp_path):
    example = load_example()
    out = tmp_path / "maps"
    result = example.run(
        pipeline_folder, "a photo of a cat on the beach", ["cat", "beach"], out, steps=3,
        size=(16, 24), seed=0,
    )  # fmt: skip
    assert result["cross"].shape == (2, 8, 12) and result["cross"].amax() > 0
    assert result["pixels"].shape[-2:] == (8, 12)
    for name in ("words.png", "pixels.png"):
        assert (out / name).stat().st_size > 5000
    with pytest.raises(SdpaValueError, match="not a diffusers model folder"):
        example.run(tmp_path, "a cat", ["cat"], out, steps=1)


def test_example_command_line(pipeline_folder, tmp_path, capsys):
    """main() as the script runs it: arguments in, PNG paths out; a folder that is not a
    diffusers model is a usage error (exit 2) naming it."""
    example = load_example()
    example.main(
        ["--model", str(pipeline_folder), "--prompt", "a red car", "--words", "red,car",
         "--out", str(tmp_path), "--steps", "2", "--height", "16", "--width", "16"]
    )  # fmt: skip
    assert str(tmp_path / "words.png") in capsys.readouterr().out
    assert (tmp_path / "words.png").stat().st_size > 5000
    with pytest.raises(SystemExit) as exit_:
        example.main(["--model", str(tmp_path), "--prompt", "a", "--words", "a", "--out", "x"])
    assert exit_.value.code == 2
    assert "not a diffusers model folder" in capsys.readouterr().err
