"""Every transformers architecture, tiny, on sdpa against eager (the harness: zoo.py).

One test per model type that transformers' auto mappings give a model class: built tiny
with random weights, run on eager and on sdpa's registered attention with the same
weights, outputs and attentions compared on valid query rows at atol 1e-4, greedy
`generate` compared for decoders (3 new tokens). A model type passes when it matches
eager, when it never calls the attention interface and zoo.NOT_ROUTED says so, or when
sdpa refuses it with the message zoo.EXPECTED_REFUSALS gives, or when it differs as
zoo.KNOWN_DIFFERENCES says (reviewed: not sdpa's to fix), or when layers outside
attention amplify float32 rounding near the tolerance and the difference stays within
zoo.AMPLIFIES's bound. Model types on
zoo.CANNOT_APPLY (reviewed, each with its reason: they cannot be built tiny or run here)
are not collected; every other outcome fails, so a new mismatch is never silent.
tests/model_zoo.py runs those too and says when one of them starts to run.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -m zoo        # the zoo alone
    HF_HUB_OFFLINE=1 .venv/bin/python tests/model_zoo.py      # the longer sweep, as JSON
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import zoo

pytestmark = [pytest.mark.zoo, pytest.mark.small_shapes]  # as users run them

NEW_TOKENS = 3


@pytest.fixture(scope="module")
def name():
    name = zoo.register()
    yield name
    zoo.unregister(name)  # other test modules get sdpa's function itself back


def test_every_architecture_is_enumerated_once():
    arch = zoo.architectures()
    assert len(arch) > 500  # transformers 5 has ~660 model types with a model class
    assert {"llama", "bert", "t5", "whisper", "vit", "clip", "gpt2"} <= arch.keys()
    runs = zoo.EXPECTED_REFUSALS.keys() | zoo.NOT_ROUTED | zoo.KNOWN_DIFFERENCES.keys()
    runs |= zoo.AMPLIFIES.keys()
    listed = zoo.CANNOT_APPLY.keys() | runs
    assert listed <= arch.keys(), f"listed but gone from transformers: {listed - arch.keys()}"
    assert not zoo.CANNOT_APPLY.keys() & runs


def test_cannot_apply_entries_give_a_reason():
    for model_type, why in zoo.CANNOT_APPLY.items():
        assert why.strip(), model_type


@pytest.mark.parametrize(
    "model_type", [t for t in zoo.architectures() if t not in zoo.CANNOT_APPLY]
)
def test_matches_eager(model_type, name):
    res = zoo.run(model_type, name, new_tokens=NEW_TOKENS)
    said = f"{model_type} ({res.cls}): {res.status}: {res.detail}"
    if res.max_diff is not None and res.status == "mismatch":
        said += f" (max abs diff {res.max_diff:.3g})"
    if model_type in zoo.EXPECTED_REFUSALS:
        assert res.status == "refused", said
        assert zoo.EXPECTED_REFUSALS[model_type] in res.detail, said
    elif model_type in zoo.NOT_ROUTED:
        assert res.status == "not routed", said
    elif model_type in zoo.AMPLIFIES:
        values_only = res.status == "match" or res.detail.endswith(" differs")
        assert res.status in ("match", "mismatch") and values_only, said
        assert res.max_diff <= zoo.AMPLIFIES[model_type][0], said
    elif model_type in zoo.KNOWN_DIFFERENCES:
        assert res.status == zoo.KNOWN_DIFFERENCES[model_type][0], said
    else:
        assert res.status == "match", said
