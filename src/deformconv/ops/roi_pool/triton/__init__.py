"""Deformable RoI pooling's Triton backend: ``roi`` (deform_roi_pool's kernels and launchers) and ``ps`` (the
position-sensitive deform_psroi_pool's)."""
