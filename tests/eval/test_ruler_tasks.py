"""RULER-style tasks: deterministic, the answers where the metadata says, the prompt within the
budget (byte-level and the bundled BPE tokenizer), the exact-match rules, any text source, and
runs through the runner and ``herald eval`` on tiny-sdar."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch
from eval_helpers import stdlib_corpus, tokenizer

from herald.eval.metrics import predict, score
from herald.eval.ruler import Document, build_instance
from herald.eval.ruler_formats import ANSWER_RULE, RULER_TASKS, RulerConfig
from herald.eval.tasks import TaskConfig, build_examples, prompt_tokens, selection_hash

CFG = TaskConfig(control_tokens=64, ruler=RulerConfig(cwe_common=3, cwe_common_freq=8))
"""CPU sizes: a 64-token control window; cwe with 3 words 8 times each (the default 5 x 30
entries need about 1,000 tokens of a BPE tokenizer, more bytes than this test's contexts)."""
CONTEXT = 1024
NEEDLE_TASKS = [t for t in RULER_TASKS if t != "cwe"]


@pytest.fixture(scope="module")
def built():
    corpus, tok = stdlib_corpus(), tokenizer()
    return {t: build_examples(t, corpus, tok, CONTEXT, 3, CFG) for t in RULER_TASKS}


def _text(ids: list[int]) -> str:
    return bytes(ids).decode()  # the byte-level tokenizer: id b is byte b


def test_deterministic_prefix_and_seeded(built):
    corpus, tok = stdlib_corpus(), tokenizer()
    for task in RULER_TASKS:
        again = build_examples(task, corpus, tok, CONTEXT, 2, CFG)
        assert selection_hash(again) == selection_hash(built[task][:2])
        assert [e.meta for e in again] == [e.meta for e in built[task][:2]]
        other = build_examples(task, corpus, tok, CONTEXT, 2, replace(CFG, seed=1))
        assert selection_hash(other) != selection_hash(again)


def test_prompts_fit_and_end_with_the_question(built):
    budget = prompt_tokens("vt", CONTEXT, CFG)
    assert budget == CONTEXT - RulerConfig().answer_tokens
    for task, exs in built.items():
        assert len({e.target for e in exs}) == len(exs)
        for e in exs:
            assert budget - 128 <= len(e.prompt_ids) <= budget, task  # less a line at most
            assert e.meta["prompt_tokens"] == len(e.prompt_ids)
            assert _text(e.prompt_ids).endswith(f"# Question: {e.meta['question']}\n# Answer:")
            files = e.meta["context_files"]
            assert files and all(len(f["sha256"]) == 64 for f in files)


def test_needles_hold_the_answer_where_claimed(built):
    for task in NEEDLE_TASKS:
        for e in built[task]:
            text = _text(e.prompt_ids)
            tail = _text(e.prompt_ids[-CFG.control_tokens :])
            items = []
            for n in e.meta["needles"]:
                off = n["offset"]
                assert text[off : off + len(n["text"]) + 1] == n["text"] + "\n"
                assert off == 0 or text[off - 1] == "\n"  # a line of its own
                assert n["text"] not in tail  # the control window holds no needle
                if n["answer"] is not None:
                    items.append(n["answer"])
                    assert n["answer"] in n["text"]
            answer = e.target.split(", ")
            assert answer == items or ANSWER_RULE[task] == "ordered"
            assert sorted(answer) == sorted(items)
            assert not any(a in tail for a in answer)
            # each key, value or name occurs only in the needles and the question
            body = text[: text.rindex("# Question:")]
            for n in e.meta["needles"]:
                body = body.replace(n["text"] + "\n", "", 1)
            assert not any(s in body for s in e.meta.get("keys", []) + answer)


def test_needle_tasks_ask_what_they_hide(built):
    for e in built["niah_single"] + built["niah_multikey"]:
        key, value = e.meta["keys"][0], e.meta["values"][0]
        assert e.meta["asked"] == [key] and e.target == value
        assert f"# magic number for {key}: {value}" in _text(e.prompt_ids)
    assert all(len(e.meta["keys"]) == 4 for e in built["niah_multikey"])
    for e in built["niah_multiquery"]:
        assert e.target == ", ".join(e.meta["values"])  # in the order asked
        assert ", ".join(e.meta["keys"]) in e.meta["question"]
    for e in built["niah_multivalue"]:
        assert sorted(e.target.split(", ")) == sorted(e.meta["values"])


def test_variable_chains_resolve_to_the_asked_value(built):
    for e in built["vt"]:
        binding: dict[str, str] = {}
        for n in e.meta["needles"]:  # in prompt order: each name bound after its source
            name, src = n["text"].split(" = ")
            binding[name] = binding[src] if src.startswith("VAR_") else src
        value = re.search(r"the value (\d+)", e.meta["question"]).group(1)
        bound = sorted(name for name, v in binding.items() if v == value)
        assert bound == sorted(e.target.split(", ")) and len(bound) == 5
        assert len(binding) == 10  # two chains of 4 hops


def test_common_words_are_the_most_common(built):
    cfg = CFG.ruler
    for e in built["cwe"]:
        words = re.findall(r"^# \d+\. (\w+)$", _text(e.prompt_ids), re.MULTILINE)
        counts = Counter(words)
        common = {w for w, c in counts.items() if c == cfg.cwe_common_freq}
        assert common == set(e.target.split(", ")) and len(common) == cfg.cwe_common
        assert max(c for w, c in counts.items() if w not in common) == cfg.cwe_rare_freq
        assert e.meta["num_rare"] == len(counts) - cfg.cwe_common


def test_bundled_tokenizer_fits_4k():
    """The bundled model's BPE tokenizer: 4K prompts fill the budget, needles where claimed."""
    from herald.eval.sources import Corpus
    from herald.models.loader import bundled_checkpoint, load_config, load_tokenizer

    path = bundled_checkpoint("code-sdar")
    tok = load_tokenizer(path, load_config(path))
    corpus = Corpus(codec=tok)
    cfg = TaskConfig()
    for task in ("niah_multikey", "vt", "cwe"):
        (e,) = build_examples(task, corpus, tok, 4096, 1, cfg)
        assert 4096 - 128 - 64 <= len(e.prompt_ids) <= 4096 - 128
        text = tok.decode(e.prompt_ids)
        assert tok.encode(text) == e.prompt_ids
        for n in e.meta.get("needles", []):
            assert text[n["offset"] :].startswith(n["text"] + "\n")
        tail = tok.decode(e.prompt_ids[-cfg.control_tokens :])
        assert task == "cwe" or not any(n["text"] in tail for n in e.meta["needles"])


@pytest.mark.parametrize(
    ("task", "target", "right", "wrong"),
    [
        ("niah_single", "7204518", [" 7204518", "7204518 \nmore"], ["720451", "7204518, 1", ""]),
        ("niah_multikey", "7204518", [" 7204518\n"], ["1183920", " 7204518."]),
        (
            "niah_multiquery",
            "11, 22, 33",
            [" 11, 22, 33", "11,22,33\n# x"],
            ["22, 11, 33", "11, 22", "11, 22, 33, 44"],
        ),
        (
            "niah_multivalue",
            "11, 22, 33",
            [" 33, 11, 22", "22,11,33"],
            ["11, 22", "11, 22, 33, 44", "11, 22, 22, 33", "11 22 33"],
        ),
        ("vt", "VAR_A, VAR_B", [" VAR_B, VAR_A"], ["VAR_A", "VAR_A, VAR_B, VAR_C", "var_a, var_b"]),
        ("cwe", "dump, error", [" error, dump"], ["dump", "dump, errors"]),
    ],
)
def test_exact_match_rules(task, target, right, wrong):
    for completion in right:
        assert score(task, predict(task, completion), target)["em"] == 1.0, completion
    for completion in wrong:
        s = score(task, predict(task, completion), target)
        assert s["em"] == 0.0 and s["es"] < 1.0, completion
    assert predict(task, "\n7204518") == ""  # the answer is on the prompt's last line


class _Lines:
    """A text source that is not the standard library: lines of made-up words."""

    def __init__(self, n: int) -> None:
        rng = random.Random(0)
        word = lambda: "".join(rng.choice("abcdefghij") for _ in range(rng.randint(4, 8)))  # noqa: E731
        self.docs = [
            Document(f"doc{i}", "".join(f"{word()} {word()} {word()}\n" for _ in range(30)))
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.docs)

    def document(self, index: int) -> Document:
        return self.docs[index]


def test_builder_takes_any_source():
    tok, source = tokenizer(), _Lines(30)
    for task in RULER_TASKS:
        a = build_instance(task, source, tok, 700, random.Random(5), CFG.ruler, tail_tokens=50)
        b = build_instance(task, source, tok, 700, random.Random(5), CFG.ruler, tail_tokens=50)
        assert a.prompt_ids == b.prompt_ids and a.target == b.target
        assert len(a.prompt_ids) <= 700 and _text(a.prompt_ids) == a.text
        assert a.completion == f" {a.target}\n"
        assert all(f["file"].startswith("doc") for f in a.meta["context_files"])
    with pytest.raises(ValueError, match="no room"):
        build_instance("niah_single", source, tok, 120, random.Random(0), tail_tokens=100)


def test_runner_end_to_end_on_tiny_sdar():
    from herald.eval.runner import DecodeConfig, Unit, run_unit
    from herald.models.registry import build_model, get_preset

    corpus, tok = stdlib_corpus(), tokenizer()
    config = get_preset("tiny-sdar")
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=1)
    dcfg = DecodeConfig(steps=2, control_tokens=64, batch_size=2)
    for task in ("niah_multivalue", "cwe"):
        exs = build_examples(task, corpus, tok, 512, 2, CFG)
        res = run_unit(Unit(task, 512, "dense"), exs, model, config, tok, dcfg)
        assert res["num_examples"] == 2 and 0.0 <= res["metrics"]["em"] <= 1.0
        assert res["metrics"]["score"] == 100 * res["metrics"]["em"]
        for row in res["examples"]:
            assert row["num_output_tokens"] <= 2 * config.block_size
            assert row["prediction"] == row["completion"].split("\n")[0].strip()


def test_task_groups_expand():
    import argparse

    from herald.eval.cli import register
    from herald.eval.cli_checks import check_args

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", "--out", "x", "--tasks", "vt", "ruler", "line"])
    check_args(args)
    assert args.task == ["vt", *[t for t in RULER_TASKS if t != "vt"], "line"]
    assert parser.parse_args(["eval", "--out", "x"]).task == ["line", "recall"]


def test_herald_eval_runs_ruler_tasks(tmp_path, capsys):
    from herald.cli import main

    out = tmp_path / "eval"
    args = [
        "eval", "--model", "tiny-sdar", "--device", "cpu", "--tasks", "niah_single,vt",
        "--contexts", "1024", "--modes", "dense", "-n", "1", "--steps", "1", "--control-tokens",
        "64", "--analysis-examples", "0", "--no-control", "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    runs = sorted(p.stem for p in (out / "runs").iterdir())
    assert runs == ["niah_single_1024_dense", "vt_1024_dense"]
    sel = json.loads((out / "examples" / "vt_1024.json").read_text())
    assert sel["task_config"]["ruler"]["vt_hops"] == 4 and sel["task_config"]["seed"] == 0
    assert sel["examples"][0]["context_files"][0]["sha256"]
    readme = (out / "README.md").read_text()
    assert "**vt** = RULER-style, variable tracking" in readme
    capsys.readouterr()
    # the line and recall settings do not change these units
    assert main([*args, "--min-distance", "100", "--infile-tokens", "99", "--no-report"]) == 0
    assert "2 already done" in capsys.readouterr().err
