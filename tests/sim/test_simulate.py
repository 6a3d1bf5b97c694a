"""``clusterwatch simulate``: scenario files, the noise and job models, scoring, and real runs
against a real coordinator."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
from pathlib import Path

import pytest
from helpers import (
    ROOT,
    Cluster,
    Coordinator,
    Process,
    clusterwatch_cmd,
    ranks_of,
    run_cli,
    tls_credentials,
    tls_flags,
    wait_for,
)

from clusterwatch.cli import certs
from clusterwatch.client import ClusterClient
from clusterwatch.errors import ConfigError
from clusterwatch.runtime.cert_terms import Role
from clusterwatch.sim.noise import NoiseModel
from clusterwatch.sim.ranks import JobModel, RankCondition
from clusterwatch.sim.runner import Simulation, resolve_settings
from clusterwatch.sim.scenario import (
    FaultKind,
    NoiseSettings,
    Scenario,
    check_fits,
    load_scenario,
    parse_scenario,
)
from clusterwatch.sim.scoring import IncidentHistory, SeenIncident, overall, score_scenario
from clusterwatch.sim.truth import GroundTruth
from clusterwatch.v1 import cluster_pb2, node_pb2, training_pb2

EXITED = training_pb2.RankState.RANK_STATE_EXITED
RUNNING = training_pb2.RankState.RANK_STATE_RUNNING
UNREACHABLE = cluster_pb2.NodeState.NODE_STATE_UNREACHABLE

STRAGGLER_AND_CRASH = """
description = "rank 1 computes 1.5x slower from step 3; rank 6 is killed at step 40"
seed = 3
step_s = 0.1
[noise]
compute_cv = 0.01
[[fault]]
kind = "compute_straggler"
rank = 1
slowdown_ratio = 1.5
at_step = 3
[[fault]]
kind = "crash"
rank = 6
at_step = 40
"""

NODE_LOSS = """
seed = 4
step_s = 0.1
[[fault]]
kind = "node_loss"
node = 1
at_step = 5
"""


def _scenario(doc: str, name: str = "s") -> Scenario:
    import tomllib

    return parse_scenario(tomllib.loads(doc), source=f"{name}.toml", default_name=name)


# --- scenario files ----------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_scenario_file_parses_with_defaults_from_its_name(tmp_path: Path) -> None:
    path = tmp_path / "straggler_and_crash.toml"
    path.write_text(STRAGGLER_AND_CRASH)
    scenario = load_scenario(path)
    assert scenario.name == "straggler_and_crash"
    assert (scenario.seed, scenario.step_s, scenario.nodes, scenario.duration_s) == (3, 0.1, None, None)
    assert scenario.noise.compute_cv == 0.01
    assert scenario.noise.collective_cv == NoiseSettings().collective_cv
    straggler, crash = scenario.faults
    assert (straggler.kind, straggler.rank, straggler.slowdown_ratio, straggler.at_step) == (
        FaultKind.COMPUTE_STRAGGLER,
        1,
        1.5,
        3,
    )
    assert (crash.kind, crash.rank, crash.signal, crash.index) == (FaultKind.CRASH, 6, 9, 1)
    check_fits(scenario, nodes=2, gpus_per_node=4)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ("bogus = 1", "bogus"),
        ('name = "a b"', "name"),
        ("[noise]\ncompute_cv = -0.1", "noise.compute_cv"),
        ("[noise]\ncolective_cv = 0.1", "noise.colective_cv"),
        ('[[fault]]\nkind = "meteor"\nat_step = 5', "fault[0].kind"),
        ('[[fault]]\nkind = "hang"\nat_step = 5', "fault[0].rank"),
        ('[[fault]]\nkind = "hang"\nrank = 1', "fault[0].at_step"),
        ('[[fault]]\nkind = "hang"\nrank = 1\nat_step = 1', "fault[0].at_step"),
        (
            '[[fault]]\nkind = "compute_straggler"\nrank = 1\nat_step = 5\nslowdown_ratio = 0.9',
            "fault[0].slowdown_ratio",
        ),
        ('[[fault]]\nkind = "compute_straggler"\nrank = 1\nat_step = 5', "fault[0].slowdown_ratio"),
        (
            '[[fault]]\nkind = "thermal_throttle"\nnode = 1\nat_step = 5\nslowdown_ratio = 1.2',
            "fault[0].rank",
        ),
        (
            '[[fault]]\nkind = "thermal_throttle"\nrank = 1\nnode = 0\ngpu = 1\nat_step = 5\nslowdown_ratio = 1.2',
            "fault[0].rank",
        ),
        ('[[fault]]\nkind = "crash"\nrank = 1\nat_step = 5\nsignal = 99', "fault[0].signal"),
        ('[[fault]]\nkind = "node_loss"\nat_step = 5\nrank = 1', "fault[0].rank"),
        (
            '[[fault]]\nkind = "hang"\nrank = 1\nat_step = 5\n[[fault]]\nkind = "node_loss"\nat_step = 5',
            "fault[1].node",
        ),
    ],
)
def test_a_bad_scenario_names_the_key(doc: str, key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _scenario(doc)
    assert raised.value.key == key


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ('[[fault]]\nkind = "hang"\nrank = 16\nat_step = 5', "fault[0].rank"),
        ('[[fault]]\nkind = "node_loss"\nnode = 2\nat_step = 5', "fault[0].node"),
        (
            '[[fault]]\nkind = "thermal_throttle"\nnode = 0\ngpu = 8\nat_step = 5\nslowdown_ratio = 1.2',
            "fault[0].gpu",
        ),
    ],
)
def test_faults_must_fit_the_cluster(doc: str, key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_fits(_scenario(doc), nodes=2, gpus_per_node=8)
    assert raised.value.key == key


@pytest.mark.timeout(10)
def test_cpu_contention_needs_two_nodes() -> None:
    scenario = _scenario('[[fault]]\nkind = "cpu_contention"\nnode = 0\nat_step = 5\nslowdown_ratio = 1.2')
    check_fits(scenario, nodes=2, gpus_per_node=8)
    with pytest.raises(ConfigError) as raised:
        check_fits(scenario, nodes=1, gpus_per_node=8)
    assert raised.value.key == "fault[0].kind"


@pytest.mark.timeout(10)
def test_every_benchmark_scenario_is_valid() -> None:
    paths = sorted((ROOT / "bench" / "scenarios").glob("*.toml"))
    assert len(paths) >= 9
    kinds: set[FaultKind] = set()
    for path in paths:
        scenario = load_scenario(path)
        assert scenario.nodes is not None
        assert scenario.gpus_per_node is not None
        check_fits(scenario, scenario.nodes, scenario.gpus_per_node)
        kinds.update(f.kind for f in scenario.faults)
    assert kinds == set(FaultKind)


# --- the noise and job models -------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cv", [0.01, 0.03])
def test_compute_noise_has_the_scenario_cv_and_is_seeded(cv: float) -> None:
    settings = NoiseSettings(compute_cv=cv, rank_bias_cv=0.0)
    noise = NoiseModel(settings, ranks=2000, seed=7)
    across_ranks = noise.compute_s(0.4)
    assert statistics.fmean(across_ranks) == pytest.approx(0.4, rel=0.01)
    assert statistics.stdev(across_ranks) / statistics.fmean(across_ranks) == pytest.approx(cv, rel=0.1)
    single = NoiseModel(settings, ranks=1, seed=7)
    one_rank = [single.compute_s(0.4)[0] for _ in range(2000)]
    assert statistics.stdev(one_rank) / statistics.fmean(one_rank) == pytest.approx(cv, rel=0.1)
    assert NoiseModel(settings, 2000, seed=7).compute_s(0.4) == across_ranks
    assert NoiseModel(settings, 2000, seed=8).compute_s(0.4) != across_ranks


@pytest.mark.timeout(10)
def test_drift_is_slow_and_common() -> None:
    noise = NoiseModel(NoiseSettings(drift_amplitude_ratio=0.02, drift_period_s=300.0), ranks=4, seed=1)
    values = [noise.drift(t) for t in range(0, 300, 5)]
    assert max(values) - min(values) == pytest.approx(0.04, abs=0.002)
    assert max(abs(a - b) for a, b in itertools.pairwise(values)) < 0.003


def _job(doc: str, nodes: int = 2, gpus: int = 4) -> JobModel:
    scenario = _scenario(doc)
    node_ids = [f"n{j}" for j in range(nodes)]
    uuids = [[f"GPU-{j}-{g}" for g in range(gpus)] for j in range(nodes)]
    return JobModel("job", node_ids, gpus, 0.1, scenario, start_unix_s=1000.0, gpu_uuids=uuids)


@pytest.mark.timeout(10)
def test_synchronous_steps_the_straggler_waits_least() -> None:
    job = _job(STRAGGLER_AND_CRASH)
    job.advance(1003.0)
    reports = [r for node in range(2) for r in job.node_ranks(node, 1003.0).reports]
    assert [r.identity.rank for r in reports] == list(range(8))
    by_rank = {r.identity.rank: r for r in reports}
    last = {rank: r.steps[-1] for rank, r in by_rank.items()}
    assert len({s.step for s in last.values()}) == 1
    others = [s for rank, s in last.items() if rank != 1]
    assert last[1].compute_seconds / statistics.median(s.compute_seconds for s in others) == pytest.approx(
        1.5, rel=0.05
    )
    assert last[1].communication_seconds < min(s.communication_seconds for s in others)
    for s in last.values():  # everyone leaves the collective together
        assert s.step_seconds == pytest.approx(last[1].step_seconds, abs=0.005)
        assert s.compute_seconds + s.communication_seconds == pytest.approx(s.step_seconds)
    summary = by_rank[0].collectives[0]
    assert (summary.op, summary.count) == ("all_reduce", len(by_rank[0].steps))
    assert summary.bus_bandwidth_bytes_per_second > 0
    assert sum(summary.duration_bucket_counts) == summary.count
    beat = by_rank[0].heartbeat
    assert beat.flight_recorder[0].last_completed_collective == last[0].step


@pytest.mark.timeout(10)
def test_a_step_is_reported_by_every_rank_once_the_last_node_sent_it() -> None:
    job = _job(STRAGGLER_AND_CRASH)
    job.advance(1001.0)
    newest = job.last_step_done()
    assert newest > 5
    job.node_ranks(0, 1001.0)
    assert job.reported_by_every_rank() == 0  # node 1 has not reported
    assert job.reported_by_every_rank(lost_nodes={1}) == newest  # unless it is lost
    job.node_ranks(1, 1001.0)
    assert job.reported_by_every_rank() == newest
    job.advance(1002.0)
    job.node_ranks(1, 1002.0)
    assert job.reported_by_every_rank() == newest  # node 0 is behind now


class _Outbox:
    """Stands in for a node's stream: keeps what the loop submits."""

    def __init__(self) -> None:
        self.sent_unix_s: list[float] = []

    def submit(self, report: node_pb2.NodeReport) -> None:
        self.sent_unix_s.append(report.timestamp_unix_seconds)

    def silence(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_a_simulator_that_falls_behind_still_reports_every_node_each_interval() -> None:
    # Every read of this clock costs 0.07 s, so the loop is always behind by more
    # than a slot (0.1 s): slots are late every time. A slot left out would leave
    # its nodes silent for intervals on end (unreachable, to the coordinator).
    now = [0.0]

    def slow_clock() -> float:
        now[0] += 0.07
        return now[0]

    settings = resolve_settings(
        _scenario("seed = 2\nstep_s = 0.5"),
        coordinator="127.0.0.1:1",
        nodes=20,
        gpus_per_node=2,
        interval_s=1.0,
        duration_s=30.0,
    )
    simulation = Simulation(settings, clock=slow_clock, wall_clock=lambda: 1000.0)
    outboxes = [_Outbox() for _ in range(settings.nodes)]
    simulation.streams = outboxes  # type: ignore[assignment]
    asyncio.run(simulation._loop(asyncio.Event()))
    assert simulation.late_slots > 0
    for outbox in outboxes:
        gaps = [b - a for a, b in itertools.pairwise([1000.0, *outbox.sent_unix_s])]
        assert max(gaps) < 1.5, gaps  # one interval, plus a slot or two of lag


@pytest.mark.timeout(10)
def test_hang_leaves_the_culprit_behind_in_its_group_with_heartbeats_going_on() -> None:
    job = _job('seed = 1\n[[fault]]\nkind = "hang"\nrank = 5\nat_step = 4')
    job.advance(1002.0)
    assert job.stalled_at_step == 4
    onset = job.onsets[0]
    assert onset.step == 4
    for now in (1002.0, 1003.0):
        job.advance(now)
        ranks = {r.identity.rank: r for node in range(2) for r in job.node_ranks(node, now).reports}
        assert all(r.state == RUNNING for r in ranks.values())
        assert all(r.heartbeat.timestamp_unix_seconds == now for r in ranks.values())
        enqueued = {
            rank: r.heartbeat.flight_recorder[0].last_enqueued_collective for rank, r in ranks.items()
        }
        assert enqueued.pop(5) == 3
        assert set(enqueued.values()) == {4}
        assert not ranks[5].heartbeat.HasField("collective")
        assert ranks[0].heartbeat.collective.sequence == 4
        assert ranks[0].heartbeat.collective.elapsed_seconds > 0
    assert job.condition(5, 1003.0) is RankCondition.HUNG
    assert job.condition(0, 1003.0) is RankCondition.WAITING  # in the stuck all-reduce for > 2 steps


@pytest.mark.timeout(10)
def test_frozen_heartbeat_stops_and_crash_exits_once() -> None:
    frozen = _job('[[fault]]\nkind = "frozen"\nrank = 2\nat_step = 3')
    frozen.advance(1001.0)
    beats = []
    for now in (1001.0, 1002.0):
        (report,) = [r for r in frozen.node_ranks(0, now).reports if r.identity.rank == 2]
        beats.append(report.heartbeat.timestamp_unix_seconds)
    assert beats[0] == beats[1] == frozen.stop_events_s[2] < 1001.0

    crash = _job('[[fault]]\nkind = "crash"\nrank = 6\nat_step = 3\nsignal = 9')
    crash.advance(1001.0)
    (report,) = [r for r in crash.node_ranks(1, 1001.0).reports if r.identity.rank == 6]
    assert report.state == EXITED
    assert (report.exit.signal, report.exit.clean, report.exit.HasField("exit_code")) == (9, False, False)
    assert "SIGKILL" in report.exit.description
    assert 6 not in [r.identity.rank for r in crash.node_ranks(1, 1002.0).reports]


# --- scoring ------------------------------------------------------------------------------------


def _incident(
    id_: str,
    kind: str,
    cause: str,
    opened: float,
    *,
    ranks: tuple[int, ...] = (),
    nodes: tuple[str, ...] = (),
    job: str = "j",
) -> IncidentHistory:
    history = IncidentHistory()
    history.add(opened, SeenIncident(id_, kind, cause, job, ranks, nodes, opened))
    return history


@pytest.mark.timeout(10)
def test_the_ground_truth_keeps_step_ends_exact(tmp_path: Path) -> None:
    # A straggler's onset is its own end of the step before, here 10 us after
    # the first rank's: the steps done by then must still count that step.
    truth = GroundTruth(
        scenario="s",
        job="j",
        nodes=["n0"],
        gpus_per_node=8,
        world_size=8,
        step_s=0.5,
        interval_s=1.0,
        compute_cv=0.03,
        seed=1,
        started_unix_s=1000.0,
        faults=[],
        step_ends_unix_s=[1000.50006],
        step_reported_unix_s=[1001.00006],
    )
    truth.write(tmp_path / "truth.json")
    read = GroundTruth.read(tmp_path / "truth.json")
    assert read.steps_done_by(1000.50007) == 1
    assert read.step_reported_unix_s == [1001.00006]


@pytest.mark.timeout(10)
def test_scoring_matches_incidents_to_the_ground_truth() -> None:
    truth = GroundTruth.from_json(
        {
            "scenario": "s",
            "job": "j",
            "nodes": ["n0", "n1"],
            "gpus_per_node": 4,
            "world_size": 8,
            "step_s": 1.0,
            "interval_s": 1.0,
            "compute_cv": 0.02,
            "seed": 1,
            "started_unix_s": 100.0,
            "ended_unix_s": 200.0,
            "step_ends_unix_s": [101.0 + i for i in range(19)],  # the job stops in step 20
            "faults": [
                {
                    "index": 0,
                    "kind": "crash",
                    "at_step": 20,
                    "ranks": [6],
                    "nodes": ["n1"],
                    "gpus": ["GPU-6"],
                    "expected_kind": "rank_failure",
                    "expected_cause": "process_exited",
                    "onset_unix_s": 120.5,
                    "onset_step": 20,
                    "signal": 9,
                }
            ],
        }
    )
    histories = [
        _incident("early", "straggler", "compute", 110.0, ranks=(6,), nodes=("n1",)),  # before the onset: FP
        _incident("fail", "rank_failure", "process_exited", 121.0, ranks=(6,), nodes=("n1",)),
        _incident("hang", "hang", "exited", 127.0, ranks=(6,), nodes=("n1",)),  # a consequence: TP
        _incident("other-job", "hang", "exited", 127.0, ranks=(6,), job="k"),  # not this run's
        _incident("late", "rank_failure", "process_exited", 201.5, ranks=(0,)),  # teardown
    ]
    # Updates: the failure's cause is refined while the run lasts; the hang names
    # every rank once the teardown exits them (after the end: not judged).
    histories[1].add(125.0, SeenIncident("fail", "rank_failure", "exited_clean", "j", (6,), ("n1",), 121.0))
    histories[2].add(205.0, SeenIncident("hang", "hang", "exited", "j", tuple(range(8)), ("n0", "n1"), 127.0))
    score = score_scenario(truth, histories)
    assert [i.id for i in score.incidents] == ["early", "fail", "hang"]
    assert [i.id for i in score.false_positives] == ["early"]
    assert score.after_end == 1
    (fault,) = score.faults
    assert fault.detected_by is not None
    assert fault.detected_by.id == "fail"
    assert fault.latency_s == pytest.approx(0.5)
    assert fault.latency_steps == 0
    assert (fault.culprit_ok, fault.cause_ok) == (True, True)  # as it opened
    assert fault.final is not None
    assert (fault.final.cause, fault.cause_ok_final) == ("exited_clean", False)
    assert [i.ranks for i in score.incidents if i.id == "hang"] == [(6,)]
    assert score.precision == pytest.approx(2 / 3)
    assert score.recall == 1.0
    total = overall([score])
    assert (total.incidents, total.false_positives, total.detected, total.faults) == (3, 1, 1, 1)


# --- real runs against a real coordinator -------------------------------------------------------


def _simulate(cluster: Cluster, coordinator: Coordinator, scenario: Path, *args: str) -> Process:
    argv = clusterwatch_cmd(
        "simulate", "--coordinator", coordinator.address, "--scenario", str(scenario), *args
    )
    process = Process(argv, cluster.tmp_path / f"simulate-{scenario.stem}.log")
    cluster.processes.append(process)
    return process.start()


@pytest.mark.timeout(60)
def test_simulated_job_streams_to_a_real_coordinator(cluster: Cluster, tmp_path: Path) -> None:
    coordinator = cluster.coordinator()
    straggler_file = tmp_path / "straggler_crash.toml"
    straggler_file.write_text(STRAGGLER_AND_CRASH)
    loss_file = tmp_path / "loss.toml"
    loss_file.write_text(NODE_LOSS)
    truth_path = tmp_path / "truth.json"
    job = _simulate(
        cluster,
        coordinator,
        straggler_file,
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--duration-s",
        "7",
        "--interval-s",
        "0.25",
        "--job",
        "simjob",
        "--ground-truth-out",
        str(truth_path),
    )
    loss = _simulate(
        cluster,
        coordinator,
        loss_file,
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--duration-s",
        "7",
        "--interval-s",
        "0.2",
        "--job",
        "lossjob",
        "--node-prefix",
        "lossy-",
    )

    def straggling() -> dict[int, cluster_pb2.RankStatus] | None:
        ranks = ranks_of(coordinator, "simjob")
        if len(ranks) == 8 and all(r.last_step.step >= 10 for r in ranks.values()):
            return ranks
        return None

    ranks = wait_for(straggling, 30, "8 ranks of simjob past step 10")
    assert {r.node_id for r in ranks.values()} == {"simjob-node-0", "simjob-node-1"}
    others = statistics.median(r.last_step.compute_seconds for rank, r in ranks.items() if rank != 1)
    assert ranks[1].last_step.compute_seconds / others == pytest.approx(1.5, rel=0.06)
    assert ranks[1].last_step.communication_seconds < ranks[0].last_step.communication_seconds
    assert ranks[0].identity.gpu_uuid.startswith("GPU-")
    assert ranks[0].heartbeat.flight_recorder[0].group_name == "0"
    node = coordinator.node("simjob-node-0")
    assert node is not None
    assert ranks[0].identity.gpu_uuid in [g.uuid for g in node.report.gpus]
    assert node.report.ib_ports
    assert node.report.host.cpu_count > 0

    def crashed() -> cluster_pb2.RankStatus | None:
        rank = ranks_of(coordinator, "simjob").get(6)
        return rank if rank is not None and rank.state == EXITED else None

    rank6 = wait_for(crashed, 30, "rank 6 of simjob exited")
    assert (rank6.exit.signal, rank6.exit.clean) == (9, False)
    assert all(r.state == RUNNING for rank, r in ranks_of(coordinator, "simjob").items() if rank != 6)

    def lost() -> bool:
        node = coordinator.node("lossy-1")
        return node is not None and node.state == UNREACHABLE

    wait_for(lost, 30, "lossy-1 unreachable")
    lossy0 = coordinator.node("lossy-0")
    assert lossy0 is not None
    assert lossy0.state != UNREACHABLE

    assert job.wait(timeout_s=30) == 0
    assert loss.wait(timeout_s=30) == 0
    truth = json.loads(truth_path.read_text())
    straggler, crash = truth["faults"]
    assert (straggler["onset_step"], straggler["ranks"], straggler["expected_kind"]) == (3, [1], "straggler")
    assert (crash["onset_step"], crash["nodes"], crash["expected_cause"]) == (
        40,
        ["simjob-node-1"],
        "process_exited",
    )
    assert truth["started_unix_s"] < straggler["onset_unix_s"] < crash["onset_unix_s"] < truth["ended_unix_s"]
    assert len(truth["step_ends_unix_s"]) == 39  # the job stops in step 40
    # Every rank reported each of them, after it ended (rank 6 only up to its crash).
    reported = truth["step_reported_unix_s"]
    assert len(reported) == 39
    assert reported == sorted(reported)
    assert all(sent >= ended for sent, ended in zip(reported, truth["step_ends_unix_s"], strict=True))
    assert truth["stats"]["reports_total"] > 0
    assert not math.isnan(truth["stats"]["cpu_s"])


@pytest.mark.timeout(30)
def test_a_bad_scenario_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[fault]]\nkind = "crash"\nrank = 99\nat_step = 5\n')
    result = run_cli(
        "simulate",
        "--coordinator",
        "127.0.0.1:1",
        "--scenario",
        str(path),
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "fault[0].rank" in line
    assert str(path) in line
    missing = run_cli("simulate", "--coordinator", "127.0.0.1:1", "--scenario", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2
    assert "scenario" in missing.stderr
    usage = run_cli("simulate", "--help")
    assert usage.returncode == 0
    assert "usage: clusterwatch simulate" in usage.stdout


@pytest.mark.timeout(60)
def test_simulated_nodes_report_over_mutual_tls_each_with_its_own_certificate(
    cluster: Cluster, tmp_path: Path
) -> None:
    pki = tmp_path / "pki"
    certs.create_ca(pki)
    certs.issue(pki, "coordinator", role=Role.COORDINATOR, extra_sans=["127.0.0.1"])
    for node in ("tls-0", "tls-1"):
        certs.issue(pki, node, role=Role.NODE)
    certs.issue(pki, "reader", role=Role.USER)
    coordinator = cluster.coordinator(*tls_flags(pki))
    scenario = tmp_path / "quiet.toml"
    scenario.write_text('name = "quiet"\n')
    tls = ["--no-insecure", "--tls-cert", str(pki / "{node}.crt"), "--tls-key", str(pki / "{node}.key")]
    tls += ["--tls-ca", str(pki / "ca.crt")]
    _simulate(
        cluster, coordinator, scenario, "--nodes", "2", "--gpus-per-node", "2", "--node-prefix", "tls-",
        "--duration-s", "30", "--interval-s", "0.25", *tls,
    )  # fmt: skip
    reader = ClusterClient(
        coordinator.address,
        timeout_s=10,
        credentials=tls_credentials(pki, "reader"),
    )
    with reader:
        wait_for(
            lambda: (
                {n.node_id for n in reader.snapshot(summary_only=True).nodes} == {"tls-0", "tls-1"} or None
            ),
            30,
            "both simulated nodes reporting over TLS",
        )
    # A node whose certificate is missing stops the run before it starts, naming the file.
    missing = run_cli(
        "simulate", "--coordinator", coordinator.address, "--scenario", str(scenario), "--nodes", "3",
        "--node-prefix", "tls-", *tls,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "tls-2.crt" in missing.stderr
    # Neither TLS nor --insecure: refused, as every command is.
    neither = run_cli(
        "simulate", "--coordinator", coordinator.address, "--scenario", str(scenario), "--nodes", "1",
        "--no-insecure",
    )  # fmt: skip
    assert neither.returncode == 2
    assert "agent.tls_cert: TLS is required" in neither.stderr
