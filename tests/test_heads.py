"""Head fingerprints from lazy weights against TransformerLens' detect_head on eager."""

from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path

import pytest
import torch

import sdpa
from sdpa.integrations import heads

pytest.importorskip("transformer_lens")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import tl_zoo
from transformer_lens import head_detector
from transformer_lens.model_bridge import TransformerBridge

import sdpa.integrations.transformer_lens as sdpa_tl

TEXT = "the cat sat on the mat and the cat sat on the mat again and again and the dog"


@pytest.mark.parametrize("kind", heads.HEAD_NAMES)
def test_marked_pairs_are_the_detection_pattern(kind):
    """The pairs are exactly the nonzero entries of TransformerLens' detection pattern."""
    tokens = torch.randint(0, 6, (1, 40), generator=torch.Generator().manual_seed(0))
    want = getattr(head_detector, f"get_{kind}_detection_pattern")(tokens)
    q, k = heads.marked_pairs(kind, tokens[0])
    got = torch.zeros(40, 40)
    got[q, k] = 1
    assert len(set(zip(q.tolist(), k.tolist(), strict=True))) == q.numel()  # no pair twice
    assert torch.equal(got, (want != 0).float())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tl_zoo.no_installs()
    tok = tl_zoo.tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("heads_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = TransformerBridge.boot_transformers(str(path), tokenizer=tok, device="cpu")
        ours = TransformerBridge.boot_transformers(str(path), tokenizer=tok, device="cpu")
    return eager, sdpa_tl.use_sdpa(ours)


def test_detect_head_equals_transformer_lens(pair):
    """Every head name, each exclusion, both error measures (abs rounds to 1e-3)."""
    eager, ours = pair
    settings = [(False, False, "mul"), (True, True, "mul"), (True, False, "abs"),
                (False, True, "abs")]  # fmt: skip
    combos = itertools.product(heads.HEAD_NAMES, settings)
    for kind, (bos, current, measure) in combos:
        kwargs = dict(exclude_bos=bos, exclude_current_token=current, error_measure=measure)
        with torch.no_grad():
            want = head_detector.detect_head(eager, TEXT, kind, **kwargs)
            got = heads.detect_head(ours, TEXT, kind, **kwargs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=str((kind, kwargs)))
    for chosen in ([(0, 1), (1, 3)], {1: [0, 2]}):
        with torch.no_grad():
            want = head_detector.detect_head(eager, [TEXT, "a b a b c"], "induction_head", chosen)
            got = heads.detect_head(ours, [TEXT, "a b a b c"], "induction_head", chosen)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (got == -1).sum() == 8 - 2  # two heads asked for


def test_scores_beyond_the_context_length(pair):
    """detect_head asserts L < n_ctx (its dense cache); the lazy scores need no such
    bound: at L = n_ctx they equal the dense definition computed from the pattern."""
    eager, ours = pair
    L = ours.cfg.n_ctx
    tokens = torch.randint(1000, 1010, (1, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = ours.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    pattern = cache["pattern", 1]
    dense = pattern.full()[0]  # (H, L, L)
    for kind in heads.HEAD_NAMES:
        detection = getattr(head_detector, f"get_{kind}_detection_pattern")(tokens)
        want = torch.stack([
            torch.tensor(head_detector.compute_head_attention_similarity_score(
                dense[h], detection, exclude_bos=True, exclude_current_token=False,
                error_measure="mul"))
            for h in range(dense.shape[0])
        ])  # fmt: skip
        got = heads.score(pattern, tokens[0], kind, exclude_bos=True)[0]
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)
    with pytest.raises(AssertionError):  # TransformerLens' own, at this length
        head_detector.detect_head(eager, " ".join(["cat"] * L), "induction_head")
    got = heads.detect_head(ours, " ".join(["cat"] * L), "induction_head")  # ours runs
    assert got.shape == (ours.cfg.n_layers, ours.cfg.n_heads)


def test_first_token_and_span_mass():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(3))
    _, w = sdpa.attention(q, k, v, causal=True)
    p = w.full()
    torch.testing.assert_close(heads.first_token_mass(w), p[..., 0].mean(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(heads.span_mass(w, slice(3, 9)), p[..., -1, 3:9].sum(-1),
                               atol=1e-6, rtol=0)  # fmt: skip
    torch.testing.assert_close(heads.span_mass(w, [0, 5, 7], query=20),
                               p[..., 20, [0, 5, 7]].sum(-1), atol=1e-6, rtol=0)  # fmt: skip
    torch.testing.assert_close(
        heads.score(w, torch.arange(40) % 7, "induction_head"),
        torch.stack([
            (p[b] * _dense_pattern("induction_head", torch.arange(40) % 7)).sum((-1, -2)) / 40
            for b in range(2)
        ]),
        atol=1e-5, rtol=0,
    )  # fmt: skip


def _dense_pattern(kind, tokens):
    return getattr(head_detector, f"get_{kind}_detection_pattern")(tokens[None])


def test_refusals():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    _, w = sdpa.attention(q, k, v, causal=True)
    with pytest.raises(sdpa.SdpaTypeError, match="LazyPattern"):
        heads.score(w.full(), torch.arange(10), "induction_head")
    with pytest.raises(sdpa.SdpaValueError, match="kind"):
        heads.score(w, torch.arange(10), "copy_head")
    with pytest.raises(sdpa.SdpaValueError, match="tokens"):
        heads.score(w, torch.arange(9), "induction_head")
    with pytest.raises(sdpa.SdpaValueError, match="error_measure"):
        heads.score(w, torch.arange(10), "induction_head", error_measure="l2")
