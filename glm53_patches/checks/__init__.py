"""Harness shared by the patches' checks: host emulation of GPU built-ins (CUDA warps), and the Metal type check and
differential emulation (metal/). Never imported at run time."""
