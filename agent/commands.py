"""Carries out commands the coordinator sends down the stream, at most once each."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from clusterwatch.agent.diagnose import DiagnosisTarget, ProcessDiagnoser
from clusterwatch.agent.probes.client import probe_path
from clusterwatch.agent.probes.protocol import MAX_BYTES, MAX_ROUND_TRIPS
from clusterwatch.agent.process_instance import ProcessInstance
from clusterwatch.agent.worker_env import WorkerEnvBook
from clusterwatch.agent.workers import WorkerStopper, effective_grace_s
from clusterwatch.v1 import agent_pb2, hook_pb2
from clusterwatch.wire.worker_env import WorkerEnvError

logger = logging.getLogger(__name__)

Status = agent_pb2.CommandResult.Status

MAX_PROBE_TARGETS = 16


class CheckpointRelay(Protocol):
    """Passes a checkpoint request on to the training processes of one job (HookLinks does)."""

    def relay_checkpoint(self, job: str, command_id: str, step: int) -> list[int]:
        """Ask every connected rank of ``job`` to checkpoint; return the ranks asked."""

    def relay_batch_shares(self, job: str, shares: hook_pb2.BatchShares) -> list[int]:
        """Send every connected rank of ``job`` the ranks' batch shares; return the ranks sent to."""


class ProcessLookup(Protocol):
    """Finds the registered training process of a rank (RankRegistry does)."""

    def pid_of(self, job: str, rank: int) -> int | None:
        """The pid of ``rank`` of ``job`` as registered on the hook socket; None: not hosted here."""


class WorkerLookup(Protocol):
    """Finds every registered training process of a job (RankRegistry does)."""

    def worker_pids(self, job: str) -> dict[int, int]:
        """{pid: rank} of every process of ``job`` registered on the hook socket that may still run."""

    def mark_stopping(self, pids: Iterable[int], why: str) -> None:
        """These processes are being stopped on purpose (their exits are no rank failures)."""

    def instances(self, pids: Iterable[int]) -> dict[int, ProcessInstance]:
        """The verified process behind each of ``pids`` that has one (pid reuse is checked against it)."""


class CommandHandler:
    """Runs each command id once; a replayed id gets its first result again.

    The coordinator may send an id again: a client retrying RequestAction with
    its idempotency key, or a command re-sent on a new stream while the first
    copy still runs (a stop waits out its grace period). A copy that arrives
    while the first runs waits for that run's result; one that arrives later
    gets the remembered result. Either way the action happens once. The
    ``remembered`` newest ids are kept, in this process only (a restarted agent
    starts with none). A command without an id cannot be told apart from
    another and is carried out each time.

    Args:
        checkpoint_relay: where checkpoint commands go; None: this agent cannot relay them.
        process_lookup: which registered process runs a rank, for diagnose commands;
            None: this agent cannot diagnose.
        diagnoser: examines the processes (default: ProcessDiagnoser()).
        worker_lookup: the registered processes of a job, for stop_workers commands;
            None: this agent cannot stop workers.
        stopper: stops them (default: WorkerStopper(), without a GPU memory check).
        worker_env: where worker_env commands go (the hooks read it); None: this agent
            serves no hooks.
        remembered: how many command ids (with their results) are kept for replays.

    Attributes:
        cordoned_jobs: jobs whose launcher a stop_workers command stopped here: the
            job re-forms without this node.
    """

    def __init__(
        self,
        checkpoint_relay: CheckpointRelay | None = None,
        process_lookup: ProcessLookup | None = None,
        diagnoser: ProcessDiagnoser | None = None,
        *,
        worker_lookup: WorkerLookup | None = None,
        stopper: WorkerStopper | None = None,
        worker_env: WorkerEnvBook | None = None,
        remembered: int = 1024,
    ) -> None:
        if remembered < 1:
            raise ValueError(f"remembered must be at least 1, got {remembered}")
        self._results: collections.OrderedDict[str, agent_pb2.CommandResult] = collections.OrderedDict()
        self._running: dict[str, asyncio.Future[agent_pb2.CommandResult]] = {}
        self._remembered = remembered
        self.replays_total = 0
        self._checkpoint_relay = checkpoint_relay
        self._process_lookup = process_lookup
        self._diagnoser = diagnoser or ProcessDiagnoser()
        self._worker_lookup = worker_lookup
        self._stopper = stopper or WorkerStopper()
        self._worker_env = worker_env
        self.cordoned_jobs: set[str] = set()
        # The newest fencing token seen on a command about each job (Command.fencing_token), and on
        # any command (what status shows).
        self._fencing_tokens: dict[str, int] = {}
        self.fencing_token = 0

    async def handle(self, command: agent_pb2.Command) -> agent_pb2.CommandResult:
        """Carry out ``command``, or answer a repeated id with its first run's result; refuse it when
        its fencing token is older than the newest seen on a command about the same job (the coordinator
        that sent it no longer owns the job: another one took it over)."""
        job = _job_of(command)
        newest = self._fencing_tokens.get(job, 0)
        if command.fencing_token < newest:
            logger.warning(
                "refused command %s about job %r: fencing token %d is older than %d (its coordinator was "
                "replaced)",
                command.command_id,
                job,
                command.fencing_token,
                newest,
            )
            return agent_pb2.CommandResult(
                command_id=command.command_id,
                status=Status.STATUS_FENCED,
                message=f"fencing token {command.fencing_token} is older than {newest}: "
                "the coordinator that sent it was replaced",
            )
        if len(self._fencing_tokens) >= self._remembered and job not in self._fencing_tokens:
            self._fencing_tokens.pop(next(iter(self._fencing_tokens)))
        self._fencing_tokens[job] = command.fencing_token
        self.fencing_token = max(self.fencing_token, command.fencing_token)
        command_id = command.command_id
        if not command_id:
            return await self._carry_out(command)
        previous = self._results.get(command_id)
        if previous is not None:
            self.replays_total += 1
            logger.info("command %s was already carried out here; answering with its result", command_id)
            return previous
        running = self._running.get(command_id)
        if running is not None:
            self.replays_total += 1
            logger.info("command %s is being carried out here; its repeat waits for that result", command_id)
            return await asyncio.shield(running)
        future = self._running[command_id] = asyncio.get_running_loop().create_future()
        try:
            result = await self._carry_out(command)
        except BaseException as exc:
            # Nothing to remember, so a later repeat runs it again; a repeat waiting now hears why.
            if not isinstance(exc, Exception):  # cancelled (the agent is stopping)
                exc = ConnectionError(f"the run of command {command_id} was cancelled")
            future.set_exception(exc)
            future.exception()  # retrieved: a run nobody waited on must not log "never retrieved"
            raise
        finally:
            del self._running[command_id]
        self._results[command_id] = result
        if len(self._results) > self._remembered:
            self._results.popitem(last=False)
        future.set_result(result)
        return result

    async def _carry_out(self, command: agent_pb2.Command) -> agent_pb2.CommandResult:
        """Do what ``command`` asks, now; its result, with how long it took."""
        started = time.monotonic()
        action = command.WhichOneof("action")
        if action == "ping":
            result = agent_pb2.CommandResult(
                command_id=command.command_id, status=Status.STATUS_OK, message="pong"
            )
        elif action == "checkpoint" and self._checkpoint_relay is not None:
            result = self._checkpoint(command.command_id, command.checkpoint, self._checkpoint_relay)
        elif action == "diagnose" and self._process_lookup is not None:
            result = await self._diagnose(command.command_id, command.diagnose, self._process_lookup)
        elif action == "stop_workers" and self._worker_lookup is not None:
            result = await self._stop_workers(command.command_id, command.stop_workers, self._worker_lookup)
        elif action == "rebalance" and self._checkpoint_relay is not None:
            result = self._rebalance(command.command_id, command.rebalance, self._checkpoint_relay)
        elif action == "worker_env" and self._worker_env is not None:
            result = self._set_worker_env(command.command_id, command.worker_env, self._worker_env)
        elif action == "probe":
            result = await self._probe(command.command_id, command.probe)
        else:
            logger.warning("unsupported command %s (%s)", command.command_id, action)
            result = agent_pb2.CommandResult(
                command_id=command.command_id,
                status=Status.STATUS_UNSUPPORTED,
                message=f"this agent does not support {action or 'an empty'} command",
            )
        result.duration_seconds = time.monotonic() - started
        return result

    @staticmethod
    def _rebalance(
        command_id: str, rebalance: agent_pb2.RebalanceCommand, relay: CheckpointRelay
    ) -> agent_pb2.CommandResult:
        """OK once relayed to the job's ranks here; each applies the shares from ``from_step``."""
        shares = hook_pb2.BatchShares(
            shares=rebalance.shares, from_step=rebalance.from_step, reason=rebalance.reason
        )
        ranks = relay.relay_batch_shares(rebalance.job, shares)
        if not ranks:
            return _answer(
                command_id, ok=False, message=f"no running rank of job {rebalance.job} on this node"
            )
        return _answer(
            command_id,
            ok=True,
            message=f"batch shares from step {rebalance.from_step} relayed to ranks {ranks}",
        )

    @staticmethod
    async def _probe(command_id: str, probe: agent_pb2.ProbeCommand) -> agent_pb2.CommandResult:
        """OK with one result per target, probed one after another off the event loop (a failed
        path is a result too: its error says what failed)."""
        if len(probe.targets) > MAX_PROBE_TARGETS:
            return _answer(
                command_id, ok=False, message=f"{len(probe.targets)} targets, at most {MAX_PROBE_TARGETS}"
            )
        if (
            probe.bytes > MAX_BYTES
            or probe.round_trips > MAX_ROUND_TRIPS
            or not 0 < probe.timeout_seconds <= 60
        ):
            return _answer(
                command_id,
                ok=False,
                message=f"a probe is at most {MAX_BYTES} bytes, {MAX_ROUND_TRIPS} round trips and 60 s, "
                f"not {probe.bytes}, {probe.round_trips} and {probe.timeout_seconds:g}",
            )
        results = []
        for target in probe.targets:
            results.append(
                await asyncio.to_thread(
                    probe_path, target, probe.bytes, probe.round_trips, probe.timeout_seconds
                )
            )
        failed = sum(1 for r in results if r.error)
        answer = _answer(command_id, ok=True, message=f"{len(results)} paths probed, {failed} failed")
        answer.probes.extend(results)
        return answer

    @staticmethod
    def _set_worker_env(
        command_id: str, command: agent_pb2.WorkerEnvCommand, book: WorkerEnvBook
    ) -> agent_pb2.CommandResult:
        """OK once the job's entry is in the file its workers read at start."""
        env = dict(command.env)
        try:
            book.set(
                command.job, env, command.reason, command.expires_unix_seconds, command.avoided_interfaces
            )
        except (WorkerEnvError, OSError) as exc:
            return _answer(command_id, ok=False, message=f"worker environment not set: {exc}")
        shown = " ".join(f"{key}={value}" for key, value in sorted(env.items())) or "cleared"
        logger.info("worker environment of job %s: %s (%s)", command.job, shown, command.reason)
        return _answer(
            command_id, ok=True, message=f"job {command.job}'s workers that start from now: {shown}"
        )

    @staticmethod
    def _checkpoint(
        command_id: str, checkpoint: agent_pb2.CheckpointCommand, relay: CheckpointRelay
    ) -> agent_pb2.CommandResult:
        """OK once relayed; each rank's own outcome travels up later in the node reports."""
        if not checkpoint.job:
            return agent_pb2.CommandResult(
                command_id=command_id, status=Status.STATUS_FAILED, message="checkpoint command names no job"
            )
        ranks = relay.relay_checkpoint(checkpoint.job, command_id, checkpoint.step)
        if not ranks:
            return agent_pb2.CommandResult(
                command_id=command_id,
                status=Status.STATUS_FAILED,
                message=f"no running rank of job {checkpoint.job} on this node",
            )
        logger.info(
            "checkpoint %s of job %s at step %d relayed to ranks %s",
            command_id,
            checkpoint.job,
            checkpoint.step,
            ranks,
        )
        return agent_pb2.CommandResult(
            command_id=command_id,
            status=Status.STATUS_OK,
            message="relayed to ranks " + ",".join(map(str, ranks)),
        )

    async def _diagnose(
        self, command_id: str, diagnose: agent_pb2.DiagnoseCommand, lookup: ProcessLookup
    ) -> agent_pb2.CommandResult:
        """OK with one diagnosis per named rank this node hosts; the others are left out.

        Only pids the lookup returns (processes registered on the hook socket)
        are examined. A rank named both as suspect and as healthy counts as a suspect.
        """
        if not diagnose.job:
            return agent_pb2.CommandResult(
                command_id=command_id, status=Status.STATUS_FAILED, message="diagnose command names no job"
            )
        targets: list[DiagnosisTarget] = []
        asked: set[int] = set()
        named = [(rank, False) for rank in diagnose.ranks] + [(rank, True) for rank in diagnose.healthy_ranks]
        for rank, healthy in named:
            if rank in asked:
                continue
            asked.add(rank)
            pid = lookup.pid_of(diagnose.job, rank)
            if pid is not None:
                targets.append(DiagnosisTarget(rank, pid, healthy))
        if not targets:
            return agent_pb2.CommandResult(
                command_id=command_id,
                status=Status.STATUS_FAILED,
                message=f"none of the ranks asked about of job {diagnose.job} runs on this node",
            )
        diagnoses = await self._diagnoser.diagnose(diagnose.job, targets, stack_dump=diagnose.stack_dump)
        logger.info(
            "diagnose %s of job %s: %s",
            command_id,
            diagnose.job,
            ", ".join(f"rank {d.rank} {d.process_state or 'unreadable'}" for d in diagnoses),
        )
        count = len(diagnoses)
        return agent_pb2.CommandResult(
            command_id=command_id,
            status=Status.STATUS_OK,
            message=f"{count} process{'es' if count != 1 else ''} examined",
            diagnoses=diagnoses,
        )

    async def _stop_workers(
        self, command_id: str, stop: agent_pb2.StopWorkersCommand, lookup: WorkerLookup
    ) -> agent_pb2.CommandResult:
        """OK once every registered worker of the job here (with its tree) is gone; FAILED if one survived.

        Only pids the lookup returns (processes registered on the hook socket)
        and their descendants are signalled; with ``stop_launcher`` their parent
        too, and the job is cordoned on this node.
        """
        if not stop.job:
            return agent_pb2.CommandResult(
                command_id=command_id,
                status=Status.STATUS_FAILED,
                message="stop_workers command names no job",
            )
        workers = lookup.worker_pids(stop.job)
        if stop.pids:  # only these (the orphans of a dead launcher, say)
            named = set(stop.pids)
            workers = {pid: rank for pid, rank in workers.items() if pid in named}
        if not workers:
            return agent_pb2.CommandResult(
                command_id=command_id,
                status=Status.STATUS_FAILED,
                message=f"no worker of job {stop.job} on this node"
                + (f" among pids {', '.join(map(str, stop.pids))}" if stop.pids else ""),
            )
        grace_s = effective_grace_s(stop.grace_seconds)
        logger.warning(
            "stop_workers %s: stopping %d worker(s) of job %s (grace %g s%s)%s",
            command_id,
            len(workers),
            stop.job,
            grace_s,
            ", then their launcher" if stop.stop_launcher else "",
            f": {stop.reason}" if stop.reason else "",
        )
        lookup.mark_stopping(workers, stop.reason or "stop_workers command")
        report = await self._stopper.stop(
            stop.job, workers, grace_s, stop_launcher=stop.stop_launcher, registered=lookup.instances(workers)
        )
        message = report.summary()
        if stop.stop_launcher:
            self.cordoned_jobs.add(stop.job)
            message += f"; node cordoned for job {stop.job}"
            logger.warning("node cordoned for job %s: its launcher here was stopped", stop.job)
        logger.log(logging.INFO if report.ok else logging.ERROR, "stop_workers %s: %s", command_id, message)
        return agent_pb2.CommandResult(
            command_id=command_id,
            status=Status.STATUS_OK if report.ok else Status.STATUS_FAILED,
            message=message,
            stopped=report.processes,
        )


def _answer(command_id: str, *, ok: bool, message: str) -> agent_pb2.CommandResult:
    status = Status.STATUS_OK if ok else Status.STATUS_FAILED
    return agent_pb2.CommandResult(command_id=command_id, status=status, message=message)


def _job_of(command: agent_pb2.Command) -> str:
    """The job a command is about ("" for one about none, a ping)."""
    action = command.WhichOneof("action")
    return (
        str(getattr(command, action).job)
        if action in ("checkpoint", "diagnose", "stop_workers", "worker_env", "rebalance", "probe")
        else ""
    )
