"""Cause attribution (coordinator/detection/causes/): jobs through the real JobStore, nodes through
the real ClusterState, node reports as the agent's protobufs."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest
from training_builders import T0, collective, rank_report, step

from clusterwatch.coordinator.detection.causes import (
    Cause,
    CauseName,
    CauseSettings,
    network_cause,
    straggler_cause,
)
from clusterwatch.coordinator.detection.causes.network import CORROBORATING_EVIDENCE
from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord
from clusterwatch.errors import ConfigError
from clusterwatch.v1 import agent_pb2, node_pb2

pytestmark = pytest.mark.timeout(30)

NODES = 4
RANKS_PER_NODE = 4
WORLD = NODES * RANKS_PER_NODE
STRAGGLER = 5  # on node-1
COMPUTE_S = 0.4
GHZ = 1e9
GIB = 1 << 30
COLLECTIVE_BYTES = 256 << 20
COLLECTIVE_S = 0.02
BEFORE_UNIX_S, NOW_UNIX_S = 1000.0, 1001.0  # the two reports of every node, 1 s apart
# Routine InfiniBand transmit wait on every port (ticks per second).
ROUTINE_WAIT_PER_S = 5000.0

THERMAL = 0x40  # hw_thermal_slowdown
HW_SLOWDOWN = 0x8
POWER_BRAKE = 0x80  # hw_power_brake_slowdown
POWER_CAP = 0x4  # sw_power_cap

Fields = Mapping[str, float | int | str | bool | None]


def build_job(
    *,
    slow: Collection[int] = (STRAGGLER,),
    collective_s: Mapping[int, float] | None = None,
    nodes: int = NODES,
) -> JobRecord:
    """A job of ``nodes`` x 4 ranks (rank r on node-(r // 4)) after 20 steps; ``slow`` ranks
    compute 25 % longer; node -> all-reduce duration (default 20 ms) sets the bus bandwidth."""
    store = JobStore()
    world = nodes * RANKS_PER_NODE
    for node in range(nodes):
        duration_s = (collective_s or {}).get(node, COLLECTIVE_S)
        reports = [
            rank_report(
                rank,
                world_size=world,
                steps=[
                    step(n, start=T0 + n, step_s=0.6, compute_s=COMPUTE_S * (1.25 if rank in slow else 1.0))
                    for n in range(1, 21)
                ],
                collectives=[
                    collective(group_size=world, bytes_total=COLLECTIVE_BYTES, duration_s=duration_s)
                ],
            )
            for rank in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
        ]
        outcome = store.ingest(f"node-{node}", reports, now_mono=1.0, now_unix=T0)
        assert outcome.applied == RANKS_PER_NODE
    return store.jobs["train"]


def node_report(
    node: int,
    at_unix_s: float,
    *,
    gpus: Mapping[int, Fields] | None = None,
    host: Fields | None = None,
    ib: Mapping[str, Fields] | None = None,
    ib_rates: Mapping[str, Mapping[str, float]] | None = None,
    nic_rates: Mapping[str, Mapping[str, float]] | None = None,
    nic: Mapping[str, Fields] | None = None,
    tcp_rates: Mapping[str, float] | None = None,
) -> node_pb2.NodeReport:
    """A node's report at ``at_unix_s``: a healthy GPU per rank (overrides by rank; None
    clears a field), a healthy host, InfiniBand port mlx5_0/1 ACTIVE and a spare mlx5_1/1
    that is DOWN (not cabled) on every node, NIC eth0 up and eth1 down everywhere, TCP
    sending 10,000 segments/s with one retransmitted. Counters grow at ``*_rates`` per
    second from 0 at time 0."""
    report = node_pb2.NodeReport(sequence=1, timestamp_unix_seconds=at_unix_s, interval_seconds=1.0)
    for rank in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE):
        gpu = report.gpus.add(
            index=rank % RANKS_PER_NODE,
            uuid=f"GPU-{rank:04d}",
            name="NVIDIA H100",
            sm_clock_hertz=1.98 * GHZ,
            sm_clock_max_hertz=1.98 * GHZ,
            temperature_celsius=65.0,
            power_watts=550.0,
            power_limit_watts=700.0,
            clocks_event_reasons=0,
        )
        _apply(gpu, (gpus or {}).get(rank, {}))
    _apply(
        report.host,
        {
            "cpu_utilization_ratio": 0.35,
            "cpu_count": 64,
            "load1": 20.0,
            "memory_total_bytes": 1024 * GIB,
            "memory_available_bytes": 700 * GIB,
            "memory_used_bytes": 324 * GIB,
            "swap_used_bytes": 0,
            "swap_total_bytes": 8 * GIB,
            **(host or {}),
        },
    )
    for device, state in (("mlx5_0", "ACTIVE"), ("mlx5_1", "DOWN")):
        routine = ROUTINE_WAIT_PER_S if state == "ACTIVE" else 0.0
        rates = {"transmit_wait_total": routine, **(ib_rates or {}).get(device, {})}
        port = report.ib_ports.add(device=device, port=1, state=state, link_layer="InfiniBand")
        for field in (
            "transmit_wait_total",
            "symbol_errors_total",
            "link_downed_total",
            "receive_errors_total",
            "cnp_sent_total",
        ):
            setattr(port, field, int(rates.get(field, 0.0) * at_unix_s))
        _apply(port, (ib or {}).get(device, {}))
    for device, up in (("lo", True), ("eth0", True), ("eth1", False)):
        nic_counter_rates = (nic_rates or {}).get(device, {})
        sample = report.nics.add(device=device, up=up)
        for field in (
            "receive_errors_total",
            "transmit_errors_total",
            "qdisc_drops_total",
            "qdisc_overlimits_total",
            "pause_frames_received_total",
        ):
            setattr(sample, field, int(nic_counter_rates.get(field, 0.0) * at_unix_s))
        _apply(sample, (nic or {}).get(device, {}))
    tcp = {"segments_sent_total": 10_000.0, "segments_retransmitted_total": 1.0, **(tcp_rates or {})}
    for field, rate in tcp.items():
        setattr(report.tcp, field, int(rate * at_unix_s))
    return report


def _apply(
    message: node_pb2.GpuSample | node_pb2.HostSample | node_pb2.IbPortSample | node_pb2.NicSample,
    fields: Fields,
) -> None:
    for name, value in fields.items():
        if value is None:
            message.ClearField(name)  # type: ignore[arg-type]
        else:
            setattr(message, name, value)


NodeSpec = Mapping[str, object]


def cluster(
    now: Mapping[int, NodeSpec] | None = None,
    before: Mapping[int, NodeSpec] | None = None,
    *,
    nodes: int = NODES,
    previous: bool = True,
) -> dict[str, NodeRecord]:
    """ClusterState.nodes after every node's agent said hello and sent two reports
    (``before`` and ``now``: node -> node_report keyword arguments; ``before`` defaults
    to ``now``), or only the latest with ``previous=False``."""
    state = ClusterState()
    for node in range(nodes):
        node_id = f"node-{node}"
        hello = agent_pb2.Hello(node_id=node_id, hostname=node_id, instance_id="i", interval_seconds=1.0)
        state.hello(hello, 0.0, BEFORE_UNIX_S)
        spec_now = (now or {}).get(node, {})
        spec_before = (before or {}).get(node, spec_now)
        if previous:
            earlier = node_report(node, BEFORE_UNIX_S, **spec_before)  # type: ignore[arg-type]
            earlier.sequence = 1
            state.ingest(node_id, earlier, 1.0, BEFORE_UNIX_S)
        latest = node_report(node, NOW_UNIX_S, **spec_now)  # type: ignore[arg-type]
        latest.sequence = 2
        state.ingest(node_id, latest, 2.0, NOW_UNIX_S)
    return state.nodes


def cause_of(
    nodes: Mapping[str, NodeRecord],
    *,
    job: JobRecord | None = None,
    rank: int = STRAGGLER,
    slow: Collection[int] = (STRAGGLER,),
) -> Cause:
    return straggler_cause(job or build_job(slow=slow), rank, nodes, slow_ranks=set(slow) - {rank})


# --- GPU ---------------------------------------------------------------------------------------


def test_a_hot_gpu_running_slow_clocks_is_gpu_thermal() -> None:
    nodes = cluster(
        {
            1: {
                "gpus": {
                    STRAGGLER: {
                        "sm_clock_hertz": 1.30 * GHZ,
                        "temperature_celsius": 91.0,
                        "clocks_event_reasons": THERMAL | HW_SLOWDOWN,
                    }
                }
            }
        }
    )
    cause = cause_of(nodes)
    assert cause.name == CauseName.GPU_THERMAL
    assert cause.name == "gpu_thermal"
    assert cause.nodes == ("node-1",)
    assert cause.evidence == {
        "sm_clock_hertz": 1.30 * GHZ,
        "peer_sm_clock_hertz": 1.98 * GHZ,
        "sm_clock_max_hertz": 1.98 * GHZ,
        "temperature_celsius": 91.0,
        "peer_temperature_celsius": 65.0,
        "power_watts": 550.0,
        "power_limit_watts": 700.0,
        "clocks_event_reasons": float(THERMAL | HW_SLOWDOWN),
    }
    assert cause.detail == (
        "rank 5's GPU GPU-0005 on node-1 runs its SM clock at 1.30 GHz vs 1.98 GHz on its peers' GPUs "
        "(0.66x), at 91 °C, drawing 550 W of 700 W, with hw_slowdown, hw_thermal_slowdown set"
    )


@pytest.mark.parametrize(
    ("own", "peers", "expected"),
    [
        # A power brake on its GPU only, clocks down.
        ({"sm_clock_hertz": 1.5 * GHZ, "clocks_event_reasons": POWER_BRAKE}, {}, CauseName.GPU_POWER),
        # Its clock well below its peers' without any reason: gpu_clock.
        ({"sm_clock_hertz": 1.6 * GHZ}, {}, CauseName.GPU_CLOCK),
        # HW slowdown alone, and no clock to compare: the reason is enough.
        ({"sm_clock_hertz": None, "clocks_event_reasons": HW_SLOWDOWN}, {}, CauseName.GPU_CLOCK),
        # Every GPU sits at its power cap (routine under load), its clock like theirs: not the GPU.
        ({"clocks_event_reasons": POWER_CAP}, {"clocks_event_reasons": POWER_CAP}, CauseName.COMPUTE),
        # ...but with its clock clearly lower, the power cap it hits is the likely cause.
        (
            {"clocks_event_reasons": POWER_CAP, "sm_clock_hertz": 1.6 * GHZ},
            {"clocks_event_reasons": POWER_CAP},
            CauseName.GPU_POWER,
        ),
        # A thermal reason of its own with a clock no lower than its peers' explains nothing.
        ({"clocks_event_reasons": THERMAL, "sm_clock_hertz": 1.98 * GHZ}, {}, CauseName.COMPUTE),
        # A slightly lower clock (5 %) with no reason: within the noise.
        ({"sm_clock_hertz": 1.88 * GHZ}, {}, CauseName.COMPUTE),
    ],
)
def test_gpu_rules(own: Fields, peers: Fields, expected: CauseName) -> None:
    gpus = {rank: dict(peers) for rank in range(WORLD)}
    gpus[STRAGGLER] = {**peers, **own}
    spec = {node: {"gpus": gpus} for node in range(NODES)}
    assert cause_of(cluster(spec)).name == expected


def test_peers_gpus_without_clock_data_leave_only_the_reasons() -> None:
    gpus: dict[int, Fields] = {
        rank: {"sm_clock_hertz": None, "clocks_event_reasons": None} for rank in range(WORLD)
    }
    gpus[STRAGGLER] = {"sm_clock_hertz": 1.2 * GHZ, "clocks_event_reasons": THERMAL}
    cause = cause_of(cluster({node: {"gpus": gpus} for node in range(NODES)}))
    assert cause.name == CauseName.GPU_THERMAL
    assert "peer_sm_clock_hertz" not in cause.evidence
    assert "runs its SM clock at 1.20 GHz," in cause.detail


# --- host --------------------------------------------------------------------------------------


SLOW_NODE_1 = (4, 5, 6, 7)  # every rank of node-1 straggles


def test_a_saturated_cpu_on_the_node_whose_ranks_all_straggle_is_host_cpu() -> None:
    nodes = cluster({1: {"host": {"cpu_utilization_ratio": 0.99, "load1": 70.0}}})
    cause = cause_of(nodes, slow=SLOW_NODE_1)
    assert cause.name == CauseName.HOST_CPU
    assert cause.nodes == ("node-1",)
    assert cause.evidence == pytest.approx(
        {
            "host_cpu_utilization_ratio": 0.99,
            "peer_host_cpu_utilization_ratio": 0.35,
            "host_load1_per_cpu_ratio": 70 / 64,
            "peer_host_load1_per_cpu_ratio": 20 / 64,
        }
    )
    assert cause.detail == (
        "node-1, where rank 5 runs, is CPU-saturated (CPU 99 % busy, load 1.09 per CPU) while its peers' "
        "nodes are at 35 %"
    )


def test_a_load_average_above_the_cpu_count_is_host_cpu_without_utilization() -> None:
    nodes = cluster({1: {"host": {"cpu_utilization_ratio": None, "load1": 80.0}}})
    cause = cause_of(nodes, slow=SLOW_NODE_1)
    assert cause.name == CauseName.HOST_CPU
    assert "host_cpu_utilization_ratio" not in cause.evidence
    assert cause.evidence["host_load1_per_cpu_ratio"] == pytest.approx(1.25)


def test_host_signals_do_not_explain_a_straggler_whose_node_runs_healthy_ranks() -> None:
    # Rank 5 straggles alone: ranks 4, 6 and 7 share its saturated CPU and keep pace.
    nodes = cluster({1: {"host": {"cpu_utilization_ratio": 0.99, "memory_available_bytes": 1 * GIB}}})
    assert cause_of(nodes, slow=(STRAGGLER,)).name == CauseName.COMPUTE


def test_a_cpu_saturated_on_most_nodes_does_not_single_one_out() -> None:
    busy = {"host": {"cpu_utilization_ratio": 0.99}}
    nodes = cluster({0: busy, 1: busy, 2: busy})
    assert cause_of(nodes, slow=SLOW_NODE_1).name == CauseName.COMPUTE


def test_low_available_memory_is_host_memory_and_comes_before_cpu() -> None:
    nodes = cluster({1: {"host": {"memory_available_bytes": 20 * GIB, "cpu_utilization_ratio": 0.99}}})
    cause = cause_of(nodes, slow=SLOW_NODE_1)
    assert cause.name == CauseName.HOST_MEMORY
    assert cause.evidence["host_memory_available_ratio"] == pytest.approx(20 / 1024)
    assert cause.evidence["peer_host_memory_available_ratio"] == pytest.approx(700 / 1024)
    assert cause.detail == "node-1, where rank 5 runs, is short of memory: has 2.0 % of its memory available"


def test_growing_swap_is_host_memory() -> None:
    nodes = cluster(
        {1: {"host": {"swap_used_bytes": 2 * GIB + (64 << 20)}}}, {1: {"host": {"swap_used_bytes": 2 * GIB}}}
    )
    cause = cause_of(nodes, slow=SLOW_NODE_1)
    assert cause.name == CauseName.HOST_MEMORY
    assert cause.evidence["host_swap_growth_bytes_per_second"] == float(64 << 20)
    assert "swap use growing by 64.0 MiB/s" in cause.detail


def test_swap_in_use_but_not_growing_is_not_memory_pressure() -> None:
    nodes = cluster({1: {"host": {"swap_used_bytes": 2 * GIB}}})
    assert cause_of(nodes, slow=SLOW_NODE_1).name == CauseName.COMPUTE


# --- network -----------------------------------------------------------------------------------


def test_infiniband_symbol_errors_on_its_node_are_network() -> None:
    nodes = cluster({1: {"ib_rates": {"mlx5_0": {"symbol_errors_total": 5.0}}}})
    cause = cause_of(nodes)
    assert cause.name == CauseName.NETWORK
    assert cause.nodes == ("node-1",)
    assert cause.evidence == {"ib_errors_per_second": 5.0}
    assert cause.detail == "node-1, where rank 5 runs, has network trouble: InfiniBand errors at 5.0/s"


def test_nic_errors_and_link_flaps_are_network() -> None:
    nodes = cluster(
        {
            1: {
                "nic_rates": {"eth0": {"receive_errors_total": 3.0}},
                "ib_rates": {"mlx5_0": {"link_downed_total": 1.0}},
            }
        }
    )
    cause = cause_of(nodes)
    assert cause.name == CauseName.NETWORK
    assert cause.evidence == {"nic_errors_per_second": 3.0, "ib_link_downed_per_second": 1.0}


def test_an_interfaces_queue_dropping_packets_is_network_naming_the_interface() -> None:
    nodes = cluster({1: {"nic_rates": {"eth0": {"qdisc_drops_total": 40.0}}}})
    cause = cause_of(nodes)
    assert (cause.name, cause.nodes) == (CauseName.NETWORK, ("node-1",))
    assert cause.evidence == {"queue_drops_per_second": 40.0}
    assert cause.detail == "node-1, where rank 5 runs, has network trouble: eth0's queue drops 40.0 packets/s"
    job_level = network_cause(build_job(slow=()), nodes)
    assert (job_level.name, job_level.nodes) == (CauseName.NETWORK, ("node-1",))


def test_a_shaper_holding_back_one_nodes_job_interface_names_it_unless_every_node_is_shaped() -> None:
    job = build_job(slow=())
    for record in job.ranks.values():
        record.interfaces = ("eth0",)  # what the agents read from the ranks' sockets
    shaped = {"nic_rates": {"eth0": {"qdisc_overlimits_total": 500.0}}}
    cause = network_cause(job, cluster({1: shaped}))
    assert (cause.name, cause.nodes, cause.interfaces) == (
        CauseName.NETWORK,
        ("node-1",),
        (("node-1", "eth0"),),
    )
    assert "node-1: eth0's shaper holds packets back 500 times/s vs 0/s on the others" in cause.detail
    assert cause.evidence == {"queue_overlimits_per_second": 500.0, "peer_queue_overlimits_per_second": 0.0}
    assert network_cause(job, cluster(dict.fromkeys(range(NODES), shaped))).name == CauseName.COMMUNICATION
    # A shaper on an interface the job does not use is none of its business.
    elsewhere = {"nic_rates": {"eth1": {"qdisc_overlimits_total": 500.0}}}
    assert network_cause(job, cluster({1: elsewhere})).name == CauseName.COMMUNICATION


@pytest.mark.parametrize(
    ("spec", "named", "said", "key"),
    [
        (
            {"nic_rates": {"eth0": {"pause_frames_received_total": 2000.0}}},
            "eth0",
            "eth0 receives 2000 pause frames/s vs 0/s on the others (its switch port holds it back)",
            "pause_frames",
        ),
        (
            {"ib_rates": {"mlx5_0": {"cnp_sent_total": 5000.0}}},
            "mlx5_0/1",
            "mlx5_0/1 sends 5000 RoCE congestion notifications/s vs 0/s on the others (packets reach it ECN-marked)",
            "congestion_notifications",
        ),
    ],
)
def test_a_node_paused_by_its_switch_or_congested_names_its_link_unless_every_node_is(
    spec: NodeSpec, named: str, said: str, key: str
) -> None:
    job = build_job(slow=())
    for record in job.ranks.values():
        record.interfaces = ("eth0",)
    cause = network_cause(job, cluster({1: spec}))
    assert (cause.name, cause.nodes, cause.interfaces) == (
        CauseName.NETWORK,
        ("node-1",),
        (("node-1", named),),
    )
    assert said in cause.detail
    assert cause.evidence.keys() == {f"{key}_per_second", f"peer_{key}_per_second"}
    assert cause.evidence[f"{key}_per_second"] >= 1000
    assert cause.evidence[f"peer_{key}_per_second"] == 0.0
    assert CORROBORATING_EVIDENCE & cause.evidence.keys(), "the link itself says so: recovery may act"
    # A whole fabric paused or congested alike singles no node out.
    assert network_cause(job, cluster(dict.fromkeys(range(NODES), spec))).name == CauseName.COMMUNICATION


def test_the_interface_of_a_node_wide_signal_is_the_one_the_jobs_ranks_use_there() -> None:
    job = build_job(slow=())
    lossy = cluster({1: {"tcp_rates": {"segments_retransmitted_total": 300.0}}})
    assert network_cause(job, lossy).interfaces == (), "no socket read: no interface named"
    for record in job.ranks.values():
        record.interfaces = ("eth0",)
    cause = network_cause(job, lossy)
    assert cause.interfaces == (("node-1", "eth0"),)
    assert "node-1 (eth0): TCP retransmits 3.0% of the segments it sends" in cause.detail


def test_tcp_retransmitting_over_a_percent_is_network_and_idle_tcp_is_not_judged() -> None:
    lossy = cluster({1: {"tcp_rates": {"segments_retransmitted_total": 300.0}}})  # 3 % of 10,000/s
    cause = network_cause(build_job(slow=()), lossy)
    assert (cause.name, cause.nodes) == (CauseName.NETWORK, ("node-1",))
    assert "node-1: TCP retransmits 3.0% of the segments it sends" in cause.detail
    assert cause.evidence == {"tcp_retransmit_ratio": pytest.approx(0.03)}
    # 50 segments/s, a fifth of them again: too little traffic to judge.
    idle = cluster({1: {"tcp_rates": {"segments_sent_total": 50.0, "segments_retransmitted_total": 10.0}}})
    assert network_cause(build_job(slow=()), idle).name == CauseName.COMMUNICATION
    # Healthy everywhere (0.01 %): nothing stands out.
    assert network_cause(build_job(slow=()), cluster()).name == CauseName.COMMUNICATION


def test_a_port_that_went_down_is_network_but_a_port_down_everywhere_is_not_cabled() -> None:
    went_down = cluster({1: {"ib": {"mlx5_0": {"state": "DOWN"}}}})  # was ACTIVE a second ago
    cause = cause_of(went_down)
    assert cause.name == CauseName.NETWORK
    assert cause.evidence["links_down"] == 1.0
    assert "mlx5_0/1 down" in cause.detail
    # Down in both reports, but ACTIVE on every other node: still a link down.
    always_down = cluster({1: {"ib": {"mlx5_0": {"state": "DOWN"}}}}, previous=False)
    assert cause_of(always_down).name == CauseName.NETWORK
    # eth0 down while up on the others.
    nic_down = cluster({1: {"nic": {"eth0": {"up": False}}}}, previous=False)
    assert "eth0 down" in cause_of(nic_down).detail
    # mlx5_1 and eth1 are down on every node in every test here: never a cause by themselves.
    assert cause_of(cluster()).name == CauseName.COMPUTE


def test_transmit_wait_far_above_the_peers_nodes_is_network() -> None:
    nodes = cluster({1: {"ib_rates": {"mlx5_0": {"transmit_wait_total": 40 * ROUTINE_WAIT_PER_S}}}})
    cause = cause_of(nodes)
    assert cause.name == CauseName.NETWORK
    assert cause.evidence == {
        "ib_transmit_wait_per_second": 40 * ROUTINE_WAIT_PER_S,
        "peer_ib_transmit_wait_per_second": ROUTINE_WAIT_PER_S,
    }
    assert "InfiniBand transmit wait 2e+05/s vs 5e+03/s on the others (40x)" in cause.detail
    # Three times the peers' is within what congestion does.
    modest = cluster({1: {"ib_rates": {"mlx5_0": {"transmit_wait_total": 3 * ROUTINE_WAIT_PER_S}}}})
    assert cause_of(modest).name == CauseName.COMPUTE


def test_low_bus_bandwidth_on_its_node_is_network() -> None:
    job = build_job(collective_s={1: 3 * COLLECTIVE_S})
    cause = cause_of(cluster(), job=job)
    assert cause.name == CauseName.NETWORK
    assert cause.evidence["bus_bandwidth_bytes_per_second"] == pytest.approx(
        cause.evidence["peer_bus_bandwidth_bytes_per_second"] / 3
    )
    assert "(0.33x)" in cause.detail


def test_a_compute_straggler_waits_least_and_so_has_no_low_bus_bandwidth() -> None:
    job = build_job(collective_s={1: COLLECTIVE_S / 2})  # node-1 arrives last and waits least
    assert cause_of(cluster(), job=job).name == CauseName.COMPUTE


# --- compute and missing data ------------------------------------------------------------------


def test_nothing_on_the_node_explains_it_so_the_rank_computes_slower() -> None:
    cause = cause_of(cluster())
    assert cause.name == CauseName.COMPUTE
    assert cause.nodes == ()
    assert cause.evidence == pytest.approx(
        {
            "compute_seconds": 0.5,
            "peer_compute_seconds": 0.4,
            "sm_clock_hertz": 1.98 * GHZ,
            "peer_sm_clock_hertz": 1.98 * GHZ,
        }
    )
    assert cause.detail == (
        "rank 5 on node-1 computes 0.500 s per step vs 0.400 s on its peers (1.25x) and nothing on its node "
        "sets it apart from its peers' (GPU clocks, host, network): the rank itself is slower (data loading, "
        "code path or input)"
    )


def test_a_straggler_whose_gpu_does_little_tensor_work_is_starved_by_its_rank() -> None:
    """GPM's tensor activity (Hopper and newer): a GPU that waits for its rank is idle more, not slower."""
    busy = {"tensor_active_ratio": 0.6}
    specs = {
        n: {"gpus": dict.fromkeys(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE), busy)}
        for n in range(NODES)
    }
    specs[1]["gpus"] = {**specs[1]["gpus"], STRAGGLER: {"tensor_active_ratio": 0.12}}
    cause = cause_of(cluster(specs))
    assert cause.name == CauseName.COMPUTE  # nothing else on the node sets it apart
    assert cause.evidence["tensor_active_ratio"] == pytest.approx(0.12)
    assert cause.evidence["peer_tensor_active_ratio"] == pytest.approx(0.6)
    assert cause.detail.endswith(
        "; its GPU's tensor pipes were busy 12% of the time vs 60% on its peers': the GPU waits for the rank "
        "(input pipeline, host code)"
    )
    # As busy as its peers: the evidence is there, the sentence is not.
    specs[1]["gpus"] = {**specs[1]["gpus"], STRAGGLER: {"tensor_active_ratio": 0.55}}
    unstarved = cause_of(cluster(specs))
    assert unstarved.evidence["tensor_active_ratio"] == pytest.approx(0.55)
    assert "tensor pipes" not in unstarved.detail


def test_missing_data_skips_rules_and_never_crashes() -> None:
    job = build_job()
    # No node known at all.
    assert straggler_cause(job, STRAGGLER, {}).name == CauseName.COMPUTE
    # A rank the job does not have.
    assert straggler_cause(job, 99, cluster()) == Cause(
        CauseName.COMPUTE, "job train has no rank 99: nothing to compare", {}
    )
    # Nodes that sent empty reports (no GPU, host, NIC or InfiniBand data).
    state = ClusterState()
    for node in range(NODES):
        state.hello(agent_pb2.Hello(node_id=f"node-{node}", instance_id="i", interval_seconds=1.0), 0.0, 0.0)
        state.ingest(f"node-{node}", node_pb2.NodeReport(sequence=1), 1.0, 0.0)
    assert straggler_cause(job, STRAGGLER, state.nodes).name == CauseName.COMPUTE
    # Every optional field unset: GPUs known by UUID only, a host with only its CPU count.
    bare_gpu: Fields = dict.fromkeys(
        (
            "sm_clock_hertz",
            "sm_clock_max_hertz",
            "temperature_celsius",
            "power_watts",
            "power_limit_watts",
            "clocks_event_reasons",
        )
    )
    bare_host: Fields = dict.fromkeys(
        (
            "cpu_utilization_ratio",
            "load1",
            "memory_total_bytes",
            "memory_available_bytes",
            "memory_used_bytes",
            "swap_used_bytes",
            "swap_total_bytes",
        )
    )
    bare_ib: Fields = {
        "transmit_wait_total": None,
        "symbol_errors_total": None,
        "link_downed_total": None,
        "receive_errors_total": None,
    }
    bare = {
        node: {"gpus": dict.fromkeys(range(WORLD), bare_gpu), "host": bare_host, "ib": {"mlx5_0": bare_ib}}
        for node in range(NODES)
    }
    cause = cause_of(cluster(bare))
    assert cause.name == CauseName.COMPUTE
    assert set(cause.evidence) == {"compute_seconds", "peer_compute_seconds"}
    # Errors piling up, but no previous report to take a rate from.
    errors = {1: {"ib_rates": {"mlx5_0": {"symbol_errors_total": 5.0}}}}
    assert cause_of(cluster(errors, previous=False)).name == CauseName.COMPUTE


def test_a_cpu_rank_has_no_gpu_to_blame() -> None:
    job = build_job()
    identity = type(job.ranks[STRAGGLER].identity)()
    identity.CopyFrom(job.ranks[STRAGGLER].identity)
    identity.gpu_uuid = ""
    job.ranks[STRAGGLER].identity = identity
    hot = {1: {"gpus": {STRAGGLER: {"sm_clock_hertz": 1.0 * GHZ, "clocks_event_reasons": THERMAL}}}}
    cause = cause_of(cluster(hot), job=job)
    assert cause.name == CauseName.COMPUTE
    assert "sm_clock_hertz" not in cause.evidence


def test_a_counter_that_went_back_gives_no_rate() -> None:
    # The agent restarted: error counters start over, which is not minus a million errors.
    nodes = cluster(
        {1: {"ib_rates": {"mlx5_0": {"symbol_errors_total": 0.0}}}},
        {1: {"ib_rates": {"mlx5_0": {"symbol_errors_total": 1000.0}}}},
    )
    assert cause_of(nodes).name == CauseName.COMPUTE


# --- job-level communication slowdown ----------------------------------------------------------


def test_the_nodes_whose_network_stands_out_are_named_worst_first() -> None:
    nodes = cluster({2: {"ib_rates": {"mlx5_0": {"transmit_wait_total": 50 * ROUTINE_WAIT_PER_S}}}})
    job = build_job(slow=(), collective_s={0: 3 * COLLECTIVE_S})
    cause = network_cause(job, nodes)
    assert cause.name == CauseName.NETWORK
    assert cause.nodes == ("node-2", "node-0")  # transmit wait, then bandwidth
    assert cause.detail.startswith(
        "job train communicates slower and 2 of its 4 nodes stand out: "
        "node-2: InfiniBand transmit wait 2.5e+05/s vs 5e+03/s on the others (50x); node-0: bus bandwidth"
    )


def test_where_a_nodes_transport_says_what_is_wrong_nodes_that_only_measure_slower_are_not_named() -> None:
    # A bad link slows its peers' collectives too: node-0's bandwidth and node-2's transmit wait
    # are what node-3's port going down does to them.
    nodes = cluster(
        {
            2: {"ib_rates": {"mlx5_0": {"transmit_wait_total": 50 * ROUTINE_WAIT_PER_S}}},
            3: {"ib": {"mlx5_0": {"state": "DOWN"}}},
        }
    )
    job = build_job(slow=(), collective_s={0: 3 * COLLECTIVE_S})
    cause = network_cause(job, nodes)
    assert (cause.nodes, cause.interfaces) == (("node-3",), (("node-3", "mlx5_0/1"),))
    assert cause.evidence == {"links_down": 1.0}
    assert (
        cause.detail == "job train communicates slower and 1 of its 4 nodes stand out: node-3: mlx5_0/1 down"
    )


def test_no_node_standing_out_is_communication_with_no_node() -> None:
    cause = network_cause(build_job(slow=()), cluster())
    assert cause.name == CauseName.COMMUNICATION
    assert cause.nodes == ()
    assert cause.evidence == pytest.approx(
        {
            "bus_bandwidth_bytes_per_second": COLLECTIVE_BYTES * 2 * (WORLD - 1) / WORLD / COLLECTIVE_S,
            "ib_transmit_wait_per_second": ROUTINE_WAIT_PER_S,
        }
    )


def test_a_one_node_job_has_nothing_to_compare_transmit_wait_with() -> None:
    busy = {0: {"ib_rates": {"mlx5_0": {"transmit_wait_total": 100 * ROUTINE_WAIT_PER_S}}}}
    job = build_job(slow=(), nodes=1)
    assert network_cause(job, cluster(busy, nodes=1)).name == CauseName.COMMUNICATION
    errors = {0: {"ib_rates": {"mlx5_0": {"receive_errors_total": 2.0}}}}
    cause = network_cause(job, cluster(errors, nodes=1))
    assert (cause.name, cause.nodes) == (CauseName.NETWORK, ("node-0",))


def test_network_cause_without_reports_or_collectives() -> None:
    store = JobStore()
    store.ingest("node-0", [rank_report(0, world_size=1, steps=[step(1)])], 1.0, T0)
    cause = network_cause(store.jobs["train"], {})
    assert (cause.name, cause.nodes, cause.evidence) == (CauseName.COMMUNICATION, (), {})


@pytest.mark.parametrize(
    "bad",
    [
        {"sm_clock_below_peers_ratio": 0.0},
        {"sm_clock_below_peers_ratio": 1.5},
        {"cpu_utilization_ratio": 1.2},
        {"memory_available_below_ratio": 0.0},
        {"load_per_cpu_ratio": 0.0},
        {"swap_growth_bytes_per_s": -1.0},
        {"errors_min_per_s": 0.0},
        {"transmit_wait_min_per_s": -1.0},
        {"transmit_wait_above_peers_ratio": 0.5},
        {"bus_bandwidth_below_peers_ratio": 0.0},
        {"compute_window_steps": 0},
    ],
)
def test_settings_out_of_range_are_config_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError) as raised:
        CauseSettings(**bad)  # type: ignore[arg-type]
    assert raised.value.key == f"detection.cause_{next(iter(bad))}"


def test_settings_change_the_thresholds() -> None:
    nodes = cluster({1: {"gpus": {STRAGGLER: {"sm_clock_hertz": 1.88 * GHZ}}}})
    job = build_job()
    assert straggler_cause(job, STRAGGLER, nodes).name == CauseName.COMPUTE
    strict = CauseSettings(sm_clock_below_peers_ratio=0.97)
    assert straggler_cause(job, STRAGGLER, nodes, settings=strict).name == CauseName.GPU_CLOCK
