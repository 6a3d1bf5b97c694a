"""The PyTorch Flight Recorder's per-process-group status.

With ``TORCH_FR_BUFFER_SIZE`` set before ``init_process_group``, torch keeps a
ring of recent collectives per process group, on gloo as on NCCL. Its
``pg_status`` (last enqueued / started / completed sequence per group) costs a
few microseconds to read without the entries (``includeCollectives=False``)
and answers from a background thread while the training thread is blocked in
a collective: the rank whose ``last_enqueued_collective`` is behind its
group's is the one the others wait for (docs/SIGNALS.md).
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping

from clusterwatch.v1 import training_pb2

BUFFER_SIZE_ENV = "TORCH_FR_BUFFER_SIZE"
# Entries kept per process; only pg_status is read every heartbeat, the ring
# is there for stack-and-trace dumps when a hang is found.
DEFAULT_BUFFER_SIZE = "2000"


def enable(environ: MutableMapping[str, str]) -> bool:
    """Turn the Flight Recorder on for process groups created from now on.

    Returns:
        True if it is (or will be) on; False if the launcher turned it off
        explicitly (``TORCH_FR_BUFFER_SIZE=0``), which we respect.
    """
    if BUFFER_SIZE_ENV not in environ:
        environ[BUFFER_SIZE_ENV] = DEFAULT_BUFFER_SIZE
    return environ[BUFFER_SIZE_ENV].strip() not in ("", "0")


def read_status() -> list[training_pb2.FlightRecorderGroup]:
    """``pg_status`` of every process group; empty before init_process_group or with the recorder off."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # private, unstubbed

    dump = json.loads(_dump_fr_trace_json(includeCollectives=False))
    return [
        training_pb2.FlightRecorderGroup(
            group_name=name,
            last_enqueued_collective=int(status.get("last_enqueued_collective", -1)),
            last_started_collective=int(status.get("last_started_collective", -1)),
            last_completed_collective=int(status.get("last_completed_collective", -1)),
        )
        for name, status in sorted(dump.get("pg_status", {}).items())
    ]
