"""sdpa.integrations.transformers.capture belongs to its model: it records the calls of the
model (or sub-model) it was given and no other, captures nest, worker threads started in
the block are recorded, and a compiled model it does not hold keeps its graphs. Tiny
random Llamas built from their configs (nothing is downloaded)."""

from __future__ import annotations

import contextvars
import copy
import io
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")

import sdpa  # noqa: E402
import sdpa.integrations.transformers as sdpa_hf  # noqa: E402
from sdpa.integrations.transformers import capture  # noqa: E402

pytestmark = pytest.mark.small_shapes  # the engines as users run them on these shapes

LAYERS = 2
TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    initializer_range=0.3,  # weights wide enough that attention is far from uniform
)  # fmt: skip


@pytest.fixture(scope="module")
def name():
    return sdpa_hf.register()


def causal_lm(name, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**TINY)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=name).eval()


@pytest.fixture(scope="module")
def lms(name):
    """Two models of one architecture, different weights: their attentions differ."""
    return causal_lm(name, 0), causal_lm(name, 1)


def ids(L, B=1, seed=0):
    return torch.randint(3, 64, (B, L), generator=torch.Generator().manual_seed(seed))


def attentions(model, x):
    """The model's own dense attentions for x outside any capture: (B, Hq, L, L) per layer."""
    with torch.no_grad():
        return model(input_ids=x, output_attentions=True).attentions


def run(model, x):
    with torch.no_grad():  # grad mode is per thread: a worker starts with grad on
        return model(input_ids=x, use_cache=False).logits


def assert_same(got, want):
    assert len(got) == len(want)
    for w, ref in zip(got, want, strict=True):
        torch.testing.assert_close(w.full(), ref, atol=1e-6, rtol=0)


def test_the_two_models_attend_differently(lms):
    """What the tests below tell apart: a call of one model from a call of the other."""
    a, b = lms
    x = ids(5)
    assert (attentions(a, x)[0] - attentions(b, x)[0]).abs().max() > 1e-2


# --- 1. nesting ---


def test_nested_captures_each_see_every_call_inside(lms):
    a, _ = lms
    x = ids(5)
    with capture(a) as outer:
        run(a, x)
        with capture(a) as inner:
            run(a, x)
        run(a, x)
    run(a, x)  # after both blocks: recorded by neither
    assert not [m for m in a.modules() if vars(m).get(sdpa_hf._OPEN)]  # nothing left open
    assert len(outer.weights) == 3 * LAYERS  # the old global switch gave 2 * LAYERS
    assert len(inner.weights) == LAYERS
    assert all(w is v for w, v in zip(inner.weights, outer.weights[LAYERS:], strict=False))
    assert_same(outer.weights[:LAYERS], attentions(a, x))


def test_a_capture_of_a_sub_model_records_only_its_layers(lms):
    """Nested on one decoder layer: the inner capture sees that layer's calls, the outer
    every layer's, each call handed to the outer capture first."""
    a, _ = lms
    seen = []
    with (
        capture(a, on_call=lambda n, w: seen.append(("outer", n))),
        capture(a.model.layers[1], on_call=lambda n, w: seen.append(("inner", n))),
    ):
        run(a, ids(4))
    assert seen == [("outer", 0), ("outer", 1), ("inner", 1)]


def test_stats_and_handles_nest_on_one_model(lms):
    """Each nested capture keeps what it asked for: the outer one handles, the inner one
    statistics of the same calls."""
    a, _ = lms
    x = ids(6)
    with capture(a, keep=True) as outer, capture(a, stats="entropy") as inner:
        run(a, x)
    assert len(outer.weights) == LAYERS and inner.weights == []
    for layer in range(LAYERS):
        (h,) = inner.entropy[layer]
        torch.testing.assert_close(h, outer.weights[layer].entropy(), atol=1e-6, rtol=0)


# --- 2. two models kept apart ---


def test_a_capture_records_only_its_model(lms):
    a, b = lms
    x = ids(5)
    with capture(a) as cap:
        run(a, x)
        run(b, x)  # another model in the same block: not recorded
    assert_same(cap.weights, attentions(a, x))


def test_two_models_captured_side_by_side_are_kept_apart(lms):
    a, b = lms
    x, y = ids(5), ids(7, seed=1)
    with capture(a) as ca, capture(b) as cb:
        run(b, y)
        run(a, x)
        run(b, x)
    assert_same(ca.weights, attentions(a, x))
    assert_same(cb.weights, attentions(b, y) + attentions(b, x))


def test_a_copy_made_in_the_block_is_another_model(lms):
    """copy.deepcopy of a captured model is not captured (and carries nothing open)."""
    a, _ = lms
    x = ids(4)
    with capture(a) as cap:
        twin = copy.deepcopy(a)
        run(twin, x)
        assert cap.weights == []
        run(a, x)
    assert len(cap.weights) == LAYERS
    with capture(twin) as again:  # the copy captures on its own
        run(twin, x)
    assert_same(again.weights, attentions(a, x))


# --- 3. threads ---


def test_calls_of_a_thread_pool_started_in_the_block_are_recorded(lms):
    a, b = lms
    xs = [ids(L, seed=L) for L in (3, 5, 7, 9)]
    with capture(a) as cap, ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda x: run(a, x), xs))
        list(pool.map(lambda x: run(b, x), xs))  # the other model's workers: not recorded
    assert len(cap.weights) == len(xs) * LAYERS
    for x in xs:  # calls of concurrent threads in the order they finished: match by length
        assert_same([w for w in cap.weights if w.shape[-1] == x.shape[1]], attentions(a, x))


def test_on_call_and_stats_from_worker_threads_run_one_call_at_a_time(lms):
    a, _ = lms
    active, most = [0], [0]

    def on_call(layer, w):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.002)  # long enough for another worker to arrive
        active[0] -= 1

    xs = [ids(6, seed=s) for s in range(6)]
    with capture(a, stats="entropy", on_call=on_call) as cap, ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda x: run(a, x), xs))
    assert most[0] == 1
    for layer in range(LAYERS):
        assert len(cap.entropy[layer]) == len(xs)
        want = sorted(torch.special.entr(attentions(a, x)[layer]).sum(-1).sum().item() for x in xs)
        got = sorted(h.sum().item() for h in cap.entropy[layer])
        assert got == pytest.approx(want, abs=1e-4)


def replicas(model, n):
    """What torch.nn.parallel.replicate (DataParallel, every forward) makes of a module
    tree, without the broadcast to devices that needs CUDA: each module's
    _replicate_for_data_parallel() (its __dict__ copied), children relinked, the same
    parameters referenced."""
    modules = list(model.modules())
    made = []
    for _ in range(n):
        copies = {id(m): m._replicate_for_data_parallel() for m in modules}
        for m in modules:
            replica = copies[id(m)]
            for key, child in m._modules.items():
                replica._modules[key] = None if child is None else copies[id(child)]
            for key, param in m._parameters.items():
                replica.__dict__[key] = param  # replicate sets the broadcast copy there
        made.append(copies[id(model)])
    return made


def test_data_parallel_replicas_in_worker_threads_are_recorded(lms):
    """DataParallel replicates the model inside its forward and runs each replica on its
    slice of the batch in a thread of its own: those calls are the captured model's."""
    a, _ = lms
    x = ids(6, B=2, seed=3)
    want = attentions(a, x)
    with capture(a) as cap:
        kept = replicas(a, 2)
        threads = [threading.Thread(target=run, args=(r, x[i : i + 1])) for i, r in enumerate(kept)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(cap.weights) == 2 * LAYERS
    for w in cap.weights:  # which slice a call had: the one whose attentions it gives
        full = w.full()  # (1, Hq, L, S)
        matches = [i for i in range(2) for layer in range(LAYERS)
                   if torch.allclose(full, want[layer][i : i + 1], atol=1e-6, rtol=0)]  # fmt: skip
        assert len(matches) == 1
    run(kept[0], x[:1])  # a replica kept after the block: the capture has closed
    assert len(cap.weights) == 2 * LAYERS


def test_data_parallel_without_devices_is_the_model(lms):
    a, _ = lms
    parallel = torch.nn.DataParallel(a)  # no accelerator: forward calls a itself
    with capture(parallel) as outer, capture(a) as inner:
        run(parallel, ids(4))
    assert len(outer.weights) == len(inner.weights) == LAYERS


def test_a_second_capture_of_the_model_in_another_thread_is_refused(lms):
    """Two captures of one model open side by side in two threads would each record the
    other's calls: the second is refused. Under copy_context the thread nests instead."""
    a, b = lms
    x = ids(5)
    results = {}

    def try_capture(model, key):
        try:
            with capture(model) as cap:
                run(model, x)
            results[key] = cap
        except sdpa.SdpaValueError as e:
            results[key] = e

    with capture(a) as outer:
        here = contextvars.copy_context()  # this thread's context: the open capture
        for key, model, target in [
            ("same", a, try_capture),
            ("other", b, try_capture),
            ("nested", a, lambda *args: here.run(try_capture, *args)),
        ]:
            thread = threading.Thread(target=target, args=(model, key))
            thread.start()
            thread.join()
    assert isinstance(results["same"], sdpa.SdpaValueError)
    assert "open in another thread or task" in str(results["same"])
    assert "LlamaForCausalLM (llama)" in str(results["same"])
    assert_same(results["other"].weights, attentions(b, x))
    assert_same(results["nested"].weights, attentions(a, x))
    assert_same(outer.weights, attentions(a, x))  # the nested thread's calls, not b's
    thread = threading.Thread(target=try_capture, args=(a, "after"))
    thread.start()
    thread.join()  # once the block has closed, another thread may capture
    assert_same(results["after"].weights, attentions(a, x))


def test_two_threads_capture_two_models_at_the_same_time(lms):
    """Both blocks open at once and the forwards interleave, layer by layer: each capture
    holds its own model's calls."""
    a, b = lms
    x = ids(6)
    opened, step = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)
    results = {}

    def work(model):
        with capture(model, on_call=lambda n, w: (step.wait(), results[model].append(w))):
            opened.wait()
            run(model, x)

    results.update({a: [], b: []})
    threads = [threading.Thread(target=work, args=(m,)) for m in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_same(results[a], attentions(a, x))
    assert_same(results[b], attentions(b, x))


# --- 4. what capture takes ---


class Pipeline:
    """Stands in for a transformers pipeline: not a module, but it holds one."""

    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda a: "x", r"model must be a torch\.nn\.Module.*got str 'x'$"),
        (lambda a: None, r"got NoneType None$"),
        (lambda a: [a], r"got list \[LlamaForCausalLM\(\.\.\.$"),  # a short repr, not the model's
        (lambda a: Pipeline(a), r"got Pipeline .*pass its \.model\)$"),
    ],
)
def test_capture_of_a_non_model_is_refused_by_name(lms, make, match):
    a, _ = lms
    with pytest.raises(sdpa.SdpaTypeError, match=match), capture(make(a)):
        pass


# --- 5. torch.compile ---


@pytest.fixture(scope="module")
def fresh_dynamo():  # one for both tests: the two models share their graphs (and compile time)
    torch._dynamo.reset()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def graphs_and_breaks(counters):
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_an_open_capture_leaves_a_compiled_other_model_alone(lms, fresh_dynamo):
    """Opening a capture on `a` neither recompiles nor breaks the graph of a compiled `b`
    (dynamo's "aot_eager" backend: its front end, without inductor's C++ build)."""
    a, b = lms
    counters, x = fresh_dynamo, ids(5)
    fast = torch.compile(b, backend="aot_eager")
    want = run(b, x)
    torch.testing.assert_close(run(fast, x), want)
    counters.clear()
    with capture(a) as cap:
        run(a, x)
        torch.testing.assert_close(run(fast, x), want)
        run(a, x)
    assert graphs_and_breaks(counters) == (0, 0)  # the old global switch: 1 graph, 2 breaks
    assert_same(cap.weights, attentions(a, x) + attentions(a, x))
    with capture(a), torch.no_grad():
        explained = torch._dynamo.explain(b)(input_ids=x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_a_compiled_model_is_captured_block_after_block_without_new_graphs(lms, fresh_dynamo):
    """Inside a capture of the compiled model each attention call leaves the graph and is
    recorded; the graphs made for the first block serve every later one, and after the
    blocks the compiled model gives the model's logits again."""
    a, _ = lms
    counters, x = fresh_dynamo, ids(5)
    fast = torch.compile(a, backend="aot_eager")
    want = run(a, x)
    run(fast, x)
    for block in range(3):
        if block == 1:
            counters.clear()
        with capture(a) as cap:
            torch.testing.assert_close(run(fast, x), want)
        assert_same(cap.weights, attentions(a, x))
    assert counters["stats"]["unique_graphs"] == 0  # blocks 2 and 3: no new graph
    torch.testing.assert_close(run(fast, x), want)  # (traces the attention whole again)
    counters.clear()
    torch.testing.assert_close(run(fast, x), want)
    assert counters["stats"]["unique_graphs"] == 0
    with torch.no_grad():  # the blocks have closed: the model traces with no break again
        explained = torch._dynamo.explain(a)(input_ids=x, use_cache=False)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def _saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_capture_saves_loads_and_copies(lms):
    """torch.save / torch.load(weights_only=True), pickle and deepcopy of a closed
    capture: the handles read as the originals, the statistics are equal (detached)."""
    a, _ = lms
    x = ids(9, B=2)
    a.train()  # q and k require grad: the statistics carry gradients, the copies none
    stats = ("entropy", "received", "last_row", "max_logits")
    with capture(a, stats=stats, keep=True, on_call=lambda layer, w: None) as cap:
        a(input_ids=x, use_cache=False)
    a.eval()
    refused = pytest.raises(sdpa.NotSupportedError, match="inside its `with` block")
    with refused, capture(a) as open_capture:
        torch.save(open_capture, io.BytesIO())
    for twin in (_saved_and_loaded(cap), pickle.loads(pickle.dumps(cap)), copy.deepcopy(cap)):
        assert type(twin) is sdpa_hf.Capture and twin.on_call is None
        assert len(twin.weights) == len(cap.weights) == LAYERS
        for w, original in zip(twin.weights, cap.weights, strict=True):
            torch.testing.assert_close(w.full(), original.full().detach(), rtol=0, atol=0)
        for stat in ("entropy", "last_row", "max_logits"):
            got, want = getattr(twin, stat), getattr(cap, stat)
            assert got.keys() == want.keys()
            for layer in want:
                for g, t in zip(got[layer], want[layer], strict=True):
                    assert not g.requires_grad
                    torch.testing.assert_close(g, t.detach(), rtol=0, atol=0)
        assert twin.received.keys() == cap.received.keys()
        for layer, r in cap.received.items():
            torch.testing.assert_close(twin.received[layer], r.detach(), rtol=0, atol=0)
    assert any(t.requires_grad for ts in cap.entropy.values() for t in ts)  # (the originals)
