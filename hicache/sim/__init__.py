"""The capacity simulator (docs/DESIGN.md, "capacity simulator"): `hicache simulate` replays a request
trace through the real scheduler and cache in virtual time, with compute and data movement costed by a
cost model (cost.py) instead of performed."""
