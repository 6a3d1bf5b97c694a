"""Who this training process is: from torchrun's (or SLURM's) environment, then torch itself."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from clusterwatch import __version__
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.slurm_env import slurm_job_name, slurm_labels, slurm_task

DEFAULT_SOCKET = "/run/clusterwatch/agent.sock"
SOCKET_ENV = "CLUSTERWATCH_AGENT_SOCKET"
JOB_ENV = "CLUSTERWATCH_JOB"


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def job_name(explicit: str | None, environ: Mapping[str, str]) -> str:
    """The job's name: explicit, else CLUSTERWATCH_JOB, else the SLURM job, else torchrun's run id,
    else "default".

    The SLURM job is ``SLURM_JOB_ID``, or ``<array job id>_<task id>`` for a
    task of a job array (see clusterwatch/wire/slurm_env.py). It comes before
    torchrun's run id because it is the name everything else in a SLURM
    cluster uses for the job: squeue and sacct, the Prolog/Epilog scripts that
    register and end it (clusterwatch job begin|end --slurm), and ``scontrol
    requeue`` when clusterwatch restarts it. It also survives a requeue, so
    the requeued job resumes from its checkpoints; a ``--rdzv-id`` is often
    ``$SLURM_JOB_ID`` anyway, or a ``$RANDOM`` that changes on every start.
    Several trainings in one allocation set CLUSTERWATCH_JOB to tell them
    apart. torchrun's ``TORCHELASTIC_RUN_ID`` is "none" when no
    ``--rdzv-id`` was given.
    """
    if explicit:
        return explicit
    if environ.get(JOB_ENV):
        return environ[JOB_ENV]
    slurm_job = slurm_job_name(environ)
    if slurm_job:
        return slurm_job
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and run_id != "none" else "default"


def parse_nnodes(spec: str) -> tuple[int, int]:
    """torchrun's ``--nnodes`` value ("2" or "1:4") as (min, max); (0, 0) when malformed."""
    low, _, high = spec.partition(":")
    try:
        min_nodes = int(low)
        max_nodes = int(high) if high else min_nodes
    except ValueError:
        return 0, 0
    if not 0 < min_nodes <= max_nodes:
        return 0, 0
    return min_nodes, max_nodes


def launcher_nnodes(environ: Mapping[str, str], parent_argv: Sequence[str]) -> tuple[int, int]:
    """The node range the rank's launcher runs with: torchrun's ``--nnodes``, else ``PET_NNODES``.

    torchrun reads every flag from a ``PET_*`` variable too, which its workers
    inherit. (0, 0) when neither says (not torchrun, or a single-node default).
    """
    for i, arg in enumerate(parent_argv):
        if arg == "--nnodes" and i + 1 < len(parent_argv):
            return parse_nnodes(parent_argv[i + 1])
        if arg.startswith("--nnodes="):
            return parse_nnodes(arg.removeprefix("--nnodes="))
    return parse_nnodes(environ.get("PET_NNODES", ""))


def parent_argv() -> list[str]:
    """The parent process's command line (Linux); empty when it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


@dataclasses.dataclass
class RankInfo:
    """The rank's identity; ``refresh()`` fills what torch learns after start-up."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    restart_count: int
    pid: int = dataclasses.field(default_factory=os.getpid)
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    instance_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    backend: str = ""
    gpu_uuid: str = ""
    min_nodes: int = 0
    max_nodes: int = 0
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    rebalances: bool = False  # a BalancedBatchSampler follows the coordinator's batch shares

    @classmethod
    def from_environ(
        cls, job: str | None, environ: Mapping[str, str], launcher_argv: Sequence[str] = ()
    ) -> RankInfo:
        """The identity the environment gives.

        Rank, local rank and world size come from torchrun's ``RANK``,
        ``LOCAL_RANK`` and ``WORLD_SIZE``, each; a process ``srun`` started
        without torchrun has none of them and takes ``SLURM_PROCID``,
        ``SLURM_LOCALID`` and its step's task count instead. Labels are the
        SLURM job's (id, name, array, nodes, partition, account, user).
        """
        min_nodes, max_nodes = launcher_nnodes(environ, launcher_argv)
        task = slurm_task(environ)
        return cls(
            job=job_name(job, environ),
            rank=_int_env(environ, "RANK", task.rank if task else 0),
            local_rank=_int_env(environ, "LOCAL_RANK", task.local_rank if task else 0),
            world_size=max(1, _int_env(environ, "WORLD_SIZE", task.world_size if task else 1)),
            restart_count=_int_env(environ, "TORCHELASTIC_RESTART_COUNT", 0),
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            labels=slurm_labels(environ),
        )

    def refresh(self) -> bool:
        """Pick up rank, backend and CUDA device once torch knows them; True if anything changed.

        Never initialises CUDA or torch.distributed itself: it only reads what
        the training code has already set up.
        """
        import torch
        import torch.distributed as dist

        before = dataclasses.astuple(self)
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            self.backend = str(dist.get_backend())
        if not self.gpu_uuid and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            properties = torch.cuda.get_device_properties(torch.cuda.current_device())
            self.gpu_uuid = f"GPU-{properties.uuid}"  # NVML's spelling of the same UUID
        return dataclasses.astuple(self) != before

    def to_proto(self) -> training_pb2.RankIdentity:
        return training_pb2.RankIdentity(
            job=self.job,
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            pid=self.pid,
            hostname=self.hostname,
            restart_count=self.restart_count,
            gpu_uuid=self.gpu_uuid,
            hook_version=__version__,
            instance_id=self.instance_id,
            backend=self.backend,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            labels=self.labels,
            rebalances=self.rebalances,
        )


def resolve_socket_path(explicit: str | None, environ: Mapping[str, str]) -> str:
    return explicit or environ.get(SOCKET_ENV) or DEFAULT_SOCKET
