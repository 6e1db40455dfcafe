"""`w.full()` hands the weights a call kept out uncopied where nothing else holds them
(the handle lets go of them), and copies them where something might: another handle (a
lead view, a detached twin) or an autograd graph. Checked with writes torch cannot see
(through numpy), which no version counter would catch."""

from __future__ import annotations

import pytest
import torch

import sdpa

from conftest import randn
from oracle import oracle

pytestmark = pytest.mark.small_shapes  # (the small backend keeps the weights)


def _call(gen, **grad):
    q, k, v = (randn(gen, 2, 3, 5, 8) for _ in range(3))
    for name, t in zip("qkv", (q, k, v), strict=True):
        t.requires_grad_(grad.get(name, False))
    out, w = sdpa.attention(q, k, v)
    assert w.served_by.startswith("small"), w.served_by
    truth = oracle(q.detach(), k.detach(), v.detach())[1].float()
    return (q, k, v), out, w, truth


def test_full_hands_out_the_kept_weights_and_later_reads_compute_them_again(gen):
    _, _, w, truth = _call(gen)
    kept = w._probs.data_ptr()
    p = w.full()
    assert p.data_ptr() == kept  # uncopied
    p.numpy()[:] = 7.0  # the caller's own tensor: the handle no longer reads it
    torch.testing.assert_close(w[1, 2], truth[1, 2], atol=1e-6, rtol=0)
    again = w.full()
    assert again.data_ptr() != p.data_ptr()  # each full() a tensor of its own
    torch.testing.assert_close(again, truth, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.sum(-2), truth.sum(-2), atol=1e-5, rtol=0)


HOLDERS = {
    "lead view": lambda w: w.transpose(0, 1),
    "one batch element": lambda w: w[1],
    "detached twin": lambda w: w.detach(),
}


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("written", ["the call's", "the holder's"])
def test_full_copies_what_another_handle_holds(gen, holder, written):
    _, _, w, truth = _call(gen)
    other = HOLDERS[holder](w)
    assert isinstance(other, sdpa.AttentionWeights) and other._probs is not None
    first = w if written == "the call's" else other
    first.full().numpy()[:] = 7.0
    torch.testing.assert_close(other.full(), HOLDERS[holder](truth), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.full(), truth, atol=1e-6, rtol=0)


@pytest.mark.parametrize("needs", ["v", "q", "k"])
def test_full_copies_what_a_graph_saved(gen, needs):
    """The output's backward reads the weights it saved: a full() taken under no_grad
    and written through numpy must leave them alone."""
    (q, k, v), out, w, _ = _call(gen, **{needs: True})
    with torch.no_grad():
        w.full().numpy()[:] = 7.0
    out.sum().backward()
    given = {"q": q, "k": k, "v": v}
    twins = {n: t.detach().double().requires_grad_(n == needs) for n, t in given.items()}
    oracle(*twins.values())[0].sum().backward()
    truth = twins[needs].grad.float()
    torch.testing.assert_close(given[needs].grad, truth, atol=1e-5, rtol=0)
