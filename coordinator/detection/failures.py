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
import functools
import signal
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter

from clusterwatch.coordinator.detection.mismatch import find_mismatches, position
from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.jobs import EXITED, RUNNING, JobRecord, RankRecord
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.v1 import cluster_pb2, node_pb2

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


# A finding of a node's report, waiting for the ranks the node hosts now (its job, ranks and severity).
_Pending = Callable[[list[RankRecord]], Finding]
_NO_RANKS: list[RankRecord] = []
UP = cluster_pb2.NODE_STATE_UP
_GPU_FIELDS = attrgetter("uuid", "name", "xid_errors")
_PORT_FIELDS = attrgetter(
    "device", "port", "state", "link_downed_total", "symbol_errors_total", "receive_errors_total"
)


def _port_fields(port: node_pb2.IbPortSample) -> tuple[str, int, str, int, int]:
    """(device, port, state, link downs, symbol + receive errors) of one InfiniBand port."""
    device, number, state, downed, symbol_errors, receive_errors = _PORT_FIELDS(port)
    return device, number, state, downed, symbol_errors + receive_errors


UNREACHABLE = cluster_pb2.NODE_STATE_UNREACHABLE


def running_ranks_by_node(jobs: Iterable[JobRecord]) -> dict[str, list[RankRecord]]:
    """Node -> the running ranks it hosts, of every job: one pass over the ranks (once per round)."""
    by_node: dict[str, list[RankRecord]] = {}
    for job in jobs:
        for rank in job.ranks.values():
            if rank.state == RUNNING:
                hosted = by_node.get(rank.node_id)
                if hosted is None:
                    by_node[rank.node_id] = [rank]
                else:
                    hosted.append(rank)
    return by_node


@dataclasses.dataclass(frozen=True, slots=True)
class _ReportChecks:
    """What one report of a node shows (before the ranks the node hosts are named)."""

    report: node_pb2.NodeReport
    previous: node_pb2.NodeReport | None
    pending: tuple[_Pending, ...]


@dataclasses.dataclass
class NodeFailureDetector:
    """Unreachable nodes, XID errors, lost GPUs and InfiniBand trouble.

    Remembers which GPUs each node has shown and which ports were ever
    active, so "gone" and "down" mean "was there before".

    A node's report is read once, when it is new (``NodeRecord.report`` is
    another object): what it shows is kept and named again every round while
    it is the node's latest report, with the ranks the node hosts in that
    round. So a round costs a lookup per node whose report did not change,
    not a walk over its GPUs and ports (~20 us per 8-GPU node).

    Attributes:
        ib_errors_per_report: a rise of a port's error counters (symbol +
            receive errors) by at least this much between two reports is a jump.
    """

    ib_errors_per_report: int = 100
    _gpus_seen: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    _ports_active: dict[str, set[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    _checks: dict[str, _ReportChecks] = dataclasses.field(default_factory=dict)

    def update(
        self,
        nodes: Mapping[str, NodeRecord],
        jobs: Mapping[str, JobRecord],
        ranks_by_node: Mapping[str, list[RankRecord]] | None = None,
    ) -> list[Finding]:
        """Every node finding that holds now.

        Args:
            nodes: the cluster state's nodes.
            jobs: the job store's jobs.
            ranks_by_node: ``running_ranks_by_node(jobs.values())``, when the caller has it already.
        """
        if ranks_by_node is None:
            ranks_by_node = running_ranks_by_node(jobs.values())
        checks = self._checks
        if len(checks) > len(nodes):  # nodes the state forgot
            self._checks = checks = {n: c for n, c in checks.items() if n in nodes}
        findings: list[Finding] = []
        for node_id, record in nodes.items():
            state = record.state
            if state == UNREACHABLE:
                findings.append(_unreachable(record, ranks_by_node.get(node_id, _NO_RANKS)))
                continue
            report = record.report
            if state != UP or report is None:
                continue
            checked = checks.get(node_id)
            if checked is None or checked.report is not report or checked.previous is not record.previous:
                checked = checks[node_id] = self._check(node_id, record, report)
            if checked.pending:
                hosted = ranks_by_node.get(node_id, _NO_RANKS)
                findings.extend(pending(hosted) for pending in checked.pending)
        return findings

    def _check(self, node_id: str, record: NodeRecord, report: node_pb2.NodeReport) -> _ReportChecks:
        # One read of each GPU's uuid, name and XID list; the XIDs themselves only when there are some.
        gpus = list(map(_GPU_FIELDS, report.gpus))
        pending = [
            *(_xids(node_id, report) if any(xids for _, _, xids in gpus) else ()),
            *self._lost_gpus(node_id, gpus),
            *(self._infiniband(node_id, report, record.previous) if report.ib_ports else ()),
        ]
        return _ReportChecks(report, record.previous, tuple(pending))

    def _lost_gpus(self, node_id: str, gpus: list[tuple[str, str, object]]) -> list[_Pending]:
        seen = self._gpus_seen.setdefault(node_id, {})
        present = {uuid: name for uuid, name, _ in gpus if uuid}
        seen.update(present)
        if len(seen) == len(present):  # every GPU ever seen is here
            return []
        evidence = {"gpus_present": float(len(present)), "gpus_seen": float(len(seen))}
        return [
            functools.partial(_gpu_lost, node_id, uuid, name, evidence)
            for uuid, name in sorted(seen.items())
            if uuid not in present
        ]

    def _infiniband(
        self, node_id: str, report: node_pb2.NodeReport, previous: node_pb2.NodeReport | None
    ) -> list[_Pending]:
        # One read of each port's fields (and of the previous report's ports, which the
        # previous call read too: a report object is new each time).
        before = {
            (device, number): (downed, errors)
            for device, number, _, downed, errors in map(_port_fields, previous.ib_ports if previous else ())
        }
        active = self._ports_active.setdefault(node_id, set())
        pending: list[_Pending] = []
        ports = list(report.ib_ports)
        for port, (device, number, state, downed, errors) in zip(
            ports, map(_port_fields, ports), strict=True
        ):
            where = (device, number)
            if state == ACTIVE:
                active.add(where)
            elif where in active:
                pending.append(functools.partial(_ib_down, node_id, port, f"{device} port {number}"))
            old = before.get(where)
            if old is None:
                continue
            old_downed, old_errors = old
            if downed > old_downed:
                pending.append(
                    functools.partial(
                        _ib_finding,
                        key=("ib_link_flap", node_id, device, number),
                        summary=f"InfiniBand {device} port {number} on {node_id} went down "
                        f"{downed - old_downed} time(s) since the previous report",
                        cause="link_flap",
                        node_id=node_id,
                        evidence={"link_downed_total": float(downed)},
                        latch_value=float(downed),
                    )
                )
            jump = errors - old_errors
            if jump >= self.ib_errors_per_report:
                pending.append(
                    functools.partial(
                        _ib_finding,
                        key=("ib_errors", node_id, device, number),
                        summary=f"InfiniBand {device} port {number} on {node_id}: {jump} symbol/receive "
                        "errors since the previous report",
                        cause="network",
                        node_id=node_id,
                        evidence={"errors_since_previous_report": float(jump), "errors_total": float(errors)},
                        latch_value=float(errors),
                    )
                )
        return pending


def _gpu_lost(
    node_id: str, uuid: str, name: str, evidence: dict[str, float], hosted: list[RankRecord]
) -> Finding:
    job, ranks, users = _gpu_users(hosted, uuid)
    return Finding(
        key=("gpu_lost", node_id, uuid),
        kind=Kind.GPU_LOST,
        severity=Severity.CRITICAL,
        summary=f"GPU {uuid} ({name}) on {node_id} is gone from NVML{users}",
        cause="gpu_lost",
        job=job,
        ranks=ranks,
        nodes=(node_id,),
        gpus=(uuid,),
        evidence=dict(evidence),
    )


def _ib_down(node_id: str, port: node_pb2.IbPortSample, name: str, hosted: list[RankRecord]) -> Finding:
    job, ranks = _hosted_job(hosted)
    return Finding(
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


def _ib_finding(
    hosted: list[RankRecord],
    *,
    key: tuple[str | int, ...],
    summary: str,
    cause: str,
    node_id: str,
    evidence: dict[str, float],
    latch_value: float,
) -> Finding:
    job, ranks = _hosted_job(hosted)
    return Finding(
        key=key,
        kind=Kind.INFINIBAND,
        severity=Severity.WARNING,
        summary=summary,
        cause=cause,
        job=job,
        ranks=ranks,
        nodes=(node_id,),
        evidence=dict(evidence),
        latch_value=latch_value,
    )


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


def _xids(node_id: str, report: node_pb2.NodeReport) -> list[_Pending]:
    return [
        functools.partial(
            _xid, node_id=node_id, index=gpu.index, uuid=gpu.uuid, code=xid.xid, count=xid.count
        )
        for gpu in report.gpus
        for xid in gpu.xid_errors
        if xid.count != 0
    ]


def _xid(hosted: list[RankRecord], *, node_id: str, index: int, uuid: str, code: int, count: int) -> Finding:
    job, ranks, users = _gpu_users(hosted, uuid)
    return Finding(
        key=("gpu_xid", node_id, uuid, code),
        kind=Kind.GPU_XID,
        severity=Severity.CRITICAL if code in CRITICAL_XIDS else Severity.WARNING,
        summary=f"GPU {index} ({uuid}) on {node_id} raised XID {code} {count} time(s){users}",
        cause="xid",
        job=job,
        ranks=ranks,
        nodes=(node_id,),
        gpus=(uuid,),
        evidence={"xid": float(code), "count": float(count)},
        latch_value=float(count),
    )


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
