"""P/D disaggregation: the copy boundary between a device KV pool and a transfer — staging a prompt's
rows out of prefill's pages, landing them in decode's reserved pages.

The unit is the page: a transfer starts at a page boundary (decode_prefix_len is page-aligned) and
covers whole pages but the last, which carries only the prompt's rows (the rest of that page is
decode's to fill). Rows go as raw bytes in the pool's own row layout; the handshake has checked that
both pools share dtype, layout and shard, so no conversion is needed.
"""

from __future__ import annotations

import warnings

import torch

from hicache.disagg.transfer import StagedKV
from hicache.mem.device_pool import DeviceKVPool

CHUNK_BYTES = 4 << 20  # one message of a transfer carries about this much KV (whole pages)


def stage(pool: DeviceKVPool, pages: list[int], start: int, end: int) -> StagedKV:
    """Copy the rows of tokens [start, end) out of `pages` (a request's pages, in order), every layer."""
    slots = pool.allocator.slots(pages, end)[start:].to(pool.device)
    return StagedKV(start, end, [pool.buffers[layer].index_select(0, slots).cpu() for layer in range(pool.num_layers)])


def chunk_tokens(pool_page_size: int, row_bytes: int) -> int:
    """Tokens per message: whole pages, about CHUNK_BYTES of KV (at least one page)."""
    pages = max(1, CHUNK_BYTES // max(1, row_bytes * pool_page_size))
    return pages * pool_page_size


def frames_of(kv: StagedKV, start: int, end: int) -> list[memoryview]:
    """The bytes of rows [start, end) (absolute token positions), one frame per layer, zero-copy."""
    a, b = start - kv.start, end - kv.start
    return [memoryview(t[a:b].contiguous().view(torch.uint8).numpy()).cast("B") for t in kv.layers]


def land(pool: DeviceKVPool, slots: torch.Tensor, frames: list[memoryview | bytes]) -> int:
    """Write one message's rows (one frame per layer) into `slots`; returns the bytes written. Raises
    ValueError if the frames do not fit the slots (a peer of another layout)."""
    if len(frames) != pool.num_layers:
        raise ValueError(f"{len(frames)} layer frames for a pool of {pool.num_layers} layers")
    row = pool.layout.row_numel
    written = 0
    with warnings.catch_warnings():
        # The received buffer is read-only; it is only ever the source of the copy below.
        warnings.simplefilter("ignore", UserWarning)
        for layer, frame in enumerate(frames):
            data = torch.frombuffer(frame, dtype=torch.uint8) if len(frame) else torch.empty(0, dtype=torch.uint8)
            if data.numel() != slots.numel() * row * pool.buffers[layer].element_size():
                raise ValueError(f"layer {layer}: {data.numel()} bytes for {slots.numel()} rows")
            rows = data.view(pool.dtype).view(slots.numel(), row)
            pool.buffers[layer].index_copy_(0, slots, rows.to(pool.device))
            written += data.numel()
    return written
