"""Properties of the other ops that must hold for any geometry (hypothesis): DCNv3 is deform_conv2d with a depthwise
weight of ones on the converted offsets; DCNv4 is DCNv3 on its offset_mask's parts; DCNv3 with zero offsets, one
point weighted 1 and offset_scale 1 is a shifted copy of the input; one-level attention on one point is
grid_sample; deformable RoI pooling without offsets is roi_align."""

import torch
import torch.nn.functional as F
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st

import deformconv


@st.composite
def dcn_geometries(draw):
    k = draw(st.sampled_from([1, 3, 5]))
    kh, kw = (k, k) if draw(st.booleans()) else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    remove_center = kh == kw and kh % 2 == 1 and kh > 1 and draw(st.booleans())
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    lo_h, lo_w = max(1, dil[0] * (kh - 1) + 1 - 2 * pad[0]), max(1, dil[1] * (kw - 1) + 1 - 2 * pad[1])
    h = draw(st.integers(lo_h, lo_h + 6))  # from the smallest size with an output on (a 5x5 kernel dilated needs 9)
    w = draw(st.integers(lo_w, lo_w + 6))
    return dict(n=draw(st.integers(1, 2)), h=h, w=w, g=draw(st.integers(1, 3)), d=draw(st.integers(1, 4)), kh=kh,
                kw=kw, stride=stride, pad=pad, dil=dil, scale=draw(st.sampled_from([1.0, 0.5, 1.7])),
                remove_center=remove_center, seed=draw(st.integers(0, 10_000)))


def _dcn_case(g):
    gen = torch.Generator().manual_seed(g["seed"])
    ho = (g["h"] + 2 * g["pad"][0] - (g["dil"][0] * (g["kh"] - 1) + 1)) // g["stride"][0] + 1
    wo = (g["w"] + 2 * g["pad"][1] - (g["dil"][1] * (g["kw"] - 1) + 1)) // g["stride"][1] + 1
    k = g["kh"] * g["kw"] - int(g["remove_center"])
    x = torch.randn(g["n"], g["h"], g["w"], g["g"] * g["d"], generator=gen, dtype=torch.float64)
    offset = torch.randn(g["n"], ho, wo, g["g"] * k * 2, generator=gen, dtype=torch.float64) * 2
    mask = torch.rand(g["n"], ho, wo, g["g"] * k, generator=gen, dtype=torch.float64)
    params = (g["kh"], g["kw"], *g["stride"], *g["pad"], *g["dil"], g["g"], g["d"], g["scale"])
    return x, offset, mask, params, k


@settings(max_examples=40, deadline=None)
@given(dcn_geometries())
def test_dcnv3_is_a_depthwise_deform_conv2d_and_dcnv4_is_dcnv3(g):
    x, offset, mask, params, k = _dcn_case(g)
    rc = g["remove_center"]
    out = deformconv.dcnv3(x, offset, mask, *params, 256, rc)
    off2, mask2 = deformconv.dcnv3_to_deform_conv2d(offset, mask, g["kh"], g["kw"], *g["dil"], g["g"], g["scale"], rc)
    ones = torch.ones(g["g"] * g["d"], 1, g["kh"], g["kw"], dtype=torch.float64)
    ref = deformconv.deform_conv2d(x.permute(0, 3, 1, 2), off2, ones, stride=g["stride"], padding=g["pad"],
                                   dilation=g["dil"], mask=mask2).permute(0, 2, 3, 1)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    om = deformconv.dcnv3_to_dcnv4(offset, mask, g["g"])
    torch.testing.assert_close(deformconv.dcnv4(x, om, *params, 256, rc), out, atol=0, rtol=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(2, 7), st.integers(2, 7), st.integers(1, 3), st.integers(1, 3),
       st.integers(-2, 2), st.integers(-2, 2), st.integers(0, 10_000))
def test_dcnv3_one_point_zero_offsets_is_a_shift(n, h, w, groups, d, ty, tx, seed):
    """3x3, dilation 1, pad 1: all weight on the tap (ty, tx) in {-1, 0, 1}² (after clamping) and zero offsets
    sample input[y + ty, x + tx], zero outside."""
    ty, tx = max(-1, min(1, ty)), max(-1, min(1, tx))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, w, groups * d, generator=gen, dtype=torch.float64)
    tap = (tx + 1) * 3 + (ty + 1)  # points kw-outer
    mask = torch.zeros(n, h, w, groups, 9, dtype=torch.float64)
    mask[..., tap] = 1
    out = deformconv.dcnv3(x, torch.zeros(n, h, w, groups * 18, dtype=torch.float64), mask.reshape(n, h, w, -1),
                           3, 3, 1, 1, 1, 1, 1, 1, groups, d, 1.0)
    padded = F.pad(x, (0, 0, 1, 1, 1, 1))
    ref = padded[:, 1 + ty:1 + ty + h, 1 + tx:1 + tx + w]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(1, 6), st.integers(1, 6), st.integers(1, 3), st.integers(1, 4),
       st.integers(1, 5), st.integers(0, 10_000))
def test_one_level_one_point_attention_is_grid_sample(n, h, w, heads, d, queries, seed):
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(n, h * w, heads, d, generator=gen, dtype=torch.float64)
    loc = torch.rand(n, queries, heads, 1, 1, 2, generator=gen, dtype=torch.float64) * 1.4 - 0.2
    out = deformconv.ms_deform_attn(value, torch.tensor([[h, w]]), torch.tensor([0]), loc,
                                    torch.ones(n, queries, heads, 1, 1, dtype=torch.float64))
    img = value.permute(0, 2, 3, 1).reshape(n * heads, d, h, w)
    grid = (2 * loc[:, :, :, 0, 0] - 1).transpose(1, 2).reshape(n * heads, queries, 1, 2)
    ref = F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)  # [n·M, D, Lq, 1]
    ref = ref[..., 0].reshape(n, heads, d, queries).permute(0, 3, 1, 2).reshape(n, queries, heads * d)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 3), st.integers(0, 3), st.sampled_from([1.0, 0.5, 0.25]), st.integers(0, 10_000))
def test_roi_pool_without_offsets_is_roi_align(n, h, w, c, ph, pw, sampling_ratio, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    r = 6
    xy = torch.rand(r, 2, generator=gen, dtype=torch.float64) * torch.tensor([w, h]) / scale * 1.2 - 1
    wh = torch.rand(r, 2, generator=gen, dtype=torch.float64) * torch.tensor([w, h]) / scale
    rois = torch.cat([torch.randint(0, n, (r, 1), generator=gen).double(), xy, xy + wh], 1)
    out = deformconv.deform_roi_pool(x, rois, None, (ph, pw), scale, sampling_ratio)
    ref = torchvision.ops.roi_align(x, rois, (ph, pw), scale, sampling_ratio, aligned=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
