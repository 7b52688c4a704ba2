"""deformconv.integrations.transformers: every transformers family with multi-scale deformable attention, patched,
against transformers' own path in float64 (outputs and every parameter's gradient, train and eval mode, batch 1 and
2), with transformers' own attention code made to raise during the patched run, so that a silent fallback fails.

Tiny models from their configs (tests/_hf_models.py), nothing downloaded (HF_HUB_OFFLINE=1)."""

import copy
import os
import sys
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import _hf_models as models  # noqa: E402
from conftest import TOL, assert_close, requires_cuda  # noqa: E402

import deformconv  # noqa: E402
from deformconv.integrations import transformers as integration  # noqa: E402

# The quick test command takes one family of each code shape; the whole suite every family.
QUICK = ("deformable_detr", "rt_detr_v2", "d_fine", "mask2former")
CASES = [pytest.param(family, {}, marks=() if family in QUICK else pytest.mark.full) for family in models.FAMILIES] + [
    ("rt_detr_v2", {"decoder_method": "discrete"}),
    pytest.param("d_fine", {"decoder_method": "discrete"}, marks=pytest.mark.full),
]
IDS = [family + "".join(f"-{k}={v}" for k, v in overrides.items())
       for family, overrides in (c.values if hasattr(c, "values") else c for c in CASES)]


ZERO = 1e-6  # a gradient this small against the model's largest is zero up to cancellation


def _fallback(*args, **kwargs):
    raise AssertionError("transformers' own multi-scale deformable attention ran in a patched model")


def _disable_transformers_attention(monkeypatch, model) -> None:
    """transformers' attention functions and MultiScaleDeformableAttention.forward raise from here on."""
    for m in model.modules():
        cls = type(m)
        module = sys.modules[cls.__module__]
        if cls.__name__ == integration.MODULE_CLASS:
            monkeypatch.setattr(cls, "forward", _fallback)
        for name in integration.FUNCTIONS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _fallback)


def _float_tensors(out) -> list:
    """Every floating tensor of a model output, in order (nested tuples and ModelOutputs flattened)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _float_tensors(item)]
    return []


def _random_linear(outputs: list) -> torch.Tensor:
    """The same random linear function of all outputs on every path: float64 weights from a generator seeded on the
    outputs' device."""
    g = torch.Generator(device=outputs[0].device).manual_seed(7)
    return sum((t.double() * torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float64)).sum()
               for t in outputs)


def _step(model, family: str, batch: int, train: bool):
    """Outputs and every parameter's gradient of a random linear function of all outputs (seeded: dropout and the
    function's weights the same in every run)."""
    model.train(train)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    outputs = _float_tensors(model(**models.inputs(family, batch)))
    _random_linear(outputs).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [t.detach() for t in outputs], grads


def _model(family: str, **overrides):
    """The family's tiny model in float64, its sampling offsets moved off their initial whole-pixel pattern: at a whole
    pixel the bilinear sample's derivative has a jump, and which side each path takes is rounding's choice (a trained
    model's points lie anywhere)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.build(family, **overrides).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sampling_offsets" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("family, overrides", CASES, ids=IDS)
def test_patched_model_matches_transformers(family, overrides, monkeypatch):
    base = _model(family, **overrides)
    # each run on a fresh copy: batch norms' running statistics and OmDet-Turbo's text cache start the same
    runs = [(b, t) for b in (1, 2) for t in (False, True)]
    expected = {run: _step(copy.deepcopy(base), family, *run) for run in runs}
    patched = [integration.patch(copy.deepcopy(base)) for _ in runs]
    assert integration.patched(patched[0]), "nothing patched"
    _disable_transformers_attention(monkeypatch, base)
    for model, ((batch, train), (want_out, want_grads)) in zip(patched, expected.items()):
        got_out, got_grads = _step(model, family, batch, train)
        what = f"{family} batch {batch} {'train' if train else 'eval'}"
        assert len(got_out) == len(want_out) > 0, what
        for i, (a, b) in enumerate(zip(got_out, want_out)):
            assert_close(a, b, torch.float64, f"{what}: output {i}")
        assert set(got_grads) == set(want_grads), what
        assert want_grads, what
        # Each gradient within float64's tolerance of the largest gradient of the model. Some are zero by the
        # algebra (a bias just before a normalisation): what either path computes for those is the residue of a sum
        # that cancels, whose terms can be far larger than any gradient; such a gradient (under ZERO of the largest
        # on transformers' path) must be as small on ours.
        scale = max(g.abs().max().item() for g in want_grads.values())
        atol, rtol = TOL[torch.float64]
        for name, grad in want_grads.items():
            got = got_grads[name]
            assert not torch.isnan(got).any(), f"{what}: NaN in grad of {name}"
            if grad.abs().max() < ZERO * scale:
                assert got.abs().max() < ZERO * scale, f"{what}: grad of {name} is zero on transformers' path"
                continue
            torch.testing.assert_close(got, grad, atol=atol * scale, rtol=rtol,
                                       msg=lambda m: f"{what}: grad of {name}: {m}")


@pytest.mark.parametrize("method", ["default", "discrete"])
@pytest.mark.parametrize("counts", [(3, 1, 2), (2, 2, 2), (1,)], ids=str)
def test_v2_function_matches_transformers(method, counts):
    """ms_deform_attn_v2 against transformers' multi_scale_deformable_attention_v2 itself, levels with points of
    their own count (the models of transformers 5.23 fail on such configs before reaching the attention), odd level
    sizes, locations also outside [0, 1]; output and gradients in float64."""
    from transformers.models.rt_detr_v2.modeling_rt_detr_v2 import multi_scale_deformable_attention_v2 as theirs

    g = torch.Generator().manual_seed(sum(counts))
    sizes = [(7, 9), (4, 5), (3, 2)][:len(counts)]
    n, lq, m, d, t = 2, 5, 3, 4, sum(counts)
    value = torch.randn(n, sum(h * w for h, w in sizes), m, d, generator=g, dtype=torch.float64)
    loc = torch.rand(n, lq, m, t, 2, generator=g, dtype=torch.float64) * 1.4 - 0.2
    attn = torch.rand(n, lq, m, t, generator=g, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (value, loc, attn)]
    want = theirs(value, sizes, loc, attn, list(counts), method)
    grad_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    need = leaves if method == "default" else [value, attn]  # discrete: no gradient for the locations
    want_grads = torch.autograd.grad(want, need, grad_out)
    for backend in ("reference", "cpu"):
        got = deformconv.ms_deform_attn_v2(value, sizes, loc, attn, counts, method, backend=backend)
        assert_close(got, want, torch.float64, f"{backend} output")
        names = ("value", "loc", "attn") if method == "default" else ("value", "attn")
        for a, b, name in zip(torch.autograd.grad(got, need, grad_out), want_grads, names):
            assert_close(a, b, torch.float64, f"{backend} grad of {name}")
    shapes = torch.tensor(sizes)  # the levels as a tensor too
    assert_close(deformconv.ms_deform_attn_v2(value, shapes, loc, attn, counts, method), want, torch.float64, "")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_v2_discrete_sums_the_points_of_a_pixel_once_rounded(device, dtype):
    """The discrete method in 16 bits: 8,192 points a pixel (a 2x2 level), the value's gradient within the dtype's
    tolerance of float64's. Summed in the value's dtype (the GPU's atomics), each addition would round: off by
    about a tenth."""
    g = torch.Generator().manual_seed(3)
    n, lq, m, d, t = 1, 4096, 1, 3, 8
    value = torch.randn(n, 4, m, d, generator=g, dtype=torch.float64).to(dtype).double()
    loc = torch.randint(0, 2, (n, lq, m, t, 2), generator=g).double() / 2 + 0.25  # pixel centres: no rounding ties
    attn = torch.randn(n, lq, m, t, generator=g, dtype=torch.float64).to(dtype).double()
    grad_out = torch.randn(n, lq, m * d, generator=g, dtype=torch.float64).to(dtype).double()
    want = torch.autograd.grad(deformconv.ms_deform_attn_v2(value.requires_grad_(), [(2, 2)], loc, attn, [t],
                                                            "discrete"), value, grad_out)[0]
    low = value.detach().to(device, dtype).requires_grad_()
    out = deformconv.ms_deform_attn_v2(low, [(2, 2)], loc.to(device, dtype), attn.to(device, dtype), [t], "discrete")
    got = torch.autograd.grad(out, low, grad_out.to(device, dtype))[0]
    assert got.dtype == dtype
    assert_close(got.double().cpu(), want, dtype, "grad of value")


def test_v2_function_checks_its_arguments():
    value, loc, attn = torch.randn(1, 20, 2, 4), torch.rand(1, 3, 2, 5, 2), torch.rand(1, 3, 2, 5)
    with pytest.raises(ValueError, match="method must be one of \\['default', 'discrete'\\], got 'nearest'"):
        deformconv.ms_deform_attn_v2(value, [(4, 5)], loc, attn, [5], "nearest")
    with pytest.raises(ValueError, match="num_points_list must have a count per level \\(1\\), got \\[2, 3\\]"):
        deformconv.ms_deform_attn_v2(value, [(4, 5)], loc, attn, [2, 3])
    with pytest.raises(ValueError, match="num_points_list\\[0\\] must be an int >= 1, got 0"):
        deformconv.ms_deform_attn_v2(value, [(4, 5)], loc, attn, [0])
    with pytest.raises(ValueError, match="spatial_shapes' levels must cover value's S = 20 pixels"):
        deformconv.ms_deform_attn_v2(value, [(4, 4)], loc, attn, [5])
    with pytest.raises(ValueError, match="sampling_locations must have shape \\[1, Lq, 2, 5, 2\\]"):
        deformconv.ms_deform_attn_v2(value, [(4, 5)], loc[..., :4, :], attn, [5])
    with pytest.raises(ValueError, match="attention_weights must have shape \\[1, 3, 2, 5\\]"):
        deformconv.ms_deform_attn_v2(value, [(4, 5)], loc, attn[..., :4], [5])
    empty = deformconv.ms_deform_attn_v2(value[:0], [(4, 5)], loc[:0], attn[:0], [5])
    assert empty.shape == (0, 3, 8)


def test_patch_is_idempotent_and_unpatch_restores(monkeypatch):
    model = models.build("deformable_detr").double().eval()
    sites = integration.patched(integration.patch(model))
    # encoder self-attention and decoder cross-attention of each layer
    assert len(sites) == 3 and all(s.endswith(".attn") for s in sites), sites
    assert integration.patched(integration.patch(model, backend="reference")) == sites
    assert model.model.encoder.layers[0].self_attn.attn.__dict__["_deformconv_backend"] == "reference"
    integration.unpatch(model)
    assert integration.patched(model) == []
    state = model.state_dict()
    integration.patch(model)
    assert model.state_dict().keys() == state.keys()  # nothing of the model's own changes
    integration.unpatch(model)
    for family in ("rt_detr_v2", "d_fine", "mask2former"):  # the other three shapes: a global, an attribute
        m = models.build(family)
        assert integration.patched(integration.patch(m))
        assert integration.patched(integration.unpatch(m)) == []


def test_patch_warns_where_there_is_nothing_to_patch():
    with pytest.warns(UserWarning, match=r"nothing to patch in Sequential: looked for a module "
                                         r"MultiScaleDeformableAttention"):
        integration.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        integration.patch("SenseTime/deformable-detr")


def test_enable_covers_models_built_afterwards(monkeypatch):
    """enable(): classes and module functions replaced, so a model built afterwards runs on deformconv (and matches
    transformers' path); disable() gives transformers back."""
    families = ("deformable_detr", "rt_detr_v2", "d_fine", "mask2former")
    expected = {}
    for family in families:
        model = models.build(family).double().eval()
        expected[family] = _step(model, family, 2, False)
    integration.enable()
    try:
        assert integration.enabled()
        for family in families:
            model = models.build(family).double().eval()
            assert integration.patched(model), family
            got = _step(model, family, 2, False)
            for a, b in zip(got[0], expected[family][0]):
                assert_close(a, b, torch.float64, family)
    finally:
        integration.disable()
    assert not integration.enabled()
    for family in families:
        assert integration.patched(models.build(family)) == [], family


def test_import_deformconv_imports_no_transformers():
    import subprocess

    code = "import sys, deformconv, deformconv.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


GPU_CASES = [("deformable_detr", {}), ("rt_detr", {}), ("rt_detr_v2", {"decoder_method": "discrete"}),
             ("d_fine", {}), ("grounding_dino", {}), ("mask2former", {}), ("oneformer", {})]


def _gpu_run(model, family: str, dtype: torch.dtype, autocast: bool):
    """Outputs, then None, then every parameter's gradient (float64 copies) of a training step on the GPU: the model
    in dtype, under bf16 autocast if asked, differentiating _random_linear as _step does."""
    model.train(True)
    torch.manual_seed(5)
    args = {k: v.cuda().to(dtype) if v.is_floating_point() else v.cuda()
            for k, v in models.inputs(family, 2, torch.float32).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        outputs = _float_tensors(model(**args))
    _random_linear(outputs).backward()
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return [t.detach().double() for t in outputs] + [None] + grads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("family, overrides", GPU_CASES, ids=[c[0] + "-" + "".join(c[1]) for c in GPU_CASES])
def test_patched_model_on_the_gpu(family, overrides, dtype, monkeypatch):
    """The patched model's outputs and every gradient on the Triton kernels (TF32 off), each tensor in norm.

    fp32: no further from transformers' own path in float64 than twice transformers' own fp32 path is, or within
    fp32's tolerance of it. A tiny random model's gradients can be ill-conditioned (a batch norm over two values),
    where no fp32 result is within fp32's tolerance of float64's, transformers' own included.
    bf16 autocast: within bf16's tolerance of the same patched model on the reference backend under the same autocast
    (the same casts: value and output in bf16). transformers' own path is no yardstick there: autocast runs its
    grid_sample in fp32.
    Gradients zero by the algebra (under ZERO of the largest) must be as small as the yardstick's residue or the
    tolerance of the largest. Non-finite elements must match; transformers' attention raises during the patched
    runs."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    autocast = dtype == torch.bfloat16
    base = _model(family, **overrides).cuda()
    theirs = None
    model = integration.patch(copy.deepcopy(base).float())  # patched before transformers' attention is disabled
    if autocast:
        on_reference = integration.patch(copy.deepcopy(base).float(), backend="reference")
        _disable_transformers_attention(monkeypatch, base)
        want_all = _gpu_run(on_reference, family, torch.float32, True)
    else:
        want_all = _gpu_run(copy.deepcopy(base), family, torch.float64, False)
        theirs = _gpu_run(copy.deepcopy(base).float(), family, torch.float32, False)
        _disable_transformers_attention(monkeypatch, base)
    ours = _gpu_run(model, family, torch.float32, autocast)
    first_grad = want_all.index(None) + 1
    scale = max(g.abs().max().item() for g in want_all[first_grad:])
    atol = TOL[dtype][0]
    assert len(ours) == len(want_all) and first_grad > 1
    for i, (want, got) in enumerate(zip(want_all, ours)):
        if want is None:
            continue
        what = f"{family} {'output' if i < first_grad else 'gradient'} {i}"
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite elements differ"
        their = None if theirs is None else theirs[i][finite]
        want, got = want[finite], got[finite]
        if want.numel() == 0:
            continue
        if i >= first_grad and want.abs().max() < ZERO * scale:
            bound = atol * scale if their is None else max(2 * (their - want).abs().max().item(), atol * scale)
            assert (got - want).abs().max().item() <= bound, f"{what} is zero by the algebra"
            continue
        err = (got - want).norm().item()
        bound = atol * want.norm().item()
        if their is not None:
            bound = max(bound, 2 * (their - want).norm().item())
        assert err <= bound, f"{what}: off by {err:.3g} in norm (allowed {bound:.3g}, norm {want.norm().item():.3g})"


@pytest.mark.full
@pytest.mark.parametrize("family", ["deformable_detr", "mask2former"])
def test_patched_model_compiles(family):
    """torch.compile over a patched model (the module's forward replaced; a forward rebound to read deformconv's
    function: Dynamo keeps its compiled code in the module's globals, which the rebound forward must share)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.build(family).eval()
        args = models.inputs(family, 2, torch.float32)
        want = _float_tensors(model(**args))
        got = _float_tensors(torch.compile(integration.patch(model), backend="aot_eager")(**args))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, torch.float32, f"output {i}")
