"""Speculative decoding (docs/DESIGN.md, "speculative decoding"): a draft model proposes tokens, the target
verifies them in one forward pass, and the draft's state is kept by the cache beside the target's.

- draft_state.py: where the draft's state lives (packed into the target's host pool, or a sidecar),
  checked at start-up;
- decoder.py: one speculative step for the scheduler (draft catch-up and proposals, the verify pass,
  what each request keeps), with rollback through the request's KV handle;
- stats.py: proposed, accepted and recomputed draft tokens;
- build.py: the draft model, its pool and the decoder, from the configuration.
"""
