"""deformconv: the deformable ops for PyTorch: deformable convolution (DCNv1 offsets, DCNv2 modulation; of rank 1, 2
and 3, and transposed), InternImage's DCNv3 and DCNv4, multi-scale deformable attention (Deformable DETR) and
deformable RoI pooling (with its position-sensitive variant).

Each op is one ``torch.library`` op (``torch.ops.deformconv.*``) with a plain-PyTorch reference, a CPU backend where
one pays and fused Triton kernels on the GPU; ``deform_conv2d`` is a drop-in for ``torchvision.ops.deform_conv2d``.
Public side: one file per family (``deform_conv``, ``deform_conv_nd``, ``dcnv``, ``msda``, ``roi_pool``); each
family's op, reference and kernels under ``ops/<family>``; one dispatch for all of them (``select_backend``,
``not_supported_reasons``).
"""

from . import onnx  # registers the TorchScript exporter's symbolic
from .dcnv import (
    DCNv3,
    DCNv3Function,
    DCNv4,
    DCNv4Function,
    dcnv3,
    dcnv3_to_dcnv4,
    dcnv3_to_deform_conv2d,
    dcnv4,
    dcnv4_to_dcnv3,
)
from .deform_conv import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack, deform_conv2d, deform_conv2d_script
from .deform_conv_nd import (
    DeformConv1d,
    DeformConv1dPack,
    DeformConv3d,
    DeformConv3dPack,
    DeformConvTranspose1d,
    DeformConvTranspose1dPack,
    DeformConvTranspose2d,
    DeformConvTranspose2dPack,
    DeformConvTranspose3d,
    DeformConvTranspose3dPack,
    deform_conv1d,
    deform_conv3d,
    deform_conv_transpose1d,
    deform_conv_transpose2d,
    deform_conv_transpose3d,
)
from .msda import MSDeformAttn, MultiScaleDeformableAttention, ms_deform_attn, ms_deform_attn_v2
from .ops.common.dispatch import not_supported_reasons, select_backend
from .roi_pool import (
    DeformPSRoIPooling,
    DeformRoIPool,
    DeformRoIPoolPack,
    ModulatedDeformRoIPoolPack,
    deform_psroi_pool,
    deform_roi_pool,
)
from .surgery import make_deformable, resnet_stages

__version__ = "0.1.0"

__all__ = [
    "deform_conv2d",
    "deform_conv2d_script",
    "DeformConv2d",
    "DeformConv2dPack",
    "ModulatedDeformConv2dPack",
    "deform_conv1d",
    "deform_conv3d",
    "deform_conv_transpose1d",
    "deform_conv_transpose2d",
    "deform_conv_transpose3d",
    "DeformConv1d",
    "DeformConv3d",
    "DeformConvTranspose1d",
    "DeformConvTranspose2d",
    "DeformConvTranspose3d",
    "DeformConv1dPack",
    "DeformConv3dPack",
    "DeformConvTranspose1dPack",
    "DeformConvTranspose2dPack",
    "DeformConvTranspose3dPack",
    "dcnv3",
    "dcnv4",
    "DCNv3",
    "DCNv4",
    "DCNv3Function",
    "DCNv4Function",
    "dcnv3_to_dcnv4",
    "dcnv4_to_dcnv3",
    "dcnv3_to_deform_conv2d",
    "ms_deform_attn",
    "ms_deform_attn_v2",
    "MultiScaleDeformableAttention",
    "MSDeformAttn",
    "deform_roi_pool",
    "DeformRoIPool",
    "DeformRoIPoolPack",
    "ModulatedDeformRoIPoolPack",
    "deform_psroi_pool",
    "DeformPSRoIPooling",
    "onnx",
    "make_deformable",
    "resnet_stages",
    "not_supported_reasons",
    "select_backend",
    "__version__",
]
