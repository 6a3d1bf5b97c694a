"""Take the job's worker environment from the agent before the process group exists.

The agent keeps, next to its hook socket, what the coordinator's
avoid_interface action set for each job on this node
(clusterwatch/wire/worker_env.py): GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME,
NCCL_IB_HCA. The monitor applies its job's entry when it starts. A process
group already set up has chosen its interfaces: then nothing is changed and
one warning says that the move needs the monitor created before
``init_process_group`` (``clusterwatch run`` does so). A value the user set is
replaced, with a warning naming both: the interface it names is the one
being avoided.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping

from clusterwatch.wire.worker_env import MAX_FILE_BYTES, WorkerEnvError, decode, env_file_path

logger = logging.getLogger("clusterwatch.hook")


def apply_worker_env(
    socket_path: str,
    job: str,
    environ: MutableMapping[str, str],
    *,
    process_group_exists: bool,
    now_unix_s: float | None = None,
) -> dict[str, str]:
    """Set ``job``'s entry in ``environ``; the variables set (empty: none, or too late).

    Never raises: a missing, unreadable or malformed file leaves the
    environment as it is (malformed: with one warning).
    """
    path = env_file_path(socket_path)
    try:
        with open(path, "rb") as file:
            entries = decode(file.read(MAX_FILE_BYTES))
    except FileNotFoundError:
        return {}
    except (OSError, WorkerEnvError) as exc:
        logger.warning("clusterwatch: ignoring the worker environment in %s: %s", path, exc)
        return {}
    entry = entries.get(job)
    if entry is None or not entry.live(time.time() if now_unix_s is None else now_unix_s):
        return {}
    wanted = {key: value for key, value in entry.env.items() if environ.get(key) != value}
    if not wanted:
        return {}
    shown = " ".join(f"{key}={value}" for key, value in sorted(wanted.items()))
    if process_group_exists:
        logger.warning(
            "clusterwatch: not applied: %s (%s): the process group already chose its interfaces; create "
            "the TrainingMonitor before init_process_group, or launch with clusterwatch run",
            shown,
            entry.reason,
        )
        return {}
    for key, value in sorted(wanted.items()):
        if key in environ:
            logger.warning(
                "clusterwatch: %s=%s replaces %s=%s (%s)", key, value, key, environ[key], entry.reason
            )
        environ[key] = value
    logger.warning("clusterwatch: this rank's collectives use %s (%s)", shown, entry.reason)
    return wanted
