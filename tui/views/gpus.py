"""The GPUs view's data: every GPU's utilisation by node, and which GPUs are held down."""

from __future__ import annotations

import dataclasses

from clusterwatch.tui.state import TopState
from clusterwatch.tui.views.rows import Cell, Tone
from clusterwatch.wire.gpu_reasons import slowdown_reasons

THROTTLED_NAMED = 4
"""Throttled GPUs named in the summary line; the rest are counted."""


@dataclasses.dataclass(frozen=True, slots=True)
class GpuCell:
    index: int
    utilization_ratio: float | None
    slowdown: tuple[str, ...]
    """Why its clocks are held down (empty: they are not)."""
    sm_active_ratio: float | None = None
    tensor_active_ratio: float | None = None
    """NVML GPM (Hopper and newer): real work, where utilisation says only that a kernel ran."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeGpus:
    node_id: str
    gpus: tuple[GpuCell, ...]


def gpu_grid(state: TopState) -> list[NodeGpus]:
    grid = []
    for node in state.snapshot.nodes:
        cells = tuple(
            GpuCell(
                gpu.index,
                gpu.utilization_ratio if gpu.HasField("utilization_ratio") else None,
                tuple(slowdown_reasons(gpu.clocks_event_reasons))
                if gpu.HasField("clocks_event_reasons")
                else (),
                gpu.sm_active_ratio if gpu.HasField("sm_active_ratio") else None,
                gpu.tensor_active_ratio if gpu.HasField("tensor_active_ratio") else None,
            )
            for gpu in node.report.gpus
        )
        grid.append(NodeGpus(node.node_id, cells))
    return grid


def gpu_summary(grid: list[NodeGpus]) -> list[Cell]:
    utilizations = [g.utilization_ratio for n in grid for g in n.gpus if g.utilization_ratio is not None]
    throttled = [(n.node_id, g) for n in grid for g in n.gpus if g.slowdown]
    cells = [
        Cell(f"{sum(len(n.gpus) for n in grid)} GPUs on {len(grid)} nodes"),
        Cell(f"mean {sum(utilizations) / len(utilizations):.0%}" if utilizations else "mean -"),
    ]
    sm_active = [g.sm_active_ratio for n in grid for g in n.gpus if g.sm_active_ratio is not None]
    tensor_active = [g.tensor_active_ratio for n in grid for g in n.gpus if g.tensor_active_ratio is not None]
    if sm_active:  # GPM: what share of that was real work
        tensor = f", tensor {sum(tensor_active) / len(tensor_active):.0%}" if tensor_active else ""
        cells.append(Cell(f"SM active {sum(sm_active) / len(sm_active):.0%}{tensor}", Tone.ACCENT))
    if not throttled:
        return [*cells, Cell("none throttled", Tone.GOOD)]
    named = ", ".join(
        f"{node}/gpu{g.index} {'+'.join(g.slowdown)}" for node, g in throttled[:THROTTLED_NAMED]
    )
    more = f" and {len(throttled) - THROTTLED_NAMED} more" if len(throttled) > THROTTLED_NAMED else ""
    return [*cells, Cell(f"▲ {len(throttled)} throttled: {named}{more}", Tone.ERROR)]
