"""The worker environment file, as the agent writes it and the training hook reads it.

The coordinator's ``avoid_interface`` action moves a job off a bad network
interface by restarting it with the collective libraries told which interfaces
to use. It sends each node's agent a WorkerEnvCommand; the agent keeps the
entries in ``<hook socket>.env.json``; the hook in every training process that
starts on the node reads its job's entry and sets those variables before the
process group exists (gloo and NCCL read them when they set up their
transports). A file, not an RPC: it must be read before the script's
``init_process_group``, without waiting on anything.

Only the variables in ENV_KEYS can be set, with values made of the characters
interface lists use: the file cannot be used to inject anything else into a
training process. Shared here so the agent (writer) and the hook (which must
not import the agent) cannot disagree on the path, the framing or the checks.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping

from clusterwatch.errors import ClusterwatchError

ENV_FILE_SUFFIX = ".env.json"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
NCCL_IB_HCA = "NCCL_IB_HCA"
ENV_KEYS = frozenset({GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, NCCL_IB_HCA})
# Interface and HCA lists as NCCL and gloo take them: "eth1", "^eth0,eth2", "=mlx5_0:1".
_VALUE = re.compile(r"[A-Za-z0-9_.:@^,=+-]{1,256}")
MAX_FILE_BYTES = 1 << 20
FORMAT_VERSION = 1


class WorkerEnvError(ClusterwatchError):
    """A worker environment that may not be set, or a file that is not one."""


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerEnv:
    """One job's entry: the variables, why, when it lapses (0: never), and the interfaces it keeps
    the job off ("NODE/INTERFACE")."""

    env: dict[str, str]
    reason: str = ""
    expires_unix_s: float = 0.0
    avoided: tuple[str, ...] = ()

    def live(self, now_unix_s: float) -> bool:
        return not self.expires_unix_s or now_unix_s < self.expires_unix_s


def env_file_path(hook_socket: str) -> str:
    """Where the agent serving ``hook_socket`` keeps its worker environments."""
    return hook_socket + ENV_FILE_SUFFIX


def check_env(env: Mapping[str, str]) -> None:
    """Raises WorkerEnvError naming the first variable that may not be set, or its bad value."""
    for key, value in env.items():
        if key not in ENV_KEYS:
            raise WorkerEnvError(f"{key} is not a variable clusterwatch sets ({', '.join(sorted(ENV_KEYS))})")
        if not _VALUE.fullmatch(value):
            raise WorkerEnvError(f"{key}={value[:64]!r} is not an interface list")


def encode(entries: Mapping[str, WorkerEnv]) -> bytes:
    jobs = {
        job: {
            "env": dict(entry.env),
            "reason": entry.reason,
            "expires_unix_s": entry.expires_unix_s,
            "avoided": list(entry.avoided),
        }
        for job, entry in sorted(entries.items())
    }
    return (json.dumps({"version": FORMAT_VERSION, "jobs": jobs}, indent=1) + "\n").encode()


def decode(data: bytes) -> dict[str, WorkerEnv]:
    """The entries in a file's bytes.

    Raises:
        WorkerEnvError: not JSON of this format, or an entry that may not be set.
    """
    try:
        document = json.loads(data)
        jobs = document["jobs"] if document.get("version") == FORMAT_VERSION else None
        if not isinstance(jobs, dict):
            raise WorkerEnvError(f"not a version {FORMAT_VERSION} worker environment file")
        entries = {
            str(job): WorkerEnv(
                {str(k): str(v) for k, v in entry["env"].items()},
                str(entry.get("reason", "")),
                float(entry.get("expires_unix_s", 0.0)),
                tuple(str(name) for name in entry.get("avoided", ())),
            )
            for job, entry in jobs.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise WorkerEnvError(f"malformed worker environment file ({type(exc).__name__}: {exc})") from None
    for entry in entries.values():
        check_env(entry.env)
    return entries
