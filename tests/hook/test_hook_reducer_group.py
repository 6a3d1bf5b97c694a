"""ReducerGroup's collectives, called from C++ as DDP's reducer calls them, never deadlock gloo.

tests/hook_workers/reducer_group_gil_worker.py sets up, trial after trial, the
moment that hung DDP's second step (a gloo worker waiting for the GIL under
its queue lock while the reducer's broadcast waits for that lock; see
``_FORWARDED`` in clusterwatch/hook/collectives/ddp_group.py). Without the forwarders it
deadlocks within a few trials; with them 100 trials take about two seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import HOOK_WORKERS

pytestmark = pytest.mark.timeout(120)

WORKER = HOOK_WORKERS / "reducer_group_gil_worker.py"


def test_collectives_called_from_cpp_on_the_reducer_group_do_not_deadlock_gloo() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        # The timeout only tells a deadlock from a run: 30 times what the trials take.
        run = subprocess.run(
            [sys.executable, str(WORKER), "100"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("deadlocked: a collective on the ReducerGroup ran in C++ with the GIL held")
    assert (run.returncode, run.stdout.strip()) == (0, "done"), run.stderr[-5000:]
