"""`herald eval` end to end on the CPU: files written, resume, report rewrite, user errors."""

from __future__ import annotations

import json

from herald.cli import main

ARGS = [
    "eval", "--model", "tiny-sdar", "--device", "cpu", "--task", "line", "--contexts", "256",
    "--modes", "dense", "herald", "--kv-budget", "1.0", "-n", "2", "--steps", "2",
    "--control-tokens", "64", "--infile-tokens", "64", "--analysis-examples", "1",
    "--analysis-blocks", "2", "--selection-threads", "2", "--no-control",
]  # fmt: skip


def test_eval_writes_results_and_resumes(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main([*ARGS, "--out", str(out)]) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == [
        "line_256_analysis.json",
        "line_256_dense.json",
        "line_256_herald_1.json",
    ]
    sel = json.loads((out / "examples" / "line_256.json").read_text())
    assert len(sel["examples"]) == 2 and sel["corpus"]["python"]
    assert all("sha256" in e and "line" in e for e in sel["examples"])
    res = json.loads((out / "results.json").read_text())
    assert res["units"]["line_256_herald_1"]["metrics"] == res["units"]["line_256_dense"]["metrics"]
    readme = (out / "README.md").read_text()
    assert "Table I analog" in readme and "Fig. 9 analog" in readme and "Overview" in readme
    assert "**RANDOM WEIGHTS" in readme  # tiny-sdar: the scores are noise, and the report says so
    capsys.readouterr()
    assert main([*ARGS, "--out", str(out), "--no-report"]) == 0  # all done: nothing reruns
    assert "3 already done" in capsys.readouterr().err
    assert main(["eval", "--report", "--out", str(out)]) == 0
    # Other settings into the same --out: refused (not skipped as "already done").
    assert main([*ARGS, "--out", str(out), "--steps", "3"]) == 2  # the last --steps wins
    err = capsys.readouterr().err
    assert "other settings" in err and "steps" in err and "new --out" in err
    # A setting of the other task does not change these units; the line's own settings do.
    assert main([*ARGS, "--out", str(out), "--no-report", "--min-distance", "100"]) == 0
    assert "3 already done" in capsys.readouterr().err
    assert main([*ARGS, "--out", str(out), "--line-setting", "cross_file_later"]) == 2
    assert "line_setting" in capsys.readouterr().err
    assert main([*ARGS, "--out", str(out), "--first-pass", "int8-gpu"]) == 2
    err = capsys.readouterr().err
    assert "line_256_herald_1.json" in err and "first_pass" in err
    # a result written before the first pass was a setting ran the exact one ("none")
    for unit in ("line_256_dense", "line_256_herald_1"):
        path = out / "runs" / f"{unit}.json"
        rec = json.loads(path.read_text())
        del rec["config"]["decode"]["first_pass"]
        path.write_text(json.dumps(rec))
    assert main([*ARGS, "--out", str(out), "--no-report"]) == 0
    assert "3 already done" in capsys.readouterr().err
    assert main([*ARGS, "--out", str(out), "--first-pass", "int8-gpu"]) == 2
    assert "decode.first_pass: 'none' -> 'int8-gpu'" in capsys.readouterr().err
    # the first pass changes only the herald units: a dense-only run resumes
    dense_only = [a for a in ARGS if a not in ("herald", "--kv-budget", "1.0")]
    assert main([*dense_only, "--out", str(out), "--no-report", "--first-pass", "none"]) == 0
    assert res["not_run"] == []
    # A planned unit without a result (a time limit stopped the call) is named in the report.
    (out / "runs" / "line_256_herald_1.json").unlink()
    assert main(["eval", "--report", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["not_run"] == ["line_256_herald_1"]
    assert "Not run yet: 1 planned unit(s)" in (out / "README.md").read_text()


def test_eval_first_pass_reaches_the_herald_units(tmp_path, monkeypatch):
    """--first-pass int8-gpu: the herald units select on the device (at budget 1.0, as dense)."""
    import herald.offload.retrieval_device as rd

    calls = []
    real = rd.select_int8
    monkeypatch.setattr(rd, "select_int8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = tmp_path / "eval"
    argv = [*ARGS, "--out", str(out), "--analysis-examples", "0", "--first-pass", "int8-gpu"]
    assert main(argv) == 0 and calls
    res = json.loads((out / "results.json").read_text())
    assert res["units"]["line_256_herald_1"]["metrics"] == res["units"]["line_256_dense"]["metrics"]
    rec = json.loads((out / "runs" / "line_256_herald_1.json").read_text())
    assert rec["config"]["decode"]["first_pass"] == "int8-gpu"
    assert "| herald (int8-gpu)@1 |" in (out / "README.md").read_text()  # the report says so


def test_eval_user_errors(tmp_path, capsys):
    assert main(["eval", "--out", str(tmp_path), "--kv-budget", "0"]) == 2
    assert "--kv-budget" in capsys.readouterr().err
    assert main(["eval", "--out", str(tmp_path), "--modes", "dense", "mage",
                 "--first-pass", "int8-gpu"]) == 2  # fmt: skip
    assert "--first-pass int8-gpu applies to the herald units" in capsys.readouterr().err
    assert (
        main(["eval", "--out", str(tmp_path), "--contexts", "1024", "--control-tokens", "64"]) == 2
    )
    assert "recall needs contexts" in capsys.readouterr().err
    line = ["eval", "--out", str(tmp_path), "--task", "line", "--contexts", "8192"]
    assert main([*line, "--infile-tokens", "100"]) == 2
    assert "no-context control would see cross-file context" in capsys.readouterr().err
    assert main(["eval", "--report", "--out", str(tmp_path / "none")]) == 2


def test_eval_flag_errors_come_before_any_work(tmp_path, capsys):
    bad = [
        ["--control-tokens", "0"],
        ["--infile-tokens", "0"],
        ["--oracle-budget", "0"],
        ["--analysis-blocks", "0"],
        ["--selection-threads", "0"],
        ["--threshold", "2"],
        ["--steps", "0"],
        ["--time-limit-s", "-1"],
        ["--analysis-examples", "-1"],
    ]
    for extra in bad:
        out = tmp_path / "x"
        args = ARGS
        if "--threshold" in extra:  # not with --steps
            i = ARGS.index("--steps")
            args = ARGS[:i] + ARGS[i + 2 :]
        assert main([*args, "--out", str(out), *extra]) == 2, extra
        assert extra[0] in capsys.readouterr().err, extra
        assert not out.exists(), extra  # refused before --out was created


def test_eval_contexts_checks(tmp_path, capsys):
    """Contexts take K suffixes; zero or negative ones are refused as such; every context must
    exceed --control-tokens, with --no-control too (the tasks pick their targets outside the
    control window)."""
    import argparse

    from herald.cli import build_parser
    from herald.eval.cli_checks import check_args

    def parse(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args(["eval", "--out", str(tmp_path / "x"), *flags])

    args = parse("--contexts", "4K,8k", "16384")
    check_args(args)
    assert args.contexts == [4096, 8192, 16384]
    for bad in ("0", "-4096"):
        assert main(["eval", "--out", str(tmp_path / "x"), "--contexts", bad]) == 2
        assert f"--contexts {bad}: every context must be positive" in capsys.readouterr().err
    assert main(["eval", "--out", str(tmp_path / "x"), "--contexts", "256", "--no-control"]) == 2
    err = capsys.readouterr().err
    assert "--contexts 256: every context must exceed --control-tokens 512" in err
    assert "with --no-control too" in err and "--control-tokens 64" in err
    args = parse("--contexts", "4k", "--control-tokens", "1K", "--infile-tokens", "2K")
    check_args(args)
    assert (args.contexts, args.control_tokens, args.infile_tokens) == ([4096], 1024, 2048)
    assert not (tmp_path / "x").exists()


def test_eval_kv_budget_checks(tmp_path, capsys):
    """--kv-budget applies to the offloading modes: refused with --modes dense alone; given
    twice (its old name --budgets included) with other budgets it is refused, not dropped."""
    import pytest

    from herald.cli import build_parser
    from herald.eval.cli_checks import check_args
    from herald.eval.runner import DEFAULT_BUDGETS

    out = ["eval", "--out", str(tmp_path / "x")]
    assert main([*out, "--modes", "dense", "--kv-budget", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--kv-budget 0.1: the budgets apply to the offloading modes" in err
    assert "--modes dense runs none of them" in err
    for first in ("--budgets", "--kv-budget"):
        with pytest.raises(SystemExit):
            main([*out, first, "0.1", "--kv-budget", "0.2"])
        err = capsys.readouterr().err
        assert "--kv-budget: given twice" in err and "--kv-budget 0.1 0.2" in err
    args = build_parser().parse_args([*out, "--modes", "dense"])  # no budget given: fine
    check_args(args)
    assert args.budgets == list(DEFAULT_BUDGETS)
    args = build_parser().parse_args([*out, "--kv-budget", "0.1,0.2", "--kv-budget", "0.1", "0.2"])
    check_args(args)
    assert args.budgets == [0.1, 0.2]
    assert not (tmp_path / "x").exists()


def test_eval_part_default_reads_as_k_of_n():
    import argparse

    from herald.cliargs import HelpFormatter
    from herald.eval.cli import register

    parser = register(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--out", "x"]).part == (1, 1)
    assert parser.parse_args(["--out", "x", "--part", "2/3"]).part == (2, 3)
    part = next(a for a in parser._actions if a.dest == "part")
    assert HelpFormatter("herald")._get_help_string(part).endswith("(default: 1/1)")


def test_eval_refuses_contexts_longer_than_the_model_takes(tmp_path, capsys):
    """A context past the model's positions is refused before any example is built (not cut
    silently and reported under the asked-for label)."""
    args = [a if a != "256" else "10000000" for a in ARGS]
    out = tmp_path / "x"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--contexts 10000000: the line task fits at most" in err
    assert not (out / "examples").exists()


def test_eval_labels_the_bundled_checkpoint_as_trained():
    import argparse

    from herald.eval.cli_checks import model_info
    from herald.models.loader import load_model

    _, config, _ = load_model("code-sdar", "cpu")
    info = model_info(argparse.Namespace(model="code-sdar"), config)
    assert info["random_weights"] is False and len(info["config_sha256"]) == 64
    _, config, _ = load_model("tiny-sdar", "cpu")
    assert model_info(argparse.Namespace(model="tiny-sdar"), config)["random_weights"] is True


def test_report_names_the_planned_units_of_parts_not_run(tmp_path):
    """--part 1/2 runs 2 of the 3 units: its report names the third; once part 2 ran into a
    sibling folder, the report over both (merged) names none."""
    out = tmp_path / "eval"
    assert main([*ARGS, "--out", str(out / "p1"), "--part", "1/2"]) == 0
    res = json.loads((out / "p1" / "results.json").read_text())
    assert res["not_run"] == ["line_256_analysis"]
    assert "Not run yet: 1 planned unit(s)" in (out / "p1" / "README.md").read_text()
    assert main([*ARGS, "--out", str(out / "p2"), "--part", "2/2"]) == 0
    assert main(["eval", "--report", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["not_run"] == []
    assert "Not run yet" not in (out / "README.md").read_text()


def test_eval_exclude_examples(tmp_path, capsys):
    base = [a for a in ARGS if a not in ("herald", "--kv-budget", "1.0")]  # dense only
    base[base.index("--analysis-examples") + 1] = "0"
    first, second = tmp_path / "a", tmp_path / "b"
    assert main([*base, "--out", str(first), "--no-report"]) == 0
    seen = first / "examples" / "line_256.json"
    assert main([*base, "--out", str(second), "--no-report", "--exclude-examples", str(seen)]) == 0
    assert "excluded (--exclude-examples)" in capsys.readouterr().err

    def targets(out):
        sel = json.loads((out / "examples" / "line_256.json").read_text())
        return {(e["file"], e["target"]) for e in sel["examples"]}

    assert len(targets(second)) == 2 and not targets(first) & targets(second)
    sel = json.loads((second / "examples" / "line_256.json").read_text())
    assert sel["excluded_from"] == [str(seen)]  # the line files given, per task
    # the exclusion is part of the run's settings: resuming without it is refused
    assert main([*base, "--out", str(second), "--no-report"]) == 2
    assert "exclude_examples" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "c"), "--exclude-examples", str(tmp_path)]) == 2
    assert "--exclude-examples" in capsys.readouterr().err
    # an examples file of the same --out would be rewritten by the run itself
    assert main([*base, "--out", str(first), "--exclude-examples", str(seen)]) == 2
    assert "inside --out" in capsys.readouterr().err
    # the same file twice is one exclusion: the finished run resumes
    twice = ["--exclude-examples", str(seen), str(seen)]
    assert main([*base, "--out", str(second), "--no-report", *twice]) == 0
    assert "1 already done" in capsys.readouterr().err
    # a missing file is named as such; another task's examples are ignored with a note
    assert main([*base, "--out", str(tmp_path / "d"), "--exclude-examples", "nope.json"]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err
    recall = tmp_path / "recall_256.json"
    recall.write_text(json.dumps({"task": "recall", "selection_sha256": "0" * 64, "examples": []}))
    assert main([*base, "--out", str(second), "--no-report", *twice, str(recall)]) == 0
    assert "recall examples, ignored (this run's tasks: line)" in capsys.readouterr().err
