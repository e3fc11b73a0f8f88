"""The engine's command-line flags (SGLang's names where the concept is the same), shared by `serve`,
`generate`, `bench` and `demo`; each group's defaults are its config dataclass's."""

from __future__ import annotations

import argparse

from hicache.config import DebugConfig, DisaggConfig, EngineConfig, HiCacheConfig, ParallelConfig, SpeculativeConfig
from hicache.storage import registry


def add_command(sub: argparse._SubParsersAction, name: str, help_text: str, doc: str | None) -> argparse.ArgumentParser:
    """`hicache NAME`: `help_text` in the command list, and its module's docstring `doc` as written (line breaks
    kept) at the top of its --help."""
    return sub.add_parser(name, help=help_text, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=d.model,
        help="tiny, tiny-mla, tiny-hybrid, smollm2, a .gguf file, or a local Hugging Face directory of a supported family "
        "(Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3)",
    )
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (a power of two)")
    g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="device KV pool capacity in tokens")
    g.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=d.swa_full_tokens_ratio,
        help="a hybrid model's sliding-window KV pool, as a share of --max-total-tokens",
    )
    g.add_argument(
        "--mamba-track-interval",
        type=int,
        default=d.mamba_track_interval,
        help="tokens between the recurrent-state snapshots a hybrid model's cache keeps (a page multiple; "
        "0: only at a turn's end; default: every page): a hit ends at one",
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help="most prompt tokens prefilled in one step",
    )
    g.add_argument(
        "--max-running-requests", type=int, default=d.max_running_requests, help="requests in the continuous batch"
    )
    g.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="defaults to the model's; at most what it supports (tiny, tiny-mla, tiny-hybrid: 1048576)",
    )
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto (the fastest here: float32 where the weights run on hicache's native kernels, bfloat16 "
        "for dense weights on a CPU with native bf16 (HICACHE_CPU_BF16=1|0 overrides the CPU's answer) and on "
        "CUDA, else float32), float32 or bfloat16",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        help="the KV cache's dtype in every tier: auto (the activations'), float32 or bfloat16 (with float32 "
        "activations: half the bytes a token, each K/V row rounded once as it is written; plain attention "
        "models only)",
    )
    g.add_argument(
        "--quantization",
        default=d.quantization,
        help="weight format of the linear layers: auto (the default: a GGUF's quantized tensors stay "
        "quantized, int4 for Q4_1 and int8 for Q8_0, where a fast kernel runs them here), none (every weight "
        "dense), int8 or int4 (every linear weight in that format)",
    )
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix reuse at all")
    g.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="fail a request not finished this many seconds after submission (0: never)",
    )
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish what the cache stores and drops per tier, in vLLM's KV events format, on a ZeroMQ "
        "PUB socket bound here (tcp://host:port; vLLM's replay socket on port + 1); off by default",
    )
    h = HiCacheConfig()
    t = parser.add_argument_group("hierarchical cache")
    t.add_argument("--enable-hierarchical-cache", action="store_true", help="add the host-memory tier")
    t.add_argument("--hicache-ratio", type=float, default=h.hicache_ratio, help="host capacity / device capacity")
    t.add_argument(
        "--hicache-size", type=float, default=h.hicache_size, help="host capacity in GB (overrides the ratio)"
    )
    t.add_argument("--hicache-mem-layout", default=h.hicache_mem_layout, help="page_first, layer_first or page_unified")
    t.add_argument(
        "--hicache-write-policy",
        default=h.hicache_write_policy,
        help="write_through, write_through_selective or write_back",
    )
    t.add_argument(
        "--hicache-load-back-threshold",
        type=int,
        default=h.hicache_load_back_threshold,
        help="host hits shorter than this many tokens are recomputed",
    )
    t.add_argument(
        "--hicache-storage-backend",
        default=None,
        help=f"{' or '.join(registry.BACKENDS)}: add the storage tier (hicache/storage/registry.py)",
    )
    t.add_argument(
        "--hicache-storage-backend-extra-config",
        default=None,
        help="a JSON object of the backend's own options, as SGLang's flag (an option it does not take is "
        "refused, naming those it does)",
    )
    t.add_argument("--hicache-storage-dir", default=None, help="file backend directory (default: user cache dir)")
    t.add_argument("--hicache-storage-url", default=h.hicache_storage_url, help="redis backend URL")
    t.add_argument(
        "--hicache-storage-prefetch-threshold",
        type=int,
        default=h.hicache_storage_prefetch_threshold,
        help="prefetch from storage only when at least this many tokens are there",
    )
    t.add_argument(
        "--hicache-storage-prefetch-policy",
        default=h.hicache_storage_prefetch_policy,
        help="best_effort, wait_complete or timeout",
    )
    t.add_argument(
        "--hicache-storage-prefetch-timeout-base",
        type=float,
        default=h.hicache_storage_prefetch_timeout_base,
        help="policy timeout: seconds a prefetch may take, plus the per-1024-token share below",
    )
    t.add_argument(
        "--hicache-storage-prefetch-timeout-per-ki-token",
        type=float,
        default=h.hicache_storage_prefetch_timeout_per_ki_token,
        help="policy timeout: seconds more per 1024 prefetched tokens",
    )
    t.add_argument(
        "--hicache-transfer-timeout",
        type=float,
        default=h.hicache_transfer_timeout,
        help="seconds a step may wait on a host/device copy or a storage call before failing",
    )
    t.add_argument(
        "--hicache-storage-max-bytes",
        type=int,
        default=h.hicache_storage_max_bytes,
        help="file backend size cap in bytes: least recently used objects are removed (0: no cap)",
    )
    t.add_argument(
        "--hicache-storage-idle-ttl",
        type=float,
        default=h.hicache_storage_idle_ttl,
        help="redis backend: seconds an object lives after its last use, so that maxmemory-policy volatile-ttl "
        "evicts least recently used first and honours retention hints (0: objects never expire)",
    )
    t.add_argument(
        "--hicache-storage-key-scheme",
        default=h.hicache_storage_key_scheme,
        help="rank-suffix (each rank's own objects) or unified (objects any compatible TP/PP reads)",
    )
    t.add_argument(
        "--hicache-storage-head-partition",
        type=int,
        default=h.hicache_storage_head_partition,
        help="unified: KV heads per head group (0: one)",
    )
    t.add_argument(
        "--hicache-storage-layer-partition",
        type=int,
        default=h.hicache_storage_layer_partition,
        help="unified: layers per layer range (0: every layer in one range)",
    )
    t.add_argument(
        "--hicache-draft-layout",
        default=h.hicache_draft_layout,
        help="packed (draft layers appended to the target's host pool), sidecar (pools of its own) or auto",
    )
    p = ParallelConfig()
    r = parser.add_argument_group("parallelism")
    r.add_argument(
        "--tp-size", type=int, default=p.tp_size, help="tensor parallel ranks (split KV heads and MLP columns)"
    )
    r.add_argument("--pp-size", type=int, default=p.pp_size, help="pipeline parallel stages (split layers)")
    r.add_argument("--nnodes", type=int, default=p.nnodes, help="nodes the ranks are spread over")
    r.add_argument("--node-rank", type=int, default=p.node_rank, help="this node's index (0 serves the API)")
    r.add_argument("--dist-init-addr", default=None, help="HOST:PORT of node 0's rendezvous (multi-node)")
    r.add_argument(
        "--dist-timeout",
        type=float,
        default=p.dist_timeout,
        help="seconds a collective waits for a missing peer before the server fails",
    )
    r.add_argument(
        "--cp-size",
        type=int,
        default=p.cp_size,
        help="context parallel ranks (split prefill tokens, shard KV pages over them)",
    )
    r.add_argument(
        "--cp-gather-tokens",
        type=int,
        default=p.cp_gather_tokens,
        help="per rank: prefix tokens one layer's gather of sharded KV may hold, its scratch "
        "buffers' size, kept by admission (0: a whole layer of the pool)",
    )
    q = DebugConfig()
    b = parser.add_argument_group("fault injection (debugging rank agreement)")
    b.add_argument(
        "--debug-transfer-delay-ms",
        type=float,
        default=q.debug_transfer_delay_ms,
        help="delay each transfer's completion by a random amount up to N ms (seeded per rank)",
    )
    b.add_argument(
        "--debug-storage-fail-rate",
        type=float,
        default=q.debug_storage_fail_rate,
        help="fraction of storage page reads that fail on --debug-storage-fail-rank",
    )
    b.add_argument(
        "--debug-storage-fail-rank", type=int, default=q.debug_storage_fail_rank, help="the rank whose reads fail"
    )
    b.add_argument(
        "--debug-disable-pp-sync",
        action="store_true",
        help="let later pipeline stages poll their own transfer queues (reproduces a divergence bug)",
    )
    b.add_argument(
        "--debug-load-fail-rate",
        type=float,
        default=q.debug_load_fail_rate,
        help="fraction of host -> device loads that fail (each rank draws its own): the requests "
        "that needed them recompute",
    )
    b.add_argument(
        "--debug-step-delay-ms",
        type=float,
        default=q.debug_step_delay_ms,
        help="make every forward step N ms slower (stands in for a slow model or a long prefill)",
    )
    b.add_argument(
        "--debug-skip-draft-restore",
        action="store_true",
        help="restore only the target's KV on a host or storage hit, and move only it between P/D servers (both "
        "servers set it); the draft recomputes its prefix",
    )
    s = SpeculativeConfig()
    v = parser.add_argument_group("speculative decoding")
    v.add_argument(
        "--speculative-algorithm",
        default=None,
        help="draft: a separate draft model proposes tokens; ngram: the tokens that followed the request's last "
        "few tokens where they occurred earlier in it (prompt lookup, no draft model)",
    )
    v.add_argument(
        "--speculative-draft-model",
        default=None,
        help="tiny-draft-packed, tiny-draft-sidecar, tiny-mtp, smollm2-draft[-N], or a model path",
    )
    v.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=s.speculative_num_draft_tokens,
        help="tokens proposed per step (the target verifies them in one pass)",
    )
    v.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=s.speculative_ngram_min_match_window_size,
        help="ngram: the fewest trailing tokens a match covers",
    )
    v.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=s.speculative_ngram_max_match_window_size,
        help="ngram: the most trailing tokens a match covers (the longest match found proposes)",
    )
    s = DisaggConfig()
    x = parser.add_argument_group("prefill-decode disaggregation")
    x.add_argument(
        "--disaggregation-mode",
        default=s.disaggregation_mode,
        help="null (one server does everything), prefill or decode (pair them with `hicache router`)",
    )
    x.add_argument(
        "--disaggregation-transfer-backend",
        default=s.disaggregation_transfer_backend,
        help="how KV moves from prefill to decode: zmq (ZeroMQ over TCP)",
    )
    x.add_argument(
        "--disaggregation-bootstrap-host",
        default=s.disaggregation_bootstrap_host,
        help="prefill: the address its KV transfer endpoint binds and decode servers reach it at",
    )
    x.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=s.disaggregation_bootstrap_port,
        help="prefill: the transfer endpoint's port (rank r listens on port + r)",
    )
    x.add_argument(
        "--disaggregation-decode-enable-radix-cache",
        action="store_true",
        help="decode: keep a radix tree and ask prefill only for the KV after the prefix it holds",
    )
    x.add_argument(
        "--disaggregation-transfer-timeout",
        type=float,
        default=s.disaggregation_transfer_timeout,
        help="seconds a request waits for a word from its peer (metadata, KV, or prefill saying it still "
        "computes) before it fails",
    )
    x.add_argument(
        "--disaggregation-transfer-chunk-pages",
        type=int,
        default=s.disaggregation_transfer_chunk_pages,
        help="prefill: KV pages per transfer message (0: about 4 MiB of KV)",
    )
    x.add_argument(
        "--debug-disagg-chunk-delay-ms",
        type=float,
        default=s.debug_disagg_chunk_delay_ms,
        help="fault injection: prefill waits this long before sending each KV chunk",
    )
