"""ServerState: what the routes share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from herald.models.tokenizer import Tokenizer
from herald.server.chat import ChatTemplate
from herald.server.defaults import DenoiseDefaults
from herald.server.engine_loop import EngineLoop
from herald.server.metrics import ServerMetrics


@dataclass
class ServerState:
    """The engine loop, tokenizer, served model names and settings.

    ``model_name`` is the model id reported by ``/v1/models`` and in responses; requests may
    name it or one of ``aliases``. The mode (dense, herald, mage or infinigen) and budget are the
    engine's, fixed at launch. Without a ``chat_template``, ``model_name`` is taken for the
    checkpoint (directory or preset) whose template to use. ``denoise``: how a request that
    sets neither ``steps`` nor ``threshold`` denoises."""

    engine_loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    chat_template: ChatTemplate | None = None
    aliases: tuple[str, ...] = ()
    denoise: DenoiseDefaults = field(default_factory=DenoiseDefaults)

    def __post_init__(self) -> None:
        if self.chat_template is None:
            self.chat_template = ChatTemplate.for_model(self.model_name, self.tokenizer)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name this server answers to, ``model_name`` first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    @property
    def max_context(self) -> int:
        return self.engine_loop.engine.max_seq_len

    @property
    def mode(self) -> str:
        return self.engine_loop.engine.mode

    @property
    def kv_budget(self) -> float:
        return self.engine_loop.engine.kv_budget

    @property
    def first_pass(self) -> str | None:
        """The herald mode's ``OffloadConfig.first_pass``; None in the other modes."""
        off = self.engine_loop.engine.engine_config.offload
        return off.first_pass if off is not None and off.mode == "herald" else None

    @property
    def max_prompts(self) -> int | None:
        """Most prompts one request may queue at once (the slots plus the waiting queue), or
        None when the waiting queue is unbounded."""
        eng = self.engine_loop.engine
        waiting = eng.engine_config.max_waiting
        return None if waiting is None else eng.max_batch_size + waiting


def served_names(model: str, given: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The names a server of checkpoint or preset ``model`` answers to: ``given`` (one name or
    several, the first reported), else the model's own name (a directory's last component, not
    its path). Raises ValueError for an empty name."""
    if given is None:
        path = Path(model)
        names: tuple[str, ...] = (path.name or path.resolve().name,)
    else:
        names = (given,) if isinstance(given, str) else tuple(given)
    if not names or any(not n.strip() for n in names):
        raise ValueError(f"a served model name must be non-empty, got {list(names)}")
    return names
