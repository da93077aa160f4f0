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
