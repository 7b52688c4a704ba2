"""Properties that must hold for any geometry (hypothesis): with zero offsets and no mask deform_conv2d is
F.conv2d; integer offsets shift the sampling grid exactly; the mask scales linearly."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import deformconv


@st.composite
def geometries(draw):
    groups = draw(st.sampled_from([1, 2]))
    offset_groups = draw(st.sampled_from([1, 2]))
    cin = groups * offset_groups * draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    h = draw(st.integers(dilation[0] * (kh - 1) + 1, 7))
    w = draw(st.integers(dilation[1] * (kw - 1) + 1, 7))
    return dict(n=draw(st.integers(1, 2)), cin=cin, cout=groups * draw(st.integers(1, 3)), h=h, w=w, kh=kh, kw=kw,
                groups=groups, offset_groups=offset_groups, stride=stride, padding=padding, dilation=dilation,
                seed=draw(st.integers(0, 10_000)))


def _tensors(g):
    gen = torch.Generator().manual_seed(g["seed"])
    x = torch.randn(g["n"], g["cin"], g["h"], g["w"], generator=gen, dtype=torch.float64)
    weight = torch.randn(g["cout"], g["cin"] // g["groups"], g["kh"], g["kw"], generator=gen, dtype=torch.float64)
    bias = torch.randn(g["cout"], generator=gen, dtype=torch.float64)
    return x, weight, bias


def _out_size(g):
    ho = (g["h"] + 2 * g["padding"][0] - (g["dilation"][0] * (g["kh"] - 1) + 1)) // g["stride"][0] + 1
    wo = (g["w"] + 2 * g["padding"][1] - (g["dilation"][1] * (g["kw"] - 1) + 1)) // g["stride"][1] + 1
    return ho, wo


@settings(max_examples=40, deadline=None)
@given(geometries())
def test_zero_offsets_without_mask_is_conv2d(g):
    x, weight, bias = _tensors(g)
    ho, wo = _out_size(g)
    offset = torch.zeros(g["n"], 2 * g["offset_groups"] * g["kh"] * g["kw"], ho, wo, dtype=torch.float64)
    out = deformconv.deform_conv2d(x, offset, weight, bias, g["stride"], g["padding"], g["dilation"])
    ref = F.conv2d(x, weight, bias, g["stride"], g["padding"], g["dilation"], g["groups"])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(geometries(), st.integers(-2, 2), st.integers(-2, 2))
def test_integer_offset_equals_conv_of_shifted_input(g, dy, dx):
    """Offsets (dy, dx) on every tap sample input[y + dy, x + dx]: a conv of the zero-padded, shifted input."""
    x, weight, bias = _tensors(g)
    ho, wo = _out_size(g)
    offset = torch.empty(g["n"], g["offset_groups"] * g["kh"] * g["kw"], 2, ho, wo, dtype=torch.float64)
    offset[:, :, 0], offset[:, :, 1] = dy, dx
    out = deformconv.deform_conv2d(x, offset.flatten(1, 2), weight, bias, g["stride"], g["padding"], g["dilation"])
    (ph, pw) = g["padding"]
    big = F.pad(x, (pw + 2, pw + 2, ph + 2, ph + 2))  # the conv's zero padding plus room to shift by 2
    shifted = big[:, :, 2 + dy: 2 + dy + g["h"] + 2 * ph, 2 + dx: 2 + dx + g["w"] + 2 * pw]
    ref = F.conv2d(shifted, weight, bias, g["stride"], 0, g["dilation"], g["groups"])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(geometries(), st.floats(-3.0, 3.0))
def test_mask_scales_linearly(g, scale):
    x, weight, _ = _tensors(g)
    ho, wo = _out_size(g)
    gen = torch.Generator().manual_seed(g["seed"] + 1)
    offset = torch.randn(g["n"], 2 * g["offset_groups"] * g["kh"] * g["kw"], ho, wo, generator=gen, dtype=torch.float64)
    mask = torch.rand(g["n"], g["offset_groups"] * g["kh"] * g["kw"], ho, wo, generator=gen, dtype=torch.float64)
    args = (g["stride"], g["padding"], g["dilation"])
    out = deformconv.deform_conv2d(x, offset, weight, None, *args, mask * scale)
    ref = deformconv.deform_conv2d(x, offset, weight, None, *args, mask) * scale
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
