"""A throttled link found and routed around (issue 24): onset -> detection -> resumed, and the step
time before, during and after, over real runs of tests/e2e/test_avoid_interface.py.

Usage (root, iproute2):
    python -m bench.avoid_interface [--runs 3]

Each run is the end-to-end test: two network namespaces joined by two veth paths, a gloo job of
two ranks under ``clusterwatch run`` over path A (100 ms of compute and a 1 MiB all-reduce a
step), 8 s healthy (no incident allowed), then ``tc qdisc ... tbf rate 20mbit`` on node 1's end
of path A. The test writes its measurements to ``$CLUSTERWATCH_BENCH_OUT``; this prints them, one
run a line, and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/e2e/test_avoid_interface.py"
FIELDS = ("detection_s", "resumed_s", "step_before_s", "step_during_s", "step_after_s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.runs):
            out = Path(folder) / f"run{index}.json"
            env = {**os.environ, "CLUSTERWATCH_BENCH_OUT": str(out)}
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", TEST],
                cwd=ROOT, env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0 or not out.exists():
                print(f"run {index}: the test failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
                return 1
            runs.append(json.loads(out.read_text()))
            print(
                f"run {index}: " + ", ".join(f"{field} {runs[-1][field]:.3f}" for field in FIELDS), flush=True
            )
    medians = {field: statistics.median(run[field] for run in runs) for field in FIELDS}
    print("median: " + ", ".join(f"{field} {value:.3f}" for field, value in medians.items()))
    after_ratio = medians["step_after_s"] / medians["step_before_s"]
    print(f"step time after / before: {after_ratio:.3f} (target <= 1.10); detection target <= 15 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
