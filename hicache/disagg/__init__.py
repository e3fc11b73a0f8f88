"""Prefill-decode disaggregation (docs/DESIGN.md, "P/D disaggregation", "P/D decode reuse", "P/D across topologies",
"P/D streaming").

A prefill server computes a request's prompt (skipping what its own prefix cache holds) and its first
token; a decode server generates the rest. Between them the KV of the prompt moves a chunk of pages at
a time, read out of prefill's locked pages as it goes, each prefill rank sending each decode rank the
cells their shards share (so the two topologies may differ),
over a transport behind a sender / receiver interface (`transfer.py`; ZeroMQ over TCP in
`zmq_prefill.py` and `zmq_decode.py`). With `--disaggregation-decode-enable-radix-cache` the decode
server keeps its own tree (device and, with `--enable-hierarchical-cache`, host memory): it reserves the
request's pages through the cache API (`KVCache.reserve`), reports the page-aligned prefix it already
holds as `decode_prefix_len`, restores the host part while prefill sends only the KV after it, and
starts decoding when both have landed (`decode_role.py`; prefill's side is `prefill_role.py`: each a
role part of the one scheduler, hicache/scheduler/role.py). `hicache router` (hicache/router/) pairs a
prefill and a decode server per request.

The modules, one concept each: `roles.py` (which role part a server's scheduler gets), `handshake.py`
(what a pair must share), `cells.py` (which cells each rank pair exchanges), `transfer.py` (the
interface), `kv_rows.py` (reading and landing page rows), `wire.py` (the messages), `agreement.py`
(ranks agree on transfer outcomes), `stats.py` (counters).
"""
