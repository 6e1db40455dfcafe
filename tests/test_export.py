"""torch.export and torch.compile trace sdpa's output path with no guard on data.

Unbacked (data-dependent) batch sizes, dynamic dims (`torch.export.Dim`) and
`torch.compile(fullgraph=True)` with `mark_dynamic` on L and S: the drop-in and
`sdpa.attention(...).output` trace without a graph break and give eager torch's result.
Under tracing, mask structure is not analysed (a plan cannot depend on data in a graph):
the mask goes to the kernel whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sdpa

from conftest import randn

H, E, D = 4, 8, 32  # heads, head size, model width
FIXED_L = 9  # length of the inputs where a module holds a constant (L, S) mask


def drop_in(q, k, v, mask, causal):
    return sdpa.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)


def attention_output(q, k, v, mask, causal):
    return sdpa.attention(q, k, v, mask, causal=causal).output


CALLS = {"drop_in": drop_in, "attention": attention_output}
# mask kinds: what each call is given, and the equivalent for torch
MASKS = ["none", "causal", "key_padding", "bool", "float", "sdpa.causal", "window"]


def make_mask(kind, q, k, gen):
    """(ours, torch's, causal flag) for queries q (B, H, L, E) and keys k (B, H, S, E)."""
    L, S = q.shape[2], k.shape[2]
    if kind == "none":
        return None, None, False
    if kind == "causal":
        return None, None, True
    if kind == "key_padding":  # (B, 1, 1, S) from the inputs, so it follows B
        keep = k[:, :1, :, :1].transpose(-1, -2) > -0.5  # (B, 1, 1, S)
        keep = keep | (torch.arange(S) == 0)
        return keep, keep, False
    if kind == "bool":
        keep = torch.rand(L, S, generator=gen) < 0.7
        keep[:, 0] = True
        return keep, keep, False
    if kind == "float":
        bias = randn(gen, L, S)
        return bias, bias, False
    structured = {"sdpa.causal": sdpa.masks.causal(), "window": sdpa.masks.sliding_window(3)}
    mask = structured[kind]
    return mask, mask.materialize(L, S), False


class Block(torch.nn.Module):
    """Projections, then attention on the rows of x that are not all zero."""

    def __init__(self, call, mask_kind, gen, drop_zero_rows):
        super().__init__()
        self.proj = torch.nn.Linear(D, 3 * H * E)
        self.call, self.mask_kind, self.gen = call, mask_kind, gen
        self.drop_zero_rows = drop_zero_rows
        if mask_kind in ("bool", "float"):  # a constant (L, S) mask of the module's
            q = torch.zeros(1, H, FIXED_L, E)
            self.register_buffer("fixed", make_mask(mask_kind, q, q, gen)[0])

    def masks(self, q, k):
        """(ours, torch's, causal) for this block's mask kind."""
        if self.mask_kind in ("bool", "float"):
            return self.fixed, self.fixed, False
        return make_mask(self.mask_kind, q, k, self.gen)

    def forward(self, x):  # x (N, L, D)
        if self.drop_zero_rows:
            x = x[x.abs().sum(dim=(-1, -2)) != 0]  # (B, L, D), B data dependent
        B, L = x.shape[0], x.shape[1]
        qkv = self.proj(x).view(B, L, 3, H, E).permute(2, 0, 3, 1, 4)  # (3, B, H, L, E)
        q, k, v = qkv.unbind(0)
        mask, _, causal = self.masks(q, k)
        return self.call(q, k, v, mask, causal)


def eager_torch(block, x):
    """The same block with torch's own SDPA on the dense twin of the mask."""
    x = x[x.abs().sum(dim=(-1, -2)) != 0] if block.drop_zero_rows else x
    B, L = x.shape[0], x.shape[1]
    q, k, v = block.proj(x).view(B, L, 3, H, E).permute(2, 0, 3, 1, 4).unbind(0)
    _, mask, causal = block.masks(q, k)
    return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("call", list(CALLS))
def test_export_with_a_data_dependent_batch(gen, call, mask_kind):
    block = Block(CALLS[call], mask_kind, gen, drop_zero_rows=True)
    x = randn(gen, 5, FIXED_L, D)
    x[1] = 0  # dropped inside the graph
    program = torch.export.export(block, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), eager_torch(block, x), atol=1e-5, rtol=0)
        y = randn(gen, 5, FIXED_L, D)
        y[[0, 2, 3]] = 0  # another batch size (2), same program
        torch.testing.assert_close(program.module()(y), eager_torch(block, y), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "key_padding", "sdpa.causal", "window"])
@pytest.mark.parametrize("call", list(CALLS))
def test_export_with_dynamic_dims(gen, call, mask_kind):
    block = Block(CALLS[call], mask_kind, gen, drop_zero_rows=False)
    dims = {"x": {0: torch.export.Dim("B", max=64), 1: torch.export.Dim("L", min=2, max=512)}}
    program = torch.export.export(block, (randn(gen, 3, 10, D),), dynamic_shapes=dims)
    with torch.no_grad():
        for shape in [(3, 10, D), (2, 33, D), (5, 300, D)]:
            x = randn(gen, *shape)
            want = eager_torch(block, x)
            torch.testing.assert_close(program.module()(x), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("call", list(CALLS))
def test_compile_fullgraph_with_dynamic_lengths(gen, call, mask_kind):
    torch._dynamo.reset()
    compiled = torch.compile(CALLS[call], fullgraph=True, dynamic=False)
    for L, S in [(10, 12), (17, 40), (300, 300)]:
        q, k, v = randn(gen, 2, H, L, E), randn(gen, 2, H, S, E), randn(gen, 2, H, S, E)
        if mask_kind in ("causal", "sdpa.causal", "window"):  # causal=True needs L == S
            k, v = k[:, :, :L], v[:, :, :L]
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        ours, theirs, causal = make_mask(mask_kind, q, k, gen)
        if isinstance(ours, torch.Tensor):  # its L and S follow the inputs'
            for dim in (-2, -1):
                if ours.shape[dim] > 1:
                    torch._dynamo.mark_dynamic(ours, ours.ndim + dim)
        got = compiled(q, k, v, ours, causal)
        want = F.scaled_dot_product_attention(q, k, v, theirs, is_causal=causal)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
