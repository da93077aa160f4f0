"""bench.prefill's measurement on a tiny model on the CPU (the command itself needs CUDA)."""

import pytest
import torch

from herald.bench import prefill
from herald.models.loader import load_model


@pytest.mark.parametrize("mode", ["dense", "herald"])
def test_measure_counts_every_queued_prompt_and_no_warm_up(mode):
    model, config, _ = load_model(
        "tiny-sdar", device="cpu", dtype=torch.bfloat16, random_init_seed=0, block_size=4
    )
    rec = prefill.measure(model, config, mode, 40, 3, chunk_tokens=16, cuda_graphs=False)
    assert rec["prefill_tokens"] == 3 * 40  # the two warm-up prompts are not counted
    assert rec["mode"] == mode and rec["cuda_graphs"] is False
    assert rec["prefill_seconds"] > 0 and rec["prefill_tokens_per_s"] > 0


def test_refuses_bad_lists_before_loading_anything(capsys):
    with pytest.raises(SystemExit):
        prefill.main(["--cuda-graphs", "maybe"])
    assert "invalid choice" in capsys.readouterr().err
