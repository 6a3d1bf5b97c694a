"""Run an end-to-end test several times and report the measurements it writes (bench.avoid_interface,
bench.rebalance): each run is the test itself, with ``$CLUSTERWATCH_BENCH_OUT`` naming where it writes
its JSON; this prints one line a run and the medians of the numeric fields."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_scenario(
    test: str, fields: Sequence[str], runs: int, select: str = ""
) -> list[dict[str, Any]] | None:
    """The measurements of ``runs`` runs of ``test`` (only its cases ``select`` names, as ``pytest -k``);
    None (with the test's output) if one failed."""
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(runs):
            out = Path(folder) / f"run{index}.json"
            env = {**os.environ, "CLUSTERWATCH_BENCH_OUT": str(out)}
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", test,
                 *(("-k", select) if select else ())],
                cwd=ROOT, env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0 or not out.exists():
                print(f"run {index}: the test failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
                return None
            results.append(json.loads(out.read_text()))
            print(f"run {index}: " + ", ".join(f"{f} {results[-1][f]:.3f}" for f in fields), flush=True)
    medians = {field: statistics.median(run[field] for run in results) for field in fields}
    print("median: " + ", ".join(f"{field} {value:.3f}" for field, value in medians.items()))
    return results
