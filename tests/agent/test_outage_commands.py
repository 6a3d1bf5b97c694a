"""Nothing done twice: the agent carries out a command id once, and a restarted coordinator does not
redo (or re-decide) what the previous one had started.

The agent side runs the real CommandHandler against real worker processes (see test_workers.py);
the coordinator side the real Watchdog and Recovery over a real SQLite database, with a launcher
that only records what it is asked (the launcher is the boundary to torchrun, SLURM or Kubernetes).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from test_workers import Processes, alive, identity, outcomes, processes, registry, stop_command
from training_builders import poll_until, rank_report, step

from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.process_instance import ProcessInstance
from clusterwatch.config import DetectionSettings, RecoverySettings
from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind, Severity
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.recovery.executor import Recovery
from clusterwatch.coordinator.recovery.launchers import LaunchOutcome
from clusterwatch.v1 import agent_pb2, cluster_pb2

FENCED = agent_pb2.CommandResult.Status.STATUS_FENCED

pytestmark = pytest.mark.timeout(60)

OK = agent_pb2.CommandResult.Status.STATUS_OK
__all__ = ["processes"]  # the fixture, imported for this module's tests


async def test_a_command_repeated_while_it_runs_is_carried_out_once(processes: Processes) -> None:
    ranks = registry()
    stubborn = processes.worker("stubborn")  # ignores SIGTERM: the stop takes the whole grace period
    ranks.hello(identity(0, stubborn.pid))
    handler = CommandHandler(worker_lookup=ranks)
    command = stop_command("stop-1", job="j", grace_seconds=0.5, reason="hang incident h-1")
    # The same id twice at once, as when the coordinator re-sends it on a new stream mid-stop.
    first, second = await asyncio.gather(handler.handle(command), handler.handle(command))
    assert second is first
    assert (first.status, outcomes(first)[stubborn.pid]) == (OK, (0, "sigkill"))
    assert len(first.stopped) == 2  # the worker and its child, each stopped once
    assert handler.replays_total == 1
    assert not alive(stubborn.pid)
    # And once more after it finished: the remembered result, nothing run.
    assert await handler.handle(command) is first
    assert handler.replays_total == 2


async def test_commands_without_an_id_are_each_carried_out() -> None:
    handler = CommandHandler()
    ping = agent_pb2.Command(ping=agent_pb2.PingCommand())
    first, second = await handler.handle(ping), await handler.handle(ping)
    assert first is not second
    assert (first.status, second.status) == (OK, OK)
    assert handler.replays_total == 0


async def test_a_command_older_than_the_newest_fencing_token_about_its_job_is_refused() -> None:
    """A coordinator that was replaced as a job's owner (its fencing token is older than one this agent
    has seen about that job) is not obeyed about it; the newer owner, and anything newer still, is. The
    owners of other jobs keep their own tokens: a node hosts jobs of several coordinators."""
    handler = CommandHandler()

    def checkpoint(command_id: str, job: str, token: int) -> agent_pb2.Command:
        return agent_pb2.Command(
            command_id=command_id,
            fencing_token=token,
            checkpoint=agent_pb2.CheckpointCommand(job=job, step=1),
        )

    # Without a hook socket a checkpoint is unsupported here: what matters is that it is not fenced.
    assert (await handler.handle(checkpoint("a", "j", 7))).status != FENCED
    stale = await handler.handle(checkpoint("b", "j", 5))
    assert stale.status == FENCED
    assert stale.message == "fencing token 5 is older than 7: the coordinator that sent it was replaced"
    alone = await handler.handle(checkpoint("c", "j", 0))  # a coordinator outside any group, after one inside
    assert alone.status == FENCED
    assert (await handler.handle(checkpoint("d", "k", 3))).status != FENCED  # another job, another owner
    assert (await handler.handle(checkpoint("e", "j", 9))).status != FENCED
    assert handler.fencing_token == 9


async def test_a_repeat_waiting_on_a_run_that_fails_hears_why() -> None:
    class BrokenLookup:
        def worker_pids(self, job: str) -> dict[int, int]:
            raise OSError("cannot read /proc")

        def mark_stopping(self, pids: object, why: str) -> None:
            raise AssertionError("not reached")

        def instances(self, pids: object) -> dict[int, ProcessInstance]:
            raise AssertionError("not reached")

    handler = CommandHandler(worker_lookup=BrokenLookup())
    command = stop_command("stop-2", job="j")
    results = await asyncio.gather(handler.handle(command), handler.handle(command), return_exceptions=True)
    assert [type(r) for r in results] == [OSError, OSError]
    # Nothing remembered from a run that failed: the next copy runs again.
    with pytest.raises(OSError, match="cannot read /proc"):
        await handler.handle(command)


class RecordingLauncher:
    """Says what it was asked to restart, and does nothing."""

    name = "torchrun"
    replaces_nodes = False

    def __init__(self) -> None:
        self.restarts: list[str] = []

    async def restart(
        self, job: str, nodes: Sequence[str], exclude_nodes: Sequence[str], reason: str
    ) -> LaunchOutcome:
        self.restarts.append(job)
        return LaunchOutcome(True, "recorded")


def hang(job: str, state: IncidentState, opened_unix_s: float) -> Incident:
    return Incident(
        id=f"hang-{job}",
        key=("hang", job, 0),
        kind=Kind.HANG,
        severity=Severity.CRITICAL,
        summary=f"job {job} made no progress",
        cause="heartbeat_stopped",
        state=state,
        opened_unix_s=opened_unix_s,
        updated_unix_s=opened_unix_s,
        job=job,
        ranks=(1,),
    )


def record(incident: Incident, outcome: str, decided_unix_s: float) -> cluster_pb2.ActionRecord:
    return cluster_pb2.ActionRecord(
        id=f"restart-{incident.job}",
        job=incident.job,
        action="restart",
        reason=incident.summary,
        incident_id=incident.id,
        outcome=outcome,
        decided_unix_seconds=decided_unix_s,
    )


async def unexpected_send(
    node_id: str, command: agent_pb2.Command, timeout_s: float
) -> agent_pb2.CommandResult:
    raise KeyError(node_id)  # no agent is connected


async def unexpected_checkpoint(job: str, timeout_s: float) -> int:
    raise AssertionError("no checkpoint expected")


async def test_a_restarted_coordinator_does_not_redo_or_redecide_what_the_previous_one_started(
    tmp_path: Path,
) -> None:
    now = time.time()
    # What the coordinator that was SIGKILLed left in its database:
    interrupted = hang("j", IncidentState.ACTING, now - 30)  # its restart was in flight
    restarted = hang("k", IncidentState.ACTING, now - 60)  # restarted, recovery being tracked
    undecided = hang("m", IncidentState.OPEN, now - 5)  # opened just before the kill
    previous = EventLog(tmp_path)
    previous.save_incidents([interrupted, restarted, undecided])
    previous.save_action(record(interrupted, "pending", now - 29))
    previous.save_action(record(restarted, "done", now - 59))
    previous.close()

    log = EventLog(tmp_path)
    watchdog = Watchdog(DetectionSettings(), log, unexpected_send, time.monotonic, time.time)
    launcher = RecordingLauncher()
    recovery = Recovery(
        RecoverySettings(cooldown_s=0),
        watchdog=watchdog,
        event_log=log,
        jobs=lambda: {},
        latest_checkpoint=lambda job: None,
        checkpoint_now=unexpected_checkpoint,
        launcher=launcher,
        wall_clock=time.time,
    )
    rounds = asyncio.create_task(recovery.run(period_s=0.01))
    try:
        # Every live incident is looked at in each round: once "m" is decided, "j" and "k" were looked at too.
        await poll_until(lambda: log.actions(job="m"), 10, "the undecided incident to be decided")
    finally:
        rounds.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await rounds

    (j,) = log.actions(job="j")  # interrupted, recorded as such, not redone
    assert (j.outcome, j.id) == ("failed", "restart-j")
    assert "interrupted: the coordinator carrying it out stopped or handed the job on" in j.detail
    assert [a.outcome for a in log.actions(job="k")] == ["done"]  # done before: not decided again
    # The incident never decided is decided now (its job is gone from this new coordinator's memory).
    assert [(a.action, a.outcome, a.detail) for a in log.actions(job="m")] == [
        ("restart", "failed", "job m is gone")
    ]
    assert launcher.restarts == []
    for incident in (interrupted, restarted):
        live = watchdog.book.get(incident.id)
        assert live is not None
        assert live.state == IncidentState.ACKNOWLEDGED  # a person's now; resolves once the condition clears
    assert (
        "interrupted (coordinator restarted or replaced)"
        in (watchdog.book.get("hang-j") or interrupted).recovery_note
    )
    # The restarts of the past hour still count against the budget and the cooldown.
    assert recovery.policy.restarts_in_last_hour("k", now) == 1
    assert recovery.policy.restarts_in_last_hour("j", now) == 1
    log.close()


def recovery_of_a_hang_in_j(
    tmp_path: Path, store: JobStore, now: float, fenced: Callable[[], str | None] = lambda: None
) -> tuple[EventLog, RecordingLauncher, Recovery]:
    """A fresh database with job j's hang open, and the Recovery that will decide on it (no cooldown)."""
    log = EventLog(tmp_path)
    log.save_incidents([hang("j", IncidentState.OPEN, now)])
    watchdog = Watchdog(DetectionSettings(), log, unexpected_send, time.monotonic, time.time)
    launcher = RecordingLauncher()
    recovery = Recovery(
        RecoverySettings(cooldown_s=0),
        watchdog=watchdog,
        event_log=log,
        jobs=lambda: store.jobs,
        latest_checkpoint=lambda job: None,
        checkpoint_now=unexpected_checkpoint,
        launcher=launcher,
        wall_clock=time.time,
        fenced=fenced,
    )
    return log, launcher, recovery


async def test_recovery_alerts_instead_of_acting_on_a_job_two_nodes_claim(tmp_path: Path) -> None:
    """A rank claimed by a second node while it runs on the first: what the job reports is not
    trusted, so the policy's restart becomes an alert that names both claims."""
    store = JobStore(instance_takeover_s=10.0)
    now_mono, now = time.monotonic(), time.time()
    store.ingest("honest", [rank_report(r, job="j", steps=[step(5)]) for r in (0, 1)], now_mono, now)
    forged = rank_report(1, job="j", instance_id="forged", restart_count=3)
    assert store.ingest("rogue", [forged], now_mono, now).rejections
    log, launcher, recovery = recovery_of_a_hang_in_j(tmp_path, store, now)
    recovery.round()
    await poll_until(lambda: log.actions(job="j"), 10, "the hang to be decided")
    ((action, outcome, detail),) = [(a.action, a.outcome, a.detail) for a in log.actions(job="j")]
    assert (action, outcome) == ("restart", "skipped")
    assert detail.startswith("alerted instead: two nodes claim ranks of job j")
    assert "rank 1 runs on honest (pid 1001) and is also claimed by rogue (pid 1001)" in detail
    assert launcher.restarts == []
    log.close()


async def test_a_fenced_coordinator_decides_nothing_until_it_holds_its_lease_again(tmp_path: Path) -> None:
    """One of several coordinators that may have lost its lease in etcd (another may own its jobs)
    restarts nothing; once it holds its lease again, the hang is decided as usual."""
    store = JobStore()
    now_mono, now = time.monotonic(), time.time()
    store.ingest("n1", [rank_report(r, job="j", steps=[step(5)]) for r in (0, 1)], now_mono, now)
    fence: list[str] = ["this coordinator does not surely hold its lease in etcd"]
    log, launcher, recovery = recovery_of_a_hang_in_j(
        tmp_path, store, now, lambda: fence[0] if fence else None
    )
    for _ in range(3):
        recovery.round()
        await asyncio.sleep(0.05)  # an action started by a round would run meanwhile
    assert log.actions(job="j") == []
    assert launcher.restarts == []
    fence.clear()
    recovery.round()
    await poll_until(lambda: launcher.restarts, 10, "the hang to be acted on once the fence is gone")
    assert launcher.restarts == ["j"]
    log.close()


async def test_an_action_the_group_cannot_learn_of_is_not_carried_out(tmp_path: Path) -> None:
    """With several coordinators the job's records reach etcd before recovery acts (a new owner then
    knows the action was under way); when they cannot, the restart is recorded failed, and not made."""
    store = JobStore()
    now_mono, now = time.monotonic(), time.time()
    store.ingest("n1", [rank_report(r, job="j", steps=[step(5)]) for r in (0, 1)], now_mono, now)
    log, launcher, recovery = recovery_of_a_hang_in_j(tmp_path, store, now)

    async def etcd_unreachable(job: str) -> None:
        raise ConnectionError(f"etcd at 127.0.0.1:1: UNAVAILABLE (job {job})")

    recovery.before_acting = etcd_unreachable
    recovery.round()
    (action,) = await poll_until(
        lambda: [a for a in log.actions(job="j") if a.outcome != "pending"], 10, "j decided"
    )
    assert action.outcome == "failed"
    assert "not carried out: it could not be recorded for the rest of the group" in action.detail
    assert "UNAVAILABLE" in action.detail
    assert launcher.restarts == []
    log.close()
