"""ChatTemplate: a conversation -> the prompt text the model was trained on.

The template comes from the checkpoint directory: ``chat_template.jinja`` if present, else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}``
entries, of which ``"default"`` is used). It is rendered with jinja2 in a sandbox with the
variables Hugging Face chat templates expect: ``messages`` (``role`` / ``content`` dicts),
``add_generation_prompt`` (True unless the request says otherwise: cue the assistant's reply),
``bos_token`` / ``eos_token`` (from ``tokenizer_config.json``), the ``raise_exception(msg)``
function (a template's own input check: HTTP 400) and a ``tojson`` filter that does not
HTML-escape.

Without a template (presets, checkpoints without one) a documented fallback is used: ChatML
(``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``) when
the tokenizer has both ChatML markers as tokens (the SDAR / Qwen3 family), else one
``"role: content"`` line per message and a final ``"assistant:"`` (the cue, left out without
``add_generation_prompt``).

The rendered text is encoded like any prompt: special-token text maps to its ids, except the
mask token's text, which stays text (:meth:`herald.models.tokenizer.Tokenizer.encode`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from herald.models.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template refused it, or it failed): HTTP 400."""


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """Renders a list of ``{"role", "content"}`` messages to prompt text.

    Args:
        source: the jinja2 template text, or None for the fallback (module docstring).
        chatml: the fallback's format: ChatML if True, plain lines otherwise.
        variables: extra template variables (``bos_token``, ``eos_token``).
    """

    def __init__(
        self, source: str | None, *, chatml: bool = False, variables: dict[str, Any] | None = None
    ) -> None:
        self.source = source
        self.chatml = chatml
        self.variables = dict(variables or {})
        self._render: Callable[..., str] | None = None
        if source is not None:
            self._render = _compile(source)

    @property
    def kind(self) -> str:
        """``"jinja"``, ``"chatml"`` or ``"plain"`` (for the start-up log and /v1/models)."""
        return "jinja" if self.source is not None else ("chatml" if self.chatml else "plain")

    @classmethod
    def for_model(cls, model: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
        """The template of checkpoint directory ``model`` (or the fallback for a preset or a
        directory without one). Raises ValueError for a malformed template entry."""
        source, variables = None, {}
        path = Path(model)
        if path.is_dir():
            cfg_file = path / "tokenizer_config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            jinja_file = path / "chat_template.jinja"
            if jinja_file.is_file():
                source = jinja_file.read_text()
            else:
                source = _pick(cfg.get("chat_template"))
            for key in ("bos_token", "eos_token"):
                text = _token_text(cfg.get(key))
                if text is not None:
                    variables[key] = text
        has = tokenizer.backend.token_to_id
        chatml = has("<|im_start|>") is not None and has("<|im_end|>") is not None
        return cls(source, chatml=chatml, variables=variables)

    def render(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text, ending with the assistant's cue when ``add_generation_prompt``;
        raises :class:`ChatTemplateError` when the template refuses."""
        cue = add_generation_prompt
        if self._render is not None:
            try:
                return self._render(messages=list(messages), add_generation_prompt=cue,
                                    **self.variables)  # fmt: skip
            except ChatTemplateError:
                raise
            except Exception as e:  # a template bug or an input it cannot handle
                raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
        if self.chatml:
            turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
            return "".join(turns) + ("<|im_start|>assistant\n" if cue else "")
        lines = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return lines + ("\nassistant:" if cue else "")


def _pick(entry: object) -> str | None:
    """``chat_template`` as a string, or the ``"default"`` one of a list of named templates."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {e.get("name"): e.get("template") for e in entry if isinstance(e, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ValueError("tokenizer_config.json: chat_template is neither a string nor has a 'default'")


def _compile(source: str) -> Callable[..., str]:
    """Compile ``source`` in a sandbox (templates come with checkpoints: untrusted)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(value: object, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source).render
