"""Orphaned ranks: training processes still running after the launcher that started them ended.

torchrun starts each worker in its own session, so when torchrun itself dies
(the OOM killer, a careless ``kill -9``) its workers live on: training alone,
holding their GPU memory and blocking their collective peers, with nothing
left to restart or stop them. The agent knows each registered rank's launcher
(its parent at registration) and reports when it ended (agent/ranks.py,
``RankReport.launcher_exit``); this finding names the ranks, the launcher and
how it ended. Pure: a function of one job's records.
"""

from __future__ import annotations

from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.jobs import EXITED, JobRecord, RankRecord


def orphaned_ranks(job: JobRecord) -> Finding | None:
    """The job's ranks whose launcher ended while they still run, or None."""
    orphans = sorted(
        (r for r in job.ranks.values() if r.launcher_exit is not None and r.state != EXITED),
        key=lambda r: r.rank,
    )
    if not orphans:
        return None
    launchers = sorted({(r.node_id, _launcher(r)) for r in orphans})
    ranks = [r.rank for r in orphans]
    return Finding(
        key=("orphaned_ranks", job.job, job.restart_count),
        kind=Kind.ORPHANED_RANKS,
        severity=Severity.CRITICAL,
        summary=(
            f"job {job.job}: {_ranks(ranks)} run on without their launcher: "
            + "; ".join(f"{launcher} on {node}" for node, launcher in launchers)
        ),
        cause="launcher_exited",
        job=job.job,
        ranks=tuple(ranks),
        nodes=tuple(sorted({r.node_id for r in orphans})),
        gpus=tuple(sorted({r.identity.gpu_uuid for r in orphans if r.identity.gpu_uuid})),
        evidence={"ranks_orphaned": float(len(orphans))},
    )


def orphan_pids(job: JobRecord, node_id: str) -> list[int]:
    """The pids of the job's orphaned ranks on ``node_id`` (what a stop names)."""
    return sorted(
        r.identity.pid
        for r in job.ranks.values()
        if r.node_id == node_id and r.launcher_exit is not None and r.state != EXITED
    )


def _launcher(rank: RankRecord) -> str:
    ended = rank.launcher_exit
    assert ended is not None  # noqa: S101 - orphans only
    name = ended.launcher_name or "launcher"
    return f"{name} (pid {ended.launcher_pid}) ended: {ended.description or 'exited'}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))
