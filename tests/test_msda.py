"""Multi-scale deformable attention (deformconv.ms_deform_attn, its op and modules) against an independent naive loop
implementation in float64: locations outside [0, 1], levels of very different sizes, one level, D not a power of
two, empty queries; the Triton kernels under the interpreter; the registrations; the modules' keys and definition."""

import pytest
import torch
from _naive_msda import naive_ms_deform_attn
from conftest import assert_close, requires_interpreter

import deformconv

# (N, Lq, M, D, levels [(H, W)], P)
CASES = {
    "4-levels": (2, 7, 2, 5, [(9, 11), (5, 6), (3, 3), (1, 2)], 3),
    "one-level": (1, 5, 3, 4, [(6, 7)], 4),
    "very-different-sizes": (1, 4, 1, 3, [(23, 31), (1, 1)], 2),
    "d16-heads4": (2, 3, 4, 16, [(5, 4), (3, 2)], 2),
    "sixteen-points": (1, 6, 2, 8, [(7, 5), (4, 3), (2, 2), (1, 1)], 4),
    "twenty-points": (1, 5, 2, 3, [(6, 7), (3, 4), (2, 2), (1, 3)], 5),
}


def _case(name, seed=0):
    n, lq, m, d, levels, p = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(levels, dtype=torch.int64)
    sizes = shapes.prod(1)
    starts = torch.cumsum(sizes, 0) - sizes
    value = torch.randn(n, int(sizes.sum()), m, d, generator=gen, dtype=torch.float64)
    # locations from -0.3 to 1.3: some points outside every level
    loc = torch.rand(n, lq, m, len(levels), p, 2, generator=gen, dtype=torch.float64) * 1.6 - 0.3
    attn = torch.rand(n, lq, m, len(levels), p, generator=gen, dtype=torch.float64)
    return value, shapes, starts, loc, attn


def _grads(fn, value, shapes, starts, loc, attn, gout, dtype=torch.float64, backend=None):
    leaves = [t.to(dtype).requires_grad_(True) for t in (value, loc, attn)]
    out = fn(leaves[0], shapes, starts, leaves[1], leaves[2], backend)
    return [out, *torch.autograd.grad(out, leaves, gout.to(out.dtype))]


def _ours(v, s, st, loc, a, backend):
    return deformconv.ms_deform_attn(v, s, st, loc, a, backend=backend)


def _naive(v, s, st, loc, a, backend):
    return naive_ms_deform_attn(v, s, st, loc, a)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", list(CASES))
def test_backends_match_the_naive_loops(name, backend):
    value, shapes, starts, loc, attn = _case(name)
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], dtype=torch.float64)
    ours = _grads(_ours, value, shapes, starts, loc, attn, gout, backend=backend)
    naive = _grads(_naive, value, shapes, starts, loc, attn, gout)
    for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, naive):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.25], ids=["nan", "inf", "on-the-border"])
def test_points_outside_or_nan_count_nowhere(bad, backend):
    """A NaN or infinite location, or one exactly on a level's border (x·W - 0.5 = -1: outside the open interval),
    counts nowhere and gets no gradient; an infinite value at a pixel no point reads reaches nothing."""
    value, shapes, starts, loc, attn = _case("4-levels")
    assert shapes[3].tolist() == [1, 2]  # the last level: W = 2, so x = -0.25 is pixel -1 exactly
    value = value.clone()
    value[0, 0] = float("inf")  # level 0's pixel (0, 0), read by no point once level 0's locations keep off it
    loc = loc.clone()
    loc[:, :, :, 0] = torch.where(loc[:, :, :, 0] < 2.0 / shapes[0].flip(0), 0.5, loc[:, :, :, 0])
    loc[0, 1, 1, 3, 1, 0] = bad
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], dtype=torch.float64)
    ours = _grads(_ours, value, shapes, starts, loc, attn, gout, backend=backend)
    for what, t in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours):
        assert torch.isfinite(t[:, 1:] if what == "grad_value" else t).all(), what
    assert (ours[2][0, 1, 1, 3, 1] == 0).all() and ours[3][0, 1, 1, 3, 1] == 0
    clean, finite = loc.clone(), value.clone()
    clean[0, 1, 1, 3, 1, 0] = 1e6  # far outside: the same point skipped
    finite[0, 0] = 0.0
    naive = _grads(_naive, finite, shapes, starts, clean, attn, gout)
    for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, naive):
        if what == "grad_value":
            a, b = a[:, 1:], b[:, 1:]  # the infinite pixel's own gradient aside
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_in_low_precision(dtype):
    """The CPU backend computes float32 and half inputs in float32: against float64 within the dtype's tolerance."""
    value, shapes, starts, loc, attn = _case("4-levels")
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], dtype=torch.float64)
    ours = _grads(_ours, value, shapes, starts, loc, attn, gout, dtype, backend="cpu")
    exact = _grads(_ours, *[t.to(dtype).double() if t.is_floating_point() else t
                            for t in (value, shapes, starts, loc, attn)], gout, backend="cpu")
    for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, exact):
        assert a.dtype == dtype and torch.isfinite(a).all(), what
        assert_close(a, b, dtype, what)


def test_gradcheck():
    value, shapes, starts, loc, attn = _case("one-level")
    leaves = [t.requires_grad_(True) for t in (value, loc, attn)]
    assert torch.autograd.gradcheck(lambda v, lo, a: deformconv.ms_deform_attn(v, shapes, starts, lo, a), leaves)


def test_empty_queries_and_batch():
    value, shapes, starts, loc, attn = _case("4-levels")
    for sl in ((slice(None), slice(0, 0)), (slice(0, 0),)):
        v = value[sl[0]].requires_grad_(True)
        out = deformconv.ms_deform_attn(v, shapes, starts, loc[sl], attn[sl])
        assert out.shape == (*loc[sl].shape[:2], value.shape[2] * value.shape[3])
        out.sum().backward()
        assert v.grad.shape == v.shape and not v.grad.any()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_no_levels_sample_nothing(backend):
    """Zero levels: the output is zero and every gradient has its (empty or zero) shape."""
    v = torch.randn(2, 0, 2, 3, dtype=torch.float64, requires_grad=True)
    loc = torch.rand(2, 5, 2, 0, 2, 2, dtype=torch.float64, requires_grad=True)
    attn = torch.rand(2, 5, 2, 0, 2, dtype=torch.float64, requires_grad=True)
    shapes, starts = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    out = deformconv.ms_deform_attn(v, shapes, starts, loc, attn, backend=backend)
    assert out.shape == (2, 5, 6) and not out.any()
    out.sum().backward()
    assert v.grad.shape == v.shape and loc.grad.shape == loc.shape and attn.grad.shape == attn.shape


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_triton_matches_the_reference(name, dtype):
    value, shapes, starts, loc, attn = _case(name, seed=1)
    value, loc, attn = (t.to(dtype).double() for t in (value, loc, attn))  # the reference gets the rounded inputs
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], dtype=torch.float64)
    ours = _grads(_ours, value, shapes, starts, loc, attn, gout, dtype, backend="triton")
    ref = _grads(_ours, value, shapes, starts, loc, attn, gout, backend="reference")
    assert ours[0].dtype == dtype
    for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, ref):
        assert_close(a, b, dtype, what)


@requires_interpreter
@pytest.mark.parametrize("preload", [True, False], ids=["preloaded", "per-point-loads"])
@pytest.mark.parametrize("name", ["sixteen-points", "4-levels", "twenty-points"])
def test_triton_parameters_preloaded_or_per_point_are_right(name, preload):
    """A query's locations and weights loaded for all its points first (the default where L·P ≤ 16: all 16 columns
    used, or 12) or a point at a time (options.preload_points=False; always beyond 16): both give the reference's
    output and gradients."""
    from deformconv.config import options

    value, shapes, starts, loc, attn = _case(name, seed=4)
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], dtype=torch.float64)
    with options.override(preload_points=preload):
        ours = _grads(_ours, value, shapes, starts, loc, attn, gout, torch.float32, "triton")
    ref = _grads(_ours, value.float().double(), shapes, starts, loc.float().double(), attn.float().double(), gout,
                 backend="reference")
    for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, ref):
        assert_close(a, b, torch.float32, what)


@requires_interpreter
def test_triton_deterministic_mode_is_reproducible_and_right():
    value, shapes, starts, loc, attn = _case("4-levels", seed=2)
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], dtype=torch.float64)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_grads(_ours, value, shapes, starts, loc, attn, gout, torch.float32, "triton") for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0][1], runs[1][1])
    ref = _grads(_ours, value.float().double(), shapes, starts, loc.float().double(), attn.float().double(), gout,
                 backend="reference")
    assert_close(runs[0][1], ref[1], torch.float32, "grad_value")


def _op_path(value, shapes, starts, loc, attn):
    """The registered op (the dispatcher, its autograd and autocast registrations): the general path."""
    return torch.ops.deformconv.ms_deform_attn(value, shapes, starts, loc, attn, "triton")


def _out_and_grads(fn, leaves, others, gout):
    """fn's output and the gradients of the leaves that require one (None for the others)."""
    value, loc, attn = leaves
    out = fn(value, others[0], others[1], loc, attn)
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, gout.to(out.dtype)))
    return [out] + [next(grads) if t.requires_grad else None for t in leaves]


@requires_interpreter
def test_planned_calls_match_the_registered_op():
    """The eager fast path's per-signature Call (msda._planned: launches worked out once) against the registered op:
    bit for bit, at a second call of the same signature with new inputs (nothing of the first kept), with a
    different set of inputs requiring gradients, under autocast, and where a tensor is not contiguous or not 16-byte
    aligned (other signatures, or the general path)."""
    from deformconv.config import options

    def leaves_for(seed, dtype=torch.float32, grads=(True, True, True)):
        value, shapes, starts, loc, attn = _case("4-levels", seed=seed)
        return [t.to(dtype).requires_grad_(g) for t, g in zip((value, loc, attn), grads)], (shapes, starts)

    def check(leaves, others, autocast=None):
        gout = torch.randn(leaves[0].shape[0], leaves[1].shape[1], leaves[0].shape[2] * leaves[0].shape[3])
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            ours = _out_and_grads(lambda *a: deformconv.ms_deform_attn(*a, backend="triton"), leaves, others, gout)
            ref = _out_and_grads(_op_path, leaves, others, gout)
        for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, ref):
            assert (a is None) == (b is None), what
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), what
        return ours

    options.clear()
    first = check(*leaves_for(0))
    calls = [c for c in options.cache("msda_eager").values() if c is not None]
    assert len(calls) == 1  # the planned path was taken
    second = check(*leaves_for(1))
    assert not torch.equal(first[0], second[0])
    assert len(options.cache("msda_eager")) == 1  # the same signature: the same Call
    check(*leaves_for(2, grads=(False, False, True)))
    check(*leaves_for(3, grads=(True, True, False)))
    check(*leaves_for(4), autocast=torch.float16)
    (value, loc, attn), others = leaves_for(5)
    check([value.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(), loc, attn], others)
    misaligned = torch.empty(value.numel() + 1)[1:].view(value.shape).copy_(value).requires_grad_()
    assert misaligned.data_ptr() % 16 and misaligned.is_contiguous()
    check([misaligned, loc, attn], others)
    with pytest.raises(ValueError, match="level_start_index must be"):  # contents checked at every call
        deformconv.ms_deform_attn(value, others[0], others[1] + 1, loc, attn, backend="triton")


def test_registrations_compile_export_and_autocast():
    value, shapes, starts, loc, attn = (t.float() if t.is_floating_point() else t for t in _case("one-level"))
    leaves = [t.requires_grad_(True) for t in (value, loc, attn)]
    torch.library.opcheck(torch.ops.deformconv.ms_deform_attn.default,
                          (leaves[0], shapes, starts, leaves[1], leaves[2], ""))
    m = deformconv.MSDeformAttn(12, n_levels=1, n_heads=3, n_points=4).eval()
    q, x, ref = torch.randn(1, 5, 12), torch.randn(1, 42, 12), torch.rand(1, 5, 1, 2)
    eager = m(q, ref, x, shapes, starts)
    torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(q, ref, x, shapes, starts), eager)
    ep = torch.export.export(m, (q, ref, x, shapes, starts))
    assert any("deformconv.ms_deform_attn" in str(nd.target) for nd in ep.graph.nodes)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the eager path and the registered op's autocast rule
        outs = [deformconv.ms_deform_attn(value, shapes, starts, loc, attn),
                torch.ops.deformconv.ms_deform_attn(value, shapes, starts, loc, attn, "")]
    attn64 = attn.detach().double().requires_grad_(True)
    exact = deformconv.ms_deform_attn(value.bfloat16().double(), shapes, starts, loc.double(), attn64)
    (exact_grad,) = torch.autograd.grad(exact.sum(), attn64)
    for out in outs:
        assert out.dtype == torch.bfloat16
        assert_close(out, exact, torch.bfloat16, "locations and weights kept in fp32 under autocast")
        # the weights' gradient of a sum (bf16 ones: exact) in fp32 from the bf16 value: fp32's rounding, not bf16's
        (grad,) = torch.autograd.grad(out.float().sum(), attn)
        assert_close(grad, exact_grad, torch.float32, "the weights' gradient")


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(a, spatial_shapes=a["spatial_shapes"] + 1), "must cover value's S"),
    (lambda a: dict(a, level_start_index=a["level_start_index"] + 1), "level_start_index must be"),
    (lambda a: dict(a, spatial_shapes=a["spatial_shapes"].float()), "spatial_shapes must be an int64"),
    (lambda a: dict(a, sampling_locations=a["sampling_locations"][..., :1]), "sampling_locations must have shape"),
    (lambda a: dict(a, attention_weights=a["attention_weights"][:, :, :1]), "attention_weights must have shape"),
    (lambda a: dict(a, value=a["value"][0]), "value must be"),
    (lambda a: dict(a, backend="cuda"), "backend must be"),
])
def test_argument_errors_name_the_argument(change, match):
    value, shapes, starts, loc, attn = _case("4-levels")
    args = dict(value=value, spatial_shapes=shapes, level_start_index=starts, sampling_locations=loc,
                attention_weights=attn)
    with pytest.raises((ValueError, TypeError), match=match):
        deformconv.ms_deform_attn(**change(args))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("change,match", [
    (lambda a, bf: dict(a, query=a["query"][..., :-1]), "query must be .* got shape"),
    (lambda a, bf: dict(a, query=a["query"][0]), "query must be .* got shape"),
    (lambda a, bf: dict(a, value=a["value"][:1] if bf else a["value"][:, :1]), "value must be .* got shape"),
    (lambda a, bf: dict(a, reference_points=a["reference_points"][:, :, :1].expand(2, 3, 3, 2)),
     "reference_points must be .*levels"),
    (lambda a, bf: dict(a, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)), "key_padding_mask must be"),
])
def test_module_input_errors_name_the_argument(batch_first, change, match):
    """Shapes checked in the caller's layout ([L, N, C] unless batch_first) before any projection: errors name the
    argument and its layout instead of a matmul's sizes."""
    m = deformconv.MultiScaleDeformableAttention(16, num_heads=2, num_levels=2, num_points=2, batch_first=batch_first)
    shapes, starts = torch.tensor([[4, 5], [2, 3]]), torch.tensor([0, 20])
    q, v = torch.randn(2, 3, 16), torch.randn(2, 26, 16)
    if not batch_first:
        q, v = q.transpose(0, 1), v.transpose(0, 1)
    args = dict(query=q, value=v, reference_points=torch.rand(2, 3, 2, 2), spatial_shapes=shapes,
                level_start_index=starts)
    assert m(**args).shape == q.shape
    with pytest.raises(ValueError, match=match):
        m(**change(args, batch_first))


def test_module_reference_points_and_padding_mask_broadcast_as_in_the_source():
    """A size of 1 where the source's arithmetic broadcasts (one level's reference points, one image's padding mask)
    is accepted and gives the expanded tensor's result."""
    torch.manual_seed(0)
    m = deformconv.MSDeformAttn(16, n_levels=2, n_heads=2, n_points=2)
    shapes, starts = torch.tensor([[4, 5], [2, 3]]), torch.tensor([0, 20])
    q, ref, x = torch.randn(2, 3, 16), torch.rand(2, 3, 1, 2), torch.randn(2, 26, 16)
    pad = torch.rand(1, 26) < 0.3
    torch.testing.assert_close(m(q, ref, x, shapes, starts, pad),
                               m(q, ref.expand(2, 3, 2, 2), x, shapes, starts, pad.expand(2, 26)))


@pytest.mark.parametrize("batch_first", [True, False])
def test_module_takes_an_empty_batch(batch_first):
    m = deformconv.MultiScaleDeformableAttention(16, num_heads=2, num_levels=2, num_points=2, dropout=0.0,
                                                 batch_first=batch_first)
    q, v = torch.randn(0, 3, 16, requires_grad=True), torch.randn(0, 26, 16)
    if not batch_first:
        q, v = q.transpose(0, 1), v.transpose(0, 1)
    out = m(q, value=v, reference_points=torch.rand(0, 3, 2, 2), spatial_shapes=torch.tensor([[4, 5], [2, 3]]),
            level_start_index=torch.tensor([0, 20]))
    assert out.shape == q.shape
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


def test_deformable_detr_module_names_its_own_arguments():
    m = deformconv.MSDeformAttn(16, n_levels=2, n_heads=2, n_points=2)
    shapes, starts = torch.tensor([[4, 5], [2, 3]]), torch.tensor([0, 20])
    q, ref, x = torch.randn(2, 3, 16), torch.rand(2, 3, 2, 2), torch.randn(2, 26, 16)
    with pytest.raises(ValueError, match="input_flatten must be \\[N, S, C\\]"):
        m(q, ref, x[:1], shapes, starts)
    with pytest.raises(ValueError, match="input_padding_mask must be \\[N, S\\], here \\[2, 26\\]"):
        m(q, ref, x, shapes, starts, torch.zeros(2, 25, dtype=torch.bool))


def test_module_keys_init_and_definition():
    """mmcv's and Deformable DETR's keys and published initialisation; the forward is the definition written out
    with the naive loops (points and boxes as reference points, a padding mask, mmcv's [L, N, C] layout)."""
    torch.manual_seed(0)
    mm = deformconv.MultiScaleDeformableAttention(16, num_heads=4, num_levels=2, num_points=3, dropout=0.0).double()
    dd = deformconv.MSDeformAttn(16, n_levels=2, n_heads=4, n_points=3).double()
    keys = ["attention_weights.bias", "attention_weights.weight", "output_proj.bias", "output_proj.weight",
            "sampling_offsets.bias", "sampling_offsets.weight", "value_proj.bias", "value_proj.weight"]
    assert sorted(mm.state_dict()) == keys and sorted(dd.state_dict()) == keys
    bias = mm.sampling_offsets.bias.view(4, 2, 3, 2)
    torch.testing.assert_close(bias[1, 0, 2], torch.tensor([0.0, 3.0], dtype=torch.float64), atol=1e-6, rtol=0)
    assert not mm.attention_weights.weight.any() and not mm.sampling_offsets.weight.any()
    dd.load_state_dict(mm.state_dict())
    for p in dd.parameters():
        torch.nn.init.normal_(p, std=0.2)
    mm.load_state_dict(dd.state_dict())
    shapes, starts = torch.tensor([[5, 6], [2, 3]]), torch.tensor([0, 30])
    q, x = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 36, 16, dtype=torch.float64)
    pad = torch.zeros(2, 36, dtype=torch.bool)
    pad[1, -5:] = True
    for ref in (torch.rand(2, 7, 2, 2, dtype=torch.float64), torch.rand(2, 7, 2, 4, dtype=torch.float64)):
        v = dd.value_proj(x).masked_fill(pad[..., None], 0).view(2, 36, 4, 4)
        off = dd.sampling_offsets(q).view(2, 7, 4, 2, 3, 2)
        a = dd.attention_weights(q).view(2, 7, 4, 6).softmax(-1).view(2, 7, 4, 2, 3)
        if ref.shape[-1] == 2:
            normalizer = torch.tensor([[6.0, 5.0], [3.0, 2.0]], dtype=torch.float64)  # (W, H) of each level
            loc = ref[:, :, None, :, None] + off / normalizer[:, None]
        else:
            loc = ref[:, :, None, :, None, :2] + off / 3 * ref[:, :, None, :, None, 2:] * 0.5
        expected = dd.output_proj(naive_ms_deform_attn(v, shapes, starts, loc, a))
        torch.testing.assert_close(dd(q, ref, x, shapes, starts, pad), expected)
        got = mm(q.transpose(0, 1), value=x.transpose(0, 1), reference_points=ref, spatial_shapes=shapes,
                 level_start_index=starts, key_padding_mask=pad)
        torch.testing.assert_close(got, expected.transpose(0, 1) + q.transpose(0, 1))
