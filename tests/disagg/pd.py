"""In-process prefill-decode pairs for the disagg tests: a prefill `Engine` and a decode `Engine` in
this process, their KV moving over the real ZeroMQ transport on loopback, driven the way `hicache
router` drives two servers (both halves submitted at once with one bootstrap room)."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hicache import Engine, SamplingParams
from hicache.config import DisaggConfig, EngineConfig, HiCacheConfig, ParallelConfig
from hicache.engine.engine import GenerationResult, RequestHandle
from hicache.engine.launch import free_port
from hicache.scheduler.request import Bootstrap


def free_ports(n: int) -> int:
    """A base port with n - 1 free ones after it (a prefill's rank r listens on base + r)."""
    while True:
        base = free_port()
        try:
            for r in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + r))
            return base
        except OSError:
            continue


def prefill_engine(port: int, tp: int = 1, **disagg: float) -> Engine:
    d = DisaggConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **disagg)  # type: ignore[arg-type]
    return Engine(EngineConfig(model="tiny", disagg=d, parallel=ParallelConfig(tp_size=tp)))


def decode_engine(reuse: bool, tp: int = 1, max_total_tokens: int = 8192, **engine: object) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            max_total_tokens=max_total_tokens,
            hicache=HiCacheConfig(enable_hierarchical_cache=reuse, hicache_load_back_threshold=16),
            disagg=DisaggConfig(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=reuse),
            parallel=ParallelConfig(tp_size=tp),
            **engine,  # type: ignore[arg-type]
        )
    )


@dataclass
class Turn:
    prefill: GenerationResult
    decode: GenerationResult

    @property
    def decode_prefix_tokens(self) -> int:
        assert self.decode.disagg is not None, self.decode.error
        return self.decode.disagg.decode_prefix_tokens

    @property
    def transferred_tokens(self) -> int:
        assert self.decode.disagg is not None, self.decode.error
        return self.decode.disagg.transferred_tokens


class PDPair:
    def __init__(self, prefill: Engine, decode: Engine, port: int, seed: int = 14) -> None:
        self.prefill, self.decode, self.port = prefill, decode, port
        self._rooms = random.Random(seed)

    def bootstrap(self) -> Bootstrap:
        """A fresh room at this pair's prefill, as the router makes one per request."""
        return Bootstrap("127.0.0.1", self.port, self._rooms.randrange(1 << 62))

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> tuple[RequestHandle, RequestHandle]:
        boot = self.bootstrap()
        return self.prefill.submit(prompt, params, bootstrap=boot), self.decode.submit(prompt, params, bootstrap=boot)

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Turn]:
        """Every prompt at once, as concurrent clients of the router would send them."""
        started = [self.submit(p, params) for p in prompts]
        return [Turn(hp.result(), hd.result()) for hp, hd in started]


def scheduler_of(engine: Engine):
    """The single-rank engine's scheduler (for checks run on its thread through `call_in_loop`)."""
    return engine._runtime.scheduler  # type: ignore[attr-defined]
