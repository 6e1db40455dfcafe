"""Attend-and-Excite through sdpa's processors against diffusers' own A&E path (its
deprecated StableDiffusionAttendAndExcitePipeline: AttendExciteAttnProcessor on every
layer, AttentionStore, _compute_max_attention_per_index, _compute_loss) on tiny random
UNets built from configs: the maps, the max attention, the loss and the latent's
gradient; no self-attention map made on sdpa (every tensor recorded); the refusals;
examples/attend_and_excite.py against the A&E pipeline's own latents."""

from __future__ import annotations

import copy
import functools
import inspect
import os
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from loader import load_file

pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

with warnings.catch_warnings():  # the module is deprecated, and says so on import
    warnings.simplefilter("ignore")
    from diffusers.pipelines.deprecated.stable_diffusion_attend_and_excite import (
        pipeline_stable_diffusion_attend_and_excite as ae_pipeline,
    )

import sdpa
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.integrations import diffusers as sdpa_diffusers
from sdpa.integrations.attend_excite import (
    AttendExcite,
    attend_and_excite_loss,
    max_attention,
    token_maps,
)
from sdpa.integrations.diffusers.calls import CallInfo, CallRecord

ROOT = Path(__file__).parent.parent
AEPipeline = ae_pipeline.StableDiffusionAttendAndExcitePipeline
TOKENS = [2, 5]


def tiny_unet():
    """Cross attention on the latent's grid and on half of it (down 1, mid, up 0)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=32, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=4, attention_head_dim=2,
    ).eval()  # fmt: skip


def inputs(gen, B, latent):
    """A latent and text embeddings large enough for peaked cross attention."""
    return torch.randn(B, 4, *latent, generator=gen), 4 * torch.randn(B, 77, 32, generator=gen)


class DiffusersAE:
    """diffusers' A&E path: the pipeline's register_attention_control puts its
    AttendExciteAttnProcessor on every layer of a copy of the UNet (each call's
    probabilities materialised by attn.get_attention_scores), its AttentionStore keeps
    the cross maps of the attn_res layers; the loss as its pipeline computes it."""

    def __init__(self, unet, attn_res):
        self.holder = types.SimpleNamespace(
            unet=copy.deepcopy(unet), attention_store=ae_pipeline.AttentionStore(attn_res)
        )
        AEPipeline.register_attention_control(self.holder)

    def __call__(self, latent, t, text, tokens):
        """(maps (h, w, T), max attention (n,), loss, d loss / d latent) of one latent."""
        x = latent.clone().requires_grad_(True)
        self.holder.unet(x, t, encoder_hidden_states=text)
        maps = self.holder.attention_store.aggregate_attention(("up", "down", "mid"))
        before = maps.detach().clone()  # (A&E scales its maps in place)
        per_token = AEPipeline._compute_max_attention_per_index(maps, tokens)
        loss = AEPipeline._compute_loss(per_token)
        (grad,) = torch.autograd.grad(loss, x)
        return before, torch.stack(per_token).detach(), loss.detach(), grad


def ours(unet, latent, t, text, tokens, grid):
    """The same on sdpa: our processors, a capture, AttendExcite."""
    ae = AttendExcite(tokens, grid=grid)
    x = latent.clone().requires_grad_(True)
    with sdpa_diffusers.capture(unet, on_call=ae):
        unet(x, t, encoder_hidden_states=text)
    loss = ae.loss()
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return ae, loss.detach(), grad


def close(ours_, ref, rel=1e-5):
    """Within rel of the reference's largest magnitude (float32 both)."""
    torch.testing.assert_close(ours_, ref, rtol=rel, atol=rel * float(ref.abs().max()))


CASES = {
    "16 x 16": ((32, 32), (16, 16), 1),  # A&E's default attn_res
    "8 x 12, batch 2": ((16, 24), (8, 12), 2),  # non-square: rows and columns not swapped
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_equals_diffusers_attend_and_excite(gen, case):
    """Each item's maps, max attention, loss and latent gradient equal diffusers' A&E
    path run on that item alone (as its pipeline runs one latent at a time)."""
    latent, grid, B = CASES[case]
    unet = tiny_unet()
    ref = DiffusersAE(unet, grid)
    sdpa_diffusers.use_sdpa(unet)
    x, text = inputs(gen, B, latent)
    ae, loss, grad = ours(unet, x, 10, text, TOKENS, grid)
    assert ae.calls == 4 and ae.maps.shape == (B, *grid, 77)  # down 1, mid, up 0 (2)
    for b in range(B):
        ref_maps, ref_max, ref_loss, ref_grad = ref(x[b : b + 1], 10, text[b : b + 1], TOKENS)
        torch.testing.assert_close(ae.maps[b].detach(), ref_maps, atol=1e-6, rtol=0)
        torch.testing.assert_close(ae.max_attention()[b].detach(), ref_max, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(loss[b], ref_loss, atol=1e-6, rtol=1e-5)
        assert ref_grad.abs().max() > 1e-4  # a gradient worth comparing
        close(grad[b : b + 1], ref_grad)


@pytest.mark.small_shapes
def test_gradient_equals_diffusers_small_backend(gen):
    """The same with the small backend and one-product weights at their real
    thresholds (as users get them at these sizes: the cross weights held in the graph)."""
    test_gradient_equals_diffusers_attend_and_excite(gen, "8 x 12, batch 2")


def test_loss_functions_equal_diffusers(gen):
    """max_attention and attend_and_excite_loss on given maps against the pipeline's
    static methods, values and gradients, with a token whose map saturates the softmax
    (max attention exactly 1: A&E's loss there is the int 0, and no update)."""
    maps = torch.rand(1, 6, 7, 12, generator=gen) * 0.05  # (B, h, w, T)
    maps[0, 1:4, 2:6, 3] = 0.9  # token 3 takes every pixel of the block, softmax -> 1
    for tokens in ([2, 5], [3, 4], [3]):
        mine = maps.clone().requires_grad_(True)
        theirs = maps.clone().requires_grad_(True)
        got = max_attention(mine, tokens)  # (1, n)
        want = AEPipeline._compute_max_attention_per_index(theirs.clone()[0], tokens)
        torch.testing.assert_close(got[0], torch.stack(want), atol=1e-7, rtol=1e-6)
        loss = attend_and_excite_loss(got)  # (1,)
        ref_loss = AEPipeline._compute_loss(want)
        if tokens == [3]:  # saturated: A&E returns 0 and skips the update
            assert ref_loss == 0 and not isinstance(ref_loss, torch.Tensor)
            assert float(got[0, 0].detach()) == 1.0 and float(loss.detach()) == 0.0
            loss.sum().backward()
            assert mine.grad.abs().max() == 0
            continue
        torch.testing.assert_close(loss[0], ref_loss, atol=1e-7, rtol=1e-6)
        loss.sum().backward()
        ref_loss.backward()
        assert theirs.grad.abs().max() > 0
        close(mine.grad, theirs.grad)
    smoothing = ae_pipeline.GaussianSmoothing()
    plain = torch.rand(2, 5, 4, 9, generator=gen)
    a = (plain[..., 1:-1] * 100).softmax(-1)[..., [0, 3]].permute(0, 3, 1, 2)  # tokens 1, 4
    torch.testing.assert_close(token_maps(plain, [1, 4], smooth=False), a, atol=0, rtol=0)
    padded = torch.nn.functional.pad(a.reshape(4, 1, 5, 4), (1, 1, 1, 1), mode="reflect")
    smoothed = smoothing(padded).reshape(2, 2, 5, 4)
    torch.testing.assert_close(token_maps(plain, [1, 4]), smoothed, atol=1e-7, rtol=1e-6)


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def square_maps(shapes, sizes) -> list[tuple[int, ...]]:
    return [s for s in shapes if len(s) >= 2 and s[-1] == s[-2] and s[-1] in sizes]


def test_no_self_attention_map_is_materialised(gen):
    """Every tensor made in the A&E forward, loss and backward, recorded: on sdpa none
    is a self-attention map (..., N, N) of the 32 x 32 or 16 x 16 layers, and none has
    even N^2 / 8 elements; diffusers' A&E path makes (B * H, 1024, 1024) ones."""
    unet = tiny_unet()
    ref = DiffusersAE(unet, (16, 16))
    sdpa_diffusers.use_sdpa(unet)
    x, text = inputs(gen, 1, (32, 32))
    theirs, mine = Shapes(), Shapes()
    with theirs:
        ref(x, 10, text, TOKENS)
    with mine:
        ours(unet, x, 10, text, TOKENS, (16, 16))
    assert (2, 1024, 1024) in square_maps(theirs.shapes, {1024})  # the detector sees them
    assert square_maps(mine.shapes, {1024, 256}) == []
    assert max(torch.Size(s).numel() for s in mine.shapes) < 1024**2 // 8


@pytest.mark.small_shapes
def test_no_self_attention_map_above_small_backend(gen):
    """At the real thresholds the small backend computes calls of at most 2**16 scores
    per head (a 16 x 16 layer's self attention) in one product, by design; the 32 x 32
    layers' maps are never made."""
    unet = sdpa_diffusers.use_sdpa(tiny_unet())
    x, text = inputs(gen, 1, (32, 32))
    mine = Shapes()
    with mine:
        ours(unet, x, 10, text, TOKENS, (16, 16))
    assert square_maps(mine.shapes, {1024}) == []
    assert max(torch.Size(s).numel() for s in mine.shapes) < 1024**2 // 4


def record(gen, kind="cross", grid=(16, 16), B=1, T=77, name="attn2"):
    """A CallRecord of random q, k as a processor would hand it over."""
    H, D, L = 2, 8, grid[0] * grid[1]
    q = torch.randn(B, H, L, D, generator=gen).requires_grad_(True)
    k = torch.randn(B, H, T, D, generator=gen)
    w = sdpa.attention(q, k, k).weights
    info = CallInfo(
        name=name, kind=kind, step=0, tokens=L, grid=grid, text_tokens=T, text_start=0,
        scale=None, layer=torch.nn.Identity(),
    )  # fmt: skip
    return CallRecord(info, w), q


def test_refusals(gen):
    ae = AttendExcite(TOKENS)
    with pytest.raises(SdpaValueError, match="no cross-attention call on grid"):
        ae.loss()
    with pytest.raises(NotSupportedError, match="'joint' call"):
        ae(record(gen, kind="joint")[0])
    ae(record(gen, kind="self")[0])  # self attention: not read
    ae(record(gen, grid=(8, 8))[0])  # another grid: not A&E's layers
    assert ae.calls == 0
    with pytest.raises(SdpaValueError, match="would average it as a 16 x 16 map"):
        ae(record(gen, grid=(32, 8))[0])  # 256 tokens on another grid
    rec, q = record(gen)
    ae(rec)
    with pytest.raises(SdpaValueError, match="seen twice"):
        ae(rec)
    with pytest.raises(SdpaValueError, match="batch 2"):
        ae(record(gen, B=2, name="other")[0])
    with pytest.raises(SdpaValueError, match="requiring grad"):
        ae.step(q.detach(), 1.0)
    with pytest.raises(SdpaValueError, match="does not depend on this latent"):
        ae.step(torch.zeros(3, requires_grad=True), 1.0)
    assert ae.step(q, 1.0).shape == q.shape
    with torch.no_grad():
        ae.reset()
        ae(record(gen)[0])
    with pytest.raises(SdpaValueError, match="carries no gradient"):
        ae.step(q, 1.0)
    for tokens in ([0], [76]):
        ae = AttendExcite(tokens)
        ae(record(gen)[0])
        with pytest.raises(SdpaValueError, match=r"outside 1\.\.75"):
            ae.loss()
    for tokens in ("cat", 2, [], [[2]], [True]):
        with pytest.raises(SdpaTypeError, match="tokens"):
            AttendExcite(tokens)
    for grid in ((16,), (0, 16), "16x16"):
        with pytest.raises(SdpaValueError, match="grid"):
            AttendExcite(TOKENS, grid=grid)
    with pytest.raises(SdpaTypeError, match="smooth"):
        AttendExcite(TOKENS, smooth=1)
    with pytest.raises(SdpaValueError, match="2 x 2"):
        AttendExcite(TOKENS, grid=(1, 16))
    assert AttendExcite(TOKENS, grid=(1, 16), smooth=False).grid == (1, 16)


def test_joint_model_refused():
    """A tiny SD3 transformer: its joint calls are refused by name."""
    from test_diffusers import sd3_inputs, tiny_sd3

    model = sdpa_diffusers.use_sdpa(tiny_sd3())
    ae = AttendExcite([1], grid=(6, 5))
    with (
        pytest.raises(NotSupportedError, match=r"transformer_blocks\.0\.attn\.processor"),
        sdpa_diffusers.capture(model, on_call=ae),
    ):
        model(**sd3_inputs())


# -- the example ---------------------------------------------------------------------------


def load_example():
    return load_file("examples/attend_and_excite.py")


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    from test_diffusion_maps import tiny_pipeline

    folder = tmp_path_factory.mktemp("tiny-sd")
    tiny_pipeline().save_pretrained(folder)
    return folder


def diffusers_pipeline(folder):
    """diffusers' StableDiffusionAttendAndExcitePipeline over the folder's parts."""
    from diffusers import DiffusionPipeline

    parts = DiffusionPipeline.from_pretrained(folder, local_files_only=True).components
    wanted = inspect.signature(AEPipeline.__init__).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = AEPipeline(
            **{k: v for k, v in parts.items() if k in wanted}, requires_safety_checker=False
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe


PROMPT, WORDS = "a photo of a cat on the beach", ["cat", "beach"]


def test_example_equals_pipeline(pipeline_folder, tmp_path):
    """The example's loop (refinement at step 0 until its threshold is met, updates,
    guidance) on sdpa gives the final latent of diffusers' A&E pipeline on the same
    parts, seed and settings, and that latent is not the plain pipeline's (the guidance
    moved it)."""
    example = load_example()
    # this tiny model's step-0 losses are 0.98507, 0.98502, 0.98497, 0.98493, ...: a
    # target of 0.985 stops the refinement after its third step, below the cap of 5
    settings = {"attn_res": (8, 8), "thresholds": {0: 0.015}}
    result = example.run(
        pipeline_folder, PROMPT, WORDS, tmp_path / "ae", steps=2, size=(16, 16), seed=0,
        max_refinement=5, **settings,
    )  # fmt: skip
    assert result["forwards"] == [1 + 3, 1]
    pipe = diffusers_pipeline(pipeline_folder)
    pipe._perform_iterative_refinement_step = functools.partial(
        AEPipeline._perform_iterative_refinement_step, pipe, max_refinement_steps=5
    )  # its __call__ passes none: 20
    tokens = example.subject_tokens(pipe.tokenizer, PROMPT, WORDS)
    assert tokens == [5, 8]
    run = {"height": 16, "width": 16, "num_inference_steps": 2, "output_type": "latent"}
    want = pipe(
        PROMPT, token_indices=tokens, generator=torch.Generator().manual_seed(0), **run,
        **settings,
    ).images  # fmt: skip
    close(result["latents"], want)
    plain = diffusers_pipeline(pipeline_folder)
    baseline = plain(
        PROMPT, token_indices=tokens, generator=torch.Generator().manual_seed(0),
        max_iter_to_alter=0, thresholds={}, attn_res=(8, 8), **run,
    ).images  # fmt: skip
    assert (want - baseline).abs().max() > 1e-2
    assert len(result["losses"]) == 2 and result["maps"].shape == (2, 8, 8)
    assert result["path"].stat().st_size > 5000


def test_example_command_line(pipeline_folder, tmp_path, capsys):
    example = load_example()
    example.main(
        ["--model", str(pipeline_folder), "--prompt", "a red car", "--words", "car",
         "--out", str(tmp_path), "--steps", "1", "--height", "16", "--width", "16",
         "--attn-res", "8,8", "--max-refinement", "1"]
    )  # fmt: skip
    assert str(tmp_path / "attend_and_excite.png") in capsys.readouterr().out
    for argv, message in [
        (["--model", str(tmp_path)], "not a diffusers model folder"),
        (["--model", str(pipeline_folder), "--words", "zebra"], "several tokens"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            example.main(["--prompt", "a zebra", "--words", "a", "--out", str(tmp_path), *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
