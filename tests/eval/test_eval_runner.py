"""Runner end to end on tiny-sdar: herald at budget 1.0 predicts exactly what dense predicts."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import SMALL, stdlib_corpus, tokenizer

from herald.eval.runner import DecodeConfig, Unit, plan_units, run_unit
from herald.eval.tasks import build_examples
from herald.models.registry import build_model, get_preset


def test_herald_at_budget_one_equals_dense():
    corpus, tok = stdlib_corpus(), tokenizer()
    config = get_preset("tiny-sdar")
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=1)
    examples = build_examples("line", corpus, tok, 256, 3, SMALL)
    dcfg = DecodeConfig(steps=3, control_tokens=64, selection_threads=2, batch_size=2)
    dense = run_unit(Unit("line", 256, "dense"), examples, model, config, tok, dcfg)
    herald = run_unit(Unit("line", 256, "herald", 1.0), examples, model, config, tok, dcfg)
    control = run_unit(Unit("line", 256, "control"), examples, model, config, tok, dcfg)
    assert [r["completion"] for r in herald["examples"]] == [
        r["completion"] for r in dense["examples"]
    ]
    assert herald["metrics"] == dense["metrics"]
    assert dense["prompt_tokens_mean"] == 256 and control["prompt_tokens_mean"] == 64
    assert all(r["num_output_tokens"] == 64 for r in dense["examples"])  # two blocks, no EOS cut
    assert 0.0 <= dense["metrics"]["es"] <= 1.0


def test_plan_puts_operating_points_first():
    units = plan_units(["line"], [4096], ["dense", "herald", "mage"], [0.01, 0.025, 0.05])
    keys = [u.key for u in units]
    assert keys[:4] == [
        "line_4096_dense",
        "line_4096_control",
        "line_4096_mage_0.025",
        "line_4096_herald_0.05",
    ]
    assert len(keys) == 2 + 2 * 3 and len(set(keys)) == len(keys)


def test_acceptance_lines_from_a_committed_run():
    """The report's acceptance checks on a real run (results/eval/cpu-run3-line: 24 examples at
    8K, dense 40.8 vs control 34.0): the paired bootstrap says clearly above, and a run this
    small is flagged as a rough check."""
    from pathlib import Path

    from herald.eval.acceptance import acceptance
    from herald.eval.report import collect
    from herald.eval.summary import summary_table

    units, _ = collect(Path(__file__).parents[2] / "results" / "eval" / "cpu-run3-line")
    lines = acceptance(units, summary_table(units))
    line = next(x for x in lines if "line (ES)" in x)
    assert "dense 40.8 vs control 34.0" in line and "-> clearly above" in line
    assert "(only 24 examples: a rough check)" in line
    # a handful of examples gets no verdict (one example gave "clearly above" on [+9.9, +9.9])
    few = {k: {**u, "examples": u["examples"][:5]} if k.startswith("line_8192_") else u
           for k, u in units.items()}  # fmt: skip
    tiny = next(x for x in acceptance(few, summary_table(few)) if "line (ES)" in x)
    assert "-> no verdict below 10 examples" in tiny and "clearly above" not in tiny
    # one task: the average's interval is that task's paired interval
    herald = next(x for x in lines if "herald: average" in x)
    assert "average +0.69 [" in herald and "at its operating budget 0.05" in herald
    avg_lo_hi = herald.split("average +0.69 [")[1].split("]")[0].split(", ")
    task_lo_hi = herald.split("line +0.7 [")[1].split("]")[0].split(", ")
    assert [float(x) for x in avg_lo_hi] == pytest.approx([float(x) for x in task_lo_hi], abs=0.051)


def test_acceptance_average_intervals_of_two_tasks():
    """Both tasks (results/eval/gpu-run3-random, 256 examples per task): the average's interval
    resamples each task's examples on their own, at the operating budget and, separately, at the
    first budget within 1 point; known values of the committed run."""
    from pathlib import Path

    from herald.eval.acceptance import acceptance
    from herald.eval.report import collect
    from herald.eval.stats import mean_paired_bootstrap
    from herald.eval.summary import summary_table

    out = Path(__file__).parents[2] / "results" / "eval" / "gpu-run3-random" / "8k"
    units, _ = collect(out)
    lines = acceptance(units, summary_table(units))
    herald = next(x for x in lines if "8192 tokens, herald:" in x)
    assert "average -1.32 [-2.51, -0.19] at its operating budget 0.05" in herald
    assert "within 1 point of dense from budget 0.1 (-0.92 [-1.95, +0.02])" in herald
    # the same interval from the two tasks' per-example scores, computed here
    pairs = [
        tuple(
            [float(e[m]) for e in units[f"{t}_8192_{k}"]["examples"]]
            for k in ("herald_0.1", "dense")
        )
        for t, m in (("line", "es"), ("recall", "em"))
    ]
    lo, hi = mean_paired_bootstrap(pairs)
    assert f"[{100 * lo:+.2f}, {100 * hi:+.2f}]" == "[-1.95, +0.02]"
    # a mode never within 1 point prints no second interval
    infinigen = next(x for x in lines if "8192 tokens, infinigen:" in x)
    assert "average -1.16 [-2.58, +0.26]" in infinigen and "never within 1 point" in infinigen
    # with one task's unit missing there is no average at that budget, and no interval
    del units["recall_8192_herald_0.05"]
    lines = acceptance(units, summary_table(units))
    herald = next(x for x in lines if "8192 tokens, herald:" in x)
    assert "average at its operating budget 0.05: not run for every task;" in herald
    assert "-1.32" not in herald
    assert "(-0.92 [-1.95, +0.02])" in herald


def test_report_header_line_setting_and_random_weights():
    """The header's line setting comes from a line unit even when a recall unit (whose units do
    not depend on it) recorded another; a random-weight model gets a banner."""
    import copy
    from pathlib import Path

    from herald.eval.report import collect
    from herald.eval.report_markdown import markdown

    units, selections = collect(
        Path(__file__).parents[2] / "results" / "eval" / "gpu-run3-random" / "8k"
    )
    units = {k: u for k, u in units.items() if u["task"] == "line"}  # the recall units: made here
    recall = copy.deepcopy(units["line_8192_dense"])
    recall["task"] = "recall"
    recall["config"]["tasks"]["line_setting"] = "cross_file_later"
    mixed = {"recall_8192_dense": recall, **units}
    md = markdown(mixed, selections, None)
    assert "targets: `cross_file_random`" in md and "targets: `cross_file_later`" not in md
    # and the recall text from a recall unit, wherever it sits among the units
    recall["config"]["tasks"]["min_distance"] = 1234
    md_last = markdown({**units, "recall_8192_dense": recall}, selections, None)
    assert "defined at least 1234 tokens earlier" in md_last
    assert "targets: `cross_file_random`" in md_last
    assert "RANDOM WEIGHTS" not in md
    for u in mixed.values():
        u["config"]["model"]["random_weights"] = True
    assert "**RANDOM WEIGHTS" in markdown(mixed, selections, None)


def test_report_refuses_to_merge_other_runs(tmp_path):
    """Parts of one run merge; units of another model, or another example selection of the same
    task and context, make --report refuse instead of mixing them into one table."""
    import shutil
    from pathlib import Path

    import pytest

    from herald.eval.report import collect

    ev = Path(__file__).parents[2] / "results" / "eval"
    parts = tmp_path / "one-run"
    for part in ("4k", "16k-recall"):  # two parts of gpu-run3-random
        for sub in ("runs", "examples"):
            (parts / part / sub).mkdir(parents=True)
        for name in ("recall_4096_dense", "recall_16384_dense"):
            src = ev / "gpu-run3-random" / part / "runs" / f"{name}.json"
            if src.is_file():
                shutil.copy(src, parts / part / "runs")
        for src in (ev / "gpu-run3-random" / part / "examples").glob("recall_*.json"):
            shutil.copy(src, parts / part / "examples")
    units, selections = collect(parts)
    assert set(units) == {"recall_4096_dense", "recall_16384_dense"}
    assert set(selections) == {"recall_4096", "recall_16384"}

    other_model = tmp_path / "other-model"
    shutil.copytree(parts, other_model)
    (other_model / "28m" / "runs").mkdir(parents=True)
    shutil.copy(
        ev / "gpu-28m" / "8k" / "runs" / "line_8192_dense.json", other_model / "28m" / "runs"
    )
    with pytest.raises(ValueError, match="different models"):
        collect(other_model)

    other_selection = tmp_path / "other-selection"
    shutil.copytree(parts, other_selection)
    (other_selection / "seed2" / "examples").mkdir(parents=True)
    shutil.copy(  # recall at 8K, seed 2 ...
        ev / "gpu-run3-random" / "8k" / "examples" / "recall_8192.json",
        other_selection / "seed2" / "examples",
    )
    collect(other_selection)  # ... is another context: fine
    (other_selection / "again" / "examples").mkdir(parents=True)
    shutil.copy(  # recall at 8K from the CPU run: another corpus, same task and context
        ev / "cpu-run3-recall" / "8k" / "examples" / "recall_8192.json",
        other_selection / "again" / "examples",
    )
    with pytest.raises(ValueError, match="two different recall_8192 example selections"):
        collect(other_selection)


def test_report_without_matplotlib_writes_its_tables_and_says_so(tmp_path, monkeypatch, capsys):
    """matplotlib is the ``plot`` extra: without it the report of a committed run (with a
    Fig. 7/9 analysis) writes results.json and its tables, draws no plot, and one line on
    stderr says that the plots were skipped and how to get them."""
    import shutil
    import sys
    from pathlib import Path

    from herald.eval.report import write_report

    run = Path(__file__).parents[2] / "results" / "eval" / "cpu-run2"
    for sub in ("runs", "examples"):
        shutil.copytree(run / sub, tmp_path / sub)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    readme = write_report(tmp_path).read_text()
    assert "## Table I analog: 4096-token contexts" in readme and "## Acceptance checks" in readme
    assert "## Fig. 7 analog" in readme and "## Fig. 9 analog" in readme
    assert "no plots (pip install 'herald[plot]'" in readme and "Plots:" not in readme
    assert (tmp_path / "results.json").is_file() and not list(tmp_path.glob("*.png"))
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "plots skipped" in line] == [
        "eval report: plots skipped (matplotlib is not installed); for plots: "
        "pip install 'herald[plot]' (from a checkout: pip install -e '.[plot]')"
    ]
