"""P/D disaggregation: the copy boundary between a device KV pool and a transfer — reading a prompt's
rows out of prefill's pages one chunk at a time, landing them in decode's reserved pages.

A transfer starts at a page boundary (decode_prefix_len is page-aligned) and covers whole pages but
the last, which carries only the prompt's rows (the rest of that page is decode's to fill). Between
two ranks it moves the cells their shards share (cells.py): the layers of the `Cut`, and of each row
the element ranges of the shared KV heads, as raw bytes of the pools' dtype (the handshake has checked
that both sides share it and the row's components, so no conversion is needed). With a speculative
draft whose state moves, its pool's layers follow the target's (cells.cuts). A rank of a page-sharded
pool reads only the pages it owns (`PoolRows.held`), and one lands only the rows of its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from hicache.disagg.cells import Cut
from hicache.mem.device_pool import DeviceKVPool, OwnedSlots

CHUNK_BYTES = 4 << 20  # one message of a transfer carries about this much KV (whole pages)


class PoolRows:
    """A request's rows of tokens [start, end) in its device `pages` (transfer.KVSource): each `read`
    copies one chunk of them, every layer, to host memory, so what a transfer holds on the host is a
    chunk, not the suffix (docs/DESIGN.md, "P/D streaming"). The pages must stay the request's until the
    transport has read them (the prefill role keeps them locked: prefill_role.py). A speculative draft's
    pool (`draft`) is indexed by the same pages: its layers are read after the target's."""

    def __init__(
        self, pool: DeviceKVPool, pages: list[int], start: int, end: int, draft: DeviceKVPool | None = None
    ) -> None:
        self.pool = pool
        self.pages = list(pages)  # the handle's list, as it was when the request ended
        self.start, self.end = start, end
        self.buffers = pool.buffers + (draft.buffers if draft is not None else [])

    def held(self, start: int, end: int) -> list[int] | None:
        """The pages (prompt page indices) of tokens [start, end) this rank holds when its pool's pages are
        sharded (each is on one rank: cells.py, "page ownership"); None when it holds every page."""
        if not self.pool.sharded:
            return None
        p, placement = self.pool.page_size, self.pool.placement
        pages = range(start // p, -(-end // p))
        return [q for q in pages if placement.owner(self.pages[q]) == self.pool.shard_rank]

    def read(self, start: int, end: int, layers: Collection[int] | None = None) -> dict[int, torch.Tensor]:
        """Rows of tokens [start, end) (absolute positions) this rank holds (`held`: of a sharded pool, its
        own pages' only), a [tokens, row] tensor per local layer of `layers` (the target's, then the
        draft's; all of them by default): a stage whose peers take no draft rows copies none."""
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"rows [{start}, {end}) outside [{self.start}, {self.end})")
        p = self.pool.page_size
        first = start // p
        slots = self.pool.allocator.slots(self.pages[first : -(-end // p)])[start - first * p : end - first * p]
        slots = self.pool.owned(slots).rows.to(self.pool.device)
        # A sliding-window layer's rows are its own pages' (device_pool.py); the draft's layers follow the pool's.
        wanted = range(len(self.buffers)) if layers is None else sorted(layers)
        return {i: self.buffers[i].index_select(0, self.pool.layer_rows(i, slots)).cpu() for i in wanted}


def chunk_tokens(pool_page_size: int, row_bytes: int) -> int:
    """Tokens per message: whole pages, about CHUNK_BYTES of KV (at least one page)."""
    pages = max(1, CHUNK_BYTES // max(1, row_bytes * pool_page_size))
    return pages * pool_page_size


def frames_of(chunk: Mapping[int, torch.Tensor], cuts: Sequence[Cut]) -> list[memoryview]:
    """The bytes of `cuts`' cells of one chunk's rows (a tensor per local layer), one frame per layer
    (zero-copy when a cut takes whole rows)."""
    frames = []
    for cut in cuts:
        for layer in cut.layers:
            rows = chunk[layer]
            if not cut.whole_rows:
                rows = torch.cat([rows[:, x:y] for x, y in cut.columns], dim=1)
            data = rows.contiguous().view(torch.uint8).numpy()
            # No rows (a page-sharded rank owning no page of the chunk): memoryview cannot cast an empty shape.
            frames.append(memoryview(data).cast("B") if data.size else memoryview(b""))
    return frames


def tokens_of(pages: Sequence[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """The token positions within [start, end) of prompt pages `pages`, in order: the rows a message of a
    page-sharded source carries (PoolRows.held)."""
    spans = [torch.arange(max(q * page_size, start), min((q + 1) * page_size, end)) for q in pages]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)


def land(
    buffers: Sequence[torch.Tensor], slots: torch.Tensor, frames: Sequence[memoryview | bytes], cuts: Sequence[Cut],
    where: OwnedSlots | None = None, layer_rows: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> int:  # fmt: skip
    """Write one message's rows of `cuts`' cells (one frame per layer, in their order) into `slots` of
    `buffers` (a pool's layers, a draft's after them); returns the bytes written. With `where` (a sharded
    pool's `owned(slots)`) only the rows this rank holds land, at its local rows; `layer_rows` (a pool's):
    where those rows are in each layer's buffer (a sliding-window layer's own rows). Raises ValueError if
    the frames do not fit (a peer that cut other cells)."""
    layers = [(layer, cut) for cut in cuts for layer in cut.layers]
    if len(frames) != len(layers):
        raise ValueError(f"{len(frames)} layer frames for cells of {len(layers)} layers")
    written = 0
    with warnings.catch_warnings():
        # The received buffer is read-only; it is only ever the source of the copy below.
        warnings.simplefilter("ignore", UserWarning)
        for (layer, cut), frame in zip(layers, frames):
            buffer = buffers[layer]
            data = torch.frombuffer(frame, dtype=torch.uint8) if len(frame) else torch.empty(0, dtype=torch.uint8)
            if data.numel() != slots.numel() * cut.width * buffer.element_size():
                raise ValueError(f"layer {layer}: {data.numel()} bytes for {slots.numel()} rows of {cut.width}")
            rows = data.view(buffer.dtype).view(slots.numel(), cut.width).to(buffer.device)
            target = slots
            if where is not None and where.index is not None:
                rows, target = rows.index_select(0, where.index.to(rows.device)), where.rows
            if layer_rows is not None:
                target = layer_rows(layer, target)
            if cut.whole_rows:
                buffer.index_copy_(0, target, rows)
            else:
                offset = 0
                for x, y in cut.columns:
                    buffer[target, x:y] = rows[:, offset : offset + y - x]
                    offset += y - x
            written += data.numel()
    return written
