"""The intercept (sdpa.integrations.deferred.Intercept) is exact: eager attention code run
under it gives eager's values, whatever it does to the scores.

Each test runs one piece of eager attention code twice, on plain tensors (eager) and
under the intercept, and compares outputs and patterns to float32 rounding: in-place
arithmetic on the scores through a helper or a view, fills that are values and not masks
(NaN, +inf), a bias that broadcasts the scores to a larger batch, and the refusals left
past the memory budget, which name the code that made the op.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import sdpa
from sdpa.integrations import deferred

ATOL = 1e-5  # the fused kernel against eager's matmul-softmax-matmul, float32
B, H, L, S, D = 2, 3, 40, 40, 8


def inputs(b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, H, n, D, generator=g) for n in (L, S, S))
    bias = torch.randn(B, 1, L, S, generator=g)
    return q, k, v, bias


def close(got, want, atol=ATOL, equal_nan=False):
    got = deferred.dense_of(got, None)
    torch.testing.assert_close(got, deferred.dense_of(want, None), atol=atol, rtol=0,
                               equal_nan=equal_nan)  # fmt: skip


def both(code, *args):
    """code(*args) on eager tensors, then under the intercept; with the second run's
    count of fused calls and its dense fallbacks (op -> count)."""
    want = code(*args)
    fused, before = deferred.FUSED[0], deferred.fallbacks()
    with warnings.catch_warnings(), deferred.Intercept():
        warnings.simplefilter("ignore")  # (the fallbacks' RuntimeWarning)
        got = code(*args)
    fell = {k: v - before.get(k, 0) for k, v in deferred.fallbacks().items()}
    fell = {k: v for k, v in fell.items() if v}
    return want, got, deferred.FUSED[0] - fused, fell


def scores(q, k):
    return torch.matmul(q, k.transpose(-2, -1)) * D**-0.5


def finish(s, v):
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v), p


# ---- 1. in-place arithmetic on the scores ----


def add_mask_(s, m):
    s += m


def sub_mask_(s, m):
    s -= m


def mul_(s, m):
    s *= m


def div_(s, m):
    s /= m


def add_method_(s, m):
    s.add_(m)


@pytest.mark.parametrize(
    "helper,fused",
    [(add_mask_, True), (add_method_, True), (sub_mask_, False), (mul_, False), (div_, False)],
)
def test_in_place_arithmetic_through_a_helper(helper, fused):
    """s += m in a helper: every alias of s sees it (recorded on the node where the
    out-of-place op would be, else eager's dense values)."""
    q, k, v, bias = inputs()
    other = bias if helper in (add_mask_, add_method_, sub_mask_) else bias.abs() + 0.5

    def code(q, k, v):
        s = scores(q, k)
        helper(s, other)
        return (*finish(s, v), s)

    want, got, n_fused, fell = both(code, q, k, v)
    assert (want[0] - finish(scores(q, k), v)[0]).abs().max() > 0.1  # the op matters
    for g, w in zip(got, want, strict=True):
        close(g, w)
    assert n_fused == (1 if fused else 0)
    assert bool(fell) != fused  # recorded, or eager's dense values (and a warning)


@pytest.mark.parametrize("helper", [add_mask_, sub_mask_])
def test_in_place_arithmetic_carries_the_gradient(helper):
    """The gradients to q, k, v and the bias through a recorded (fused) or a dense
    in-place change equal eager's."""
    q, k, v, bias = inputs()
    grads = []
    for intercept in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        qq, kk, vv, bb = leaves

        def code(qq=qq, kk=kk, vv=vv, bb=bb):
            s = scores(qq, kk)
            helper(s, bb)
            return finish(s, vv)[0]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if intercept:
                with deferred.Intercept():
                    out = code()
            else:
                out = code()
        (out * torch.linspace(-1, 1, D)).sum().backward()
        grads.append([t.grad for t in leaves])
    for g, w in zip(*reversed(grads), strict=True):
        close(g, w)


def test_in_place_masked_fill_and_scale_are_recorded():
    """scale, mask, bias and softcap applied in place: the fused call, eager's values."""
    q, k, v, bias = inputs()
    keep = torch.rand(L, S, generator=torch.Generator().manual_seed(3)) > 0.2

    def code(q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1))
        s.mul_(D**-0.5)
        s /= 2.0
        s.tanh_()
        s *= 2.0
        s.masked_fill_(~keep, torch.finfo(s.dtype).min)
        s += bias
        return (*finish(s, v), s)

    want, got, n_fused, fell = both(code, q, k, v)
    assert n_fused == 1 and not fell
    assert isinstance(got[1], deferred.LazyPattern)
    for g, w in zip(got, want, strict=True):
        close(g, w)


VIEWS = {
    "view": lambda s: s.view(B * H, L, S),
    "transpose": lambda s: s.transpose(-2, -1),
    "getitem": lambda s: s[:, 1:],
    "unsqueeze": lambda s: s.unsqueeze(0),
    "detach": lambda s: s.detach(),
    "whole": lambda s: s[:, :],
    "paired-lists": lambda s: s[[0, 1], [2, 0]],
    "list": lambda s: s[:, [2, 0]],
    "view-of-a-view": lambda s: s[:, 1:][1, [1, 0, 1]],
    "lead-mask": lambda s: s[torch.tensor([[True, False, True], [False, True, True]])],
}


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("changed", ["scores", "view"])
def test_a_view_taken_before_the_change_sees_it(view, changed):
    """v = view(s); then s += m (or v += m): both see the mask, as on eager."""
    q, k, v_, bias = inputs()
    take = VIEWS[view]

    def code(q, k, v):
        s = scores(q, k)
        w = take(s)
        if changed == "scores":
            add_mask_(s, bias)
        else:
            add_mask_(w, take(bias.expand(B, H, L, S).contiguous()))
        out, p = finish(s, v)
        return out, p, s, w.contiguous() * 1  # every value of the view, as eager has it

    want, got, _, _ = both(code, q, k, v_)
    for g, w in zip(got, want, strict=True):
        close(g, w)


LEAD_VIEWS = [
    ([0, 1], [2, 0]),
    (torch.tensor([1, 1]), torch.tensor([0, 2])),
    (slice(None), [2, 0]),
    (0, [2, 0, 2]),
    (torch.tensor([[True, False, True], [False, True, True]]),),
    (-1, None),
]


@pytest.mark.parametrize("index", LEAD_VIEWS, ids=[str(i) for i in range(len(LEAD_VIEWS))])
def test_a_lead_view_of_a_replayed_pattern_is_torchs(index):
    """An index of the lead dims of eager's replayed pattern (a float bias), in the
    forward and after it, is the lead index torch makes (two lists pair up): its shape
    and values, and a view of it."""
    q, k, v, bias = inputs()

    def code(q, k, v):
        out, p = finish(scores(q, k) + bias, v)
        return out, p, p[index], p[index][..., 1:3, :]

    want, got, _, _ = both(code, q, k, v)
    for g, w in zip((*got, got[1][index], got[1][index][..., 2, :]),
                    (*want, want[1][index], want[1][index][..., 2, :]), strict=True):  # fmt: skip
        assert g.shape == w.shape
        close(g, w)


@pytest.mark.parametrize("after", ["view", "cumsum"])
def test_folded_scores_of_a_bmm_are_eagers(after):
    """bmm of (B*H, L, D) tensors (BLOOM's, LED's): the folded scores' dense values,
    read by an op no lazy read takes (cumsum) or after the view to (B, H, L, S), and the
    pattern and output are eager's."""
    q, k, v, _ = inputs()
    fold = lambda t: t.reshape(B * H, *t.shape[2:])  # noqa: E731

    def code(q, k, v):
        s = torch.bmm(fold(q), fold(k).transpose(1, 2)) * D**-0.5  # (B*H, L, S)
        read = s.cumsum(-1) if after == "cumsum" else s.view(B, H, L, S)
        p = torch.softmax(s, dim=-1)
        return torch.bmm(p, fold(v)), p, read

    want, got, _, _ = both(code, q, k, v)
    for g, w in zip(got, want, strict=True):
        close(g, w)


def test_a_mask_built_in_place_and_changed_after_use():
    """tril_() on the bool ones eager builds (kept symbolic until then), and those masks
    changed after the scores used them: the scores keep what eager computed then."""
    q, k, v, _ = inputs()

    def code(q, k, v):
        causal = torch.ones(L, S, dtype=torch.bool)
        causal.tril_()
        s = scores(q, k).masked_fill(~causal, -torch.inf)
        none = torch.ones(L, S, dtype=torch.bool).tril(-L)  # all False
        s = s.masked_fill(none, -torch.inf)
        keep = torch.ones(L, S, dtype=torch.bool).tril(1)
        s = torch.where(keep, s, torch.full((), -torch.inf))
        keep.fill_(False)  # after use: s is unchanged on eager
        none.logical_not_()
        return (*finish(s, v), s)

    want, got, n_fused, fell = both(code, q, k, v)
    assert n_fused == 1, fell
    for g, w in zip(got, want, strict=True):
        close(g, w)


def test_a_plain_mask_changed_after_use_is_refused():
    """A plain mask eager changes in place after the scores used it: sdpa no longer has
    the values eager computed with, and says so rather than run with the new ones."""
    q, k, v, _ = inputs()
    drop = torch.zeros(L, S, dtype=torch.bool)
    with deferred.Intercept():
        s = scores(q, k).masked_fill(drop, -torch.inf)
        drop.fill_(True)
        p = torch.softmax(s, dim=-1)
        with pytest.raises(sdpa.StaleWeightsError, match="after the attention code used it"):
            torch.matmul(p, v)


def test_in_place_on_lazy_views_and_aliases():
    """A detached alias (what a cache stores) and a lazy view of the pattern see a later
    in-place change of the scores or of the pattern."""
    q, k, v, bias = inputs()

    def code(q, k, v):
        s = scores(q, k)
        cached = s.detach()
        s += bias  # s has an alias: both become eager's dense values, masked
        p = torch.softmax(s, dim=-1)
        head = p[:, 1]
        p.mul_(2.0)  # not a change sdpa models: eager's dense values, in every alias
        return torch.matmul(p, v), cached * 1, head * 1, p

    want, got, _, _ = both(code, q, k, v)
    for g, w in zip(got, want, strict=True):
        close(g, w)


def test_in_place_on_a_cached_pattern_outside_a_forward():
    """After the forward, within the budget: the change lands in the tensor and in its
    lazy views; past the budget it is refused by name."""
    q, k, _, bias = inputs()
    with deferred.Intercept():
        p = torch.softmax(scores(q, k) + bias, dim=-1)
    want = torch.softmax(scores(q, k) + bias, dim=-1)
    row = p[1, 2]
    p[0, 0, 0] = 5.0
    p *= 2
    want[0, 0, 0] = 5.0
    want *= 2
    close(p, want)
    close(row, want[1, 2])
    with deferred.Intercept(budget=1024):
        small = torch.softmax(scores(q, k), dim=-1)
    with pytest.raises(sdpa.WeightsTooLargeError, match=r"add_ changes .* in place.*full"):
        small += 1


@pytest.mark.parametrize(
    "take",
    [
        lambda p: p[1, 2],
        lambda p: p.mT,
        lambda p: p.unsqueeze(0),
        lambda p: p.detach(),
        lambda p: p * 2,
        lambda p: p[0, 1].to(torch.bfloat16),
    ],
    ids=["row", "mT", "unsqueeze", "detach", "times", "cast"],
)
@pytest.mark.parametrize("write", ["setitem", "mul_"])
@pytest.mark.parametrize("lazy", ["AttentionWeights", "LazyRows"])
def test_a_lazy_view_of_a_fused_pattern_refuses_after_the_pattern_changes(lazy, take, write):
    """A fused pattern after the forward hands out views of sdpa's weights (or of its
    replayed rows), which do not share eager's storage: once the pattern is changed in
    place, each lazy tensor made from it before refuses (eager's view would show the
    change) but an alias of replayed rows (p[1, 2]), which shares them and shows it; one
    made after reads the changed values, and so does the pattern."""
    q, k, v, bias = inputs()
    code = (lambda q, k: scores(q, k) + bias) if lazy == "LazyRows" else scores
    with deferred.Intercept():  # (a float bias: eager's rows, replayed)
        p = finish(code(q, k), v)[1]
    assert type(deferred._lazy_view(p)).__name__ == lazy
    want = torch.softmax(code(q, k), dim=-1)
    before = take(p)
    close(before, take(want))  # (fresh until the write)
    for t in (p, want):
        if write == "setitem":
            t[1, 2, 0] = 5.0
        else:
            t.mul_(2.0)
    if isinstance(before, deferred.Deferred):  # (an alias of replayed rows: eager's view)
        assert lazy == "LazyRows"
        close(before, take(want))
    else:
        changed = r"in place after it \((__setitem__|mul_)\)"
        with pytest.raises(sdpa.StaleWeightsError, match=changed):
            deferred.dense_of(before, None)
    close(take(p), take(want))
    close(p, want)


# ---- 2. fills that are values, not masks ----


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), 5.0, -torch.inf])
@pytest.mark.parametrize("how", ["masked_fill", "masked_fill_", "where", "additive"])
def test_fills_that_are_values_are_not_masks(fill, how):
    """NaN, +inf and finite fills are values: eager's NaN rows come back NaN; -inf (and
    the dtype's min) mask."""
    q, k, v, _ = inputs()
    drop = torch.rand(L, S, generator=torch.Generator().manual_seed(2)) < 0.1

    def code(q, k, v):
        s = scores(q, k)
        if how == "masked_fill":
            s = s.masked_fill(drop, fill)
        elif how == "masked_fill_":
            s.masked_fill_(drop, fill)
        elif how == "where":
            s = torch.where(~drop, s, torch.full((), fill))
        else:
            s = s + torch.where(~drop, torch.zeros(()), torch.full((), fill))
        return finish(s, v)

    want, got, n_fused, _ = both(code, q, k, v)
    masks = fill == -torch.inf
    assert want[0].isnan().any() == (fill != fill or fill == torch.inf)
    close(got[0], want[0], equal_nan=True)
    close(got[1], want[1], equal_nan=True)
    assert n_fused == (1 if masks else 0)


# ---- 3. a bias that broadcasts the scores to a larger batch ----


@pytest.mark.parametrize("how", ["add", "radd", "masked_fill", "where"])
def test_a_mask_that_broadcasts_to_a_larger_batch(how):
    """scores (1, H, L, S) with a mask (2, 1, L, S): the result has the larger batch, as
    on eager, and still runs fused."""
    q, k, v, bias = inputs(b=1)
    drop = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(4)) < 0.2

    def code(q, k, v):
        s = scores(q, k)
        if how == "add":
            s = s + bias
        elif how == "radd":
            s = bias + s
        elif how == "masked_fill":
            s = s.masked_fill(drop, -torch.inf)
        else:
            s = torch.where(~drop, s, torch.full((), -torch.inf))
        return (*finish(s, v), s)

    want, got, n_fused, fell = both(code, q, k, v)
    assert want[0].shape == (B, H, L, D)
    assert got[0].shape == want[0].shape and got[1].shape == (B, H, L, S)
    for g, w in zip(got, want, strict=True):
        close(g, w)
    assert n_fused == 1 and not fell


def test_in_place_bias_of_a_larger_batch_is_eagers_error():
    """s += bias with a larger batch than s: eager's own error (an in-place op keeps the
    shape of s)."""
    q, k, _, bias = inputs(b=1)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        add_mask_(scores(q, k), bias)  # eager
    with deferred.Intercept(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = scores(q, k)
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            add_mask_(s, bias)


# ---- 4. the refusals past the budget name the code that made the op ----


class Attention(torch.nn.Module):
    """Eager attention code with an in-place op sdpa does not model (s -= bias)."""

    def forward(self, q, k, v, bias):
        s = scores(q, k)
        s -= bias  # the line the refusal names
        return finish(s, v)[0]


def test_refusal_in_model_code_names_the_module_and_line():
    """Past the budget, an in-place op in a module's attention code: the error names the
    op, the module and its line, says the code cannot run on the intercept and where
    unfused() names it (no hook advice); within the budget, eager's values."""
    q, k, v, bias = inputs()
    module = Attention()
    lines, start = inspect.getsourcelines(Attention.forward)
    line = start + next(i for i, t in enumerate(lines) if "s -= bias" in t)
    want = module(q, k, v, bias)
    with pytest.raises(sdpa.WeightsTooLargeError) as err, deferred.Intercept(budget=4096):
        module(q, k, v, bias)
    message = str(err.value)
    assert f"test_intercept.py:{line}" in message
    assert "Attention" in message and "sub_" in message and "in place" in message
    assert "cannot run on" in message and "unfused(bridge)" in message
    assert "hook" not in message
    with deferred.Intercept(), warnings.catch_warnings():  # within the budget: eager's
        warnings.simplefilter("ignore")
        close(module(q, k, v, bias), want)


def test_refusal_in_a_hook_says_so():
    """The same op in a hook (called by a TransformerLens HookPoint): the error names the
    hook's line and says to return a new tensor from the hook."""
    hook_points = pytest.importorskip("transformer_lens.hook_points")
    q, k, _, bias = inputs()
    point = hook_points.HookPoint()
    point.name = "blocks.0.attn.hook_attn_scores"

    def my_hook(s, hook):
        s -= bias

    point.add_hook(my_hook)
    with pytest.raises(sdpa.WeightsTooLargeError) as err, deferred.Intercept(budget=4096):
        point(scores(q, k))
    message = str(err.value)
    line = inspect.getsourcelines(my_hook)[1] + 1
    assert f"test_intercept.py:{line}" in message
    assert "hook" in message and "return a new tensor" in message
    assert "cannot run on" not in message
