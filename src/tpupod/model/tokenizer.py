"""The checkpoint's tokenizer (through ``tokenizers``) and its chat template (jinja2).

The template is rendered the way transformers renders it (a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, ``raise_exception``, a
``tojson`` that keeps non-ASCII text), so a prompt built here tokenizes to the
same ids as ``apply_chat_template``.

Deferred imports: tokenizers (the model extra) when a tokenizer is made, jinja2 and its
sandbox when a chat template is first rendered: this module imports without the model extra,
and a caller that renders no chat never loads jinja2.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

from tpupod.errors import CheckpointError, ModelError

Message = dict[str, Any]


class Tokenizer:
    """Encode, decode and render chat prompts for one checkpoint."""

    def __init__(self, folder: Path) -> None:
        import tokenizers

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{folder} has no tokenizer.json",
                hint="copy the checkpoint's tokenizer files, or load with tokenizer=False",
            )
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        # A saved tokenizer may pad every text of a batch to the longest (or a fixed
        # length) and cut long ones: ids would then carry pad tokens and lose real
        # ones. Every caller wants each text's own ids; tpupod pads and cuts itself.
        self._tok.no_padding()
        self._tok.no_truncation()
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.chat_template = _chat_template(folder, config)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        return self.token_id(self.pad_token)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for ``messages`` (``extra``: e.g. ``enable_thinking=False``)."""
        if self.chat_template is None:
            raise ModelError(
                "this checkpoint has no chat template",
                hint="pass token ids or plain text prompts instead of messages",
            )
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out in full
        return str(value.get("content"))
    return None if value is None else str(value)


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    standalone = folder / "chat_template.jinja"
    if standalone.is_file():
        return standalone.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def render_chat(template: str, messages: list[Message], **context: Any) -> str:
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(messages=messages, **context)
    except TemplateError as exc:
        raise ModelError(f"the chat template refused these messages: {exc}") from exc


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """The template compiled once (compiling takes milliseconds; a server renders it
    for every request)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ModelError(f"the chat template does not compile: {exc}") from exc
