"""SpatialSelfAttention: the U-Net block over the pixels of a feature map."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdpa import SpatialSelfAttention, listing
from sdpa.nn import pixel_attention


@pytest.fixture
def block(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return SpatialSelfAttention(64, num_heads=4, groups=8).eval()


def test_shapes_residual_and_listing_agreement(gen, block):
    x = torch.randn(2, 64, 6, 7, generator=gen)
    out, w = block(x)
    assert out.shape == x.shape and w.shape == (2, 4, 42, 42)
    torch.testing.assert_close(out, listing.spatial_block(block, x), atol=1e-5, rtol=0)
    with torch.no_grad():  # the residual: zero the output projection, get x back
        block.proj_out.weight.zero_()
        block.proj_out.bias.zero_()
    assert torch.equal(block(x).output, x)


def test_rows_sum_to_one(gen, block):
    w = block(torch.randn(1, 64, 5, 5, generator=gen)).weights
    torch.testing.assert_close(w.full().sum(-1), torch.ones(1, 4, 25))


def test_equivariant_to_a_permutation_of_pixels(gen, block):
    x = torch.randn(2, 64, 4, 6, generator=gen)
    perm = torch.randperm(24, generator=gen)
    shuffle = lambda t: t.flatten(2)[:, :, perm].view(t.shape)  # noqa: E731
    out, w = block(x)
    out_p, w_p = block(shuffle(x))
    torch.testing.assert_close(out_p, shuffle(out), atol=1e-5, rtol=0)
    torch.testing.assert_close(w_p.full(), w.full()[:, :, perm][:, :, :, perm], atol=1e-6, rtol=0)


def test_pixel_attention_is_one_row_per_head(gen, block):
    x = torch.randn(2, 64, 5, 7, generator=gen)
    w = block(x).weights
    maps = pixel_attention(w, 3, 4, (5, 7))
    assert maps.shape == (2, 4, 5, 7)
    torch.testing.assert_close(maps, w.full()[:, :, 3 * 7 + 4].view(2, 4, 5, 7), atol=1e-6, rtol=0)
    with pytest.raises(IndexError, match=r"pixel \(y=5, x=0\) is outside the 5x7 image"):
        pixel_attention(w, 5, 0, (5, 7))
    with pytest.raises(ValueError, match=r"not over a 6x7 image"):
        pixel_attention(w, 0, 0, (6, 7))


def test_gradients_and_dropout_in_training_only(gen):
    m = SpatialSelfAttention(32, num_heads=2, groups=4, dropout=0.5)
    x = torch.randn(1, 32, 4, 4, generator=gen, requires_grad=True)
    m(x).output.sum().backward()
    assert all(p.grad is not None for p in m.parameters()) and x.grad is not None
    a, b = m(x).output, m(x).output
    assert not torch.allclose(a, b)
    m.eval()
    assert torch.equal(m(x).output, m(x).output)


def test_seed_unet_case():
    m = SpatialSelfAttention(128, num_heads=4)
    assert isinstance(m.norm, nn.GroupNorm) and m.norm.num_groups == 32
    with torch.no_grad():
        out, w = m(torch.randn(1, 128, 64, 64))
    assert out.shape == (1, 128, 64, 64) and w.shape == (1, 4, 4096, 4096)


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda: SpatialSelfAttention(100, groups=32), r"channels=100 and groups=32"),
        (lambda: SpatialSelfAttention(96, num_heads=5, groups=32), r"channels=96 and num_heads=5"),
    ],
)
def test_construction_refusals(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_call_refusals(block):
    with pytest.raises(ValueError, match=r"\(B, C=64, H, W\), got \(64, 4, 4\)"):
        block(torch.randn(64, 4, 4))
    with pytest.raises(ValueError, match=r"got \(1, 32, 4, 4\)"):
        block(torch.randn(1, 32, 4, 4))
