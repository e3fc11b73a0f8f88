"""Chat templates: a model's Jinja template (from GGUF metadata or tokenizer_config.json) rendered the
way Hugging Face renders it, or a plain fallback for models without one (`tiny`)."""

from __future__ import annotations

from dataclasses import dataclass

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def plain(cls) -> "ChatTemplate":
        return cls(PLAIN_TEMPLATE)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        # Jinja is imported by what renders a chat, not by every rank and server process (0.2 s of each start).
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        template = env.from_string(self.source)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
