"""The simulation's time loop: advance the job, build each node's report, stream it, record the truth.

Nodes report every ``interval_s``, spread over up to ten slots per interval
(real agents are not in phase). At each slot the job model is advanced to
now, and the slot's nodes each get one report: their ranks (steps finished
since the node's previous report, heartbeat, collectives, exits) and their
telemetry. A loop that falls behind does not burst: the nodes of the slots
it missed report once, now, and it goes on from now, as a late agent reports
once, late, and skips the intervals it missed; it never leaves a node silent
(three silent intervals make a node unreachable). ``stats`` counts how far
behind it ever was and how many slots reported late.

When the run ends (``duration_s`` or a signal), every rank still running
exits cleanly in one last report per node (the job is over, as when the
training script returns), the streams drain their acks and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from clusterwatch.config import TransportSettings, split_host_port
from clusterwatch.errors import ConfigError
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.runtime.tls import TlsFiles, credentials
from clusterwatch.sim import diagnose
from clusterwatch.sim.nodes import NodeModel, gpu_uuid
from clusterwatch.sim.ranks import FIRST_STEP, JobModel
from clusterwatch.sim.scenario import (
    FaultKind,
    FaultSpec,
    Scenario,
    affected_nodes,
    affected_ranks,
    check_fits,
)
from clusterwatch.sim.streams import SimAgentStream
from clusterwatch.sim.truth import EXPECTED_INCIDENTS, FaultTruth, GroundTruth
from clusterwatch.v1 import agent_pb2

logger = logging.getLogger(__name__)

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_STEP_S = 1.0
DEFAULT_INTERVAL_S = 1.0
MAX_SLOTS_PER_INTERVAL = 10
# Streams per gRPC channel (one HTTP/2 connection carries this many nodes).
NODES_PER_CHANNEL = 32
DRAIN_TIMEOUT_S = 6.0


@dataclasses.dataclass(frozen=True, slots=True)
class SimulationSettings:
    """One run: a scenario on a cluster shape, against a coordinator.

    Attributes:
        duration_s: None runs until stopped.
        node_prefix: node j is named ``f"{node_prefix}{j}"``.
        seed: overrides the scenario's seed when set.
    """

    coordinator: str
    scenario: Scenario
    nodes: int
    gpus_per_node: int
    step_s: float
    interval_s: float
    job: str
    node_prefix: str
    duration_s: float | None = None
    ground_truth_out: Path | None = None
    seed: int | None = None
    tls: dict[str, TlsFiles] | None = None
    """Each node's certificate, key and CA; None: plaintext."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node_ids(self) -> list[str]:
        return [f"{self.node_prefix}{j}" for j in range(self.nodes)]


def resolve_settings(
    scenario: Scenario,
    *,
    coordinator: str,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    step_s: float | None = None,
    interval_s: float | None = None,
    duration_s: float | None = None,
    job: str | None = None,
    node_prefix: str | None = None,
    ground_truth_out: Path | None = None,
    seed: int | None = None,
    tls: TransportSettings | None = None,
) -> SimulationSettings:
    """Flags (the keyword arguments) over the scenario file over defaults, checked. ``tls``: the
    certificate and key paths may hold ``{node}``, each node's name (one certificate per node).

    Raises:
        ConfigError: naming the bad setting.
    """
    try:
        split_host_port(coordinator)
    except ValueError as exc:
        raise ConfigError("coordinator", str(exc)) from None
    node_count = nodes if nodes is not None else scenario.nodes
    if node_count is None:
        raise ConfigError(
            "nodes", "is required (--nodes, or nodes = N in the scenario file)", scenario.source
        )
    gpus = gpus_per_node if gpus_per_node is not None else scenario.gpus_per_node or DEFAULT_GPUS_PER_NODE
    step = step_s if step_s is not None else scenario.step_s or DEFAULT_STEP_S
    interval = interval_s if interval_s is not None else scenario.interval_s or DEFAULT_INTERVAL_S
    duration = duration_s if duration_s is not None else scenario.duration_s
    for key, value in (("nodes", node_count), ("gpus_per_node", gpus)):
        if value < 1:
            raise ConfigError(key, f"must be at least 1, got {value}")
    for key, number in (("step_s", step), ("interval_s", interval), ("duration_s", duration)):
        if number is not None and not (number > 0 and math.isfinite(number)):
            raise ConfigError(key, f"must be greater than 0, got {number}")
    job_name = job or scenario.name
    if not job_name:
        raise ConfigError("job", "must not be empty")
    check_fits(scenario, node_count, gpus)
    prefix = node_prefix if node_prefix is not None else f"{job_name}-node-"
    return SimulationSettings(
        coordinator=coordinator,
        scenario=scenario,
        nodes=node_count,
        gpus_per_node=gpus,
        step_s=step,
        interval_s=interval,
        job=job_name,
        node_prefix=prefix,
        duration_s=duration,
        ground_truth_out=ground_truth_out,
        seed=seed,
        tls=_node_credentials(tls, [f"{prefix}{j}" for j in range(node_count)]) if tls is not None else None,
    )


def _node_credentials(transport: TransportSettings, node_ids: list[str]) -> dict[str, TlsFiles]:
    """Every node's TLS files, read now so that a missing one stops the run before it starts.

    Raises:
        ConfigError: naming the setting of a missing or unreadable file.
    """
    found: dict[str, TlsFiles] = {}
    for node_id in node_ids:
        files = credentials(
            dataclasses.replace(
                transport,
                tls_cert=transport.tls_cert.replace("{node}", node_id),
                tls_key=transport.tls_key.replace("{node}", node_id),
            ),
            "agent",
        )
        assert files is not None  # noqa: S101 - insecure is the caller's None
        found[node_id] = files
    return found


class Simulation:
    """Drives one simulated job in real time (see the module docstring).

    Args:
        settings: what to run.
        clock: monotonic seconds (scheduling); the model's wall time is
            ``wall at start + clock elapsed``, so a wall-clock step never warps it.
        wall_clock: wall seconds, read once at start.
    """

    def __init__(
        self,
        settings: SimulationSettings,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = s = settings
        self._clock = clock
        self._mono0 = clock()
        self._wall0 = wall_clock()
        seed = s.scenario.seed if s.seed is None else s.seed
        self.seed = seed
        node_ids = s.node_ids
        uuids = [[gpu_uuid(node, g) for g in range(s.gpus_per_node)] for node in node_ids]
        self.job = JobModel(
            s.job,
            node_ids,
            s.gpus_per_node,
            s.step_s,
            s.scenario,
            start_unix_s=self._wall0,
            gpu_uuids=uuids,
            seed=seed,
        )
        self.nodes = [
            NodeModel(node, s.gpus_per_node, random.Random(seed * 1_000_003 + j + 1), self._wall0)  # noqa: S311 - telemetry wobble
            for j, node in enumerate(node_ids)
        ]
        self.truth = GroundTruth(
            scenario=s.scenario.name,
            description=s.scenario.description,
            source=s.scenario.source,
            job=s.job,
            nodes=node_ids,
            gpus_per_node=s.gpus_per_node,
            world_size=s.world_size,
            step_s=s.step_s,
            interval_s=s.interval_s,
            compute_cv=s.scenario.noise.compute_cv,
            seed=seed,
            started_unix_s=self._wall0,
            faults=[self._fault_truth(f) for f in s.scenario.faults],
        )
        self.streams: list[SimAgentStream] = []
        self._lost: set[int] = set()
        self._applied: set[int] = set()
        self._recorded: set[int] = set()
        port_factor = self.job.bus_factor or 1.0
        self._port_bytes_per_step = int(self.job.allreduce_bytes * port_factor)
        self.reports_total = 0
        self.build_s_total = 0.0
        self.max_lag_s = 0.0
        self.late_slots = 0

    def now_unix_s(self) -> float:
        return self._wall0 + (self._clock() - self._mono0)

    def _fault_truth(self, fault: FaultSpec) -> FaultTruth:
        g = self.settings.gpus_per_node
        ranks = affected_ranks(fault, g)
        node_ids = self.settings.node_ids
        kind, cause = EXPECTED_INCIDENTS[fault.kind]
        return FaultTruth(
            index=fault.index,
            kind=fault.kind.value,
            at_step=fault.at_step,
            ranks=list(ranks),
            nodes=[node_ids[n] for n in affected_nodes(fault, g)],
            gpus=[self.nodes[r // g].gpu_uuids[r % g] for r in ranks],
            expected_kind=kind,
            expected_cause=cause,
            slowdown_ratio=fault.slowdown_ratio if fault.slowdown_ratio != 1.0 else None,
            signal=fault.signal if fault.kind is FaultKind.CRASH else None,
        )

    async def run(self, stop: asyncio.Event) -> GroundTruth:
        """Run until ``duration_s`` passes or ``stop`` is set; return the ground truth."""
        s = self.settings
        if s.tls is None:  # plaintext: many nodes share a channel
            shared = [
                grpc.aio.insecure_channel(s.coordinator, options=CHANNEL_OPTIONS)
                for _ in range(math.ceil(s.nodes / NODES_PER_CHANNEL))
            ]
            channels = [shared[j // NODES_PER_CHANNEL] for j in range(s.nodes)]
        else:  # a node is known by its certificate: a channel each
            channels = [
                grpc.aio.secure_channel(
                    s.coordinator, s.tls[node_id].channel_credentials(), options=CHANNEL_OPTIONS
                )
                for node_id in s.node_ids
            ]
        self.streams = [
            SimAgentStream(channels[j], node_id, s.interval_s, self._answerer(j))
            for j, node_id in enumerate(s.node_ids)
        ]
        stream_stop = asyncio.Event()
        tasks = [
            asyncio.create_task(stream.run(stream_stop), name=f"sim-{stream.node_id}")
            for stream in self.streams
        ]
        cpu0 = time.process_time()
        try:
            await self._loop(stop)
            await self._finish()
        finally:
            stream_stop.set()
            for stream in self.streams:
                stream.close()
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S) if tasks else (set(), set())
            for task in pending:
                task.cancel()
            for channel in {id(c): c for c in channels}.values():
                await channel.close(grace=None)
        self._record_stats(time.process_time() - cpu0)
        self._write_truth()
        return self.truth

    def _answerer(self, node: int) -> Callable[[agent_pb2.Command], agent_pb2.CommandResult]:
        def answer(command: agent_pb2.Command) -> agent_pb2.CommandResult:
            return diagnose.answer(self.job, node, command, self.now_unix_s())

        return answer

    async def _loop(self, stop: asyncio.Event) -> None:
        s = self.settings
        slots = max(1, min(s.nodes, MAX_SLOTS_PER_INTERVAL))
        period_s = s.interval_s / slots
        by_slot = [list(range(slot, s.nodes, slots)) for slot in range(slots)]
        end_mono = self._mono0 + s.duration_s if s.duration_s is not None else math.inf
        tick = 0
        while not stop.is_set():
            tick += 1
            due = self._mono0 + tick * period_s
            if due > end_mono:
                break
            delay_s = due - self._clock()
            if delay_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay_s)
                if stop.is_set():
                    break
            lag_s = self._clock() - due
            self.max_lag_s = max(self.max_lag_s, lag_s)
            due_slots = [tick % slots]
            if lag_s > period_s:  # fell behind: the missed slots report now, once each
                missed = int(lag_s / period_s)
                self.late_slots += missed
                due_slots = [(tick + k) % slots for k in range(min(missed, slots - 1) + 1)]
                tick += missed
            started = time.perf_counter()
            now_s = self.now_unix_s()
            self.job.advance(now_s)
            self._apply_onsets(now_s)
            for slot in due_slots:
                for node in by_slot[slot]:
                    self._report(node, now_s)
            self._note_reported(now_s)
            if 0 in due_slots:
                self.job.prune()
            self.build_s_total += time.perf_counter() - started
        self.truth.ended_unix_s = self.now_unix_s()

    def _note_reported(self, now_s: float) -> None:
        """Stamp the steps that every rank has now reported (the ground truth's step_reported_unix_s)."""
        reported = self.truth.step_reported_unix_s
        newest = self.job.reported_by_every_rank(self._lost)
        reported.extend([now_s] * (newest - (FIRST_STEP - 1) - len(reported)))

    def _report(self, node: int, now_s: float) -> None:
        if node in self._lost:
            return
        ranks = self.job.node_ranks(node, now_s)
        report = self.nodes[node].report(
            now_s, ranks.conditions, ranks.steps_done, self._port_bytes_per_step, self.job.base_transfer_s
        )
        report.interval_seconds = self.settings.interval_s
        report.ranks.extend(ranks.reports)
        self.streams[node].submit(report)
        self.reports_total += 1

    async def _finish(self) -> None:
        """Every running rank exits cleanly in one last report per node; wait for the acks."""
        now_s = self.now_unix_s()
        self.job.advance(now_s)
        for node, model in enumerate(self.nodes):
            if node in self._lost:
                continue
            report = model.report(now_s, [None] * self.settings.gpus_per_node, 0, 0, 0.0)
            report.interval_seconds = self.settings.interval_s
            report.ranks.extend(self.job.final_ranks(node, now_s))
            self.streams[node].submit(report)
        await asyncio.gather(*(stream.drain(DRAIN_TIMEOUT_S) for stream in self.streams))

    def _apply_onsets(self, now_s: float) -> None:
        """Show known faults in the node telemetry; silence lost nodes; record onsets that passed."""
        g = self.settings.gpus_per_node
        for fault in self.settings.scenario.faults:
            onset = self.job.onsets.get(fault.index)
            if onset is None:
                continue
            if fault.index not in self._applied:
                self._applied.add(fault.index)
                self._show(fault, onset.unix_s)
            if fault.kind is FaultKind.NODE_LOSS and now_s >= onset.unix_s:
                for node in affected_nodes(fault, g):
                    if node not in self._lost:
                        self._lost.add(node)
                        self.streams[node].silence()
                        logger.info("node %s lost (stream silenced)", self.settings.node_ids[node])
            if fault.index not in self._recorded and now_s >= onset.unix_s:
                self._recorded.add(fault.index)
                truth = self.truth.faults[fault.index]
                truth.onset_unix_s, truth.onset_step = onset.unix_s, onset.step
                logger.info(
                    "fault %s (%s) took effect at step %d: ranks %s, nodes %s",
                    fault.index,
                    fault.kind.value,
                    onset.step,
                    truth.ranks[:8],
                    truth.nodes,
                )
                self._write_truth()

    def _show(self, fault: FaultSpec, onset_s: float) -> None:
        g = self.settings.gpus_per_node
        if fault.kind is FaultKind.THERMAL_THROTTLE:
            (rank,) = affected_ranks(fault, g)
            self.nodes[rank // g].faults.thermal_gpus[rank % g] = (onset_s, fault.slowdown_ratio)
        elif fault.kind is FaultKind.CPU_CONTENTION:
            for node in affected_nodes(fault, g):
                self.nodes[node].faults.cpu_busy = (onset_s, fault.slowdown_ratio)
        elif fault.kind is FaultKind.NETWORK_STRAGGLER:
            for node in affected_nodes(fault, g):
                self.nodes[node].faults.slow_link = (onset_s, fault.slowdown_ratio)

    def _record_stats(self, cpu_s: float) -> None:
        elapsed_s = max(1e-9, self._clock() - self._mono0)
        self.truth.step_ends_unix_s = list(self.job.step_ends_unix_s)
        self.truth.stats = {
            "elapsed_s": round(elapsed_s, 3),
            "reports_total": self.reports_total,
            "reports_per_s": round(self.reports_total / elapsed_s, 2),
            "reports_acked_total": sum(stream.acked_sequence for stream in self.streams),
            "reports_dropped_total": sum(stream.dropped_total for stream in self.streams),
            "connections_total": sum(stream.connections_total for stream in self.streams),
            "build_ms_per_report": round(1e3 * self.build_s_total / max(1, self.reports_total), 3),
            "cpu_s": round(cpu_s, 3),
            "cpu_ratio": round(cpu_s / elapsed_s, 3),
            "max_lag_s": round(self.max_lag_s, 3),
            "late_slots": self.late_slots,
            "steps_done": self.job.last_step_done(),
        }

    def _write_truth(self) -> None:
        out = self.settings.ground_truth_out
        if out is None:
            return
        self.truth.step_ends_unix_s = list(self.job.step_ends_unix_s)
        try:
            self.truth.write(out)
        except OSError as exc:  # the run goes on; the final write reports again
            logger.warning("cannot write the ground truth to %s: %s", out, exc.strerror)
