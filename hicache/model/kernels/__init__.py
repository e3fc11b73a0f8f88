"""Kernels (docs/DESIGN.md, "batch-invariant ops"): the one layer through which the model calls GEMM
and attention kernels (ops.py), the call shapes measured on this machine (calibration.py), the
start-up self-check (invariance.py), weights kept as integer codes (quant.py), hicache's native
quantized GEMMs and their build (native.py, csrc/), where measured plans and builds are kept
(cache_dir.py), and TP's fixed groups (tp_groups.py)."""
