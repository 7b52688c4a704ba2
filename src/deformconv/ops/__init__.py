"""The operators' implementations, one folder per op family (its reference, kernels, configs and launchers), and
``common``: what the families share (bilinear sampling helpers, layout kernels, launch machinery)."""
