"""Fixtures: a fresh, reported seed per test, and inputs of every mask kind.

Where a new test goes:
- oracle.py is the one float64 reference; tolerances.py holds every tolerance and the
  flash-attention rule (within_rule); engines.py the engines every oracle matrix runs
  (ENGINES, BACKEND_ENGINES: from the registry; run, refusal, skip_refused). A test over
  engines takes them from there, never a list of backend names: test_engines_listed.py.
- a rule of the tile rule (sdpa.tile: scale 0, rows that see no key, NaN, huge |lse|)
  on every engine: test_rules.py; precision by the rule: test_precision.py.
- outputs against the oracle: test_functional.py (backends, masks, sizes, GQA),
  test_small.py (the small backend), test_dropin.py / test_torch_contract.py (the torch
  drop-in), test_nested.py, test_empty.py, test_export.py (torch.export / compile).
- a read of the weights: test_weights.py (rows, statistics, budget, staleness),
  test_key_reads.py (key columns), test_pairs.py (pairs, diagonal); its gradient:
  test_grads.py; issue 25's reproductions on the core: test_round_three.py.
- masks: test_masks.py, test_mask_blocks.py (block occupancy held to keep); score mods:
  test_score_mods.py; inputs and refusals: test_inputs.py; settings: test_settings.py.
- the Triton kernels (interpreted here): test_triton.py; CUDA only: test_cuda.py
  (marked `cuda`, skipped without a GPU); the device script: test_gpu_check.py.
- integrations: test_transformers.py, test_captures.py, test_generation.py,
  test_model_zoo.py (`zoo`), test_kvpress.py (`kvpress`, its own venv),
  test_diffusers.py, test_diffusion_maps.py, test_prompt2prompt.py,
  test_attend_excite.py, test_transformer_lens.py, test_nnsight.py, test_edits.py,
  test_heads.py, test_viewers.py; modules: test_multihead.py, test_positional.py,
  test_spatial.py; ring attention: test_distributed.py (its schemes at 8 processes,
  marked `slow`, run only by `pytest -m slow`: test_ring_slow.py).
- the command and the viewer: test_cli.py, test_view.py, test_view_load.py,
  test_view_browser.py; docs and packaging: test_docs.py, test_docs_blocks.py,
  test_layout_map.py, test_packaging.py.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter must be chosen before triton is first imported, and test
    # modules import it at collection (torch.nn.attention.bias does): choose it here, so
    # tests/test_triton.py runs the kernels interpreted on CPU whatever the order.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two threads at most; one per worker when pytest-xdist runs the suite in several
# processes (`make test` runs one per core: more threads than cores would only queue).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))


@pytest.fixture(autouse=True)
def _engines_for_long_inputs(request):
    """Tests use small sizes to run fast, yet most must exercise the engines long inputs
    take (torch's fused kernel, the block planner, the row engine): below the small
    backend's thresholds those would never run. So the small backend and the one-product
    weights are off, unless a test (or module) is marked `small_shapes`: there they run
    at their real thresholds, as users get them."""
    if request.node.get_closest_marker("small_shapes") is not None:
        yield
        return
    import sdpa.settings

    # (a fixture runs in the test's context: the override holds for the test body)
    with sdpa.settings.override(small_weights=0, small_head=0, one_product_weights=0):
        yield


MASK_KINDS = ["none", "bool", "int", "float", "float_inf", "key_padding", "2d", "dead_rows"]


@pytest.fixture
def gen(request):
    """A torch.Generator with a fresh seed, printed on failure so it can be replayed."""
    seed = random.randrange(2**31)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def make_mask(gen, kind, B, H, L, S):
    """A mask of `kind` broadcasting to (B, H, L, S), or None."""
    keep = torch.rand(B, H, L, S, generator=gen) < 0.7
    if kind == "none":
        return None
    if kind == "bool":
        return keep
    if kind == "int":
        return keep.to(torch.int64) * torch.randint(1, 5, (B, H, L, S), generator=gen)
    if kind == "float":
        return torch.randn(B, 1, L, S, generator=gen)
    if kind == "float_inf":
        return torch.randn(B, H, L, S, generator=gen).masked_fill(~keep, float("-inf"))
    if kind == "key_padding":
        lengths = torch.randint(1, S + 1, (B,), generator=gen)
        return (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S)
    if kind == "2d":
        return keep[0, 0]
    if kind == "dead_rows":
        dead = keep.clone()
        dead[..., :: max(1, L // 3), :] = False  # every third query row sees no key
        return dead
    raise ValueError(kind)


def make_inputs(
    gen, *, B=2, Hq=3, Hkv=None, L=7, S=9, E=16, Ev=None, dtype=torch.float32, mask_kind="none"
):
    Hkv = Hq if Hkv is None else Hkv
    Ev = E if Ev is None else Ev
    q = randn(gen, B, Hq, L, E, dtype=dtype)
    k = randn(gen, B, Hkv, S, E, dtype=dtype)
    v = randn(gen, B, Hkv, S, Ev, dtype=dtype)
    return q, k, v, make_mask(gen, mask_kind, B, Hq, L, S)


def pytest_collection_modifyitems(config, items):
    if "slow" not in (config.getoption("markexpr") or ""):  # run only when -m selects them
        slow = pytest.mark.skip(reason="slow: run with pytest -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
