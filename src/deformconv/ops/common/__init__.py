"""Shared by the op families: ``sampling`` (``@triton.jit`` bilinear helpers), ``layout`` (layout kernels and their
launchers), ``launch`` (plans, direct relaunch, TMA checks, config choice)."""
