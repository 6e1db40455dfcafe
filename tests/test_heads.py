"""Head fingerprints from lazy weights against TransformerLens' detect_head on eager."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import sdpa
from sdpa.integrations import heads

pytest.importorskip("transformer_lens")

from transformer_lens import head_detector
from transformer_lens.model_bridge import TransformerBridge

import sdpa.integrations.transformer_lens as sdpa_tl
import tl_zoo

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


def _dense_score(p, D, bos, current, measure, marked_only):
    """A head's score from its dense pattern p (L, L) and detection pattern D (L, L):
    TransformerLens' definitions, with the sums over every query (detect_head) or over
    the queries D marks a key for once the exclusions are made (marked_only)."""
    L = p.shape[-1]
    p, kept = p.clone(), torch.ones(L, L, dtype=torch.bool)
    if bos:
        kept[:, 0] = False
    if current:
        kept.fill_diagonal_(False)
    p, D = p * kept, D * kept
    rows = D.sum(-1) > 0 if marked_only else torch.ones(L, dtype=torch.bool)  # after both
    if measure == "mul":
        return (p * D)[rows].sum() / p[rows].sum()
    return 1 - torch.round(((p - D).abs() * kept)[rows].sum() / rows.sum(), decimals=3)


@pytest.mark.parametrize("measure", heads.MEASURES)
@pytest.mark.parametrize(
    "bos,current", [(False, False), (True, False), (False, True), (True, True)]
)
def test_both_normalisations_equal_their_dense_definitions(measure, bos, current):
    n = 15
    g = torch.Generator().manual_seed(0)
    half = torch.randperm(50, generator=g)[:n] + 10  # distinct: the second copy is marked
    tokens = torch.stack([
        torch.cat([torch.tensor([1]), half, half]),  # [BOS, x, x]
        torch.randint(0, 6, (2 * n + 1,), generator=g),  # repeats anywhere
    ])  # fmt: skip
    q, k, v = (torch.randn(2, 3, 2 * n + 1, 8, generator=g, dtype=torch.float64) for _ in "qkv")
    _, w = sdpa.attention(q * 3, k, v, causal=True)  # peaked rows
    p = w.full()
    for kind in heads.HEAD_NAMES:
        for normalize in heads.NORMALIZATIONS:
            got = heads.score(w, tokens, kind, exclude_bos=bos, exclude_current_token=current,
                              error_measure=measure, normalize=normalize)  # fmt: skip
            want = torch.stack([
                torch.stack([
                    _dense_score(p[b, h], _dense_pattern(kind, tokens[b]).double(), bos, current,
                                 measure, normalize == "marked_queries")
                    for h in range(3)
                ]) for b in range(2)
            ])  # fmt: skip
            torch.testing.assert_close(
                got, want.float(), atol=1e-5, rtol=0, msg=str((kind, normalize))
            )


def test_the_textbook_induction_score_is_the_mean_over_the_second_copy():
    """On [BOS, x, x] the induction pairs are the stripe (i, i - n + 1) of the second
    copy: "marked_queries" is its mean, "detect_head" its sum over all 2n + 1 rows."""
    n = 12
    g = torch.Generator().manual_seed(1)
    half = torch.randperm(40, generator=g)[:n] + 5
    tokens = torch.cat([torch.tensor([1]), half, half])
    q, k, v = (torch.randn(1, 2, 2 * n + 1, 8, generator=g) for _ in "qkv")
    _, w = sdpa.attention(q, k, v, causal=True)
    stripe = w.full().diagonal(-(n - 1), dim1=-2, dim2=-1)[..., 2:]  # (1, 2, n): i = n+1..2n
    textbook = heads.score(w, tokens, "induction_head", normalize="marked_queries")
    torch.testing.assert_close(textbook, stripe.mean(-1), atol=1e-6, rtol=0)
    default = heads.score(w, tokens, "induction_head")
    torch.testing.assert_close(default, stripe.sum(-1) / (2 * n + 1), atol=1e-6, rtol=0)
    distinct = torch.arange(2 * n + 1)  # nothing repeats: no query to average over
    assert heads.score(w, distinct, "induction_head", normalize="marked_queries").isnan().all()
    assert (heads.score(w, distinct, "induction_head") == 0).all()


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
    with pytest.raises(sdpa.SdpaValueError, match=r"normalize must be one of .*'textbook'"):
        heads.score(w, torch.arange(10), "induction_head", normalize="textbook")
