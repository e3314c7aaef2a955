"""Client-side chat formatting for `--chat`.

The server takes plain text, so the client renders the conversation with a Jinja2 chat template (Hugging Face
conventions: `messages`, `add_generation_prompt`). The default is the ChatML template of the default model,
SmolLM2-135M-Instruct, copied from its GGUF file (it adds SmolLM2's default system prompt when none is given);
pass another model's template with `--chat-template FILE`.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ClientError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_chat(user_message: str, system: str | None = None, template: str = DEFAULT_CHAT_TEMPLATE) -> str:
    """The prompt text for a one-turn conversation, ending where the assistant's reply starts."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_message}]
    # The same Jinja2 settings transformers renders chat templates with, so a model's template file works as is.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True)
    except jinja2.TemplateError as exc:
        raise ClientError(f"chat template cannot be rendered: {exc}") from None


def load_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ClientError(f"cannot read chat template {path}: {exc.strerror}") from None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
