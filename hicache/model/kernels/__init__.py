"""Kernels (docs/DESIGN.md, "batch-invariant ops"): the one layer through which the model calls GEMM
and attention kernels (ops.py), the call shapes measured on this machine (calibration.py), the
start-up self-check (invariance.py), weights kept as integer codes (quant.py), and TP's fixed groups
(tp_groups.py)."""
