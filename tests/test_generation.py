"""Generation on sdpa against transformers' eager attention: greedy tokens with Dynamic,
Static and sliding-window caches, statistics computed during generation, torch.compile."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")

import sdpa  # noqa: E402
import sdpa.integrations.transformers as sdpa_hf  # noqa: E402

pytestmark = pytest.mark.small_shapes  # the engines as users run them on these shapes

NEW = 5  # new tokens: one prefill and NEW - 1 decode steps
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def name():
    return sdpa_hf.register()


def pair(name, config_class=transformers.LlamaConfig, model_class=None, **extra):
    """(ours, eager): one tiny random causal LM with the same weights on both."""
    model_class = model_class or transformers.LlamaForCausalLM
    torch.manual_seed(0)
    ours = model_class._from_config(config_class(**TINY, **extra), attn_implementation=name)
    eager = model_class._from_config(config_class(**TINY, **extra), attn_implementation="eager")
    eager.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == name  # each its own config
    return ours.eval(), eager.eval()


@pytest.fixture(scope="module")
def llama(name):
    return pair(name)


@pytest.fixture(scope="module")
def mistral(name):  # every layer a sliding window of 4 keys: the caches drop keys
    return pair(name, transformers.MistralConfig, transformers.MistralForCausalLM,
                sliding_window=4)  # fmt: skip


def prompt(padded: bool) -> dict:
    """B = 1, or B = 2 with the second row left-padded by 3 (pad id 0), built by hand."""
    g = torch.Generator().manual_seed(1)
    if not padded:
        return {"input_ids": torch.randint(3, 128, (1, 7), generator=g)}
    ids = torch.randint(3, 128, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, inputs, cache, **kwargs):
    return model.generate(
        **inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
        cache_implementation=cache, **kwargs,
    )  # fmt: skip


CASES = [(c, p) for c in ("dynamic", "static") for p in (False, True)]
IDS = [f"{c}-{'padded' if p else 'B1'}" for c, p in CASES]


@pytest.mark.parametrize("cache,padded", CASES, ids=IDS)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_tokens_equal_eager(family, cache, padded, request):
    ours, eager = request.getfixturevalue(family)
    inputs = prompt(padded)
    with sdpa_hf.capture(ours) as cap, torch.no_grad():
        a = generate(ours, inputs, None if cache == "dynamic" else cache)
    with torch.no_grad():
        b = generate(eager, inputs, None if cache == "dynamic" else cache)
    assert len(cap.weights) == 3 * NEW  # every attention call ran on sdpa
    assert a.shape == (inputs["input_ids"].shape[0], 7 + NEW)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def eager_stats(eager, inputs, cache, sliding=False):
    """received, entropy and last_row per layer from eager's attentions over the steps
    of generate, reduced as capture documents: query rows of padding left out (eager
    gives them uniform weights over every key), the query heads of each key/value head
    averaged, and for a sliding-window cache key j of a call placed at token
    position end - S + j."""
    with torch.no_grad():
        out = generate(eager, inputs, cache, output_attentions=True, return_dict_in_generate=True)
    mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
    received, entropy, last_row = {}, {}, {}
    end = 0
    for step in out.attentions:  # one tuple of (B, Hq, L, S) per layer per forward
        for layer, att in enumerate(step):
            B, Hq, L, S = att.shape
            rows = mask.bool()[:, None, :, None] if L > 1 else torch.ones(B, 1, 1, 1, dtype=bool)
            got = att.masked_fill(~rows, 0).sum(2)  # (B, Hq, S)
            got = got.reshape(B, 2, Hq // 2, S).mean(2)  # (B, Hkv, S)
            start = max(0, end + L - S) if sliding else 0
            total = received.setdefault(layer, torch.zeros(B, 2, 0))
            total = torch.nn.functional.pad(total, (0, max(0, start + S - total.shape[-1])))
            total[..., start : start + S] += got
            received[layer] = total
            entropy.setdefault(layer, []).append(torch.special.entr(att).sum(-1))  # (B, Hq, L)
            last_row.setdefault(layer, []).append(att[:, :, -1])  # (B, Hq, S)
        end += step[0].shape[2]
    return out.sequences, received, entropy, last_row, mask


STAT_CASES = [
    *(pytest.param("llama", c, p, id=f"llama-{i}") for (c, p), i in zip(CASES, IDS, strict=True)),
    *(pytest.param("mistral", c, True, id=f"mistral-{c}-padded") for c in ("dynamic", "static")),
]


@pytest.mark.parametrize("family,cache,padded", STAT_CASES)
def test_statistics_during_generation_equal_eager(family, cache, padded, request):
    """received accumulated over prefill and every decode step, entropy and last row
    per step, all computed inside the calls (a StaticCache writes keys in place)."""
    ours, eager = request.getfixturevalue(family)
    cache = None if cache == "dynamic" else cache
    inputs = prompt(padded)
    sliding = family == "mistral"
    tokens, received, entropy, last_row, mask = eager_stats(eager, inputs, cache, sliding)
    with sdpa_hf.capture(ours, stats=("received", "entropy", "last_row")) as cap, torch.no_grad():
        ours_tokens = generate(ours, inputs, cache)
    torch.testing.assert_close(ours_tokens, tokens, rtol=0, atol=0)
    assert cap.weights == [] and sorted(cap.received) == [0, 1, 2]
    B = mask.shape[0]
    for layer in range(3):
        got = cap.received[layer]
        assert got.dtype == torch.float32 and got.shape == received[layer].shape
        assert got.shape[:2] == (B, 2)
        torch.testing.assert_close(got, received[layer], atol=1e-5, rtol=0)
        assert len(cap.entropy[layer]) == len(cap.last_row[layer]) == NEW
        for step, (h, ref) in enumerate(zip(cap.entropy[layer], entropy[layer], strict=True)):
            rows = (
                mask.bool()[:, None, :].expand_as(ref) if step == 0 else torch.ones_like(ref).bool()
            )
            assert h.shape == ref.shape
            torch.testing.assert_close(h[rows], ref[rows], atol=1e-5, rtol=0)
            assert (h[~rows] == 0).all()  # padded queries see no key: entropy 0
        for row, ref in zip(cap.last_row[layer], last_row[layer], strict=True):
            torch.testing.assert_close(row, ref, atol=1e-5, rtol=0)
    if cache is None and family == "llama":  # a DynamicCache grows: one key per step
        assert cap.received[0].shape[-1] == 7 + NEW - 1
    # every valid query row gave weight 1 in total, per key/value head
    rows = int(mask.sum()) + B * (NEW - 1)
    torch.testing.assert_close(cap.received[0].sum((0, 2)), torch.full((2,), float(rows)))


def test_received_sums_two_generate_calls_position_by_position(mistral):
    """A second generate in the same block starts again at token 0, also for the
    sliding-window cache, whose keys are placed by token position."""
    ours, eager = mistral
    inputs = prompt(padded=False)
    _, received, _, _, _ = eager_stats(eager, inputs, None, sliding=True)
    with sdpa_hf.capture(ours, stats="received") as cap, torch.no_grad():
        generate(ours, inputs, None)
        generate(ours, inputs, None)
    for layer in range(3):
        torch.testing.assert_close(cap.received[layer], 2 * received[layer], atol=2e-5, rtol=0)


def test_on_call_gets_every_layer_once_per_forward_with_fresh_weights(llama):
    """on_call runs inside each call, before the next: the weights it receives still
    answer with a StaticCache, and equal eager's attentions of that layer and step."""
    ours, eager = llama
    inputs = prompt(padded=True)
    with torch.no_grad():
        ref = generate(eager, inputs, "static", output_attentions=True,
                       return_dict_in_generate=True).attentions  # fmt: skip
    seen = []

    def on_call(layer, w):
        seen.append((layer, w.full()))

    with sdpa_hf.capture(ours, on_call=on_call) as cap, torch.no_grad():
        generate(ours, inputs, "static")
    assert [layer for layer, _ in seen] == [0, 1, 2] * NEW
    assert cap.weights == [] and cap.received == {}  # keep defaults to False with on_call
    rows = inputs["attention_mask"].bool()[:, None, :, None]
    for i, (layer, full) in enumerate(seen):
        att = ref[i // 3][layer]  # (B, Hq, L, S)
        valid = rows.expand_as(att) if i < 3 else torch.ones_like(att).bool()
        torch.testing.assert_close(full[valid], att[valid], atol=1e-5, rtol=0)


def test_kept_handles_go_stale_with_a_static_cache(llama):
    """Why statistics are computed inside the call: a StaticCache writes its keys in
    place, and a kept handle then refuses to answer for other inputs."""
    ours, _ = llama
    with sdpa_hf.capture(ours, stats="entropy", keep=True) as cap, torch.no_grad():
        generate(ours, prompt(padded=False), "static")
    assert len(cap.weights) == 3 * NEW and len(cap.entropy[0]) == NEW
    with pytest.raises(sdpa.StaleWeightsError, match="key"):
        cap.weights[0].full()


class Attn(torch.nn.Module):
    """An attention module without layer_idx, or with the given one."""

    def __init__(self, layer_idx=None):
        super().__init__()
        if layer_idx is not None:
            self.layer_idx = layer_idx


def call(module, L=3, S=3):
    q, k = torch.randn(1, 4, L, 8), torch.randn(1, 2, S, 8)
    return sdpa_hf.attention_forward(module, q, k, k, None, scaling=0.5, is_causal=False)


def test_layer_is_the_call_position_for_modules_without_layer_idx(llama):
    ours, _ = llama  # the model on sdpa; the calls below are made by hand, on a and b
    a, b = Attn(), Attn()
    layers = []
    held = torch.nn.ModuleList([ours, a, b])  # a capture records its own modules' calls
    with sdpa_hf.capture(held, stats="received", on_call=lambda n, w: layers.append(n)) as cap:
        for _ in range(2):  # two forward passes
            call(a), call(b)
    assert layers == [0, 1, 0, 1]
    assert cap.received[0].shape == (1, 2, 3)
    torch.testing.assert_close(cap.received[0].sum(), torch.tensor(2 * 3 * 2.0))


def test_statistics_refuse_two_modules_with_one_layer_index(llama):
    ours, _ = llama
    a, b = Attn(0), Attn(0)
    with pytest.raises(sdpa.SdpaValueError, match="two attention modules claim layer 0"), \
            sdpa_hf.capture(torch.nn.ModuleList([ours, a, b]), stats="entropy"):  # fmt: skip
        call(a), call(b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stats": ("received", "attention")},
         r"stats must name statistics from \('received', 'entropy', 'last_row', 'max_logits'\), "
         r"got unknown \['attention'\]"),
        ({"stats": "recieved"}, r"got unknown \['recieved'\]"),
        ({"on_call": 3}, r"on_call must be a callable taking \(layer, weights\), got 3"),
        ({"keep": "yes"}, r"keep must be True, False or None, got 'yes'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name(llama, kwargs, match):
    ours, _ = llama
    with pytest.raises(sdpa.SdpaValueError, match=match), sdpa_hf.capture(ours, **kwargs):
        pass


# --- torch.compile, as transformers recommends for fast generation: a static cache and
# the decoding forward compiled. Dynamo's "aot_eager" backend traces and functionalises
# as inductor's front end does, without inductor's C++ build (15-25 s here on 2 cores;
# inductor gave the same tokens with fullgraph=True).


def compile_config(fullgraph):
    config = transformers.CompileConfig(backend="aot_eager", fullgraph=fullgraph, mode=None)
    config._compile_all_devices = True  # generate compiles on CUDA only, unless told
    return config


@pytest.fixture
def compiled(name):
    torch._dynamo.reset()
    yield pair(name)
    torch._dynamo.reset()


def test_decode_step_traces_without_graph_breaks(compiled):
    """A decode step of the whole model (static cache, left-padded batch) is one graph:
    no break in our attention function, nor anywhere else."""
    ours, _ = compiled
    inputs = prompt(padded=True)
    cache = transformers.StaticCache(config=ours.config, max_cache_len=16)
    with torch.no_grad():  # prefill, eagerly, as generate runs it
        logits = ours(**inputs, cache=cache).logits
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
        step = dict(input_ids=logits[:, -1:].argmax(-1), attention_mask=mask,
                    position_ids=mask.sum(1, keepdim=True) - 1, cache=cache)  # fmt: skip
        explained = torch._dynamo.explain(ours)(**step)
    reasons = [f"{b.reason.splitlines()[0]} at {b.user_stack[-1]}" for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


def test_compiled_generate_gives_eager_tokens(compiled):
    """generate(cache_implementation="static", compile_config=...) with fullgraph=True:
    any graph break would raise; the tokens are eager's."""
    ours, eager = compiled
    for padded in (False, True):
        inputs = prompt(padded)
        with torch.no_grad():
            got = generate(ours, inputs, "static", compile_config=compile_config(True))
            want = generate(eager, inputs, "static")
        assert hasattr(ours, "_compiled_call")  # generate compiled the decoding forward
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_capture_under_compile_sees_every_call(compiled):
    """Inside a capture block the compiled forward runs each attention call outside the
    graph, so the statistics are those of eager."""
    ours, eager = compiled
    inputs = prompt(padded=True)
    tokens, received, entropy, _, _ = eager_stats(eager, inputs, "static")
    with sdpa_hf.capture(ours, stats=("received", "entropy")) as cap, torch.no_grad():
        got = generate(ours, inputs, "static", compile_config=compile_config(False))
    assert hasattr(ours, "_compiled_call")
    torch.testing.assert_close(got, tokens, rtol=0, atol=0)
    for layer in range(3):
        torch.testing.assert_close(cap.received[layer], received[layer], atol=1e-5, rtol=0)
        assert len(cap.entropy[layer]) == NEW
        for h, ref in zip(cap.entropy[layer][1:], entropy[layer][1:], strict=True):
            torch.testing.assert_close(h, ref, atol=1e-5, rtol=0)  # decode steps


def test_example_prints_top_keys_and_entropy_per_layer():
    from loader import load_file

    example = load_file("examples/generation_stats.py")
    lines = example.main(["--new-tokens", "3", "--top", "2", "--cache", "static"])
    assert lines[0].startswith("12 prompt tokens + 3 generated, static cache")
    assert [line.split(":")[0] for line in lines[1:5]] == [f"layer {i}" for i in range(4)]
    assert all("top keys" in line and "entropy per head" in line for line in lines[1:5])
