"""Does the long context lower the line target's loss? (a diagnostic, not an eval metric)

For each line-task example of ``herald eval`` (same builder, seed and example set), the target
line (``"\n" + line``, at most 48 tokens) is appended to the prompt and every one of its tokens is
masked: the blocks holding it are the noisy copy of the block-diffusion objective
(``herald.train.objective``: noisy blocks see themselves bidirectionally and the clean prefix
before them; a prompt part inside the first such block stays unmasked). The diagnostic is the
mean cross-entropy (nats per target token) of the target under this one all-masked step, given

- dense: the whole ``--context``-token prompt,
- control: its last 512 tokens (the eval's no-context control),

and the paired difference. A model that uses the long context gives the target a lower loss with
it, even where greedy decoding of the line does not change.

    PYTHONPATH=. python scripts/diagnostics/line_context_nll.py -n 32 --context 8192 \
        --out results/eval/cpu-run3-nll/line_nll_8192.json

CPU float32 by default (about 10 s per example at 8K on two cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from herald.bench.common import command_line, machine_info
from herald.eval.sources import Corpus
from herald.eval.tasks import TaskConfig, build_examples, selection_hash
from herald.models.loader import load_model
from herald.train.objective import DenseDiffusionAttention

TARGET_TOKENS = 48


def masked_target_ce(model, block_size: int, mask_id: int, prompt: list[int], target: list[int]):
    """Mean CE (nats/token) of ``target`` after ``prompt``, all its tokens masked at once."""
    b = block_size
    seq = prompt + target
    start = len(prompt) // b * b  # first block holding a target token
    end = -(-len(seq) // b) * b
    clean = seq + [mask_id] * (end - len(seq))  # padding past the target is never scored
    noisy = list(clean[start:end])
    for i in range(len(prompt) - start, len(seq) - start):
        noisy[i] = mask_id
    m = len(noisy)
    ids = torch.tensor([noisy + clean[:start]])
    pos = torch.tensor([list(range(start, end)) + list(range(start))])
    nb, cb = torch.arange(m) // b, torch.arange(start) // b
    allowed = torch.zeros(m + start, m + start, dtype=torch.bool)
    allowed[:m, :m] = nb[:, None] == nb[None, :]  # a noisy block sees itself
    allowed[:m, m:] = True  # ...and the clean prefix before it
    allowed[m:, m:] = cb[None, :] <= cb[:, None]  # the clean prefix is block-causal
    with torch.no_grad():
        hidden = model(ids, pos, DenseDiffusionAttention(allowed))
        logits = model.lm_head(hidden[0, len(prompt) - start : len(seq) - start]).float()
    return F.cross_entropy(logits, torch.tensor(target)).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="code-sdar")
    p.add_argument("-n", "--num-examples", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--control-tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, cfg, tok = load_model(args.model, device=args.device, dtype=dtype)
    model.eval()
    exs = build_examples(
        "line", Corpus(codec=tok), tok, args.context, args.num_examples, TaskConfig()
    )
    rows, t0 = [], time.perf_counter()
    for e in exs:
        target = tok.encode("\n" + e.target)[:TARGET_TOKENS]
        dense = masked_target_ce(model, cfg.block_size, cfg.mask_token_id, e.prompt_ids, target)
        ctrl_prompt = e.prompt_ids[-args.control_tokens :]
        control = masked_target_ce(model, cfg.block_size, cfg.mask_token_id, ctrl_prompt, target)
        rows.append(
            {"id": e.example_id, "tier": e.meta.get("tier"), "target_tokens": len(target),
             "dense_ce": dense, "control_ce": control}
        )  # fmt: skip
        print(f"{e.example_id}: dense {dense:.3f} control {control:.3f} nats/token "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)  # fmt: skip
    diff = [r["control_ce"] - r["dense_ce"] for r in rows]
    sd = statistics.stdev(diff) if len(diff) > 1 else float("nan")
    summary = {
        "n": len(rows),
        "dense_ce_mean": statistics.mean(r["dense_ce"] for r in rows),
        "control_ce_mean": statistics.mean(r["control_ce"] for r in rows),
        "control_minus_dense_mean": statistics.mean(diff),
        "control_minus_dense_sd": sd,
        "paired_t": statistics.mean(diff) / (sd / len(diff) ** 0.5) if len(diff) > 1 else None,
        "fraction_dense_lower": sum(d > 0 for d in diff) / len(diff),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": command_line(),
                "machine": machine_info(),
                "model": args.model,
                "context": args.context,
                "control_tokens": args.control_tokens,
                "selection_sha256": selection_hash(exs),
                "summary": summary,
                "examples": rows,
            },
            indent=1,
        )  # fmt: skip
        + "\n"
    )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
