"""The text formats of the RULER-style long-context tasks: what each task hides in its haystack,
what it asks and what counts as its answer. No tokenizer and no corpus here: the prompt is
assembled and fitted to a token budget by :mod:`herald.eval.ruler`.

Every prompt ends with the same two comment lines::

    # Question: <the task's question>
    # Answer:

and the expected completion is one line, `` <answer>`` (a space, the answer, a newline). The
prompt stops after ``Answer:``, not after a space, so the completion starts on a token boundary
the model saw in training (a space-prefixed token). An answer of several items joins them with
``", "``. The hidden lines stand at column 0 between two lines of the haystack.

Tasks (``RULER_TASKS``; the knobs are :class:`RulerConfig`):

``niah_single``
    One needle ``# magic number for crimson-otter: 7204518`` (a key of two words, a 7-digit
    value); question ``What is the magic number for crimson-otter?``; answer the value.
``niah_multikey``
    ``multikey_keys`` needles of that shape with distinct keys; one is asked; answer its value.
``niah_multivalue``
    ``multivalue_values`` needles with one key and distinct values; question ``What are all the
    magic numbers for crimson-otter?``; answer every value (in the order they appear).
``niah_multiquery``
    ``multiquery_keys`` needles with distinct keys, all asked: ``What are the magic numbers for
    crimson-otter, quiet-lake, ..., in this order?``; answer the values in the order asked.
``vt`` (variable tracking)
    ``vt_chains`` chains of ``vt_hops + 1`` assignments: ``VAR_QXKZP = 48213`` then
    ``VAR_ABCDE = VAR_QXKZP`` and so on, each chain's lines in order at random depths, the chains
    interleaved, each with its own 5-digit value; the first chain is asked: ``Which variables are
    assigned the value 48213, directly or through another variable?``; answer every name of that
    chain (in the order they appear).
``cwe`` (common-word extraction)
    No haystack: the prompt is a numbered list ``# 1. socket`` ... of lowercase words taken from
    the source text, ``cwe_common`` of them ``cwe_common_freq`` times each, the others (as many
    as fill the budget) ``cwe_rare_freq`` times each, shuffled; question ``What are the 5 most
    common words in the list above?``; answer the common words (in the order they first appear).

Exact match (:func:`herald.eval.metrics.score`; ``ANSWER_RULE``): the prediction is the
completion's first line. ``exact`` (``niah_single``, ``niah_multikey``): the line, surrounding
whitespace stripped, equals the value. ``ordered`` (``niah_multiquery``): the line's
comma-separated items (each stripped, empty ones dropped) equal the expected values, in the order
asked. ``set`` (``niah_multivalue``, ``vt``, ``cwe``): the items equal the expected ones in any
order, each exactly once, nothing else (a missing, extra or repeated item is wrong).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
ANSWER_RULE = {
    "niah_single": "exact",
    "niah_multikey": "exact",
    "niah_multivalue": "set",
    "niah_multiquery": "ordered",
    "vt": "set",
    "cwe": "set",
}
"""How each task's answer is compared (module docstring)."""

_ADJECTIVES = """amber bold brave bright calm clever crimson dark eager early fair fancy gentle
golden grand green happy hidden humble icy jolly keen kind lively lucky mellow misty noble odd
pale plain proud quick quiet rapid rare red rosy royal rusty shiny silent silver sleepy slow
smooth snowy solid sour spicy steady stormy sunny swift tall tidy tiny vivid warm wild windy
wise young""".split()  # noqa: SIM905
_NOUNS = """anchor apple badger beacon birch bison canyon cedar cobra comet coral crane daisy
delta eagle ember falcon fern fjord flint fox garnet glacier harbor hawk heron island jaguar
lagoon lake lantern lemon lynx maple meadow mesa moose nectar oak orchid otter owl panda pebble
pine planet quartz raven reef river robin saddle salmon sparrow spruce summit thistle tiger
tulip valley walnut willow wolf yak zebra""".split()  # noqa: SIM905


@dataclass(frozen=True)
class RulerConfig:
    """Sizes of the RULER-style tasks (module docstring); part of ``herald eval``'s recorded
    task settings."""

    answer_tokens: int = 128
    """``herald eval``: a context of C tokens is the whole sequence, as in RULER: the prompt holds
    at most C minus this many tokens (two answer blocks and the engine's two blocks of slack at
    block size 32), so a model with C positions runs the C-token context."""
    multikey_keys: int = 4
    """niah_multikey: needles in all (one asked, the others distractors)."""
    multivalue_values: int = 4
    """niah_multivalue: values of the one key."""
    multiquery_keys: int = 4
    """niah_multiquery: keys, all asked."""
    vt_hops: int = 4
    """vt: assignments after the first in each chain (a chain binds hops + 1 names)."""
    vt_chains: int = 2
    """vt: chains (one asked, the others distractors)."""
    cwe_common: int = 5
    """cwe: words to return."""
    cwe_common_freq: int = 30
    """cwe: occurrences of each common word."""
    cwe_rare_freq: int = 3
    """cwe: occurrences of each other word."""

    def validate(self) -> None:
        for name in (
            "multikey_keys", "multivalue_values", "multiquery_keys", "vt_chains", "cwe_common",
            "cwe_rare_freq",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"RulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.vt_hops < 0 or self.answer_tokens < 0:
            raise ValueError("RulerConfig.vt_hops and answer_tokens must be >= 0")
        if self.cwe_common_freq <= self.cwe_rare_freq:
            raise ValueError(
                f"RulerConfig.cwe_common_freq ({self.cwe_common_freq}) must exceed "
                f"cwe_rare_freq ({self.cwe_rare_freq})"
            )


@dataclass(frozen=True)
class Needle:
    """One hidden line; ``item``: the answer item it carries (None for a distractor)."""

    text: str
    item: str | None = None


@dataclass
class Plan:
    """What an instance hides and asks, before any haystack.

    ``groups``: needle lines; the lines of a group keep their order in the prompt (a vt chain),
    groups are placed independently. ``answer``: the expected items (for ``set`` tasks the
    builder re-orders them as they appear). ``forbidden``: strings the haystack must not hold
    (the keys, values and names), else the plan is drawn again. ``info``: recorded choices."""

    groups: list[list[Needle]]
    question: str
    answer: list[str]
    forbidden: list[str]
    info: dict[str, Any] = field(default_factory=dict)


def question_block(question: str) -> str:
    """The prompt's last two lines (no newline after ``Answer:``)."""
    return f"# Question: {question}\n# Answer:"


def answer_text(items: list[str]) -> str:
    """The expected answer line's content: the items joined with ``", "``."""
    return ", ".join(items)


def _distinct(rng: random.Random, n: int, draw: Any) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = draw(rng)
        if x not in out:
            out.append(x)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _value(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _var(rng: random.Random) -> str:
    return "VAR_" + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _needle(key: str, value: str, item: str | None) -> list[Needle]:
    return [Needle(f"# magic number for {key}: {value}", item)]


def plan_niah(task: str, rng: random.Random, cfg: RulerConfig) -> Plan:
    """The needles, question and answer of a ``niah_*`` task."""
    if task == "niah_multivalue":
        key = _key(rng)
        values = _distinct(rng, cfg.multivalue_values, lambda r: _value(r, 7))
        return Plan(
            [_needle(key, v, v) for v in values],
            f"What are all the magic numbers for {key}?",
            values,
            [key, *values],
            {"keys": [key], "values": values, "asked": [key]},
        )
    n_keys = {"niah_single": 1, "niah_multikey": cfg.multikey_keys}.get(task, cfg.multiquery_keys)
    keys = _distinct(rng, n_keys, _key)
    values = _distinct(rng, n_keys, lambda r: _value(r, 7))
    if task == "niah_multiquery":
        asked = keys
        question = f"What are the magic numbers for {', '.join(keys)}, in this order?"
    else:
        asked = [keys[0]]
        question = f"What is the magic number for {keys[0]}?"
    answer = [v for k, v in zip(keys, values, strict=True) if k in asked]
    groups = [_needle(k, v, v if k in asked else None) for k, v in zip(keys, values, strict=True)]
    info = {"keys": keys, "values": values, "asked": asked}
    return Plan(groups, question, answer, [*keys, *values], info)


def plan_vt(rng: random.Random, cfg: RulerConfig) -> Plan:
    """The chains, question and answer of ``vt``."""
    names = _distinct(rng, cfg.vt_chains * (cfg.vt_hops + 1), _var)
    values = _distinct(rng, cfg.vt_chains, lambda r: _value(r, 5))
    groups: list[list[Needle]] = []
    chains = []
    for c, value in enumerate(values):
        chain = names[c * (cfg.vt_hops + 1) : (c + 1) * (cfg.vt_hops + 1)]
        chains.append({"value": value, "names": chain})
        lines = [f"{chain[0]} = {value}"] + [
            f"{b} = {a}" for a, b in zip(chain, chain[1:], strict=False)
        ]
        groups.append([Needle(t, n if c == 0 else None) for t, n in zip(lines, chain, strict=True)])
    question = (
        f"Which variables are assigned the value {values[0]}, directly or through another variable?"
    )
    return Plan(groups, question, list(chains[0]["names"]), [*names, *values], {"chains": chains})


def plan(task: str, rng: random.Random, cfg: RulerConfig) -> Plan:
    """The plan of a needle task (every task but ``cwe``)."""
    if task == "vt":
        return plan_vt(rng, cfg)
    if task.startswith("niah_"):
        return plan_niah(task, rng, cfg)
    raise ValueError(f"{task!r} is not a needle task")


def cwe_question(cfg: RulerConfig) -> str:
    return f"What are the {cfg.cwe_common} most common words in the list above?"


CWE_HEADER = "# Words:\n"
"""The first line of a ``cwe`` prompt."""
