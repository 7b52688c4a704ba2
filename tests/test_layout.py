"""The package's shape: every op family the same files, imports that only go down (public files -> ops/<family> ->
ops/common -> the foundation modules config, compat and checks), and one dispatch that knows every op."""

import ast
import pathlib

import pytest

import deformconv
from deformconv.ops.common import dispatch

ROOT = pathlib.Path(deformconv.__file__).parent
PUBLIC = {"deform_conv", "deform_conv_nd", "dcnv", "msda", "roi_pool", "onnx", "surgery", "cli", "integrations",
          "benchmark"}
FOUNDATION = {"config", "compat", "checks"}
FAMILIES = {"deform_conv2d": ("deform_conv2d",), "dcnv": ("dcnv3", "dcnv4"), "msda": ("ms_deform_attn",),
            "roi_pool": ("deform_roi_pool", "deform_psroi_pool"),
            "deform_conv_nd": ("deform_conv1d", "deform_conv3d", "deform_conv_transpose1d", "deform_conv_transpose2d",
                               "deform_conv_transpose3d")}


def _imports(path: pathlib.Path):
    """(module, imported target as a tuple of package parts) for each relative import of the file."""
    rel = path.relative_to(ROOT)
    package = list(rel.parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            if node.module:
                yield rel, tuple(base + node.module.split("."))
            else:
                for alias in node.names:
                    yield rel, tuple(base + [alias.name])


def test_imports_go_down_only():
    """ops/ never imports a public module; a family imports only itself, ops/common and the foundation; ops/common
    imports no family; the foundation imports nothing of the package but itself."""
    wrong = []
    for path in ROOT.rglob("*.py"):
        for rel, target in _imports(path):
            where = rel.parts
            if where[0] == "ops":
                if target[0] in PUBLIC:
                    wrong.append((rel, target))
                elif target[0] == "ops" and len(target) > 1:
                    allowed = {"common"} if where[1] == "common" or len(where) == 2 else {"common", where[1]}
                    if target[1] not in allowed:
                        wrong.append((rel, target))
            elif where[0].removesuffix(".py") in FOUNDATION and target[0] not in FOUNDATION:
                wrong.append((rel, target))
    assert not wrong, wrong


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_has_the_same_files(family):
    """ops/<family>: op.py (the torch.library ops), reference.py (the oracle), its Triton kernels (triton.py or a
    triton/ folder) where it has a Triton backend, cpu.py where a CPU backend pays (RoI pooling's reference is its
    CPU path)."""
    folder = ROOT / "ops" / family
    assert (folder / "op.py").is_file() and (folder / "reference.py").is_file()
    has_triton = (folder / "triton.py").is_file() or (folder / "triton" / "__init__.py").is_file()
    has_cpu = (folder / "cpu.py").is_file()
    for op in FAMILIES[family]:
        assert ("triton" in dispatch.backends_of(op)) == has_triton, op
        assert ("cpu" in dispatch.backends_of(op)) == has_cpu, op


def test_the_dispatch_knows_every_op():
    ops = set(dispatch.ops())
    assert ops == {op for names in FAMILIES.values() for op in names}
    for op in ops:
        assert dispatch.backends_of(op)[-1] == "reference"
