"""Numbers for people: byte sizes, durations, bandwidths and ages, as `status` and `top` show them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from clusterwatch.v1 import cluster_pb2, training_pb2

RankState = training_pb2.RankState


def size_bytes(n: float | None, suffix: str = "") -> str:
    """Binary units (memory sizes): ``512B``, ``1.5GiB``; ``-`` when unknown."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}{suffix}" if unit == "B" else f"{n:.1f}{unit}{suffix}"
        n /= 1024
    raise AssertionError("unreachable")


def ago(timestamp_unix_s: float | None, now_unix_s: float) -> str:
    """``3.2s ago``, ``5m ago``; ``never`` for an unset timestamp."""
    if not timestamp_unix_s:
        return "never"
    seconds = max(0.0, now_unix_s - timestamp_unix_s)
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def duration(seconds: float | None) -> str:
    """``850ms``, ``1.25s``, ``300s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.2f}s" if seconds < 100 else f"{seconds:.0f}s"


def step_time(seconds: float) -> str:
    """A step or compute time in a sentence, with the digits a comparison needs: ``0.500 s`` from a
    tenth of a second up, ``1.23 ms`` (three significant digits) below, so that millisecond steps of
    different lengths do not print alike."""
    if seconds >= 0.1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1000:.3g} ms"


def bandwidth(bytes_per_s: float | None) -> str:
    """Decimal units, as nccl-tests and link speeds are quoted: ``12.5GB/s``; ``-`` when unknown."""
    if bytes_per_s is None:
        return "-"
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            value = bytes_per_s / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{bytes_per_s:.0f}B/s"


def percent(ratio: float | None) -> str:
    """A 0-1 ratio as ``87%``; ``-`` when unknown."""
    return "-" if ratio is None else f"{ratio:.0%}"


ALL_REDUCE_OPS = ("all_reduce", "ddp_all_reduce")
"""Ops whose bus bandwidth a rank's row shows (the gradient all-reduce)."""


def all_reduce_bus_bandwidth(rank: cluster_pb2.RankStatus) -> float | None:
    """The rank's best all-reduce bus bandwidth over its latest report interval, bytes/s; None if none ran."""
    return max(
        (b.bus_bandwidth_bytes_per_second for b in rank.bandwidth if b.op in ALL_REDUCE_OPS), default=None
    )


def rank_state(rank: cluster_pb2.RankStatus) -> str:
    """The rank's state, with what matters about it: the collective it is in, or how it ended."""
    if rank.state == RankState.RANK_STATE_EXITED:
        return f"exited: {rank.exit.description}" if rank.exit.description else "exited"
    if rank.state == RankState.RANK_STATE_DISCONNECTED:
        return "hook disconnected"
    if rank.state == RankState.RANK_STATE_RUNNING:
        if rank.heartbeat.HasField("collective"):
            c = rank.heartbeat.collective
            return f"in {collective(c)} {duration(c.elapsed_seconds)}"
        return "running"
    return "unknown"


def collective(c: training_pb2.CollectiveInFlight) -> str:
    """``all_reduce #61 (1.0MiB float32)``, ``barrier #61``: a collective and what it carries."""
    data = " ".join(part for part in (size_bytes(c.size_bytes) if c.size_bytes else "", c.dtype) if part)
    return f"{c.op} #{c.sequence}" + (f" ({data})" if data else "")


def node_state(state: cluster_pb2.NodeState.ValueType) -> str:
    """``up``, ``unreachable``, ``left``, ``unknown``: a node state as the CLI and metrics write it."""
    return cluster_pb2.NodeState.Name(state).removeprefix("NODE_STATE_").lower()


def columns(rows: Sequence[Sequence[object]], indent: str = "", gap: str = "  ") -> list[str]:
    """Rows as text columns padded to their widest cell, trailing spaces removed."""
    if not rows:
        return []
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(map(len, cells)))]
    return [
        indent + gap.join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip()
        for row in cells
    ]


# Ranks spelled out in a detail before the rest are only counted.
MAX_RANK_RANGES = 8


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 1, 2``; more than MAX_RANK_RANGES as ranges (``ranks 0-511, 513-1023``),
    and past MAX_RANK_RANGES ranges, counted."""
    ordered = sorted(set(ranks))
    ranges: list[tuple[int, int]] = []
    for rank in ordered:
        if ranges and rank == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], rank)
        else:
            ranges.append((rank, rank))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    if len(ordered) <= MAX_RANK_RANGES:
        return "ranks " + ", ".join(str(rank) for rank in ordered)
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:MAX_RANK_RANGES])
    more = f", ... ({len(ordered)} ranks)" if len(ranges) > MAX_RANK_RANGES else ""
    return f"ranks {shown}{more}"
