"""Draft models for speculative decoding (docs/DESIGN.md, "model family": drafts), resolved from
`--speculative-draft-model NAME|PATH`. The built-in drafts are a target's own first layers with its
final norm and output head (an early exit), so they need no weights of their own and nothing is
downloaded:

- `tiny-draft-packed`: tiny's first 3 layers. Its KV rows have tiny's shape, dtype and token
  indexing, so its layers can be appended to tiny's host pool (the packed layout).
- `tiny-draft-sidecar`: tiny's first 3 layers plus a per-token token-shift state beside the KV
  (hicache/model/families/shift.py): another row shape, so it needs pools of its own (the sidecar layout).
- `tiny-mtp`: an MTP head on tiny (hicache/model/families/mtp.py): one layer, tiny's first, reading the
  target's last hidden state and the next token's embedding (`mtp_head`).
- `smollm2-draft[-N]`: SmolLM2's first N layers (default 20 of its 30: an untrained early exit
  rarely agrees with the whole model with fewer, docs/BENCHMARKS.md section 5).
- anything else: a model loaded as `--model` loads it; it must share the target's vocabulary.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

import torch

from hicache.errors import UserError
from hicache.model.config import LoadedModel
from hicache.model.families import mtp
from hicache.model.families.shift import FAMILY, shift_weight_names
from hicache.model.loading.loader import load_model

TINY_PACKED_LAYERS = 3
TINY_SIDECAR_LAYERS = 3
SHIFT_DIM = 8
SHIFT_SEED = 4321
MTP_HIDDEN_WEIGHT = 0.1  # of 0.1, 0.5 and 1.0 (with tiny's first or last layer) the most accepted
SMOLLM2_DRAFT_LAYERS = 20
_SMOLLM2_DRAFT = re.compile(r"smollm2-draft(?:-(\d+))?")


def first_layers(base: LoadedModel, n: int, name: str, salt: str = "") -> LoadedModel:
    """`base` cut after its first `n` layers, keeping its final norm and head (the weights are shared,
    not copied: the decoder reads only the layers its config has)."""
    if not 1 <= n < base.config.num_layers:
        total = base.config.num_layers
        raise UserError(f"draft {name!r}: {n} layers of a model with {total} (a draft needs 1..{total - 1})")
    identity = hashlib.sha256(f"{base.identity}:first{n}:{salt}".encode()).hexdigest()
    config = replace(base.config, num_layers=n)
    return replace(base, name=name, config=config, identity=identity, extra=dict(base.extra))


def with_token_shift(draft: LoadedModel, dim: int, seed: int) -> LoadedModel:
    """`draft` with a token-shift state of `dim` per token and layer, seeded projections: small enough
    that the draft still agrees with its target often, large enough that a missing state shows."""
    gen = torch.Generator().manual_seed(seed)
    h = draft.config.hidden_size
    weights = dict(draft.weights)
    for i in range(draft.config.num_layers):
        w_in, w_out = shift_weight_names(i)
        weights[w_in] = torch.randn(dim, h, generator=gen) * h**-0.5
        weights[w_out] = torch.randn(h, dim, generator=gen) * 0.1 * dim**-0.5
    identity = hashlib.sha256(f"{draft.identity}:shift{dim}:{seed}".encode()).hexdigest()
    return replace(draft, weights=weights, identity=identity, family=FAMILY)


def mtp_head(base: LoadedModel, name: str, hidden_weight: float) -> LoadedModel:
    """An MTP head on `base` made of its own weights, so it agrees with it sometimes with nothing trained:
    its decoder layer is `base`'s first, its embedding, final norm and head are `base`'s (shared), and the
    projection adds the normed embedding of the token and `hidden_weight` times the normed hidden state of
    the one before it (a first layer reads a token's embedding; the hidden state steers it)."""
    h = base.config.hidden_size
    first = "model.layers.0."
    weights = {k: v for k, v in base.weights.items() if not k.startswith("model.layers.") or k.startswith(first)}
    weights[mtp.EH_PROJ] = torch.cat([torch.eye(h), hidden_weight * torch.eye(h)], dim=1)
    weights[mtp.ENORM] = weights[mtp.HNORM] = torch.ones(h)
    identity = hashlib.sha256(f"{base.identity}:mtp:{hidden_weight}".encode()).hexdigest()
    config = replace(base.config, num_layers=1)
    return replace(base, name=name, config=config, weights=weights, identity=identity, family=mtp.FAMILY)


def _base(name: str, target: LoadedModel) -> LoadedModel:
    """The model a built-in draft is cut from: the target itself when it is that model (no second copy)."""
    return target if target.name == name else load_model(name)


def load_draft(name: str, target: LoadedModel) -> LoadedModel:
    if name == "tiny-draft-packed":
        draft = first_layers(_base("tiny", target), TINY_PACKED_LAYERS, name)
    elif name == "tiny-draft-sidecar":
        draft = first_layers(_base("tiny", target), TINY_SIDECAR_LAYERS, name, salt="sidecar")
        draft = with_token_shift(draft, SHIFT_DIM, SHIFT_SEED)
    elif name == "tiny-mtp":
        draft = mtp_head(_base("tiny", target), name, MTP_HIDDEN_WEIGHT)
    elif (m := _SMOLLM2_DRAFT.fullmatch(name)) is not None:
        draft = first_layers(_base("smollm2", target), int(m.group(1) or SMOLLM2_DRAFT_LAYERS), name)
    else:
        draft = load_model(name)
    if draft.config.vocab_size != target.config.vocab_size:
        raise UserError(
            f"draft model {name!r} has a vocabulary of {draft.config.vocab_size} tokens and the target "
            f"{target.name!r} one of {target.config.vocab_size}: a draft must share the target's tokenizer"
        )
    return draft
