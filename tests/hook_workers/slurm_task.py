"""One task of a SLURM job step as ``srun`` starts it (no torchrun), for tests/deploy/test_slurm.py.

Usage: SLURM_JOB_ID=... SLURM_PROCID=... python slurm_task.py STOP_FILE

The hook reads its job, rank and labels from the SLURM_* environment the test
sets. The task steps every 20 ms (no torch.distributed: the ranks need not
talk to each other here) until STOP_FILE exists or a signal ends it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from clusterwatch.hook import TrainingMonitor

STEP_S = 0.02


def main() -> None:
    stop_file = Path(sys.argv[1])
    monitor = TrainingMonitor(heartbeat_interval_s=0.1, instrument_collectives=False)
    step = 0
    while not stop_file.exists():
        with monitor.step(step):
            time.sleep(STEP_S)
        step += 1
    monitor.close()


if __name__ == "__main__":
    main()
