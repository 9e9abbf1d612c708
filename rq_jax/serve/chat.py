"""Chat messages rendered to a prompt with a checkpoint's `chat_template` (tokenizer_config.json), the way
Hugging Face's `apply_chat_template` renders it: a sandboxed jinja2 environment with `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `tojson` filter, `raise_exception` and `strftime_now`,
and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables."""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (its `raise_exception`) or failed to render them."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template and the special tokens it may read."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ChatTemplate | None":
        """The template in a checkpoint folder's tokenizer_config.json (its "default" one when it names
        several), or None when it has none."""
        path = os.path.join(os.fspath(folder), CONFIG_FILE)
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        special = {}
        for name in SPECIAL_TOKENS:
            token = config.get(name)
            if isinstance(token, dict):  # an AddedToken written out
                token = token.get("content")
            if token is not None:
                special[name] = token
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (dicts with `role` and `content`). Raises ChatTemplateError."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                        documents=None, **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed on these messages: {err}") from None
