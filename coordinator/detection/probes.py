"""Active probes of a job's network: which paths to measure, and what the measurements name.

Pure. Asked for when a job's communication slows down and its nodes' counters do
not say why (coordinator/detection/prober.py runs the probes). In a ring every
rank waits alike, so timings cannot tell a slow link from a slow job; a probe of
each path can.

* **Plan** (``plan_probes``): each node of the job probes the next one (a ring:
  every node is measured leaving and arriving), over every network the two
  share, the job's own first: the other networks are the yardstick a path is
  compared with even when the job has two nodes. Sources probe in two waves (even
  then odd places), so no pair of nodes carries two probes at once.
* **Verdict** (``judge_probes``): a path on a network the job uses is slow when
  its round trip is ``ROUND_TRIP_ABOVE_RATIO`` times the fastest quarter of the
  other paths' and at least ``ROUND_TRIP_MIN_EXTRA_S`` more, when its throughput
  is below ``1 / THROUGHPUT_BELOW_RATIO`` of the top quarter of theirs, or when
  it failed (timed out, no route) where others did not. Throughput is what the
  source interface sent while probed, the job's traffic included (else the
  probe's own): the job's path, busy with the job, leaves a probe a fifth of
  what an idle path does and is not slow for it (bench/probe_noise.py). A node all of whose
  measured paths on the job's networks are slow, while some path between other
  nodes is not, is named alone; otherwise both ends of each slow path are. With
  nothing to compare with (one path) there is no verdict.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.model.networks import node_networks
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.v1 import agent_pb2

ROUND_TRIP_ABOVE_RATIO = 4.0
ROUND_TRIP_MIN_EXTRA_S = 0.002
"""A path's fastest ping this many times the others', and this much more (a congested or
shaped queue, a detour): healthy paths of one fabric differ by tens of microseconds."""
THROUGHPUT_BELOW_RATIO = 10.0
"""A path moving under a tenth of what the others move is throttled, not noisy: healthy paths under
a busy job, on a 2-core machine, measured up to 5.8x apart (bench/probe_noise.py)."""
MAX_TARGETS_PER_NODE = 4
"""Networks probed between one pair of nodes at most (the job's first)."""
PROBE_BYTES = 4 << 20
ROUND_TRIPS = 10
PROBE_TIMEOUT_S = 3.0


@dataclasses.dataclass(frozen=True, slots=True)
class ProbePlan:
    """What each node probes, in waves: every command of a wave runs at once, the waves in turn."""

    waves: tuple[dict[str, agent_pb2.ProbeCommand], ...]
    job_interfaces: frozenset[tuple[str, str]]
    """(node, interface) pairs the job's ranks use: paths leaving or reaching one are the job's."""


@dataclasses.dataclass(frozen=True, slots=True)
class PathResult:
    """One measured path: from ``source`` (its node, interface) to the target's node and interface."""

    source: str
    probe: agent_pb2.ProbeResult
    job: bool

    @property
    def target(self) -> agent_pb2.ProbeTarget:
        return self.probe.target

    def name(self) -> str:
        t = self.probe.target
        return f"{self.source}/{t.interface} -> {t.peer_node}/{t.peer_interface}"


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """What one round of probes says.

    Attributes:
        nodes: the nodes named (worst first); empty when every path measured alike.
        interfaces: (node, interface) at fault.
        reasons: for people, one per slow path.
        evidence: the worst slow path's numbers against the other paths' (unit-suffixed).
        summary: one sentence on what was measured, for an incident that names nothing.
    """

    nodes: tuple[str, ...]
    interfaces: tuple[tuple[str, str], ...]
    reasons: tuple[str, ...]
    evidence: dict[str, float]
    summary: str


def plan_probes(
    job: JobRecord,
    nodes: Mapping[str, NodeRecord],
    job_interfaces: Mapping[str, set[str]],
    *,
    size_bytes: int = PROBE_BYTES,
) -> ProbePlan | str:
    """The probes of ``job``'s paths, or one sentence saying why there are none."""
    hosting = job.hosting_nodes()
    if len(hosting) < 2:
        return "it runs on one node: no path between nodes to probe"
    if unprobed := [n for n in hosting if (node := nodes.get(n)) is None or not node.probe_port]:
        return f"no probe server on {', '.join(unprobed)} (agent.probe_listen off, or an older agent)"
    networks = {n: node_networks(nodes.get(n)) for n in hosting}
    waves: tuple[dict[str, agent_pb2.ProbeCommand], dict[str, agent_pb2.ProbeCommand]] = ({}, {})
    unshared = []
    for place, source in enumerate(hosting):
        peer = hosting[(place + 1) % len(hosting)]
        used = job_interfaces.get(source, set())
        shared = sorted(
            (network for network in networks[source] if network in networks[peer]),
            key=lambda network: (networks[source][network].interface not in used, str(network)),
        )[:MAX_TARGETS_PER_NODE]
        if not shared:
            unshared.append(f"{source} and {peer}")
            continue
        waves[place % 2][source] = agent_pb2.ProbeCommand(
            job=job.job,
            bytes=size_bytes,
            round_trips=ROUND_TRIPS,
            timeout_seconds=PROBE_TIMEOUT_S,
            targets=[
                agent_pb2.ProbeTarget(
                    peer_node=peer,
                    interface=networks[source][network].interface,
                    source_address=str(networks[source][network].address),
                    address=str(networks[peer][network].address),
                    port=nodes[peer].probe_port,
                    peer_interface=networks[peer][network].interface,
                )
                for network in shared
            ],
        )
    if unshared:
        return f"no network with known addresses joins {'; '.join(unshared)}"
    used_pairs = frozenset((n, i) for n, interfaces in job_interfaces.items() for i in interfaces)
    return ProbePlan(tuple(w for w in waves if w), used_pairs)


def path_results(
    plan: ProbePlan, answers: Mapping[str, agent_pb2.CommandResult]
) -> tuple[list[PathResult], list[str]]:
    """The paths measured, from each source node's answer, and what went wrong getting them."""
    paths: list[PathResult] = []
    problems: list[str] = []
    for source, answer in sorted(answers.items()):
        if answer.status != agent_pb2.CommandResult.STATUS_OK:
            problems.append(f"{source}: {answer.message or 'no answer'}")
            continue
        for probe in answer.probes:
            t = probe.target
            job = (source, t.interface) in plan.job_interfaces or (
                t.peer_node,
                t.peer_interface,
            ) in plan.job_interfaces
            paths.append(PathResult(source, probe, job or not plan.job_interfaces))
    return paths, problems


def judge_probes(paths: Sequence[PathResult]) -> ProbeVerdict:
    """Name the slow paths of the job's networks, and the nodes behind them."""
    measured = [p for p in paths if not p.probe.error]
    failed = [p for p in paths if p.probe.error and "refused" not in p.probe.error]
    if len(measured) + len(failed) < 2 or not measured:
        return ProbeVerdict((), (), (), {}, _summary(paths, "too few paths measured to compare"))
    slow: list[tuple[PathResult, str, dict[str, float]]] = []
    for path in (p for p in paths if p.job):
        others = [p for p in measured if p is not path]
        if not others:
            continue
        if path.probe.error:
            if path in failed:
                slow.append((path, f"{path.name()}: {path.probe.error}", {"probe_failed_paths": 1.0}))
            continue
        found = _slow_path(path, others)
        if found is not None:
            slow.append((path, *found))
    if not slow:
        return ProbeVerdict((), (), (), {}, _summary(paths, "every path alike"))
    named = _named(paths, [p for p, _, _ in slow])
    ends = {end for path, _, _ in slow for end in _ends(path) if end[0] in named}
    interfaces = tuple(sorted(ends, key=lambda end: (named.index(end[0]), end[1])))
    evidence = {**slow[0][2], "probe_slow_paths": float(len(slow))}
    return ProbeVerdict(named, interfaces, tuple(r for _, r, _ in slow), evidence, _summary(paths, ""))


def confirmed(first: ProbeVerdict, second: ProbeVerdict) -> ProbeVerdict:
    """The verdict of a round run again because ``first`` named a path: ``second`` where it names one
    of the same interfaces, else nothing named (one slow measurement is noise until repeated)."""
    if set(first.interfaces) & set(second.interfaces):
        return second
    return ProbeVerdict(
        (),
        (),
        (),
        {},
        f"{second.summary}; slow in one round but not the next, so not named: {first.reasons[0]}",
    )


def _slow_path(path: PathResult, others: Sequence[PathResult]) -> tuple[str, dict[str, float]] | None:
    """(reason, evidence) when ``path`` stands out from ``others``, else None."""
    reasons: list[str] = []
    evidence: dict[str, float] = {}
    round_trip = path.probe.round_trip_seconds
    peer_round_trip = _quartile(
        [p.probe.round_trip_seconds for p in others if p.probe.round_trip_seconds > 0], 0.25
    )
    if (
        round_trip > 0
        and peer_round_trip is not None
        and round_trip >= ROUND_TRIP_ABOVE_RATIO * peer_round_trip
        and round_trip - peer_round_trip >= ROUND_TRIP_MIN_EXTRA_S
    ):
        reasons.append(
            f"round trip {round_trip * 1e3:.2f} ms vs {peer_round_trip * 1e3:.2f} ms on other paths"
        )
        evidence |= {"probe_round_trip_seconds": round_trip, "peer_probe_round_trip_seconds": peer_round_trip}
    throughput = _capacity(path.probe)
    peer_throughput = _quartile([c for p in others if (c := _capacity(p.probe)) > 0], 0.75)
    if (
        throughput > 0
        and peer_throughput is not None
        and throughput * THROUGHPUT_BELOW_RATIO <= peer_throughput
    ):
        reasons.append(f"{throughput / 1e6:.1f} MB/s vs {peer_throughput / 1e6:.1f} MB/s on other paths")
        evidence |= {
            "probe_throughput_bytes_per_second": throughput,
            "peer_probe_throughput_bytes_per_second": peer_throughput,
        }
    if not reasons:
        return None
    return f"{path.name()}: {', '.join(reasons)}", evidence


def _capacity(probe: agent_pb2.ProbeResult) -> float:
    """What the path moved while probed: the interface's whole transmit rate where its agent read it (the
    job's own traffic on its path leaves the probe only a share), else the probe's throughput."""
    return max(probe.throughput_bytes_per_second, probe.interface_transmit_bytes_per_second)


def _named(paths: Sequence[PathResult], slow: Sequence[PathResult]) -> tuple[str, ...]:
    """The node every slow path touches, when all its own job paths are slow and another path is
    not; else both ends of each slow path, most often named first."""
    job_paths = [p for p in paths if p.job and "refused" not in p.probe.error]
    counts: dict[str, int] = {}
    for path in slow:
        for node, _ in _ends(path):
            counts[node] = counts.get(node, 0) + 1
    for node in sorted(counts, key=lambda n: (-counts[n], n)):
        own = [p for p in job_paths if node in (p.source, p.target.peer_node)]
        healthy_elsewhere = any(
            p not in slow for p in job_paths if node not in (p.source, p.target.peer_node)
        )
        if own and all(p in slow for p in own) and healthy_elsewhere:
            return (node,)
    return tuple(sorted(counts, key=lambda n: (-counts[n], n)))


def _ends(path: PathResult) -> tuple[tuple[str, str], tuple[str, str]]:
    return (path.source, path.target.interface), (path.target.peer_node, path.target.peer_interface)


def _quartile(values: Sequence[float], q: float) -> float | None:
    """The value at quantile ``q`` (0.25: the fastest quarter's edge), None with no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=4, method="inclusive")
    return cuts[0] if q <= 0.25 else cuts[2] if q >= 0.75 else cuts[1]


def _summary(paths: Sequence[PathResult], verdict: str) -> str:
    measured = [p for p in paths if not p.probe.error]
    failed = len(paths) - len(measured)
    round_trips = [p.probe.round_trip_seconds for p in measured if p.probe.round_trip_seconds > 0]
    shown = f", round trip median {statistics.median(round_trips) * 1e3:.2f} ms" if round_trips else ""
    tail = f": {verdict}" if verdict else ""
    return f"{len(measured)} paths probed{f' ({failed} failed)' if failed else ''}{shown}{tail}"


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeRound:
    """A job's latest round of probes: its verdict, or why there was none (``why_not``)."""

    finished_mono_s: float
    verdict: ProbeVerdict | None
    why_not: str = ""

    def describe(self) -> str:
        if self.verdict is None:
            return f"not probed: {self.why_not}"
        return f"probes: {self.verdict.summary}"
