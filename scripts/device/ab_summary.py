"""Print one line per throughput point found under DIR/<GLOB>/throughput.jsonl (tok/s, forward
median, time): the summary of an A/B run of scripts/device/ab_points.sh or forward_ab.sh.

    python3 scripts/device/ab_summary.py DIR GLOB
"""

import json
import pathlib
import sys

root, pattern = pathlib.Path(sys.argv[1]), sys.argv[2]
for d in sorted(root.glob(pattern)):
    if not (d / "throughput.jsonl").is_file():  # (a summary file the pattern also matches)
        continue
    for line in (d / "throughput.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "point":
            print(
                f"{d.name:28s} {r['variant']:16s} bs {r['batch']:3d} {r['status']:6s} "
                f"{r.get('decode_tokens_per_s', 0):8.1f} tok/s  fwd "
                f"{1e3 * (r.get('forward_median_s') or 0):6.2f} ms  {r['time_utc']}"
            )
