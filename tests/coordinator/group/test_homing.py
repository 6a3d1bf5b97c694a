"""Agents report to their node's home among a group of coordinators, follow redirects, and re-home
when a coordinator dies, losing no report; a job is judged by its owner alone (issue 21, items 1 and 2).

Real coordinators (in-process, and one a subprocess for SIGKILL), a real etcd, real agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from etcd_server import EtcdServer
from helpers import Coordinator, clusterwatch_cmd, eventually, group_settings, run_cli, sim_agent_settings
from training_builders import AgentStream, rank_report, step

from clusterwatch.agent.runtime import Agent
from clusterwatch.coordinator.group.homing import Homing
from clusterwatch.coordinator.group.membership import Member, Membership
from clusterwatch.coordinator.model.state import NodeState
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.errors import MovedError
from clusterwatch.runtime.etcd import Etcd
from clusterwatch.v1 import cluster_pb2, node_pb2, training_pb2
from clusterwatch.wire.grpc_status import home_address
from clusterwatch.wire.placement import job_owner, node_home

pytestmark = pytest.mark.timeout(120)

NODES = [f"node-{i}" for i in range(6)]
STEPS = [step(n) for n in range(1, 4)]


def named_owned_by(shard_id: str, shards: list[str], prefix: str) -> str:
    """A job name ``job_owner`` gives to ``shard_id`` among ``shards``."""
    return next(f"{prefix}-{i}" for i in range(1000) if job_owner(f"{prefix}-{i}", shards) == shard_id)


async def start_agents(
    address: str, nodes: list[str]
) -> tuple[dict[str, Agent], asyncio.Event, list[asyncio.Task[None]]]:
    agents = {node: Agent(sim_agent_settings(0, node, coordinator=address)) for node in nodes}
    stop = asyncio.Event()
    return agents, stop, [asyncio.create_task(agent.run(stop)) for agent in agents.values()]


@contextlib.asynccontextmanager
async def two_coordinators_and_agents(
    tmp_path: Path, etcd: EtcdServer, prefix: str, *, agents: bool = True
) -> AsyncIterator[tuple[dict[str, CoordinatorServer], dict[str, Agent]]]:
    """c1 and c2 in a group, and (unless not ``agents``) an agent for each of NODES pointed at c1 alone."""
    servers = {
        shard: CoordinatorServer(group_settings(tmp_path, etcd.endpoint, prefix, shard))
        for shard in ("c1", "c2")
    }
    for server in servers.values():
        await server.start()
    started, stop, running = await start_agents(
        f"127.0.0.1:{servers['c1'].grpc_port}", NODES if agents else []
    )
    try:
        yield servers, started
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        for server in servers.values():
            await server.stop()


async def test_agents_report_to_their_nodes_home_whichever_coordinator_they_are_pointed_at(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    async with two_coordinators_and_agents(tmp_path, etcd, etcd_prefix) as (servers, agents):
        await eventually(
            lambda: all(len(s.membership.members) == 2 for s in servers.values() if s.membership),
            30,
            "both in the group",
        )
        homes = {node: node_home(node, {}, ["c1", "c2"]) for node in NODES}
        assert set(homes.values()) == {"c1", "c2"}, "the test needs nodes homed on both"

        def placed() -> bool:
            return all(
                set(s.core.sessions) == {n for n, h in homes.items() if h == shard}
                for shard, s in servers.items()
            )

        await eventually(placed, 30, f"every node at its home: {homes}")
        for node, home in homes.items():
            assert agents[node].uplink.target == f"127.0.0.1:{servers[home].grpc_port}"
            other = servers["c2" if home == "c1" else "c1"]
            assert node not in other.core.state.nodes  # sent on at its hello: no state, no verdict there
        # Sent on before they joined: c1's history does not mention c2's nodes at all.
        assert not {e.node_id for e in servers["c1"].core.event_log.events()} & {
            n for n, h in homes.items() if h == "c2"
        }
        assert all(agent.buffer.dropped_total == 0 for agent in agents.values())


async def test_a_node_whose_jobs_change_moves_with_its_reports_acknowledged(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """Its stream ends at the first report homed elsewhere, after the ack of every report before it (a
    replay of those would send it back), and the old home forgets it without a verdict."""
    async with two_coordinators_and_agents(tmp_path, etcd, etcd_prefix, agents=False) as (servers, _):
        await eventually(
            lambda: all(len(s.membership.members) == 2 for s in servers.values() if s.membership),
            30,
            "both in the group",
        )
        here, there = named_owned_by("c1", ["c1", "c2"], "first"), named_owned_by("c2", ["c1", "c2"], "then")
        # Its hello names no job (AgentStream's does not): it is homed by its name at first, on c1.
        node = next(f"node-x{i}" for i in range(100) if node_home(f"node-x{i}", {}, ["c1", "c2"]) == "c1")
        async with AgentStream(f"127.0.0.1:{servers['c1'].grpc_port}", node) as stream:
            applied = await stream.report(rank_report(0, job=here, steps=STEPS))
            await stream.report(rank_report(0, job=there, steps=STEPS))
            ended = await eventually(stream.ended_with, 30, "the stream to end")
            assert ended.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert home_address(ended.trailing_metadata()) == f"127.0.0.1:{servers['c2'].grpc_port}"
            assert [m.ack.sequence for m in stream.of_kind("ack")][-1] == applied
        assert node not in servers["c1"].core.state.nodes
        assert [e.kind for e in servers["c1"].core.event_log.events() if e.node_id == node] == [
            "node_joined",
            "node_moved",
        ]
        assert not servers["c1"].core.jobs.jobs[here].ranks  # no rank of that node is left here


async def test_a_killed_coordinators_agents_re_home_and_lose_no_report(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    survivor = CoordinatorServer(group_settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"))
    await survivor.start()
    state = tmp_path / "c2"
    state.mkdir()
    doomed = Coordinator(
        argv=clusterwatch_cmd(
            "coordinator", "--insecure", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--state-dir", str(state),
            "--ready-file", str(state / "ready"), "--etcd", etcd.endpoint, "--etcd-prefix", etcd_prefix, "--shard-id", "c2", "--advertise", "127.0.0.1:0",
        ),
        log_path=tmp_path / "c2.log",
        ready_file=state / "ready",
    )  # fmt: skip
    await asyncio.to_thread(doomed.start)
    # Pointed at the coordinator that will die: they learn of the other from their streams.
    agents, stop, running = await start_agents(doomed.address, NODES)
    try:
        homed_at_c2 = {n for n in NODES if node_home(n, {}, ["c1", "c2"]) == "c2"}
        await eventually(
            lambda: (
                set(survivor.core.sessions) == set(NODES) - homed_at_c2
                and all(agents[n].uplink.connected for n in homed_at_c2)
            ),
            60,
            "every node at its home",
        )
        assert homed_at_c2, "the test needs nodes homed on the coordinator it kills"
        killed_at = time.monotonic()
        doomed.signal(signal.SIGKILL)
        await eventually(lambda: set(survivor.core.sessions) == set(NODES), 60, "every agent re-homed on c1")
        print(f"re-homed {len(homed_at_c2)} agents {time.monotonic() - killed_at:.1f} s after SIGKILL")
        # Let the survivor apply a few reports more; then nothing the agents collected is missing.
        await eventually(
            lambda: all(not agent.buffer for agent in agents.values()), 30, "every report acknowledged"
        )
        for node in NODES:
            record = survivor.core.state.nodes[node]
            assert record.state == NodeState.NODE_STATE_UP
            assert record.reports_missed_total == 0, node
            assert agents[node].buffer.dropped_total == 0
        assert not [e for e in survivor.core.event_log.events() if e.kind == "node_unreachable"]
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        doomed.kill()
        await survivor.stop()


def report_with_ranks(jobs: dict[str, int]) -> node_pb2.NodeReport:
    report = node_pb2.NodeReport(sequence=1)
    for job, count in jobs.items():
        for rank in range(count):
            report.ranks.add(identity=training_pb2.RankIdentity(job=job, rank=rank, world_size=count))
    return report


async def test_a_job_is_judged_by_its_owner_alone(etcd: EtcdServer, etcd_prefix: str) -> None:
    async with Etcd(etcd.endpoint) as client:
        groups = {s: Membership(client, etcd_prefix, Member(s, f"{s}.example:50051")) for s in ("c1", "c2")}
        for group in groups.values():
            await group.join()
        runs = [asyncio.create_task(group.run()) for group in groups.values()]
        try:
            await eventually(
                lambda: all(len(g.members) == 2 for g in groups.values()), 30, "both in the group"
            )
            homing = {shard: Homing(group) for shard, group in groups.items()}
            mine, theirs = (
                named_owned_by("c1", ["c1", "c2"], "big"),
                named_owned_by("c2", ["c1", "c2"], "small"),
            )
            # Node shared by two jobs: homed with its primary (most ranks), owned by c1.
            report = report_with_ranks({mine: 3, theirs: 1})
            with pytest.raises(MovedError, match="reports to coordinator c1") as moved:
                homing["c2"].check("node-x", report)
            assert moved.value.home_address == "c1.example:50051"
            assert len(report.ranks) == 4  # nothing kept, nothing taken: the agent replays it at c1
            homing["c1"].check("node-x", report)
            assert {r.identity.job for r in report.ranks} == {mine}  # c2 owns the other: not judged here
            assert homing["c1"].elsewhere(theirs) == "c2"
            assert homing["c1"].elsewhere(mine) is None
            assert list(homing["c1"].group_message().addresses) == ["c1.example:50051", "c2.example:50051"]
            # Alone in its group, a coordinator keeps everything.
            await groups["c1"].leave()
            await eventually(lambda: len(groups["c2"].members) == 1, 30, "c1 gone")
            alone = report_with_ranks({mine: 3, theirs: 1})
            homing["c2"].check("node-x", alone)
            assert len(alone.ranks) == 4
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)


async def test_jobs_that_move_to_a_joining_coordinator_are_let_go(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    first = CoordinatorServer(group_settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"))
    await first.start()
    joining = CoordinatorServer(group_settings(tmp_path, etcd.endpoint, etcd_prefix, "c2"))
    try:
        staying = named_owned_by("c1", ["c1", "c2"], "stays")
        leaving = named_owned_by("c2", ["c1", "c2"], "leaves")
        for job in (staying, leaving):
            first.core.begin_job(job, {}, ["node-0"])
        await joining.start()
        await eventually(lambda: leaving not in first.core.jobs.jobs, 30, f"{leaving} let go by c1")
        assert staying in first.core.jobs.jobs
        # Let go, not ended: reports of it later (it may come back) are not refused as a job that ended.
        assert leaving not in first.core.jobs.ended
    finally:
        await joining.stop()
        await first.stop()


async def test_a_drained_coordinator_hands_every_node_and_job_to_the_others_and_takes_them_back(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    group = ("--etcd", etcd.endpoint, "--etcd-prefix", etcd_prefix, "--insecure")
    async with two_coordinators_and_agents(tmp_path, etcd, etcd_prefix) as (servers, _agents):
        homed_at_c2 = {n for n in NODES if node_home(n, {}, ["c1", "c2"]) == "c2"}
        await eventually(lambda: set(servers["c2"].core.sessions) == homed_at_c2, 30, "nodes at their homes")
        job = named_owned_by("c2", ["c1", "c2"], "drained")
        servers["c2"].core.begin_job(job, {}, [])
        drained = await asyncio.to_thread(
            run_cli, "coordinator", "drain", "--shard-id", "c2", *group, timeout_s=90
        )
        assert drained.returncode == 0, drained.stderr
        assert "coordinator c2 holds no node and no job" in drained.stdout
        await eventually(lambda: set(servers["c1"].core.sessions) == set(NODES), 30, "every node at c1")
        assert job not in servers["c2"].core.jobs.jobs
        assert servers["c2"].membership is not None
        assert servers["c2"].membership.draining
        undone = await asyncio.to_thread(
            run_cli, "coordinator", "drain", "--undo", "--shard-id", "c2", *group, timeout_s=60
        )
        assert undone.returncode == 0, undone.stderr
        await eventually(lambda: set(servers["c2"].core.sessions) == homed_at_c2, 30, "c2's nodes back")
        assert not servers["c2"].membership.draining
        unknown = await asyncio.to_thread(
            run_cli, "coordinator", "drain", "--shard-id", "c9", *group, timeout_s=60
        )
        assert unknown.returncode == 1
        assert "no live coordinator 'c9' in etcd" in unknown.stderr
        no_etcd = await asyncio.to_thread(run_cli, "coordinator", "drain", "--shard-id", "c2", "--insecure")
        assert no_etcd.returncode == 2
        assert "coordinator.etcd" in no_etcd.stderr


async def test_a_coordinator_that_was_alone_keeps_what_it_is_doing_when_another_joins(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """Alone it owned every job: a joiner takes some, and the jobs it keeps are not adopted again, which
    would record its own action under way as interrupted and give its incident to a person."""
    first = CoordinatorServer(group_settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"))
    await first.start()
    joining = CoordinatorServer(group_settings(tmp_path, etcd.endpoint, etcd_prefix, "c2"))
    try:
        job = named_owned_by("c1", ["c1", "c2"], "acting")
        under_way = cluster_pb2.ActionRecord(
            id="restart-1", job=job, action="restart", outcome="pending", decided_unix_seconds=time.time()
        )
        first.core.event_log.save_action(under_way)
        assert first.group is not None
        assert first.membership is not None
        await first.group.job_state.write_now(job)  # as recovery does before it acts
        generation = first.membership.generation
        await joining.start()
        await eventually(lambda: first.membership.generation > generation, 30, "c1 to see c2 join")
        await eventually(
            lambda: joining.group is not None and joining.group.job_state.writes_total >= 0, 30, "c2"
        )
        (record,) = first.core.event_log.actions(job=job)
        assert record.outcome == "pending"
    finally:
        await joining.stop()
        await first.stop()
