"""The header: nodes, GPUs, utilisation, jobs and open incidents, in one or two lines."""

from __future__ import annotations

import collections
import dataclasses
import time

from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Tone
from clusterwatch.v1 import cluster_pb2

SEVERITY_TONES = {"critical": Tone.ERROR, "warning": Tone.WARNING}


@dataclasses.dataclass(frozen=True)
class Summary:
    nodes_up: int
    nodes_total: int
    gpus: int
    gpu_utilization_mean_ratio: float | None
    job_step_rates: list[tuple[str, float | None]]
    open_incidents: dict[str, int]
    """Live incidents by severity, most severe first."""


def summarize(snapshot: cluster_pb2.ClusterSnapshot) -> Summary:
    utilization_total, utilization_count, gpus = 0.0, 0, 0
    for node in snapshot.nodes:
        for gpu in node.report.gpus:
            gpus += 1
            if gpu.HasField("utilization_ratio"):
                utilization_total += gpu.utilization_ratio
                utilization_count += 1
    severities = collections.Counter(i.severity for i in snapshot.incidents)
    return Summary(
        nodes_up=sum(1 for n in snapshot.nodes if n.state == cluster_pb2.NODE_STATE_UP),
        nodes_total=len(snapshot.nodes),
        gpus=gpus,
        gpu_utilization_mean_ratio=utilization_total / utilization_count if utilization_count else None,
        job_step_rates=[(j.job, j.step_rate if j.HasField("step_rate") else None) for j in snapshot.jobs],
        open_incidents=dict(sorted(severities.items(), key=lambda kv: (kv[0] != "critical", kv[0]))),
    )


def header_cells(state: TopState, address: str, now_unix_s: float | None = None) -> list[Cell]:
    """The header's pieces, in order; the widget joins them with spaces."""
    now = time.time() if now_unix_s is None else now_unix_s
    if state.disconnected is not None:
        since = time.strftime("%H:%M:%S", time.localtime(state.disconnected.since_unix_s))
        waited = max(0.0, now - state.disconnected.since_unix_s)
        status = Cell(f"● disconnected since {since} ({waited:.0f}s): {state.disconnected.error}", Tone.ERROR)
    elif state.connected:
        status = Cell(f"● {address}", Tone.GOOD)
    else:
        status = Cell(f"○ connecting to {address}", Tone.MUTED)
    s = summarize(state.snapshot)
    down = s.nodes_total - s.nodes_up
    cells = [
        status,
        Cell(f"nodes {s.nodes_up}/{s.nodes_total} up", Tone.WARNING if down else Tone.PLAIN),
        Cell(f"GPUs {s.gpus}"),
        Cell(
            "util -" if s.gpu_utilization_mean_ratio is None else f"util {s.gpu_utilization_mean_ratio:.0%}"
        ),
    ]
    for job, rate in s.job_step_rates:
        cells.append(Cell(f"{job} {'-' if rate is None else f'{rate:.2f}'} steps/s", Tone.ACCENT))
    if s.open_incidents:
        cells.extend(
            Cell(f"{n} {severity}", SEVERITY_TONES.get(severity, Tone.PLAIN))
            for severity, n in s.open_incidents.items()
        )
    else:
        cells.append(Cell("no open incidents", Tone.GOOD))
    return cells
