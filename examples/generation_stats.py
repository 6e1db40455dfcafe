"""Attention statistics while a model generates, computed inside each attention call.

For every layer: the keys that received the most attention over the prompt and every
generated token (the H2O / kvpress "observed attention" score, averaged over the query
heads of each key/value head, then over the key/value heads), and the entropy of the
last step's attention per query head (in nats; ln S is uniform over S keys).

    python examples/generation_stats.py                     # a tiny random Llama
    python examples/generation_stats.py --model PATH --prompt "The capital of France is"
    python examples/generation_stats.py --cache static      # StaticCache, written in place

PATH is a local folder with a causal LM (and its tokenizer); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import torch
import transformers

import sdpa.integrations.transformers as sdpa_hf


def tiny_llama(name: str) -> transformers.PreTrainedModel:
    """A 4-layer Llama with random weights (4 query heads on 2 key/value heads)."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
        initializer_range=0.2,  # peaked attention (0.02 would leave it near uniform)
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=name)


def load(name: str, path: str | None, prompt: str):
    """(model, input_ids (1, L), token -> text)."""
    if path is None:
        model = tiny_llama(name)
        ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator())
        return model, ids, lambda t: f"#{t}"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=name, local_files_only=True
    )
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    return model, ids, lambda t: repr(tok.decode([t]))


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local folder with a causal LM (default: tiny random)")
    parser.add_argument("--prompt", default="The attention of a transformer is")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=5, help="keys listed per layer")
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    args = parser.parse_args(argv)

    model, ids, text = load(sdpa_hf.register(), args.model, args.prompt)
    model.eval()
    with sdpa_hf.capture(model, stats=("received", "entropy")) as cap, torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, do_sample=False,
            cache_implementation=None if args.cache == "dynamic" else args.cache,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )  # fmt: skip
    tokens = out[0].tolist()
    lines = [
        f"{ids.shape[1]} prompt tokens + {out.shape[1] - ids.shape[1]} generated, "
        f"{args.cache} cache; received: attention summed over every query of every step",
    ]
    for layer, received in sorted(cap.received.items()):
        score = received[0].mean(0)  # (S,): the mean over key/value heads
        top = score[: len(tokens)].topk(min(args.top, len(tokens)))
        keys = ", ".join(
            f"{j} {text(tokens[j])} {v:.2f}"
            for v, j in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        )
        h = cap.entropy[layer][-1][0, :, -1]  # (Hq,): the last step, per query head
        lines.append(
            f"layer {layer}: top keys {keys} | last-step entropy per head "
            f"{' '.join(f'{x:.2f}' for x in h.tolist())}"
        )
    seen = len(tokens) - 1  # the keys the last step attended to
    lines.append(f"(entropy of uniform attention over those {seen} keys: {math.log(seen):.2f})")
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
