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
        (["serve", "--device", "cpu", "--kv-budget", "0.5"], "--kv-budget"),
        (["serve", "--device", "cpu", "--mode", "herald", "--kv-budget", "0"], "--kv-budget"),
        (["serve", "--device", "cpu", "--max-prefill-tokens", "0"], "--max-prefill-tokens"),
        (["serve", "--device", "cpu", "--mode", "herald", "--dtype", "fp32"], "bf16"),
    ],
)
def test_serve_user_errors(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]
