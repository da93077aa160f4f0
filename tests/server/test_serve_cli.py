"""``herald serve`` argument errors: one ``error:`` line, exit 2, before any model loads."""

from __future__ import annotations

import pytest

from herald.cli import main


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--device", "cpu", "--max-waiting", "0"], "--max-waiting"),
        (["serve", "--device", "cpu", "--port", "70000"], "--port"),
        (["serve", "--device", "cpu", "--max-batch-size", "0"], "--max-batch-size"),
        (["serve", "--device", "tpu"], "--device"),
    ],
)
def test_serve_user_errors(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]
