"""The detail of one node or one rank, opened with Enter on its row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

from rich.text import Text

from clusterwatch.text.humanize import bandwidth, duration, percent, rank_state, size_bytes
from clusterwatch.text.topology_render import NOT_REPORTED, node_lines
from clusterwatch.tui.views.rows import TONE_STYLES, Tone
from clusterwatch.v1 import cluster_pb2
from clusterwatch.wire.gpu_reasons import active_reasons

TopologyFetch: TypeAlias = cluster_pb2.ClusterTopology | str | None
"""A node's topology as the detail has it: the coordinator's answer, why it is missing, or None while fetching."""


def node_detail(
    node: cluster_pb2.NodeStatus, topology: TopologyFetch = None, *, styles: Mapping[Tone, str] = TONE_STYLES
) -> Text:
    """The node's report (host, GPUs, NICs, ports, failed collectors), then its topology section."""
    report = node.report
    text = Text()
    text.append(f"{node.node_id}", style="bold")
    text.append(f"  {node.hostname}  agent {node.agent_version}  report #{report.sequence}\n", style="dim")
    host = report.host
    text.append(
        f"host: CPU {percent(host.cpu_utilization_ratio if host.HasField('cpu_utilization_ratio') else None)} "
        f"of {host.cpu_count}, load {host.load1:.2f}, memory "
        f"{size_bytes(host.memory_used_bytes)}/{size_bytes(host.memory_total_bytes)}\n"
    )
    if report.gpu_inventory.backend:
        simulated = " (simulated)" if report.gpu_inventory.simulated else ""
        text.append(
            f"GPUs: {report.gpu_inventory.backend}{simulated}, driver {report.gpu_inventory.driver_version}\n"
        )
    for gpu in report.gpus:
        util = percent(gpu.utilization_ratio if gpu.HasField("utilization_ratio") else None)
        reasons = active_reasons(gpu.clocks_event_reasons) if gpu.HasField("clocks_event_reasons") else []
        xids = ", ".join(f"xid {x.xid}x{x.count}" for x in gpu.xid_errors)
        text.append(
            f"  gpu{gpu.index} {gpu.name} util {util:>4} mem "
            f"{size_bytes(gpu.memory_used_bytes)}/{size_bytes(gpu.memory_total_bytes)} "
            f"{gpu.temperature_celsius:.0f}°C {gpu.power_watts:.0f}/{gpu.power_limit_watts:.0f}W "
            f"SM {gpu.sm_clock_hertz / 1e6:.0f}/{gpu.sm_clock_max_hertz / 1e6:.0f}MHz"
        )
        if gpu.HasField("sm_active_ratio"):
            tensor = f" tensor {gpu.tensor_active_ratio:.0%}" if gpu.HasField("tensor_active_ratio") else ""
            text.append(f" active {gpu.sm_active_ratio:.0%}{tensor}")
        if reasons:
            text.append(f" clocks held: {', '.join(reasons)}", style=styles[Tone.WARNING])
        if xids or gpu.ecc_uncorrected_errors_total:
            text.append(
                f" {xids} ecc uncorrected {gpu.ecc_uncorrected_errors_total}", style=styles[Tone.ERROR]
            )
        text.append(f"  {gpu.uuid}\n", style="dim")
    for nic in report.nics:
        text.append(
            f"  {nic.device}: {'up' if nic.up else 'down'} {bandwidth(nic.speed_bytes_per_second)}, "
            f"errors {nic.receive_errors_total + nic.transmit_errors_total}\n"
        )
    for port in report.ib_ports:
        text.append(
            f"  {port.device}:{port.port} {port.state} {port.link_layer} "
            f"{bandwidth(port.rate_bytes_per_second)}, symbol errors {port.symbol_errors_total}, "
            f"link downed {port.link_downed_total}\n"
        )
    failed = [c for c in report.collectors if not c.success]
    for collector in failed:
        text.append(f"  collector {collector.name} failed: {collector.error}\n", style=styles[Tone.ERROR])
    text.append("\n")
    text.append_text(topology_section(node.node_id, topology, styles))
    return text


def topology_section(node_id: str, topology: TopologyFetch, styles: Mapping[Tone, str] = TONE_STYLES) -> Text:
    """``topology``, then the node's matrix, NICs and ranks as ``clusterwatch topology --node`` prints them."""
    text = Text()
    text.append("topology\n", style="bold")
    if topology is None:
        text.append("fetching…\n", style="dim")
        return text
    if isinstance(topology, str):
        text.append(f"unavailable: {topology}\n", style=styles[Tone.WARNING])
        return text
    status = next((s for s in topology.nodes if s.node_id == node_id), None)
    if status is None or not status.HasField("topology"):
        text.append(f"{NOT_REPORTED}\n", style="dim")
        return text
    for line in node_lines(status, topology.placements, topology.findings):
        text.append(f"{line}\n")
    return text


def rank_detail(job: str, rank: cluster_pb2.RankStatus) -> Text:
    identity = rank.identity
    text = Text()
    text.append(f"job {job} rank {identity.rank}/{identity.world_size}", style="bold")
    text.append(
        f"  local rank {identity.local_rank} on {rank.node_id}, pid {identity.pid}, "
        f"restart {identity.restart_count}, {identity.backend}\n",
        style="dim",
    )
    text.append(f"state: {rank_state(rank)}\n")
    if rank.HasField("last_step"):
        last = rank.last_step
        text.append(
            f"step {last.step}: {duration(last.step_seconds)} = compute {duration(last.compute_seconds)} "
            f"+ communication {duration(last.communication_seconds)}\n"
        )
    beat = rank.heartbeat
    if rank.HasField("heartbeat"):
        text.append(
            f"heartbeat: step {beat.step}, {'in' if beat.in_step else 'between'} steps, "
            f"{beat.steps_completed_total} steps done, hook errors {beat.health.errors_total}\n"
        )
        for group in beat.flight_recorder:
            text.append(
                f"  flight recorder {group.group_name}: enqueued {group.last_enqueued_collective}, "
                f"started {group.last_started_collective}, "
                f"completed {group.last_completed_collective}\n"
            )
        for sentence in beat.blind_spots:  # what the hook cannot see in this rank
            text.append(f"blind: {sentence}\n", style="yellow")
    for collective in rank.collectives:
        mean_s = collective.duration_seconds_total / collective.count if collective.count else None
        text.append(
            f"  {collective.op} {collective.dtype} ~{size_bytes(collective.size_bucket_bytes)} "
            f"x{collective.count}: mean {duration(mean_s)}, max {duration(collective.duration_seconds_max)}, "
            f"busbw {bandwidth(collective.bus_bandwidth_bytes_per_second)}\n"
        )
    if rank.HasField("exit"):
        text.append(f"exit: {rank.exit.description}\n", style="dim" if rank.exit.clean else "red")
    return text
