"""Which switch makes the served replies depend on their batch mates on the GPU?

Runs the server's batch-invariance test (``tests/server/test_batch_invariance.py``, the CUDA
case: 32 mixed-length prompts sent at once, each reply against the same prompt alone) once per
variant, each in a fresh process, and prints one line per variant with how many replies
differed. Variants: the defaults; ``HERALD_COMPILE=0`` (no ``torch.compile`` of the small
element-wise functions); ``HERALD_TRITON=0`` (none of herald's Triton kernels); the start-up
warm-up of one request instead of every batch size; no warm-up at all; no CUDA graphs
(every forward eager), with and without ``torch.compile``. On the GPU machine
(carry .whl, checkpoints/code-sdar in the tree)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 scripts/diagnostics/invariance_bisect.py --modes dense herald

Each variant takes ~20-40 s per mode on an H200.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

TEST = "tests/server/test_batch_invariance.py"

# A variant: (name, extra environment, Python run before pytest in the child process).
_ONE_SIZE = (
    "import herald.server.launch as L\n"
    "_real = L.warm_up_engine\n"
    "L.warm_up_engine = lambda eng, tok: _real(eng, tok, all_sizes=False)\n"
)
_NO_WARMUP = (
    "import herald.server.launch as L\n"
    "from herald.server.warmup import WarmUp\n"
    "L.warm_up_engine = lambda eng, tok: WarmUp(0.0, (), 0, 0)\n"
)
_NO_GRAPHS = (
    "import herald.engine.runner as R\n"
    "_init = R.ModelRunner.__init__\n"
    "R.ModelRunner.__init__ = lambda self, m, *, use_cuda_graph, is_moe: "
    "_init(self, m, use_cuda_graph=False, is_moe=is_moe)\n"
)
VARIANTS: list[tuple[str, dict[str, str], str]] = [
    ("defaults", {}, ""),
    ("HERALD_COMPILE=0", {"HERALD_COMPILE": "0"}, ""),
    ("HERALD_TRITON=0", {"HERALD_TRITON": "0"}, ""),
    ("warm-up of one request", {}, _ONE_SIZE),
    ("no warm-up", {}, _NO_WARMUP),
    ("no CUDA graphs", {}, _NO_GRAPHS),
    ("no CUDA graphs, HERALD_COMPILE=0", {"HERALD_COMPILE": "0"}, _NO_GRAPHS),
]


def run_variant(name: str, env: dict[str, str], prelude: str, modes: list[str], device: str) -> str:
    select = " or ".join(f"{m}-{device}" for m in modes)
    marks = "gpu" if device == "cuda" else "not gpu"
    code = (
        prelude
        + "import sys, pytest\n"
        + f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', {marks!r}, {TEST!r}, "
        + f"'-k', {select!r}]))\n"
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    differ = re.findall(r"(\w+) on \w+: (\d+) of (\d+) replies differ", out)
    summary = re.findall(r"\d+ (?:passed|failed|error)[^\n]*", out)
    found = ", ".join(f"{m}: {n} of {t} differ" for m, n, t in differ) or "none differ"
    tail = summary[-1] if summary else out.strip()[-300:]
    return f"{name}: exit {proc.returncode}, {found}; {tail} ({time.perf_counter() - t0:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["dense"], help="engine modes to test")
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run (default all)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the test's case")
    args = ap.parse_args(argv)
    for name, env, prelude in VARIANTS:
        if args.only and name not in args.only:
            continue
        print(run_variant(name, env, prelude, args.modes, args.device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
