"""Paged-attention kernels (Triton) and their torch references.

Installed as `workbench_kernels` (never as a top-level `kernels`, a name that belongs to Hugging
Face's package). The layout of the paged KV cache is documented in `reference.py`.
"""
