"""Move the per-block stream stats of rehearsed points measured before the fix of 2026-12-02 into
their ``rehearsal`` record, where they belong.

At source hashes 58be41ac60c2b1fb (commit 9461e48) and 65e98b95a4af7054 (c4de9ac),
``herald.bench.throughput_point.run_blocks`` sliced the engine's block stats from the start of
the engine's list, so a rehearsed point's ``block_main_s``, ``block_retrieval_s``,
``block_stall_s``, ``block_retrieval_{start,end}_s`` and ``block_retrieval_parts_s`` are those of
the rehearsal pass's timed blocks, not of the timed pass. Its throughput, step times and
ceilings come from elsewhere and are right. Idempotent; rewrites the JSONL in place.

    python scripts/diagnostics/relabel_rehearsal_block_stats.py results/throughput/throughput.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BUGGY = {"58be41ac60c2b1fb", "65e98b95a4af7054"}
FIELDS = ("block_main_s", "block_retrieval_s", "block_stall_s", "block_retrieval_start_s",
          "block_retrieval_end_s", "block_retrieval_parts_s")  # fmt: skip


def main(path: Path) -> int:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    buggy = {
        r["run_id"]
        for r in recs
        if r.get("kind") == "run" and (r.get("code") or {}).get("source_sha256") in BUGGY
    }
    moved = 0
    for r in recs:
        if r.get("kind") != "point" or r.get("run_id") not in buggy or "rehearsal" not in r:
            continue
        got = {k: r.pop(k) for k in FIELDS if k in r}
        if got:
            r["rehearsal"].update(got)
            moved += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"{path}: moved the block stats of {moved} point(s) into their rehearsal")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
