"""Speculative decoding (docs/DESIGN.md, "speculative decoding"): a proposer proposes tokens, the target
verifies them in one forward pass, and a draft model's state is kept by the cache beside the target's.

- proposer.py: what a proposer gives the decoder (the proposals, its share of the target's pass);
- draft_proposer.py: a draft model's catch-up and proposals (`--speculative-algorithm draft`);
- ngram.py: proposals from the request's own tokens, no draft (`--speculative-algorithm ngram`);
- draft_state.py: where the draft's state lives (packed into the target's host pool, or a sidecar),
  checked at start-up;
- decoder.py: one speculative step for the scheduler (the proposals, the verify pass, what each request
  keeps), with rollback through the request's KV handle;
- stats.py: proposed, accepted and recomputed draft tokens;
- build.py: the draft model, its pool, the proposer and the decoder, from the configuration.
"""
