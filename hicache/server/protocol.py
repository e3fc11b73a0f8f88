"""Serving: the OpenAI request bodies hicache accepts, as strict pydantic models.

Strict types (no "1" for 1, no true for 1) and finite floats only: whatever passes here is turned into
`SamplingParams` that cannot fail inside the scheduler thread, where an exception would end every
request of the batch, not only the bad one. Unknown fields are ignored, as OpenAI-compatible servers do;
known fields hicache cannot honour (n > 1, penalties, logit_bias, echo, best_of > 1, tools, JSON mode)
are refused unless they hold their neutral value, rather than silently changing the answer's meaning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator

from hicache.cache import MAX_PRIORITY
from hicache.errors import UserError
from hicache.scheduler.request import Bootstrap, SamplingParams

# Below this a temperature is greedy: dividing logits by it would overflow float32 to inf, and a
# distribution with inf in it cannot be sampled.
MIN_TEMPERATURE = 1e-5
# The scheduler re-decodes a stop string's length of output tail at every step: keep that small.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_BATCH_PROMPTS = 64
# torch.Generator.manual_seed takes 64-bit seeds, signed or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)
# Prompt i of a batch meets its P/D peer in room bootstrap_room + i.
MAX_BOOTSTRAP_ROOM = 2**63 - 1 - MAX_BATCH_PROMPTS

TokenIds = list[StrictInt]
Prompt = StrictStr | TokenIds | list[StrictStr] | list[TokenIds]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _neutral_only(value: Any, info: ValidationInfo) -> Any:
    """For OpenAI fields hicache does not implement: accepted only when they would change nothing."""
    if value not in (None, 0, False, "", [], {}):
        raise ValueError(f"{info.field_name} is not supported by hicache (only its default is accepted)")
    return value


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1 (vLLM's and SGLang's spelling): no top-k
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: StrictStr | None = None
    cache_salt: StrictStr = ""
    # Retention hint (SGLang's names; docs/DESIGN.md, "retention hints"): what this request matches and
    # caches is evicted after lower priorities, until retention_seconds past its last use (None: no limit).
    priority: StrictInt = Field(default=0, ge=0, le=MAX_PRIORITY)
    retention_seconds: float | None = Field(default=None, ge=0.0)
    ignore_eos: bool = False
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    # Set by `hicache router` on both halves of a prefill-decode request (SGLang's names).
    bootstrap_host: StrictStr | None = None
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_room: int | None = Field(default=None, ge=0, le=MAX_BOOTSTRAP_ROOM)

    _unsupported = field_validator("presence_penalty", "frequency_penalty", "logit_bias")(_neutral_only)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (hicache returns one choice per prompt), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters")
        return stop

    def bootstrap(self) -> Bootstrap | None:
        """Where the request's P/D pair meets (prompt i of a batch in room + i), or None."""
        given = (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        if all(v is None for v in given):
            return None
        if any(v is None for v in given):
            raise UserError("bootstrap_host, bootstrap_port and bootstrap_room must be given together")
        return Bootstrap(*given)  # type: ignore[arg-type]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        # An empty stop string would match before any text at all.
        return tuple(dict.fromkeys(s for s in stops if s))

    def sampling_params(self, max_new_tokens: int | None, logprobs: int | None) -> SamplingParams:
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for legacy completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Any = None
    suffix: Any = None
    best_of: int | None = None

    _unsupported_here = field_validator("echo", "suffix")(_neutral_only)

    @field_validator("prompt")
    @classmethod
    def _batch_size(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in one request, got {len(prompt)}")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError(f"best_of must be 1, got {best_of}")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string or token ids is a batch of one."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Any = None
    response_format: Any = None

    _unsupported_here = field_validator("tools")(_neutral_only)

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, response_format: Any) -> Any:
        if response_format not in (None, {"type": "text"}):
            raise ValueError('response_format is not supported by hicache (only {"type": "text"})')
        return response_format

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise UserError("top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # max_completion_tokens supersedes the deprecated max_tokens; neither: the engine's default.
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, logprobs)
