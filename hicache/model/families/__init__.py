"""Decoder families (docs/DESIGN.md, "model family"): Llama (llama.py), MLA (mla.py), the token-shift
decoder of the sidecar draft (shift.py), each by name in one registry (registry.py), and the built-in
models with seeded weights (tiny.py, tiny_mla.py)."""
