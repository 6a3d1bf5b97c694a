"""Failure findings: ranks that died, nodes that went silent, GPUs and fabric that broke.

Pure domain code over the job store and the cluster state; the detection
round (coordinator/detection/round.py) calls it and the incident book de-duplicates
(coordinator/model/incidents.py). Conditions (a node unreachable, a GPU missing, a
port down) are findings while they hold; events (an XID, an error-counter
jump) are latched findings whose ``latch_value`` is the counter.

A rank failure names the first rank that exited uncleanly (and those after it
that the launcher did not tear down). When the ranks' last heartbeats show a
collective mismatch (coordinator/detection/mismatch.py: ranks at the same collective
number of a group with another op, size or dtype, from the collective each
failed in or was waiting in), the finding names the odd ranks too, with cause
``collective_mismatch``: on gloo a size mismatch aborts the rank that
*receives* the larger message, which is the odd rank only when its tensor is
the smaller one. The failed collective reaches the coordinator because the
hook sends a heartbeat as soon as a collective raises; a rank killed inside
one says only what its previous heartbeat caught, so the evidence is partial.
"""

from __future__ import annotations

import dataclasses
import signal

from clusterwatch.coordinator.detection.mismatch import find_mismatches, position
from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.jobs import EXITED, RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.state import NodeRecord, NodeState
from clusterwatch.v1 import node_pb2

# Signals a launcher uses to tear a worker group down after one worker failed:
# a rank that got one of these after another rank's failure is collateral.
TEARDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
# XIDs after which the GPU (not the application) needs attention: double-bit
# ECC, row remapping, NVLink, fallen off the bus, contained/uncontained ECC,
# GSP errors. Others (13, 31, 43...) are usually the program's own faults.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
ACTIVE = "ACTIVE"


def rank_failure(job: JobRecord) -> Finding | None:
    """The job's ranks that exited uncleanly in this generation, minus the launcher's collateral.

    A rank of an older generation not yet replaced by its restarted instance
    is that generation's failure (already found), not a new one.
    """
    generation = [r for r in job.ranks.values() if r.identity.restart_count == job.restart_count]
    failed = sorted(
        (r for r in generation if r.state == EXITED and _unclean(r)),
        key=lambda r: (r.exit.timestamp_unix_seconds if r.exit else 0.0, r.rank),
    )
    if not failed:
        return None
    first = failed[0]
    culprits = [first] + [r for r in failed[1:] if not _teardown(r)]
    exit_ = first.exit
    evidence: dict[str, float] = {"ranks_failed": float(len(culprits))}
    # Heartbeats taken at different moments: only ranks at the same collective number compare.
    mismatches = find_mismatches(
        (p for r in generation if (p := position(r, failed=True)) is not None), {}, compare_sequences=False
    )
    odd = [o for m in mismatches for o in m.odd]
    mismatch = ""
    if mismatches:
        evidence["collective_sequence"] = float(mismatches[0].sequence)
        named = "; ".join(f"rank {o.rank} on {o.node_id}: {o.detail}" for o in odd)
        mismatch = f"; their last heartbeats show a collective mismatch: {named}"
    if exit_ is not None and exit_.HasField("signal"):
        evidence["signal"] = float(exit_.signal)
    if exit_ is not None and exit_.HasField("exit_code"):
        evidence["exit_code"] = float(exit_.exit_code)
    how = exit_.description if exit_ is not None and exit_.description else "exited"
    others = f" (and {len(culprits) - 1} more)" if len(culprits) > 1 else ""
    running = len(job.running_ranks())
    named_ranks = {r.rank for r in culprits} | {o.rank for o in odd}
    blamed = [r for r in generation if r.rank in named_ranks]
    return Finding(
        key=("rank_failure", job.job, job.restart_count),
        kind=Kind.RANK_FAILURE,
        severity=Severity.CRITICAL,
        summary=f"job {job.job}: rank {first.rank} on {first.node_id} {how}{others}; "
        f"{running} of {job.world_size} ranks still running{mismatch}",
        cause="collective_mismatch" if mismatches else "process_exited",
        job=job.job,
        ranks=tuple(sorted(named_ranks)),
        nodes=tuple(sorted({r.node_id for r in blamed})),
        gpus=tuple(sorted({r.identity.gpu_uuid for r in blamed if r.identity.gpu_uuid})),
        evidence=evidence,
    )


def _unclean(rank: RankRecord) -> bool:
    exit_ = rank.exit
    if exit_ is None:
        return True  # the agent lost it without an exit status
    if exit_.clean:
        return False
    return exit_.HasField("signal") or (exit_.HasField("exit_code") and exit_.exit_code != 0)


def _teardown(rank: RankRecord) -> bool:
    return rank.exit is not None and rank.exit.HasField("signal") and rank.exit.signal in TEARDOWN_SIGNALS


@dataclasses.dataclass
class NodeFailureDetector:
    """Unreachable nodes, XID errors, lost GPUs and InfiniBand trouble.

    Remembers which GPUs each node has shown and which ports were ever
    active, so "gone" and "down" mean "was there before".

    Attributes:
        ib_errors_per_report: a rise of a port's error counters (symbol +
            receive errors) by at least this much between two reports is a jump.
    """

    ib_errors_per_report: int = 100
    _gpus_seen: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    _ports_active: dict[str, set[tuple[str, int]]] = dataclasses.field(default_factory=dict)

    def update(self, nodes: dict[str, NodeRecord], jobs: dict[str, JobRecord]) -> list[Finding]:
        ranks_by_node: dict[str, list[RankRecord]] = {}
        for job in jobs.values():
            for rank in job.ranks.values():
                if rank.state == RUNNING:
                    ranks_by_node.setdefault(rank.node_id, []).append(rank)
        findings: list[Finding] = []
        for node_id, record in nodes.items():
            hosted = ranks_by_node.get(node_id, [])
            if record.state == NodeState.NODE_STATE_UNREACHABLE:
                findings.append(_unreachable(record, hosted))
                continue
            if record.state != NodeState.NODE_STATE_UP or record.report is None:
                continue
            findings.extend(_xids(node_id, record.report, hosted))
            findings.extend(self._lost_gpus(node_id, record.report, hosted))
            findings.extend(self._infiniband(node_id, record, hosted))
        return findings

    def _lost_gpus(
        self, node_id: str, report: node_pb2.NodeReport, hosted: list[RankRecord]
    ) -> list[Finding]:
        seen = self._gpus_seen.setdefault(node_id, {})
        present = {gpu.uuid for gpu in report.gpus if gpu.uuid}
        for gpu in report.gpus:
            if gpu.uuid:
                seen[gpu.uuid] = gpu.name
        findings = []
        for uuid, name in sorted(seen.items()):
            if uuid in present:
                continue
            job, ranks, users = _gpu_users(hosted, uuid)
            findings.append(
                Finding(
                    key=("gpu_lost", node_id, uuid),
                    kind=Kind.GPU_LOST,
                    severity=Severity.CRITICAL,
                    summary=f"GPU {uuid} ({name}) on {node_id} is gone from NVML{users}",
                    cause="gpu_lost",
                    job=job,
                    ranks=ranks,
                    nodes=(node_id,),
                    gpus=(uuid,),
                    evidence={"gpus_present": float(len(present)), "gpus_seen": float(len(seen))},
                )
            )
        return findings

    def _infiniband(self, node_id: str, record: NodeRecord, hosted: list[RankRecord]) -> list[Finding]:
        report, previous = record.report, record.previous
        assert report is not None  # noqa: S101 - checked by the caller
        before = {(p.device, p.port): p for p in previous.ib_ports} if previous is not None else {}
        active = self._ports_active.setdefault(node_id, set())
        job, ranks = _hosted_job(hosted)
        findings = []
        for port in report.ib_ports:
            where = (port.device, port.port)
            name = f"{port.device} port {port.port}"
            if port.state == ACTIVE:
                active.add(where)
            elif where in active:
                findings.append(
                    Finding(
                        key=("ib_link_down", node_id, port.device, port.port),
                        kind=Kind.INFINIBAND,
                        severity=Severity.CRITICAL if hosted else Severity.WARNING,
                        summary=f"InfiniBand {name} on {node_id} is {port.state or 'not active'} "
                        f"({port.physical_state or 'physical state unknown'})",
                        cause="link_down",
                        job=job,
                        ranks=ranks,
                        nodes=(node_id,),
                        evidence={"link_downed_total": float(port.link_downed_total)},
                    )
                )
            old = before.get(where)
            if old is None:
                continue
            if port.link_downed_total > old.link_downed_total:
                findings.append(
                    Finding(
                        key=("ib_link_flap", node_id, port.device, port.port),
                        kind=Kind.INFINIBAND,
                        severity=Severity.WARNING,
                        summary=f"InfiniBand {name} on {node_id} went down "
                        f"{port.link_downed_total - old.link_downed_total} time(s) since the previous report",
                        cause="link_flap",
                        job=job,
                        ranks=ranks,
                        nodes=(node_id,),
                        evidence={"link_downed_total": float(port.link_downed_total)},
                        latch_value=float(port.link_downed_total),
                    )
                )
            errors = port.symbol_errors_total + port.receive_errors_total
            jump = errors - (old.symbol_errors_total + old.receive_errors_total)
            if jump >= self.ib_errors_per_report:
                findings.append(
                    Finding(
                        key=("ib_errors", node_id, port.device, port.port),
                        kind=Kind.INFINIBAND,
                        severity=Severity.WARNING,
                        summary=f"InfiniBand {name} on {node_id}: {jump} symbol/receive errors since the "
                        "previous report",
                        cause="network",
                        job=job,
                        ranks=ranks,
                        nodes=(node_id,),
                        evidence={"errors_since_previous_report": float(jump), "errors_total": float(errors)},
                        latch_value=float(errors),
                    )
                )
        return findings


def _unreachable(record: NodeRecord, hosted: list[RankRecord]) -> Finding:
    job, ranks = _hosted_job(hosted)
    jobs = sorted({r.identity.job for r in hosted})
    hosting = f"; it hosts {len(hosted)} rank(s) of job {', '.join(jobs)}" if hosted else ""
    return Finding(
        key=("node_unreachable", record.node_id),
        kind=Kind.NODE_UNREACHABLE,
        severity=Severity.CRITICAL if hosted else Severity.WARNING,
        summary=f"node {record.node_id} stopped reporting (last report {record.last_sequence}){hosting}",
        cause="node_unreachable",
        job=job,
        ranks=ranks,
        nodes=(record.node_id,),
        gpus=tuple(sorted({r.identity.gpu_uuid for r in hosted if r.identity.gpu_uuid})),
        evidence={"last_seen_unix_seconds": record.last_seen_unix_s, "ranks_hosted": float(len(hosted))},
    )


def _xids(node_id: str, report: node_pb2.NodeReport, hosted: list[RankRecord]) -> list[Finding]:
    findings = []
    for gpu in report.gpus:
        job, ranks, users = _gpu_users(hosted, gpu.uuid)
        for xid in gpu.xid_errors:
            if xid.count == 0:
                continue
            findings.append(
                Finding(
                    key=("gpu_xid", node_id, gpu.uuid, xid.xid),
                    kind=Kind.GPU_XID,
                    severity=Severity.CRITICAL if xid.xid in CRITICAL_XIDS else Severity.WARNING,
                    summary=f"GPU {gpu.index} ({gpu.uuid}) on {node_id} raised XID {xid.xid} "
                    f"{xid.count} time(s){users}",
                    cause="xid",
                    job=job,
                    ranks=ranks,
                    nodes=(node_id,),
                    gpus=(gpu.uuid,),
                    evidence={"xid": float(xid.xid), "count": float(xid.count)},
                    latch_value=float(xid.count),
                )
            )
    return findings


def _gpu_users(hosted: list[RankRecord], uuid: str) -> tuple[str, tuple[int, ...], str]:
    """The job and ranks using GPU ``uuid``, and a summary clause naming them ("" when none)."""
    users = [r for r in hosted if r.identity.gpu_uuid == uuid]
    if not users:
        return "", (), ""
    job = users[0].identity.job
    return job, tuple(r.rank for r in users), f"; rank {users[0].rank} of job {job} runs on it"


def _hosted_job(hosted: list[RankRecord]) -> tuple[str, tuple[int, ...]]:
    """The job and ranks a node's problem hits, when it hosts ranks of exactly one job."""
    jobs = {r.identity.job for r in hosted}
    if len(jobs) != 1:
        return "", ()
    return jobs.pop(), tuple(sorted(r.rank for r in hosted))
