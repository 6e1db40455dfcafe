"""diffusers models on sdpa against diffusers' own processors: tiny random UNet, SD3
(MMDiT) and Flux transformers built from configs, the Attention module's options one by
one, captures, edits, and the processor zoo (covered or refused)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import os
import pkgutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
diffusers = pytest.importorskip("diffusers")

from diffusers.models import attention_processor as ap  # noqa: E402

import sdpa  # noqa: E402
import sdpa.integrations.diffusers as sd  # noqa: E402

pytestmark = pytest.mark.small_shapes  # the engines as users run them on these shapes


def tiny_unet(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24,
        attention_head_dim=4, norm_num_groups=8, **config,
    ).eval()  # fmt: skip


def tiny_sd3() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=24,
        pooled_projection_dim=16, out_channels=4, dual_attention_layers=(0,),
        qk_norm="rms_norm", pos_embed_max_size=32,
    ).eval()  # fmt: skip


def tiny_flux() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=16,
        axes_dims_rope=[4, 4, 8],
    ).eval()  # fmt: skip


def unet_inputs(mask: bool = False, h: int = 15, w: int = 13) -> dict:
    g = torch.Generator().manual_seed(1)
    kw = {
        "sample": torch.randn(2, 4, h, w, generator=g),
        "timestep": torch.tensor([10, 10]),
        "encoder_hidden_states": torch.randn(2, 7, 24, generator=g),
    }
    if mask:
        keep = torch.ones(2, 7)
        keep[1, 4:] = 0  # the second prompt has 4 tokens
        kw["encoder_attention_mask"] = keep
    return kw


def sd3_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(2, 4, 12, 10, generator=g),
        "encoder_hidden_states": torch.randn(2, 9, 24, generator=g),
        "pooled_projections": torch.randn(2, 16, generator=g),
        "timestep": torch.tensor([3, 3]),
    }


FLUX_GRID, FLUX_TEXT = (6, 5), 7


def flux_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    (h, w), T = FLUX_GRID, FLUX_TEXT
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]  # (0, row, col) per image token
    ids[..., 2] = torch.arange(w)[None]
    return {
        "hidden_states": torch.randn(2, h * w, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, T, 24, generator=g),
        "pooled_projections": torch.randn(2, 16, generator=g),
        "timestep": torch.tensor([0.5, 0.5]),
        "img_ids": ids.reshape(-1, 3),
        "txt_ids": torch.zeros(T, 3),
    }


MODELS = {"unet": (tiny_unet, unet_inputs), "sd3": (tiny_sd3, sd3_inputs),
          "flux": (tiny_flux, flux_inputs)}  # fmt: skip


def cast(kw: dict, dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in kw.items()}


def run(model, kw) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw).sample


def pair(make):
    """(diffusers' model, a copy on sdpa)."""
    ref = make()
    ours = sd.use_sdpa(copy.deepcopy(ref))
    assert {type(m.processor).__name__ for m in sd.attention_modules(ours).values()} <= {
        "SdpaAttnProcessor", "SdpaJointAttnProcessor", "SdpaFluxAttnProcessor"
    }  # fmt: skip
    return ref, ours


@pytest.mark.parametrize("mask", [False, True])
def test_unet_matches_default_processors(mask):
    ref, ours = pair(tiny_unet)
    assert {type(p).__name__ for p in ref.attn_processors.values()} == {"AttnProcessor2_0"}
    assert set(ours.attn_processors) == set(ref.attn_processors)  # names kept
    kw = unet_inputs(mask)
    want = run(ref, kw)
    torch.testing.assert_close(run(ours, kw), want, atol=1e-5, rtol=0)
    if mask:  # the mask reaches the cross-attention and changes the result
        assert (want - run(ref, unet_inputs(False))).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_transformers_match_default_processors(name):
    make, inputs = MODELS[name]
    ref, ours = pair(make)
    torch.testing.assert_close(run(ours, inputs()), run(ref, inputs()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_within_bf16_error_of_default(name):
    """bf16 error against the float64 model: at most 2x diffusers' own bf16 error."""
    make, inputs = MODELS[name]
    ref, ours = pair(make)
    kw = inputs()
    exact = run(copy.deepcopy(ref).double(), cast(kw, torch.float64))
    theirs = run(ref.to(torch.bfloat16), cast(kw, torch.bfloat16)).double()
    mine = run(ours.to(torch.bfloat16), cast(kw, torch.bfloat16)).double()
    err_theirs = (theirs - exact).abs().max().item()
    assert (mine - exact).abs().max().item() <= 2 * err_theirs + 1e-3


def tiny_vae() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        layers_per_block=1,
    ).eval()  # fmt: skip


def tiny_unet2d() -> torch.nn.Module:  # no attn_processors: found by walking its modules
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, layers_per_block=1,
        attention_head_dim=4, sample_size=8,
    ).eval()  # fmt: skip


def test_vae_and_unet2d_match_default_processors():
    """diffusers' Attention with 4-D input, group norm and residual inside real models."""
    x = torch.randn(2, 3, 12, 10, generator=torch.Generator().manual_seed(4))
    vae, ours = pair(tiny_vae)
    with torch.no_grad():
        want = vae(x, sample_posterior=False).sample
        torch.testing.assert_close(ours(x, sample_posterior=False).sample, want,
                                   atol=1e-5, rtol=0)  # fmt: skip
        seen = []
        with sd.capture(ours, on_call=seen.append):  # decode: not forward, no pre-hook
            ours.decode(torch.randn(1, 4, 6, 5))
    assert [(r.name, r.kind, r.info.grid) for r in seen] == [
        ("decoder.mid_block.attentions.0.processor", "self", (6, 5))
    ]
    unet2d, ours = pair(tiny_unet2d)
    assert sorted(sd.attention_modules(ours)) == sorted(sd.attention_modules(unet2d))
    with torch.no_grad():
        torch.testing.assert_close(ours(x, 3).sample, unet2d(x, 3).sample, atol=1e-5, rtol=0)


def attention_module(**options) -> ap.Attention:
    torch.manual_seed(0)
    options = {"heads": 4, "dim_head": 8} | options
    return ap.Attention(query_dim=32, **options).eval()


ATTENTION_CASES = {
    "group_norm_residual_rescale_4d": dict(
        norm_num_groups=8, residual_connection=True, rescale_output_factor=1.7, bias=True
    ),
    "spatial_norm_4d": dict(spatial_norm_dim=6, residual_connection=True),
    "cross_layer_norm_qk_norm": dict(
        cross_attention_dim=12, cross_attention_norm="layer_norm", qk_norm="layer_norm"
    ),
    "cross_group_norm": dict(
        cross_attention_dim=16, cross_attention_norm="group_norm", cross_attention_norm_num_groups=4
    ),
    "scale_qk_false": dict(scale_qk=False),  # diffusers' default is then AttnProcessor
    "dim_head_not_width": dict(out_dim=32, dim_head=16),  # 2 heads of 16
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("mask", [None, "float", "bool"])
def test_attention_module_options(case, mask):
    """Each option of diffusers' Attention, alone, with its default processor as oracle."""
    options = ATTENTION_CASES[case]
    ref = attention_module(**options)
    ours = copy.deepcopy(ref)
    name = "attn.processor"
    maker, kwargs = sd.COVERED[type(ref.processor).__name__]
    ours.set_processor(maker(name, sd.ModelState(), **kwargs))
    g = torch.Generator().manual_seed(2)
    four_d = "4d" in case
    x = torch.randn(2, 32, 5, 7, generator=g) if four_d else torch.randn(2, 35, 32, generator=g)
    enc = None
    if "cross_attention_dim" in options:
        enc = torch.randn(2, 6, options["cross_attention_dim"], generator=g)
    S = 35 if enc is None else 6
    kw = {"encoder_hidden_states": enc}
    if mask == "float":
        bias = torch.zeros(2, 1, S)
        bias[1, :, S // 2 :] = -10000.0  # as UNet2DConditionModel builds it
        kw["attention_mask"] = bias
    elif mask == "bool":
        kw["attention_mask"] = torch.rand(2, 35, S, generator=g) > 0.3
    if "spatial_norm_dim" in options:
        kw["temb"] = torch.randn(2, 6, 3, 4, generator=g)
    ref_kw = dict(kw)
    if mask == "bool" and isinstance(ref.processor, ap.AttnProcessor):  # takes float only
        ref_kw["attention_mask"] = torch.zeros(2, 35, S).masked_fill(~kw["attention_mask"], -1e9)
    with torch.no_grad():
        want, got = ref(x, **ref_kw), ours(x, **kw)
    assert got.shape == want.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_flux_attention_with_key_padding_mask():
    """FluxAttention with a (B, S) bool mask, reshaped as diffusers' native dispatch does."""
    flux = tiny_flux()
    attn = flux.transformer_blocks[0].attn
    ours = copy.deepcopy(attn)
    ours.set_processor(sd.SdpaFluxAttnProcessor("x", sd.ModelState()))
    g = torch.Generator().manual_seed(3)
    x, enc = torch.randn(2, 30, 32, generator=g), torch.randn(2, 7, 32, generator=g)
    keep = torch.ones(2, 37, dtype=torch.bool)
    keep[1, 3:7] = False  # padded text tokens of the second prompt
    with torch.no_grad():
        want = attn(x, enc, attention_mask=keep)
        got = ours(x, enc, attention_mask=keep)
        unmasked = attn(x, enc)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert (want[0] - unmasked[0]).abs().max() > 1e-4


def oracle_rows(q, k, mask, scale, rows) -> torch.Tensor:
    """softmax(q k^T * scale + mask) for some query rows, float64, materialised."""
    s = (q[:, :, rows].double() @ k.double().mT) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        m = mask.expand(*s.shape[:2], mask.shape[-2], s.shape[-1])
        m = m[:, :, rows] if m.shape[-2] > 1 else m
        s = s.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else s + m.double()
    return s.softmax(-1)


@pytest.mark.parametrize("name", list(MODELS))
def test_capture_records_names_kinds_grid_and_weights(name):
    make, inputs = MODELS[name]
    model = sd.use_sdpa(make())
    seen, calls = [], []

    def note(info, q, k, v, mask):  # an edit that answers nothing: sees q, k, mask
        calls.append((info, q, k, mask))

    kw = inputs(True) if name == "unet" else inputs()
    with sd.edit(model, note), sd.capture(model, on_call=seen.append) as cap:
        cap.step = 7
        run(model, kw)
    assert cap.calls == len(seen) == len(calls) == len(model.attn_processors)
    assert [r.name for r in seen] == [c[0].name for c in calls]
    assert sorted(r.name for r in seen) == sorted(model.attn_processors)
    assert cap.records == []  # keep=False
    for record, (info, q, k, mask) in zip(seen, calls, strict=True):
        assert record.step == 7 and info.step == 0  # each session's own counter
        assert record.info.layer is model.get_submodule(record.name.rsplit(".", 1)[0])
        kind = record.kind
        if name == "unet":
            assert kind == ("self" if ".attn1." in record.name else "cross")
        elif ".attn2." in record.name:  # SD3.5's dual attention: image tokens only
            assert kind == "self"
        else:
            assert kind == "joint"
        rows, cols = record.info.grid
        image = record.info.image
        assert rows * cols == image.stop - image.start
        if name != "unet":
            assert (rows, cols) == (6, 5)
        if kind == "joint":
            T = 9 if name == "sd3" else FLUX_TEXT
            assert record.info.text_tokens == T
            assert record.info.text == (slice(0, T) if name == "flux" else slice(30, 39))
        w = record.weights
        assert w.shape == (*q.shape[:-1], k.shape[-2])
        rows_ = [0, q.shape[-2] // 2, q.shape[-2] - 1]
        want = oracle_rows(q, k, mask, record.info.scale, rows_)
        got = torch.stack([w[:, :, r] for r in rows_], dim=2)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    if name == "unet":
        first = seen[0]
        assert first.info.grid == (15, 13) and first.weights.shape[-2] == 15 * 13
        deeper = [r.info.grid for r in seen if r.name.startswith("mid_block")]
        assert deeper and all(g == (8, 7) for g in deeper)  # ceil(15 / 2), ceil(13 / 2)


def test_capture_keep_step_counter_and_callback():
    model = sd.use_sdpa(tiny_unet())
    n = len(model.attn_processors)
    with sd.capture(model, keep=True) as cap:
        for i in range(2):
            run(model, unet_inputs())
            out = cap.on_step_end(None, i, torch.tensor(999), {"latents": 1})
            assert out == {"latents": 1}
    assert [r.step for r in cap.records] == [0] * n + [1] * n
    assert cap.step == 2
    assert isinstance(cap.records[0].weights, sdpa.AttentionWeights)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cap.records[0].info.step = 3


def test_capture_only_sees_its_own_model():
    a, b = sd.use_sdpa(tiny_unet()), sd.use_sdpa(tiny_unet())
    seen = []
    with sd.capture(a, on_call=seen.append):
        run(b, unet_inputs())
    assert seen == []
    with sd.capture(a, on_call=seen.append):
        run(a, unet_inputs())
    assert len(seen) == len(a.attn_processors)


def test_no_session_builds_no_call_info(monkeypatch):
    """With nothing open, a call costs one context-variable read: no CallInfo is built."""
    model = sd.use_sdpa(tiny_unet())

    def boom(*a, **k):
        raise AssertionError("CallInfo built with no session open")

    monkeypatch.setattr("sdpa.integrations.diffusers.processors.CallInfo", boom)
    run(model, unet_inputs())
    with pytest.raises(AssertionError, match="CallInfo built"), sd.capture(model):
        run(model, unet_inputs())


def test_edit_replaces_chosen_calls():
    """An edit that zeroes the values of every cross-attention equals the model whose
    attn2.to_v weights are zero, on diffusers' own processors."""
    ref = tiny_unet()
    zeroed = copy.deepcopy(ref)
    for name, module in zeroed.named_modules():
        if name.endswith("attn2"):
            torch.nn.init.zeros_(module.to_v.weight)
    model = sd.use_sdpa(copy.deepcopy(ref))
    kw = unet_inputs()

    def zero_values(info, q, k, v, mask):
        if info.kind != "cross":
            return None
        return sdpa.attention(q, k, torch.zeros_like(v), mask, scale=info.scale)

    seen = []
    with sd.capture(model, on_call=seen.append), sd.edit(model, zero_values):
        got = run(model, kw)
    torch.testing.assert_close(got, run(zeroed, kw), atol=1e-5, rtol=0)
    assert (got - run(ref, kw)).abs().max() > 1e-3
    assert len(seen) == len(model.attn_processors)  # the capture saw the edit's weights
    torch.testing.assert_close(run(model, kw), run(ref, kw), atol=1e-5, rtol=0)  # block closed


def test_edit_answers_are_checked():
    model = sd.use_sdpa(tiny_unet())
    shape = pytest.raises(sdpa.SdpaValueError, match=r"returned \(2, 4, 195\)")
    with shape, sd.edit(model, lambda info, q, k, v, m: q[..., 0]):
        run(model, unet_inputs())
    kind = pytest.raises(sdpa.SdpaTypeError, match="must return a tensor")
    with kind, sd.edit(model, lambda info, q, k, v, m: "x"):
        run(model, unet_inputs())
    bare = lambda info, q, k, v, m: sdpa.attention(q, k, v, m).output  # noqa: E731
    with sd.edit(model, bare):  # a bare tensor is fine with no capture open
        run(model, unet_inputs())
    unseen = pytest.raises(sdpa.SdpaValueError, match="capture cannot see")
    with unseen, sd.capture(model), sd.edit(model, bare):
        run(model, unet_inputs())


def processor_classes() -> dict[str, type]:
    """Every attention-processor class diffusers defines: in attention_processor and in
    each transformer and UNet module."""
    import diffusers.models.transformers as transformers_pkg
    import diffusers.models.unets as unets_pkg

    found = {}
    modules = [ap]
    for pkg in (transformers_pkg, unets_pkg):
        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                modules.append(importlib.import_module(f"{pkg.__name__}.{info.name}"))
            except Exception:  # an optional dependency missing: not a processor we meet
                continue
    for module in modules:
        for cls_name, cls in vars(module).items():
            if (inspect.isclass(cls) and cls.__module__ == module.__name__
                    and "Processor" in cls_name and callable(cls)
                    and "Attn" in cls_name):  # fmt: skip
                found[cls_name] = cls
    return found


COVERED_CLASSES = {"AttnProcessor", "AttnProcessor2_0", "JointAttnProcessor2_0",
                   "FluxAttnProcessor", "FluxAttnProcessor2_0",
                   "FluxSingleAttnProcessor2_0"}  # fmt: skip


def test_zoo_covered_and_refused():
    """The whole zoo, stated: four classes covered (and two deprecated aliases that build
    one of them), every other one refused with a reason."""
    classes = processor_classes()
    assert len(classes) > 60  # diffusers 0.42 defines ~130
    assert set(sd.COVERED) == COVERED_CLASSES <= set(classes)
    for cls_name in sorted(classes):
        fake = type(cls_name, (), {})()  # a stand-in with the class's name
        reason = sd.refusal_reason(fake)
        assert (reason is None) == (cls_name in COVERED_CLASSES), cls_name
    refused = {n: sd.refusal_reason(type(n, (), {})()) for n in classes if n not in sd.COVERED}
    assert all(refused.values())


def test_refused_processor_names_itself_and_changes_nothing():
    model = tiny_unet()
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor"
    model.set_attn_processor({n: ap.SlicedAttnProcessor(2) if n == name else p
                              for n, p in model.attn_processors.items()})  # fmt: skip
    before = dict(model.attn_processors)
    why = rf"{name}: SlicedAttnProcessor \(attention sliced"
    with pytest.raises(sdpa.NotSupportedError, match=why):
        sd.use_sdpa(model)
    assert model.attn_processors == before


def test_refusals():
    with pytest.raises(sdpa.SdpaTypeError, match="must hold diffusers attention modules"):
        sd.use_sdpa(torch.nn.Linear(2, 2))
    first = pytest.raises(sdpa.SdpaValueError, match=r"diffusers\.use_sdpa\(model\) first")
    with first, sd.capture(tiny_unet()):
        pass
    model = tiny_unet()
    before = model.attn_processors
    assert sd.use_sdpa(sd.use_sdpa(model)) is model  # twice is harmless
    assert sd.restore(model).attn_processors == before  # the same processor objects back
    sd.use_sdpa(model)
    with pytest.raises(sdpa.SdpaTypeError, match="keep must be"), sd.capture(model, keep=1):
        pass
    sd3 = sd.use_sdpa(tiny_sd3())
    kw = sd3_inputs() | {"joint_attention_kwargs": {"attention_mask": torch.ones(2, 39)}}
    with pytest.raises(sdpa.NotSupportedError, match="JointAttnProcessor2_0 ignores"):
        run(sd3, kw)
    flux = sd.use_sdpa(tiny_flux())
    from diffusers.models.attention_dispatch import attention_backend

    active = pytest.raises(sdpa.NotSupportedError, match="active diffusers attention backend")
    with active, attention_backend("_native_math"):
        run(flux, flux_inputs())
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    saved = registry._active_backend  # set_attention_backend also sets diffusers' global one
    try:
        flux.set_attention_backend("_native_math")
        with pytest.raises(sdpa.NotSupportedError, match="attention backend or parallel config"):
            run(flux, flux_inputs())
    finally:
        registry.set_active_backend(saved)
