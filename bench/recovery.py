"""Recovery in the demo: detection and recovery times, steps lost, checkpoint delay, over several runs.

Usage:
    python -m bench.recovery [--runs 3] [--steps 150] [--inject KIND@step=N,rank=R ...]

Runs ``clusterwatch demo`` (a coordinator, two simulated-GPU agents, an
elastic ``torchrun --nnodes 1:2 --nproc-per-node 2`` job per node, a
straggler at step 30 and a hang at step 80) --runs times, one after the
other (with --inject: those faults instead), and reads each run's summary. Prints JSON: per fault kind, each run's
detection latency (onset -> incident), recovery time (detection -> every
rank past the resume step), onset -> resumed and steps lost; each run's ETTR
and wall time; and the largest coordinated-checkpoint delay in steps (the
slowest rank's save time / the job's step time). Targets (issue 5): for the
hang, detection -> resumed <= 10 s and onset -> resumed <= 20 s; steps lost
<= the checkpoint interval; a coordinated checkpoint <= 1 step of delay.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from clusterwatch.cli.demo_training import CHECKPOINT_EVERY

DEMO_TIMEOUT_S = 600


def run_demo(steps: int, inject: list[str], summary_path: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "clusterwatch",
        "demo",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--steps",
        str(steps),
        "--summary-json",
        str(summary_path),
    ]
    argv += [arg for spec in inject for arg in ("--inject", spec)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"the demo failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--inject", action="append", default=[], help="faults, as for clusterwatch demo")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            runs.append(run_demo(args.steps, args.inject, Path(tmp) / f"summary-{n}.json"))
    by_kind: dict[str, dict[str, list[float | None]]] = {}
    for summary in runs:
        for fault in summary["faults"]:
            kind = fault["label"].split(" ", 1)[0]
            entry = by_kind.setdefault(kind, {})
            for key in ("detection_s", "recovery_s", "onset_to_resumed_s", "steps_lost"):
                entry.setdefault(key, []).append(fault[key])
    report = {
        "runs": args.runs,
        "checkpoint_interval_steps": CHECKPOINT_EVERY,
        "faults": by_kind,
        "effective_training_time_ratio": [s["effective_training_time_ratio"] for s in runs],
        "wall_seconds": [round(s["wall_seconds"], 1) for s in runs],
        "max_coordinated_checkpoint_delay_steps": max(
            (
                s["coordinated_checkpoint_delay_steps"]
                for s in runs
                if s["coordinated_checkpoint_delay_steps"] is not None
            ),
            default=None,
        ),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
