"""Metrics on known strings."""

from __future__ import annotations

import pytest

from herald.eval.metrics import edit_similarity, first_identifier, first_line, predict, score


def test_edit_similarity_known_values():
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("abcd", "abce") == pytest.approx(0.75)  # 2 * 3 / 8
    assert edit_similarity("x = foo(1)", "x = bar(1)") == pytest.approx(14 / 20)


def test_first_line_and_identifier():
    # The prompt stops before the newline ending the line above the target: the prediction is
    # the first non-blank line after a line break; text before it finishes the line above.
    assert first_line("\n    return x\n    y = 2\n") == "    return x"
    assert first_line("\n\n  \n    return x\nmore") == "    return x"
    assert first_line("ardown\n        from x import y\n") == "        from x import y"
    assert first_line("    return x") == ""  # never leaves the line above
    assert first_line("\n \n") == ""
    assert first_line("\na\r\nb") == "a"
    assert first_identifier("  _foo_1(bar)") == "_foo_1"
    assert first_identifier("\nfoo") == ""  # a newline first: no identifier at the use
    assert first_identifier("(x)") == ""
    assert predict("recall", "name.attr") == "name"
    assert predict("line", "\nx = 1\n") == "x = 1"


def test_scores():
    assert score("line", "   x = 1  ", "        x = 1") == {"em": 1.0, "es": 1.0}
    assert score("recall", "foo", "foo_") == {"em": 0.0, "es": pytest.approx(6 / 7)}
    with pytest.raises(ValueError):
        predict("nope", "")


def test_paired_bootstrap_levels():
    from herald.eval.stats import paired_bootstrap

    a = [0.3, 0.5, 0.4, 0.9, 0.2, 0.6, 0.7, 0.1] * 4
    b = [0.2, 0.5, 0.1, 0.6, 0.2, 0.3, 0.7, 0.2] * 4
    lo95, hi95 = paired_bootstrap(a, b)
    lo99, hi99 = paired_bootstrap(a, b, level=0.99)
    mean = (sum(a) - sum(b)) / len(a)
    assert lo99 <= lo95 < mean < hi95 <= hi99
    assert lo99 < lo95 or hi99 > hi95  # the wider level is wider somewhere
    assert paired_bootstrap(a, a) == (0.0, 0.0)


def test_mean_paired_bootstrap():
    import pytest

    from herald.eval.stats import mean_paired_bootstrap, paired_bootstrap

    a = [0.3, 0.5, 0.4, 0.9, 0.2, 0.6, 0.7, 0.1] * 4
    b = [0.2, 0.5, 0.1, 0.6, 0.2, 0.3, 0.7, 0.2] * 4
    c, d = [1.0, 0.0, 0.0, 1.0, 0.0] * 10, [0.0] * 50
    assert mean_paired_bootstrap([(a, b)]) == paired_bootstrap(a, b)
    lo, hi = mean_paired_bootstrap([(a, b), (c, d)])
    mean_ab, mean_cd = (sum(a) - sum(b)) / len(a), sum(c) / len(c)
    assert lo < (mean_ab + mean_cd) / 2 < hi
    # averaging two independent tasks narrows the interval of the wider one
    lo_cd, hi_cd = paired_bootstrap(c, d)
    assert hi - lo < hi_cd - lo_cd
    # a task with no difference pulls the average (and its interval) about halfway to 0
    lo0, hi0 = mean_paired_bootstrap([(c, d), (d, d)])
    assert lo0 == pytest.approx(lo_cd / 2, abs=0.03) and hi0 == pytest.approx(hi_cd / 2, abs=0.03)
    assert mean_paired_bootstrap([(a, b), (c, d)]) == (lo, hi)  # seeded
    # the tasks weigh equally whatever their sizes (not one pooled resample weighted by n):
    # 10 examples all +1 and 1,000 all 0 average to +0.5, with no spread at all
    ones, zeros = ([1.0] * 10, [0.0] * 10), ([0.0] * 1000, [0.0] * 1000)
    assert mean_paired_bootstrap([ones, zeros], reps=50) == (0.5, 0.5)
    with pytest.raises(ValueError):
        mean_paired_bootstrap([])
    with pytest.raises(ValueError):
        mean_paired_bootstrap([(a, b[:-1])])


def test_line_variants_table(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "diagnostics"))
    from line_variants_table import main

    folders = {"v-in1": ([1.0, 0.5], [0.5, 0.5]), "v-in2": ([0.2, 0.2], [0.2, 0.4])}
    for name, (d, c) in folders.items():
        runs = tmp_path / name / "runs"
        runs.mkdir(parents=True)
        for mode, es in (("dense", d), ("control", c)):
            rows = [{"id": f"x{i}", "es": v} for i, v in enumerate(es)]
            (runs / f"line_8192_{mode}.json").write_text(json.dumps({"examples": rows}))
    assert main([str(tmp_path / "v-in1"), str(tmp_path / "v-in2")]) == 0
    out = capsys.readouterr().out
    assert "Bonferroni over 2" in out and "97.5%" in out
    assert "| `v-in1` | 2 | 75.0 | 50.0 | +25.0" in out
    assert "| `v-in2` | 2 | 20.0 | 30.0 | -10.0" in out


def test_crossing_budget_interpolates_between_the_budgets_around_the_target():
    from herald.eval.stats import crossing_budget

    recall = {0.05: 0.745, 0.025: 0.55, 0.075: 0.835}  # any order
    first, interpolated = crossing_budget(recall, 0.779)
    assert first == 0.075
    assert interpolated == pytest.approx(0.05 + (0.779 - 0.745) * 0.025 / (0.835 - 0.745))
    assert crossing_budget(recall, 0.5) == (0.025, 0.025)  # the smallest budget already reaches
    assert crossing_budget(recall, 0.9) is None
