"""Configuration (docs/DESIGN.md, "configuration, CLI flags"): one dataclass per concern, validated at start-up,
flags named as SGLang names them where the concept is the same. `add_engine_args` and
`EngineConfig.from_args` (one generic `from_args` over the dataclass fields) are the only bridge between
the CLI and the engine, so `generate`, `serve` and the benchmark's launcher share them."""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, TypeVar, get_type_hints

import torch

from hicache.config.cpu import cpu_has_native_bf16
from hicache.errors import UserError
from hicache.mem.host_pool import LAYOUTS
from hicache.model.kernels.quant import QUANTIZATIONS
from hicache.storage import registry

logger = logging.getLogger(__name__)


T = TypeVar("T")


def from_args(cls: type[T], args: argparse.Namespace, prefix: str = "", **given: Any) -> T:
    """A dataclass from parsed flags: each field from the attribute `prefix + name` when the parser has it
    (else its default), a nested dataclass field built the same way from the same flags, and `given`
    values taking precedence. The one bridge from argparse to every config dataclass, so adding a field
    and its flag is all a new option takes."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
        elif is_dataclass(hints[f.name]):
            values[f.name] = from_args(hints[f.name], args, prefix)
        elif hasattr(args, prefix + f.name):
            values[f.name] = getattr(args, prefix + f.name)
    return cls(**values)


class FromArgs:
    """`Config.from_args(args)` for the config dataclasses below (see `from_args`)."""

    @classmethod
    def from_args(cls: type[T], args: argparse.Namespace) -> T:
        return from_args(cls, args)


WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
KEY_SCHEMES = ("rank-suffix", "unified")
DRAFT_LAYOUTS = ("auto", "packed", "sidecar")
SPECULATIVE_ALGORITHMS = ("draft", "ngram")


@dataclass(frozen=True)
class HiCacheConfig(FromArgs):
    """The host and storage tiers (`--enable-hierarchical-cache` and the `--hicache-*` flags)."""

    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0  # GB; overrides the ratio when > 0
    hicache_mem_layout: str = "page_first"
    hicache_write_policy: str = "write_through"
    hicache_load_back_threshold: int = 64  # tokens; smaller host hits are recomputed instead
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_url: str = "redis://127.0.0.1:6379/0"
    hicache_storage_prefetch_threshold: int = 256
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_prefetch_timeout_base: float = 1.0  # seconds
    hicache_storage_prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 prefetched tokens
    hicache_storage_max_bytes: int = 0  # file backend: least recently used objects go past this; 0 = no cap
    hicache_storage_idle_ttl: float = 0.0  # redis backend: seconds an object lives after its last use; 0 = ever
    hicache_storage_backend_extra_config: str | None = None  # JSON: the backend's own options (storage/registry.py)
    hicache_transfer_timeout: float = 60.0  # seconds any wait on a copy or storage call may take
    hicache_draft_layout: str = "auto"  # how a speculative draft's state sits beside the target's (hicache/spec/)
    # Storage keys (hicache/storage/unified.py): "rank-suffix" names each rank's shard; "unified" cuts a
    # page on a grid of layer ranges x head groups that every compatible topology reads.
    hicache_storage_key_scheme: str = "rank-suffix"
    hicache_storage_head_partition: int = 0  # KV heads per head group; 0: one
    hicache_storage_layer_partition: int = 0  # layers per layer range; 0: all of them

    def __post_init__(self) -> None:
        if self.hicache_ratio <= 0:
            raise UserError(f"--hicache-ratio must be positive, got {self.hicache_ratio}")
        if self.hicache_size < 0:
            raise UserError(f"--hicache-size must be >= 0, got {self.hicache_size}")
        _choice("--hicache-mem-layout", self.hicache_mem_layout, LAYOUTS)
        _choice("--hicache-write-policy", self.hicache_write_policy, WRITE_POLICIES)
        _choice("--hicache-storage-prefetch-policy", self.hicache_storage_prefetch_policy, PREFETCH_POLICIES)
        _choice("--hicache-draft-layout", self.hicache_draft_layout, DRAFT_LAYOUTS)
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise UserError("--hicache-storage-backend needs --enable-hierarchical-cache")
        registry.check(self)
        _choice("--hicache-storage-key-scheme", self.hicache_storage_key_scheme, KEY_SCHEMES)
        if self.hicache_storage_key_scheme == "unified":
            if self.hicache_mem_layout == "layer_first":
                raise UserError("--hicache-storage-key-scheme unified needs --hicache-mem-layout page_unified")
            # The unified objects are spans of a page_unified host page; page_first (the default) is
            # the same bytes for MLA and a permutation for MHA, so it is switched, not refused.
            object.__setattr__(self, "hicache_mem_layout", "page_unified")
        for name in ("hicache_load_back_threshold", "hicache_storage_prefetch_threshold", "hicache_storage_max_bytes",
                     "hicache_storage_head_partition", "hicache_storage_layer_partition", "hicache_storage_idle_ttl"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0")
        if not self.hicache_transfer_timeout > 0:
            raise UserError(f"--hicache-transfer-timeout must be > 0 seconds, got {self.hicache_transfer_timeout}")
        for name in ("hicache_storage_prefetch_timeout_base", "hicache_storage_prefetch_timeout_per_ki_token"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig(FromArgs):
    """Ranks: tensor parallel (`--tp-size`) x pipeline parallel (`--pp-size`) x context parallel
    (`--cp-size`: a stage's prefill split over ranks that shard the KV pages), one process per rank,
    optionally over several nodes (`--nnodes`, `--node-rank`, `--dist-init-addr`, as SGLang names them)."""

    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous; loopback with a free port by default
    dist_timeout: float = 120.0  # seconds a collective may wait for a missing peer before it fails
    cp_size: int = 1
    cp_gather_tokens: int = 0  # per rank: one layer's gather of sharded pages at most (0: the whole pool)

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "nnodes", "cp_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.cp_gather_tokens < 0:
            raise UserError(f"--cp-gather-tokens must be >= 0, got {self.cp_gather_tokens}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise UserError(
                f"tp_size x pp_size x cp_size = {self.world_size} ranks cannot be split evenly over {self.nnodes} nodes"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise UserError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UserError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise UserError(f"--dist-timeout must be positive, got {self.dist_timeout}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass(frozen=True)
class DebugConfig(FromArgs):
    """Fault injection for tests of rank agreement, and for users reproducing a divergence."""

    debug_transfer_delay_ms: float = 0.0  # each transfer completes up to this much later (random, per-rank seed)
    debug_storage_fail_rate: float = 0.0  # fraction of storage page reads that fail ...
    debug_storage_fail_rank: int = 0  # ... on this rank only
    debug_disable_pp_sync: bool = False  # later PP stages poll their own ACK queues (a known bug; negative tests)
    debug_skip_draft_restore: bool = False  # a hit or a P/D transfer moves the target's KV only (negative control)
    debug_load_fail_rate: float = 0.0  # each host -> device load fails (at a random layer) with this probability
    debug_step_delay_ms: float = 0.0  # every forward step takes this much longer (a slow model, e.g. a long prefill)

    def __post_init__(self) -> None:
        if self.debug_transfer_delay_ms < 0:
            raise UserError(f"--debug-transfer-delay-ms must be >= 0, got {self.debug_transfer_delay_ms}")
        if not 0 <= self.debug_storage_fail_rate <= 1:
            raise UserError(f"--debug-storage-fail-rate must be in [0, 1], got {self.debug_storage_fail_rate}")
        if self.debug_storage_fail_rank < 0:
            raise UserError(f"--debug-storage-fail-rank must be >= 0, got {self.debug_storage_fail_rank}")
        if not 0 <= self.debug_load_fail_rate <= 1:
            raise UserError(f"--debug-load-fail-rate must be in [0, 1], got {self.debug_load_fail_rate}")
        if self.debug_step_delay_ms < 0:
            raise UserError(f"--debug-step-delay-ms must be >= 0, got {self.debug_step_delay_ms}")


DISAGG_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("zmq",)


@dataclass(frozen=True)
class DisaggConfig(FromArgs):
    """Prefill-decode disaggregation (`--disaggregation-*`, SGLang's names; hicache/disagg/): the role
    this server plays, where its KV transfer endpoint listens, and whether a decode server keeps its
    own radix tree to reuse prefixes of earlier turns."""

    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "zmq"
    disaggregation_bootstrap_host: str = "127.0.0.1"  # where prefill's transfer endpoint binds and is reached
    disaggregation_bootstrap_port: int = 8998  # rank r of a prefill server listens on this port + r
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_transfer_timeout: float = 60.0  # seconds a request waits for its peer's metadata or KV
    disaggregation_transfer_chunk_pages: int = 0  # pages per KV message; 0: about 4 MiB of KV
    debug_disagg_chunk_delay_ms: float = 0.0  # fault injection: prefill pauses this long before each KV chunk

    def __post_init__(self) -> None:
        _choice("--disaggregation-mode", self.disaggregation_mode, DISAGG_MODES)
        _choice("--disaggregation-transfer-backend", self.disaggregation_transfer_backend, TRANSFER_BACKENDS)
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            port = self.disaggregation_bootstrap_port
            raise UserError(f"--disaggregation-bootstrap-port must be in 1..65535, got {port}")
        if self.disaggregation_transfer_timeout <= 0:
            timeout = self.disaggregation_transfer_timeout
            raise UserError(f"--disaggregation-transfer-timeout must be positive, got {timeout}")
        if self.disaggregation_transfer_chunk_pages < 0:
            pages = self.disaggregation_transfer_chunk_pages
            raise UserError(f"--disaggregation-transfer-chunk-pages must be >= 0, got {pages}")
        if self.debug_disagg_chunk_delay_ms < 0:
            raise UserError(f"--debug-disagg-chunk-delay-ms must be >= 0, got {self.debug_disagg_chunk_delay_ms}")
        if self.disaggregation_decode_enable_radix_cache and self.disaggregation_mode != "decode":
            raise UserError("--disaggregation-decode-enable-radix-cache needs --disaggregation-mode decode")

    @property
    def enabled(self) -> bool:
        return self.disaggregation_mode != "null"


def _check_disagg(cfg: "EngineConfig") -> None:
    """What the role implies for the cache flags: a decode server keeps a tree only when asked to."""
    d = cfg.disagg
    if d.disaggregation_mode != "decode":
        return
    if d.disaggregation_decode_enable_radix_cache and cfg.disable_radix_cache:
        raise UserError("--disaggregation-decode-enable-radix-cache contradicts --disable-radix-cache")
    if cfg.hicache.enable_hierarchical_cache and not d.disaggregation_decode_enable_radix_cache:
        raise UserError(
            "--enable-hierarchical-cache on a decode server needs --disaggregation-decode-enable-radix-cache "
            "(without it decode keeps no tree to put in host memory)"
        )


@dataclass(frozen=True)
class SpeculativeConfig(FromArgs):
    """Speculative decoding (`--speculative-*`, hicache/spec/): a draft model or the request's own n-grams
    propose tokens that the target verifies in one pass; greedy output is the target's alone, token for token."""

    speculative_algorithm: str | None = None  # "draft": a separate draft model; "ngram": prompt lookup
    speculative_draft_model: str | None = None  # tiny-draft-packed, tiny-draft-sidecar, tiny-mtp, smollm2-draft, a path
    speculative_num_draft_tokens: int = 4  # tokens proposed per step
    # ngram: a matched suffix has at least 2 tokens: one (a space, a bracket) recurs everywhere, and what
    # followed it last is rarely what follows now, so its proposals would mostly cost rejected verify rows.
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 8

    def __post_init__(self) -> None:
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if low < 1:
            raise UserError(f"--speculative-ngram-min-match-window-size must be >= 1, got {low}")
        if high < low:
            raise UserError(f"--speculative-ngram-max-match-window-size must be >= the min window ({low}), got {high}")
        if self.speculative_algorithm is None:
            return
        _choice("--speculative-algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS)
        if self.has_draft_model and not self.speculative_draft_model:
            raise UserError("--speculative-algorithm draft needs --speculative-draft-model NAME|PATH")
        if not self.has_draft_model and self.speculative_draft_model:
            raise UserError("--speculative-algorithm ngram takes no --speculative-draft-model (it has no draft)")
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise UserError(f"--speculative-num-draft-tokens must be in 1..16, got {self.speculative_num_draft_tokens}")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def has_draft_model(self) -> bool:
        return self.speculative_algorithm == "draft"


@dataclass(frozen=True)
class EngineConfig(FromArgs):
    model: str = "tiny"
    page_size: int = 16
    max_total_tokens: int = 32768
    # A hybrid model's sliding-window layers' pool, as a share of the full pool's pages (SGLang's flag). At
    # 1.0 any request the full pool admits fits; below, a request also needs its pages' window KV to fit
    # (a running request holds its whole sequence's), and the cached prefixes' windows are evicted sooner.
    swa_full_tokens_ratio: float = 1.0
    # Where a hybrid model's recurrent-state snapshots are kept, so where its hits may end (SGLang's flag,
    # hicache/cache/snapshot_policy.py): every this many tokens (a page multiple); 0: at a turn's end only;
    # None: every page.
    mamba_track_interval: int | None = None
    chunked_prefill_size: int = 2048
    max_running_requests: int = 64
    context_length: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    # auto (the default, as llama.cpp serves a GGUF): the checkpoint's quantized tensors stay quantized
    # where a kernel for them is fast here (hicache's native kernels, or aten's with bf16 activations);
    # none: every weight dense; int8 / int4: every linear weight in that format. With `--dtype auto` the
    # activations follow (`activation_dtype`, docs/DESIGN.md, "the fastest path by default").
    quantization: str = "auto"
    # The KV pool's dtype (SGLang's --kv-cache-dtype): auto, the activations'; bfloat16 under float32
    # activations halves every tier's bytes and a decode step's KV reads, rounding each K/V row once as it is
    # written (the same rounding with the cache on or off), for plain attention models.
    kv_cache_dtype: str = "auto"
    disable_radix_cache: bool = False
    default_max_new_tokens: int = 128
    request_timeout: float = 0.0  # seconds from submission; 0: none
    kv_events_endpoint: str | None = None  # tcp://host:port of the KV events PUB socket (hicache/events/)
    # False: plain F.linear without the batch-invariant call shapes, for benchmarks that measure what
    # invariance costs (no CLI flag: a prefix cache on plain ops can change answers).
    batch_invariant_ops: bool = True
    hicache: HiCacheConfig = HiCacheConfig()
    parallel: ParallelConfig = ParallelConfig()
    debug: DebugConfig = DebugConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    disagg: DisaggConfig = DisaggConfig()

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise UserError(f"--page-size must be a power of two, got {self.page_size}")
        if not self.request_timeout >= 0:
            raise UserError(f"--request-timeout must be >= 0 seconds, got {self.request_timeout}")
        for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests", "default_max_new_tokens"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise UserError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        interval = self.mamba_track_interval
        if interval is not None and (interval < 0 or interval % self.page_size):
            raise UserError(f"--mamba-track-interval must be 0 or a multiple of --page-size {self.page_size}, "
                            f"got {interval}")  # fmt: skip
        if self.max_total_tokens < self.page_size:
            raise UserError(f"--max-total-tokens {self.max_total_tokens} is smaller than one page ({self.page_size})")
        if self.context_length is not None and self.context_length <= 0:
            raise UserError(f"--context-length must be positive, got {self.context_length}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise UserError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise UserError(f"--kv-cache-dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise UserError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.hicache.enable_hierarchical_cache and self.disable_radix_cache:
            raise UserError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but torch sees no CUDA device")
        world = self.parallel.world_size
        if self.debug.debug_storage_fail_rate > 0 and self.debug.debug_storage_fail_rank >= world:
            rank = self.debug.debug_storage_fail_rank
            raise UserError(f"--debug-storage-fail-rank {rank} is not a rank (0..{world - 1})")
        _check_disagg(self)

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size

    @property
    def sliding_pages(self) -> int:
        """Pages of a hybrid model's sliding-window pool (hicache/mem/sliding_pool.py)."""
        return max(1, int(self.num_pages * self.swa_full_tokens_ratio))

    @property
    def cp_gather_pages(self) -> int | None:
        """--cp-gather-tokens in pages per owner class (None: unbounded, a whole layer of the pool)."""
        tokens = self.parallel.cp_gather_tokens
        return -(-tokens // self.page_size) if tokens else None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device | None = None) -> torch.dtype:
        """`--dtype`, `auto` as on `device` (default: `--device`'s) for dense weights."""
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        device = device or self.resolved_device()
        if device.type == "cuda":
            return torch.bfloat16
        # float16 is never chosen on a CPU: it runs at a fraction of a GFLOP/s without native kernels.
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    def resolved_kv_dtype(self) -> torch.dtype:
        """`--kv-cache-dtype`, `auto` as the activations' (`resolved_dtype`)."""
        return self.resolved_dtype() if self.kv_cache_dtype == "auto" else getattr(torch, self.kv_cache_dtype)

    def log(self) -> None:
        device, dtype = self.resolved_device(), self.resolved_dtype()
        logger.info("engine config: %s (device=%s, dtype=%s)", asdict(self), device, dtype)
