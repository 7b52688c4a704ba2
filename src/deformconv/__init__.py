"""deformconv: deformable convolution (DCNv1 offsets, DCNv2 modulation; InternImage's DCNv3 and DCNv4) and
multi-scale deformable attention for PyTorch.

A drop-in for ``torchvision.ops.deform_conv2d`` registered as one ``torch.library`` op
(``torch.ops.deformconv.deform_conv2d``), with a plain-PyTorch reference backend and fused Triton kernels.
"""

from .backends import not_supported_reasons, select_backend
from .dcnv import (DCNv3Function, DCNv4Function, dcnv3, dcnv3_to_dcnv4, dcnv3_to_deform_conv2d, dcnv4,
                   dcnv4_to_dcnv3)
from .dcnv_modules import DCNv3, DCNv4
from .msda import MSDeformAttn, MultiScaleDeformableAttention, ms_deform_attn, ms_deform_attn_v2
from .roi_pool import (DeformPSRoIPooling, DeformRoIPool, DeformRoIPoolPack, ModulatedDeformRoIPoolPack,
                       deform_psroi_pool, deform_roi_pool)
from .functional import deform_conv2d, deform_conv2d_script
from .modules import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack
from .surgery import make_deformable, resnet_stages
from . import onnx  # noqa: E402  (registers the TorchScript exporter's symbolic)

__version__ = "0.1.0"

__all__ = [
    "deform_conv2d",
    "deform_conv2d_script",
    "DeformConv2d",
    "DeformConv2dPack",
    "ModulatedDeformConv2dPack",
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
