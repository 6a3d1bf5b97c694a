"""The Incidents view: live and recent incidents, and the detail of the one selected."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.text import Text

from clusterwatch.text.humanize import ago
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Column, Row, Tone
from clusterwatch.tui.views.summary import SEVERITY_TONES
from clusterwatch.v1 import cluster_pb2

COLUMNS = (
    Column("SEVERITY", 8),
    Column("STATE", 8),
    Column("KIND", 13),
    Column("JOB", 10, names=True),
    Column("OPENED", 8, right=True),
    Column("SUMMARY", 20, flexible=True),
)
STATE_NAMES = {
    cluster_pb2.INCIDENT_STATE_OPEN: "open",
    cluster_pb2.INCIDENT_STATE_ACKNOWLEDGED: "acked",
    cluster_pb2.INCIDENT_STATE_ACTING: "acting",
    cluster_pb2.INCIDENT_STATE_RESOLVED: "resolved",
}


def incident_rows(state: TopState, now_unix_s: float | None = None) -> list[Row]:
    now = time.time() if now_unix_s is None else now_unix_s
    rows = []
    for incident in state.incidents():
        resolved = incident.state == cluster_pb2.INCIDENT_STATE_RESOLVED
        tone = Tone.MUTED if resolved else SEVERITY_TONES.get(incident.severity, Tone.PLAIN)
        state_name = STATE_NAMES.get(incident.state, "?")
        cells = (
            Cell(incident.severity, tone),
            Cell(state_name, Tone.GOOD if resolved else Tone.PLAIN),
            Cell(incident.kind),
            Cell(incident.job or "-"),
            Cell(ago(incident.opened_unix_seconds, now).removesuffix(" ago")),
            Cell(incident.summary),
        )
        sort_values = (
            incident.severity,
            state_name,
            incident.kind,
            incident.job,
            -incident.opened_unix_seconds,
            incident.summary,
        )
        rows.append(Row(incident.id, cells, sort_values, Tone.MUTED if resolved else Tone.PLAIN))
    return rows


def incident_detail(
    incident: cluster_pb2.Incident, actions: Sequence[cluster_pb2.ActionRecord] | str | None
) -> Text:
    """Everything known about one incident: cause, evidence, stack dumps, actions taken.

    ``actions``: the incident's actions; a string says why they are missing, None that they are on their way.
    """
    text = Text()
    text.append(
        f"{incident.kind} · {incident.severity} · {STATE_NAMES.get(incident.state, '?')}", style="bold"
    )
    text.append(f"  {incident.id}\n", style="dim")
    text.append(f"{incident.summary}\n")
    opened = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(incident.opened_unix_seconds))
    text.append(f"cause: {incident.cause or '-'}   opened {opened}")
    if incident.resolved_unix_seconds:
        text.append(f", resolved after {incident.resolved_unix_seconds - incident.opened_unix_seconds:.1f}s")
    text.append("\n")
    where = [
        ("job", [incident.job] if incident.job else []),
        ("ranks", [str(r) for r in incident.ranks]),
        ("nodes", list(incident.nodes)),
        ("GPUs", list(incident.gpus)),
    ]
    text.append("   ".join(f"{name}: {', '.join(values)}" for name, values in where if values) + "\n")
    if incident.evidence:
        text.append("\nevidence\n", style="bold")
        for name, value in sorted(incident.evidence.items()):
            text.append(f"  {name:<32} {value:,.6g}\n")
    text.append("\nactions\n", style="bold")
    if actions is None or isinstance(actions, str):
        text.append(f"  {actions or 'loading…'}\n", style="dim")
    elif not actions:
        text.append("  none\n", style="dim")
    for action in () if isinstance(actions, str) else actions or ():
        text.append(f"  {action.action}{' (dry run)' if action.dry_run else ''}: {action.outcome}")
        text.append(f"  {action.detail}\n" if action.detail else "\n", style="dim")
    for diagnosis in incident.diagnoses:
        health = "healthy" if diagnosis.healthy else diagnosis.process_state or "unhealthy"
        text.append(
            f"\nstack of rank {diagnosis.rank} (pid {diagnosis.pid} on {diagnosis.node_id}, {health})\n",
            style="bold",
        )
        text.append(
            diagnosis.stack_dump or diagnosis.error or "(no stack)\n", style="dim" if diagnosis.error else ""
        )
    return text


def find(state: TopState, incident_id: str) -> cluster_pb2.Incident | None:
    return next((i for i in state.incidents() if i.id == incident_id), None)
