"""Deformable RoI pooling (Deformable ConvNets; mmcv's ``DeformRoIPool``) and its position-sensitive variant: ``op``
(the ``torch.library`` ops), ``reference`` (plain PyTorch, any device and dtype, the oracle; the CPU path) and
``triton`` (the kernels and their launchers: ``roi``, ``ps``).

Each RoI (batch index, x1, y1, x2, y2) is scaled by spatial_scale and shifted by −0.5 (aligned RoIAlign, no
rounding) and cut into ph × pw bins; bin (i, j)'s start moves by gamma · (roi width, roi height) · offset[:, (0, 1),
i, j]; the bin is the mean of sampling_ratio² bilinear samples (RoIAlign's: a sample outside [−1, H] × [−1, W] is 0,
one inside is clamped to the image), sampling_ratio 0 meaning ceil(roi size / bins) along each axis.
"""
