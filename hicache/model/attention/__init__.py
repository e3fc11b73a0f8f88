"""Attention backends (docs/DESIGN.md, "attention backends"): how a layer's queries reach their KV, in
one rank's pool (backends.py) or gathered from pages sharded across ranks (gathered.py, kv_gather.py)."""
