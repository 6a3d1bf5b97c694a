"""What a job's owner keeps of it beyond its reports: live incidents, the past hour's actions and the
newest complete checkpoint; as one value, for another coordinator to continue the job from.

With several coordinators (coordinator/group/), the owner writes it to etcd whenever one of them
changes (coordinator/group/job_state.py) and a new owner adopts it (coordinator/recovery/adoption.py).
The encoding is JSON with the protobuf messages the API already defines, base64-encoded: small (a
job has a handful of live incidents and actions) and readable with etcdctl.
"""

from __future__ import annotations

import base64
import dataclasses
import json

from clusterwatch.coordinator.model.checkpoints import CompletedCheckpoint
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.v1 import cluster_pb2


@dataclasses.dataclass(frozen=True)
class JobRecords:
    job: str
    incidents: tuple[Incident, ...] = ()
    actions: tuple[cluster_pb2.ActionRecord, ...] = ()
    checkpoint: CompletedCheckpoint | None = None

    def encode(self) -> bytes:
        checkpoint = self.checkpoint
        return json.dumps(
            {
                "job": self.job,
                "incidents": [
                    {
                        "key": list(i.key),
                        "latch": i.latch_value,
                        "incident": _b64(i.to_proto().SerializeToString()),
                    }
                    for i in self.incidents
                ],
                "actions": [_b64(a.SerializeToString()) for a in self.actions],
                "checkpoint": dataclasses.asdict(checkpoint) if checkpoint is not None else None,
            }
        ).encode()

    @classmethod
    def decode(cls, value: bytes) -> JobRecords:
        """Raises: ValueError: not what ``encode`` writes."""
        try:
            fields = json.loads(value)
            checkpoint = fields["checkpoint"]
            return cls(
                job=str(fields["job"]),
                incidents=tuple(
                    incident(tuple(i["key"]), i["latch"], base64.b64decode(i["incident"]))
                    for i in fields["incidents"]
                ),
                actions=tuple(
                    cluster_pb2.ActionRecord.FromString(base64.b64decode(a)) for a in fields["actions"]
                ),
                checkpoint=(
                    CompletedCheckpoint(
                        job=str(checkpoint["job"]),
                        step=int(checkpoint["step"]),
                        completed_unix_s=float(checkpoint["completed_unix_s"]),
                        paths=tuple(checkpoint["paths"]),
                        max_duration_s=float(checkpoint["max_duration_s"]),
                    )
                    if checkpoint is not None
                    else None
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a job's records: {exc}") from exc


def incident(key: tuple[str | int, ...], latch_value: float | None, blob: bytes) -> Incident:
    """The incident stored as its finding key, latch value and API message."""
    message = cluster_pb2.Incident.FromString(blob)
    return Incident(
        id=message.id,
        key=key,
        kind=Kind(message.kind),
        severity=Severity(message.severity),
        summary=message.summary,
        cause=message.cause,
        state=IncidentState.from_proto(message.state),
        opened_unix_s=message.opened_unix_seconds,
        updated_unix_s=message.updated_unix_seconds,
        job=message.job,
        ranks=tuple(message.ranks),
        nodes=tuple(message.nodes),
        gpus=tuple(message.gpus),
        interfaces=tuple(node_interface(entry) for entry in message.interfaces),
        evidence=dict(message.evidence),
        diagnoses=list(message.diagnoses),
        resolved_unix_s=message.resolved_unix_seconds,
        latch_value=latch_value,
    )


def node_interface(entry: str) -> tuple[str, str]:
    """("node-7", "eth1") from "node-7/eth1" (an InfiniBand port keeps its own slash: "mlx5_0/1")."""
    node, _, interface = entry.partition("/")
    return node, interface


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
