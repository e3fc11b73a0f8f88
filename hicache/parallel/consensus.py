"""Rank agreement: the one interface through which every consumer of asynchronous results (backup and
load ACKs, storage hit lengths, prefetch progress, stop decisions) decides how much to consume.

- `agree_min(name, values)` (scheduler thread, at cache checks): the first pipeline stage takes the
  element-wise MIN over its tree-sharing group, TP x CP (a dedicated gloo group, off the compute path) and sends the
  agreed values down the pipeline (`pp_sync`, non-blocking, with a bounded backlog of pending sends);
  every later stage receives them and forwards them instead of polling its own queues, then consumes
  exactly that prefix of its ACK queues (AckQueue.pop waits for a copy still running here; extra
  ready ACKs stay queued). Every rank calls at every check, even with nothing ready: an early return
  would leave the others waiting in the collective.
- `agree_min_world(name, values)` (scheduler thread, after a forward): MIN over every rank, pipeline
  stages included, for what a later stage may be the only one to know (a host -> device load that did
  not land in its layers).
- `agree_min_all(name, values)` (storage threads only): MIN over every rank, on the storage group, for
  values where any rank's view can only shorten everyone's (storage hit length, pages read so far).
- Identities, not only counts: each agreement carries a digest chain of everything agreed and consumed
  before it (`confirm` folds in the identities of the operations consumed: which nodes, which lengths,
  failed or not). TP peers compare chains inside the MIN reduction (MIN of x and of -x gives min and
  max); later stages compare theirs with what stage 0 sent. A mismatch is a `RankDivergenceError`
  naming the rank and the agreement, not a silent divergence.
- `pp_sync=False` (`--debug-disable-pp-sync`) makes every stage reduce over its own TP group only: the
  independent polling bug (docs/DESIGN.md, "PP consistency"), kept for negative tests of the checker.

At one rank every agreement is the identity.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections import deque
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from hicache.parallel.divergence import RankDivergenceError, consensus_checked
from hicache.parallel.parallel import ParallelContext

logger = logging.getLogger(__name__)

MAX_PENDING_SENDS = 64  # pp_sync messages in flight before a stage waits for the oldest to be delivered
_MASK = (1 << 62) - 1  # chains stay positive and their negation fits in int64


def _fold(chain: int, name_hash: int, values: Iterable[int]) -> int:
    data = f"{chain},{name_hash}," + ",".join(map(str, values))
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little") & _MASK


class Consensus:
    def __init__(self, pctx: ParallelContext, pp_sync: bool = True) -> None:
        self.pctx = pctx
        self.pp_sync = pp_sync
        self.chain = 0  # digest of every agreement and confirmation so far, in order
        self.count = 0  # agreements so far (names the one a divergence is found at)
        self._sends: deque[tuple[dist.Work, torch.Tensor]] = deque()

    @property
    def _single(self) -> bool:
        return self.pctx.world_size == 1

    @consensus_checked(params=("name",), results=("result",))
    def agree_min(self, name: str, values: Sequence[int]) -> list[int]:
        """Element-wise MIN of `values` over the first stage's TP x CP ranks; identical on every rank."""
        if self._single:
            return list(values)
        self.count += 1
        name_hash = zlib.crc32(name.encode())
        pctx = self.pctx
        if self.pp_sync and not pctx.is_first_stage:
            agreed = self._receive(name, name_hash, len(values))
        else:
            agreed = self._reduce_tp(name, name_hash, values)
        if self.pp_sync and not pctx.is_last_stage:
            self._send([*agreed, self.chain, name_hash])
        self.chain = _fold(self.chain, name_hash, agreed)
        return agreed

    @consensus_checked(params=("name", "identities"), results=())
    def confirm(self, name: str, identities: Sequence[int]) -> None:
        """Fold the identities of what was just consumed into the chain the next agreement compares."""
        if not self._single:
            self.chain = _fold(self.chain, zlib.crc32(name.encode()), identities)

    def agree_min_world(self, name: str, values: Sequence[int]) -> list[int]:
        """Element-wise MIN of `values` over every rank, pipeline stages included (scheduler thread, at a
        point every rank reaches in the same step: after the forward, so a later stage's view counts
        too); identical on every rank. Costs one collective over the world group where `agree_min`
        costs a send down the pipeline, so it is for what only a later stage may know."""
        if self._single:
            return list(values)
        self.count += 1
        name_hash = zlib.crc32(name.encode())
        # With --debug-disable-pp-sync the stages' chains part by design (the checker is to find it).
        chained = self.chain if self.pp_sync else 0
        agreed = self._reduce(name, name_hash, values, self.pctx.world_group, chained, "ranks")
        self.chain = _fold(self.chain, name_hash, agreed)
        return agreed

    def agree_min_all(self, name: str, values: Sequence[int]) -> list[int]:
        """Element-wise MIN over every rank. Storage threads only: it blocks until all ranks' storage
        threads reach the same operation, which they do in the same order (FIFO workers fed in the
        schedulers' logical order)."""
        if self._single:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.pctx.storage_group)
        return tensor.tolist()

    # ---- the two halves of an agreement ---------------------------------------------------------

    def _reduce_tp(self, name: str, name_hash: int, values: Sequence[int]) -> list[int]:
        if self.pctx.tree_size == 1:
            return list(values)
        return self._reduce(name, name_hash, values, self.pctx.tree_cpu_group, self.chain, "TP ranks")

    def _reduce(self, name: str, name_hash: int, values: Sequence[int], group, chain: int, who: str) -> list[int]:
        """MIN over `group`, checking on the way that its ranks call the same agreement with the same
        chain (MIN of x and of -x gives min and max)."""
        n = len(values)
        tensor = torch.tensor([*values, chain, -chain, name_hash, -name_hash], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        reduced = tensor.tolist()
        low_chain, high_chain, low_name, high_name = reduced[n:]
        where = f"agreement #{self.count} '{name}' on rank {self.pctx.rank} ({self.pctx.suffix})"
        if low_name != -high_name:
            raise RankDivergenceError(f"{who} call different agreements at {where}: their call orders diverged")
        if low_chain != -high_chain:
            raise RankDivergenceError(
                f"{who} agreed on or consumed different operations before {where}: their cache states diverged"
            )
        return reduced[:n]

    def _receive(self, name: str, name_hash: int, n: int) -> list[int]:
        message = torch.empty(n + 2, dtype=torch.int64)
        dist.recv(message, src=self.pctx.prev_stage_rank, group=self.pctx.pp_cpu_group)
        *values, their_chain, their_name = message.tolist()
        where = (
            f"pipeline stage {self.pctx.pp_rank} (rank {self.pctx.rank}, {self.pctx.suffix}) at agreement "
            f"#{self.count} '{name}'"
        )
        if their_name != name_hash:
            raise RankDivergenceError(f"{where}: the previous stage sent a different agreement; call orders diverged")
        if their_chain != self.chain:
            raise RankDivergenceError(
                f"{where}: this stage agreed on or consumed different operations than the previous stage"
            )
        return values

    def _send(self, message: list[int]) -> None:
        tensor = torch.tensor(message, dtype=torch.int64)
        work = dist.isend(tensor, dst=self.pctx.next_stage_rank, group=self.pctx.pp_cpu_group)
        self._sends.append((work, tensor))  # the tensor must live until it is sent
        while self._sends and (len(self._sends) > MAX_PENDING_SENDS or self._sends[0][0].is_completed()):
            self._sends.popleft()[0].wait()

    def flush(self) -> None:
        """Wait until every pp_sync message sent is delivered (before the process group goes away)."""
        while self._sends:
            self._sends.popleft()[0].wait()
