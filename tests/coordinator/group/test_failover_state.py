"""A job whose owner is SIGKILLed while it restarts the job continues on its new owner: the hang
incident, the action record and the restart budget carry over through etcd, and the interrupted
restart is not done again: the workers are stopped once (issue 21, item 2).

A real etcd, a real coordinator process that is killed, a real in-process one that takes over, and a
raw agent stream that never answers the stop command (the restart is in flight when the kill comes).
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from etcd_server import EtcdServer
from helpers import ADMIN_TOKEN_FILE, Coordinator, clusterwatch_cmd, eventually, group_settings
from training_builders import AgentStream, rank_report, step

from clusterwatch.client import ClusterClient
from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.model.incidents import IncidentState
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.v1 import agent_pb2
from clusterwatch.wire.placement import job_owner

pytestmark = pytest.mark.timeout(180)

SHARDS = ["c1", "c2"]
JOB = next(f"hung-{i}" for i in range(1000) if job_owner(f"hung-{i}", SHARDS) == "c2")
STEPS = [step(n) for n in range(1, 6)]


def stops(stream: AgentStream) -> list[agent_pb2.Command]:
    return [m.command for m in stream.of_kind("command") if m.command.WhichOneof("action") == "stop_workers"]


async def hang_on(stream: AgentStream, until: asyncio.Event) -> None:
    """Report the job's two ranks: steps at first, then the same heartbeat over and over (a hang)."""
    await stream.report(rank_report(0, job=JOB, steps=STEPS), rank_report(1, job=JOB, steps=STEPS))
    while not until.is_set():
        await stream.report(rank_report(0, job=JOB), rank_report(1, job=JOB))
        await asyncio.sleep(0.2)


async def test_a_restart_in_flight_when_its_owner_dies_continues_on_the_new_owner_and_is_not_redone(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    group = ("--etcd", etcd.endpoint, "--etcd-prefix", etcd_prefix, "--advertise", "127.0.0.1:0")
    state = tmp_path / "c2"
    state.mkdir()
    doomed = Coordinator(
        argv=clusterwatch_cmd(
            "coordinator", "--insecure", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--state-dir", str(state),
            "--ready-file", str(state / "ready"), "--shard-id", "c2", *group, "--hang-floor-s", "2",
            "--admin-token-file", str(ADMIN_TOKEN_FILE),
        ),
        log_path=tmp_path / "c2.log",
        ready_file=state / "ready",
    )  # fmt: skip
    survivor = CoordinatorServer(
        group_settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"),
        DetectionSettings(hang_floor_s=2),
    )
    await survivor.start()
    await asyncio.to_thread(doomed.start)
    done = asyncio.Event()
    try:
        await eventually(
            lambda: survivor.membership and len(survivor.membership.members) == 2, 30, "c2 joined"
        )
        async with AgentStream(
            doomed.address, "node-j", answer_commands=False, ranks_by_job={JOB: 2}
        ) as first:
            reporting = asyncio.create_task(hang_on(first, done))
            await first.wait_for(
                lambda m: (
                    m.WhichOneof("kind") == "command" and m.command.WhichOneof("action") == "stop_workers"
                ),
                60,
                "the restart's stop",
            )
            (stop,) = stops(first)
            assert stop.stop_workers.job == JOB

            def pending() -> str | None:
                with ClusterClient(doomed.address, timeout_s=10) as client:
                    actions = client.actions(job=JOB)
                return next((a.incident_id for a in actions if a.outcome == "pending"), None)

            incident_id = await eventually(pending, 30, "c2's restart to be in flight")
            doomed.signal(signal.SIGKILL)
            done.set()
            await asyncio.gather(reporting, return_exceptions=True)

        # c1 adopts the job from etcd once c2's lease has run out.
        def adopted() -> bool:
            incident = survivor.watchdog.book.get(incident_id)
            return incident is not None and incident.state == IncidentState.ACKNOWLEDGED

        await eventually(adopted, 60, "c1 to hold the hang incident, given to a person")
        (action,) = survivor.core.event_log.actions(job=JOB)
        assert action.outcome == "failed"
        assert "interrupted" in action.detail
        assert survivor.recovery.policy.restarts_in_last_hour(JOB, time.time()) == 1
        # The agent re-homes to c1 and the job is still hung: c1 does not stop its workers again.
        done.clear()
        survivor_address = f"127.0.0.1:{survivor.grpc_port}"
        async with AgentStream(
            survivor_address, "node-j", answer_commands=False, ranks_by_job={JOB: 2}
        ) as second:
            reporting = asyncio.create_task(hang_on(second, done))
            rounds = survivor.watchdog.counts().rounds
            await eventually(
                lambda: survivor.watchdog.counts().rounds >= rounds + 20, 60, "20 detection rounds"
            )
            live = [i for i in survivor.watchdog.book.live() if i.job == JOB]
            assert [i.id for i in live] == [incident_id]  # the same incident, not a second one
            assert not stops(second)
            done.set()
            await asyncio.gather(reporting, return_exceptions=True)
        assert len(stops(first)) == 1
    finally:
        done.set()
        doomed.kill()
        await survivor.stop()
