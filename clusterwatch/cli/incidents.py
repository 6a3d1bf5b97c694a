"""``clusterwatch incidents``: what the coordinator detected, and acknowledging or resolving it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from clusterwatch import group_client
from clusterwatch.cli.common import add_settings_flags, api_json, settings_from_args
from clusterwatch.client import ClusterClient, client_factory, connect
from clusterwatch.config import ClientSettings
from clusterwatch.v1 import cluster_pb2

IncidentState = cluster_pb2.IncidentState


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "incidents",
        help="list stragglers, hangs and failures the coordinator detected; acknowledge or resolve one",
        description="Print the incidents that are not resolved (with --all, the resolved ones too): kind, "
        "severity, state, job, ranks, nodes, the likely cause and the numbers behind it.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (a list of incidents)")
    parser.add_argument("--all", action="store_true", help="include resolved incidents")
    parser.add_argument("--job", default="", help="only this job's incidents")
    parser.add_argument("--stacks", action="store_true", help="also print the stack dumps taken on hangs")
    moves = parser.add_mutually_exclusive_group()
    moves.add_argument("--acknowledge", metavar="ID", help="mark incident ID as seen by a person")
    moves.add_argument("--resolve", metavar="ID", help="resolve incident ID by hand")
    add_settings_flags(parser, ClientSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, ClientSettings)
    client_for = client_factory(settings)
    try:
        with connect(settings, client_for) as client:
            if args.acknowledge or args.resolve:
                state = (
                    IncidentState.INCIDENT_STATE_ACKNOWLEDGED
                    if args.acknowledge
                    else IncidentState.INCIDENT_STATE_RESOLVED
                )
                incident = update_where_kept(client, client_for, args.acknowledge or args.resolve, state)
                print(
                    json.dumps(incident_json(incident), indent=2)
                    if args.json
                    else format_incident(incident, args.stacks)
                )
                return 0
            answers = group_client.from_each(
                client,
                client_for,
                lambda c: (c.incidents(include_resolved=args.all, job=args.job), c.actions(job=args.job)),
            )
    except grpc.RpcError as exc:
        print(f"clusterwatch: {settings.coordinator}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    incidents: list[cluster_pb2.Incident] = []
    actions: dict[str, list[cluster_pb2.ActionRecord]] = {}
    for answer in answers:
        if answer.value is None:
            print(
                f"clusterwatch: coordinator {answer.shard_id} ({answer.address}): {answer.error}; "
                "its incidents are missing",
                file=sys.stderr,
            )
            continue
        incidents += answer.value[0]
        for record in answer.value[1]:
            actions.setdefault(record.incident_id, []).append(record)
    incidents.sort(key=lambda i: i.opened_unix_seconds)
    if args.json:
        print(json.dumps([incident_json(i, actions.get(i.id, [])) for i in incidents], indent=2))
        return 0
    if not incidents:
        print("no incidents" + ("" if args.all else " open (--all shows resolved ones)"))
        return 0
    print("\n\n".join(format_incident(i, args.stacks, actions.get(i.id, [])) for i in incidents))
    return 0


def update_where_kept(
    first: ClusterClient,
    client_for: Callable[[str], ClusterClient],
    incident_id: str,
    state: cluster_pb2.IncidentState.ValueType,
) -> cluster_pb2.Incident:
    """Change an incident's state at the coordinator that keeps it: ``first``, else another of its group.

    Raises:
        grpc.RpcError: ``first`` failed, or no coordinator of the group knows the incident (NOT_FOUND).
    """
    try:
        return first.update_incident(incident_id, state)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        for answer in group_client.from_each(first, client_for, lambda c: c.incidents(include_resolved=True))[
            1:
        ]:
            if answer.value is not None and any(i.id == incident_id for i in answer.value):
                with client_for(answer.address) as other:
                    return other.update_incident(incident_id, state)
        raise


def incident_json(
    incident: cluster_pb2.Incident, actions: Sequence[cluster_pb2.ActionRecord] = ()
) -> dict[str, Any]:
    document = api_json(incident)
    document["state"] = state_name(incident.state)
    document["actions"] = [MessageToDict(a, preserving_proto_field_name=True) for a in actions]
    return document


def state_name(state: cluster_pb2.IncidentState.ValueType) -> str:
    return IncidentState.Name(state).removeprefix("INCIDENT_STATE_").lower()


def format_incident(
    incident: cluster_pb2.Incident, stacks: bool = False, actions: Sequence[cluster_pb2.ActionRecord] = ()
) -> str:
    """A few lines for people: header, summary, evidence, diagnoses, recovery actions."""
    opened = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(incident.opened_unix_seconds))
    header = f"{incident.id}  {incident.severity.upper()}  {incident.kind}  {state_name(incident.state)}  since {opened}"
    where = []
    if incident.job:
        where.append(f"job {incident.job}")
    if incident.ranks:
        where.append("ranks " + ",".join(map(str, incident.ranks)))
    if incident.nodes:
        where.append("nodes " + ",".join(incident.nodes))
    lines = [
        header,
        f"  {incident.summary}",
        f"  cause: {incident.cause}" + (f"   ({'; '.join(where)})" if where else ""),
    ]
    if incident.evidence:
        lines.append(
            "  evidence: " + ", ".join(f"{k}={_number(v)}" for k, v in sorted(incident.evidence.items()))
        )
    for d in incident.diagnoses:
        who = f"rank {d.rank} on {d.node_id} (pid {d.pid}{', healthy' if d.healthy else ''})"
        state = d.process_state or "unknown"
        lines.append(f"  process {who}: {state}" + (f"; {d.error}" if d.error else ""))
        if stacks and d.stack_dump:
            lines.extend("      " + line for line in d.stack_dump.rstrip().splitlines())
    for a in actions:
        dry = " (dry run)" if a.dry_run else ""
        lines.append(f"  action {a.action}{dry}: {a.outcome}" + (f"; {a.detail}" if a.detail else ""))
    return "\n".join(lines)


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else f"{value:.4g}"
