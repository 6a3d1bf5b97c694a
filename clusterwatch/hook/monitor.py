"""TrainingMonitor: the hook a plain PyTorch training loop uses.

Usage::

    monitor = TrainingMonitor(job="llama-7b")   # before init_process_group
    dist.init_process_group("nccl")
    model = monitor.watch(DistributedDataParallel(model))
    monitor.on_checkpoint(lambda step: save(model, step))   # returns the path
    for step in range(monitor.resume_step(), steps):
        with monitor.step(step):
            ...

Create the monitor before ``init_process_group``: it turns the Flight
Recorder on (``TORCH_FR_BUFFER_SIZE``) for the process groups created after
it, unless the launcher already set that variable.

Its first duty is to do no harm: nothing it does raises into the training
loop (its own failures are counted and reported in each heartbeat), the
training thread never waits on it (it only appends to a bounded queue), it
adds no CUDA synchronisation, and without an agent it logs one warning and
retries quietly in the background.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from clusterwatch.hook import flight_recorder
from clusterwatch.hook.balance import BatchShares
from clusterwatch.hook.blind_spots import BlindSpots
from clusterwatch.hook.checkpoint import CheckpointBook
from clusterwatch.hook.collectives.ddp_timing import DdpTimingMode, ddp_timing_mode
from clusterwatch.hook.health import HookHealth
from clusterwatch.hook.identity import RankInfo, parent_argv, resolve_socket_path
from clusterwatch.hook.process_groups import ProcessGroupReader
from clusterwatch.hook.transport import AgentLink
from clusterwatch.hook.worker_env import apply_worker_env
from clusterwatch.v1 import hook_pb2, training_pb2

if TYPE_CHECKING:
    from clusterwatch.hook.collectives import CollectiveTracker, InFlight
    from clusterwatch.hook.collectives.aggregate import CollectiveAggregate
    from clusterwatch.hook.optimizer_steps import OptimizerSteps

logger = logging.getLogger("clusterwatch.hook")

ModelT = TypeVar("ModelT")
SaveFn = Callable[[int], Any]


@dataclasses.dataclass(slots=True)
class _StepRecord:
    """One finished step, turned into a protobuf on the link's thread, not the training thread."""

    step: int
    start_unix_s: float
    step_s: float
    communication_s: float
    samples: float | None
    tokens: float | None
    collectives: list[CollectiveAggregate]

    def to_proto(self) -> training_pb2.StepSummary:
        communication_s = min(self.communication_s, self.step_s)
        summary = training_pb2.StepSummary(
            step=self.step,
            start_unix_seconds=self.start_unix_s,
            step_seconds=self.step_s,
            communication_seconds=communication_s,
            compute_seconds=self.step_s - communication_s,
            collectives=[c.to_proto() for c in self.collectives],
        )
        if self.samples is not None:
            summary.samples = self.samples
        if self.tokens is not None:
            summary.tokens = self.tokens
        return summary


class _StepScope:
    """``with monitor.step(n):`` — a class, not a generator, to keep the per-step cost down."""

    __slots__ = ("_monitor", "_samples", "_step", "_tokens")

    def __init__(self, monitor: TrainingMonitor, step: int, samples: float | None, tokens: float | None):
        self._monitor = monitor
        self._step = step
        self._samples = samples
        self._tokens = tokens

    def __enter__(self) -> None:
        self._monitor.begin_step(self._step)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self._monitor.end_step(samples=self._samples, tokens=self._tokens)
        else:  # the step failed; the training code's exception goes on unchanged
            self._monitor.abandon_step()


class TrainingMonitor:
    """Times steps and collectives, heartbeats, and checkpoints on request.

    Args:
        job: the job's name (default: CLUSTERWATCH_JOB, else the SLURM job
            id, else torchrun's TORCHELASTIC_RUN_ID, else "default"; see
            clusterwatch.hook.identity.job_name).
        socket_path: the agent's socket (default: CLUSTERWATCH_AGENT_SOCKET,
            else /run/clusterwatch/agent.sock).
        heartbeat_interval_s: seconds between heartbeats.
        queue_size: step summaries kept while the agent is slow or away.
        instrument_collectives: time torch.distributed collectives.
        environ: the environment to read (and to set TORCH_FR_BUFFER_SIZE in);
            CLUSTERWATCH_DDP_TIMING=comm_hook times DDP buckets with a comm hook
            instead of the reducer's group (clusterwatch.hook.collectives.ddp_timing.DdpTimingMode).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingMonitor:
        # Under clusterwatch run the launcher made this process's monitor. A script that makes
        # its own (the README's lines) gets that one, and numbers the steps itself from now on:
        # a second monitor would double every rank and leave its collectives untimed.
        launched = current_monitor()
        if launched is not None and launched.optimizer_steps is not None:
            launched.use_framework_steps()
            launched._handed_over = True
            return launched
        return super().__new__(cls)

    def __init__(
        self,
        job: str | None = None,
        *,
        socket_path: str | None = None,
        heartbeat_interval_s: float = 1.0,
        queue_size: int = 1024,
        instrument_collectives: bool = True,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        if getattr(self, "_handed_over", False):  # the launcher's monitor, set up already
            self._handed_over = False
            logger.info("clusterwatch: the script's TrainingMonitor is the one clusterwatch run created")
            return
        environ = os.environ if environ is None else environ
        self.health = HookHealth()
        self.identity = RankInfo.from_environ(job, environ, parent_argv())
        self._lock = threading.Lock()
        self._step: int | None = None
        self._in_step = False
        self._step_started_s = 0.0
        self._step_started_unix_s = 0.0
        self.steps_completed_total = 0
        self._save_fn: SaveFn | None = None
        self._save_deferred = False
        self._deferred: dict[int, tuple[list[str], float]] = {}
        self._checkpoints = CheckpointBook()
        self._batch_shares = BatchShares()
        self._tracker: CollectiveTracker | None = None
        self._ddp_timing = DdpTimingMode.AUTO
        self._process_groups = ProcessGroupReader()
        self._closed = False
        # Set by clusterwatch run (OptimizerSteps): steps from optimizer steps until a framework takes over.
        self.optimizer_steps: OptimizerSteps | None = None
        self.flight_recorder_enabled = False
        with self.health.guard("flight recorder"):
            self.flight_recorder_enabled = flight_recorder.enable(environ)
        created_after_init = _process_group_exists()
        self._blind_spots = BlindSpots(
            recorder_requested=self.flight_recorder_enabled, created_after_init=created_after_init
        )
        socket_path = resolve_socket_path(socket_path, environ)
        # Before the script's init_process_group: an interface the coordinator moved this job off.
        self.worker_env: dict[str, str] = {}
        with self.health.guard("worker environment"):
            self.worker_env = apply_worker_env(
                socket_path, self.identity.job, environ, process_group_exists=created_after_init
            )
        self._link = AgentLink(
            socket_path,
            self._hello,
            self._heartbeat,
            self._on_command,
            self.health,
            heartbeat_interval_s=heartbeat_interval_s,
            queue_size=queue_size,
            before_flush=self._refresh_identity,
        )
        if instrument_collectives:
            with self.health.guard("collective timing"):
                from clusterwatch.hook.collectives import CollectiveTracker

                tracker = CollectiveTracker(
                    on_error=lambda exc: self.health.record("collective timing", exc),
                    # Say at once which collective raised: the launcher may tear the
                    # process down before the next heartbeat is due.
                    on_failure=self._link.beat_soon,
                )
                tracker.install()
                self._tracker = tracker
                self._ddp_timing = ddp_timing_mode(environ)
            with self.health.guard("watch"):
                from clusterwatch.hook.auto_watch import watch_new_ddp_models

                watch_new_ddp_models()  # DDP models built from now on: watch() is optional
        self._link.start()
        atexit.register(self.close)
        global _newest  # noqa: PLW0603 - one process, one newest monitor
        _newest = weakref.ref(self)

    # -- the training loop's API -------------------------------------------------

    def step(self, step: int, *, samples: float | None = None, tokens: float | None = None) -> _StepScope:
        """Context manager around one training step; ``samples``/``tokens`` feed throughput."""
        return _StepScope(self, step, samples, tokens)

    def begin_step(self, step: int) -> None:
        """Start timing ``step`` (for frameworks whose callbacks split begin and end)."""
        now_s = time.monotonic()
        try:
            # Collectives between steps (async ones finishing late, logging
            # syncs) count towards the next step's summary.
            with self._lock:
                self._step = step
                self._in_step = True
                self._step_started_s = now_s
                self._step_started_unix_s = time.time()
        except Exception as exc:
            self.health.record("begin_step", exc)

    def end_step(self, *, samples: float | None = None, tokens: float | None = None) -> None:
        """Finish the current step: queue its summary, then save if a checkpoint is due now."""
        now_s = time.monotonic()
        try:
            with self._lock:
                if not self._in_step or self._step is None:
                    return
                self._in_step = False
                step = self._step
                self.steps_completed_total += 1
            communication_s, collectives = (
                self._tracker.take_step() if self._tracker is not None else (0.0, [])
            )
            record = _StepRecord(
                step=step,
                start_unix_s=self._step_started_unix_s,
                step_s=now_s - self._step_started_s,
                communication_s=communication_s,
                samples=samples,
                tokens=tokens,
                collectives=collectives,
            )
            self._link.send_step(record.to_proto)
            due, skipped = self._checkpoints.due(step)
        except Exception as exc:
            self.health.record("end_step", exc)
            return
        for result in skipped:
            self._send_result(result)
        if due:
            self._save(step, due)

    def abandon_step(self) -> None:
        """The step raised: stop timing it without reporting it."""
        with self._lock:
            self._in_step = False

    def use_framework_steps(self) -> None:
        """A framework callback numbers the steps from now on (its global step, its checkpoints).

        Under ``clusterwatch run`` steps come from optimizer steps until then;
        that hook is removed and a step it had begun is dropped.
        """
        steps, self.optimizer_steps = self.optimizer_steps, None
        if steps is not None:
            with self.health.guard("optimizer steps"):
                steps.remove()
            self.abandon_step()

    def accept_batch_shares(self) -> None:
        """Opt the job in to rebalancing: the coordinator may send each rank's share of the
        global batch (BalancedBatchSampler calls this; clusterwatch/hook/balance.py)."""
        if self.identity.rebalances:
            return
        self.identity.rebalances = True
        with self.health.guard("identity"):
            self._link.send(hook_pb2.HookMessage(identity=self.identity.to_proto()))

    def batch_shares(self, step: int) -> tuple[float, ...]:
        """Every rank's share of the global batch at ``step`` (even until the coordinator sends any)."""
        return self._batch_shares.at(step, self.identity.world_size)

    def batch_share(self, step: int | None = None) -> float:
        """This rank's share of the global batch at ``step`` (default: the current step)."""
        if step is None:
            with self._lock:
                step = self._step or 0
        return self.batch_shares(step)[self.identity.rank]

    def on_checkpoint(self, save_fn: SaveFn, *, deferred: bool = False) -> None:
        """Register ``save_fn(step) -> path``, run at the end of a step when a checkpoint is requested.

        Args:
            save_fn: saves this rank's state after ``step`` and returns where.
            deferred: for frameworks that save later in their own loop (the
                Hugging Face Trainer): ``save_fn(step)`` only arranges the save,
                and the framework reports the outcome with ``checkpoint_saved``
                or ``checkpoint_failed``.
        """
        self._save_fn = save_fn
        self._save_deferred = deferred

    def checkpoint_saved(self, step: int, path: str, *, duration_s: float = 0.0) -> None:
        """This rank's checkpoint of ``step`` is on disk at ``path``.

        Either a deferred save the framework finished, or one the training
        loop made on its own schedule: reported too, so that once every rank
        saved ``step`` it is the job's newest complete checkpoint, where a
        restart resumes. ``duration_s``: how long the save took (own saves).
        """
        self._finish_saved(step, path, "", duration_s)

    def checkpoint_failed(self, step: int, error: str) -> None:
        """This rank's checkpoint of ``step`` (deferred, or the loop's own) could not be saved."""
        self._finish_saved(step, "", error, 0.0)

    def watch(self, model: ModelT) -> ModelT:
        """Time a DistributedDataParallel model's gradient buckets; returns the model."""
        with self.health.guard("watch"):
            from torch.nn.parallel import DistributedDataParallel

            if self._tracker is not None and isinstance(model, DistributedDataParallel):
                self._tracker.watch_ddp(model, self._ddp_timing)
        return model

    def latest_checkpoint_step(self, timeout_s: float = 10.0) -> int | None:
        """The step of the newest checkpoint every rank completed; None if there is none.

        Asks the agent (which learns it from the coordinator) and waits up to
        ``timeout_s`` for the answer. Without an agent it answers None at once
        and logs why: a job started without clusterwatch starts from scratch.
        """
        try:
            self._link.first_attempt_done.wait(timeout_s)
            if not self._link.connected and not os.path.exists(self._link.socket_path):
                # Info, not warning: the link already warned once that there is no agent.
                logger.info("clusterwatch: agent socket missing, so no complete checkpoint is known")
                return None
            state = self._checkpoints.wait_state(timeout_s)
            if state is None:
                logger.warning(
                    "clusterwatch: the agent did not say within %.0f s which checkpoint is complete",
                    timeout_s,
                )
                return None
            return state.latest_complete_step
        except Exception as exc:
            self.health.record("latest_checkpoint_step", exc)
            return None

    def resume_step(self, timeout_s: float = 10.0) -> int:
        """The first step to run: one past the newest complete checkpoint, or 0 if none."""
        latest = self.latest_checkpoint_step(timeout_s)
        return 0 if latest is None else latest + 1

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Flush, say goodbye to the agent and restore torch.distributed (also runs at exit)."""
        if self._closed:
            return
        self._closed = True
        with self.health.guard("close"):
            atexit.unregister(self.close)
            if self._tracker is not None:
                self._tracker.uninstall()
            self._link.close(goodbye="exit")

    @property
    def connected(self) -> bool:
        """True while the stream to the agent is up."""
        return self._link.connected

    # -- the link's callbacks (hook threads) -------------------------------------

    def _hello(self) -> training_pb2.RankIdentity:
        with self.health.guard("identity"):
            self.identity.refresh()
        return self.identity.to_proto()

    def _heartbeat(self) -> training_pb2.Heartbeat:
        beat = training_pb2.Heartbeat(timestamp_unix_seconds=time.time())
        with self._lock:
            if self._step is not None:
                beat.step = self._step
            beat.in_step = self._in_step
            if self._in_step:
                # The clock is read under the lock, after begin_step set the start: never negative.
                beat.step_elapsed_seconds = time.monotonic() - self._step_started_s
            beat.steps_completed_total = self.steps_completed_total
        identity_known = self._refresh_identity()
        if self.flight_recorder_enabled:  # before the tracker's counts (BlindSpots.update)
            with self.health.guard("flight recorder"):
                beat.flight_recorder.extend(flight_recorder.read_status())
        launched: dict[str, int] = {}
        waited = 0
        if self._tracker is not None:
            with self.health.guard("collective timing"):
                self._tracker.poll()
                in_flight = self._tracker.in_flight()
                if in_flight is not None:
                    beat.collective.CopyFrom(_collective_proto(in_flight))
                failed = self._tracker.last_failed()
                if failed is not None:
                    beat.failed_collective.CopyFrom(_collective_proto(failed))
                launched = self._tracker.launched_per_group()
                waited = self._tracker.functional_waits_unmatched
        with self.health.guard("blind spots"):
            blind = self._blind_spots
            blind.update(
                beat.flight_recorder, launched, beat.step if beat.steps_completed_total else None, waited
            )
            if blind.recorder_on is False:
                self.flight_recorder_enabled = False
            if blind.untimed is not None:
                beat.untimed_collectives = blind.untimed
            beat.blind_spots.extend(blind.sentences(self._tracker.blind_spots if self._tracker else ()))
        beat.flight_recorder_enabled = self.flight_recorder_enabled
        if identity_known:
            # The agent checks members against the world size it was told: while an
            # identity update is queued behind this beat, the groups wait one beat.
            beat.process_groups.extend(self._process_groups.read(self.health))
        beat.health.CopyFrom(self.health.to_proto())
        return beat

    def _refresh_identity(self) -> bool:
        """Tell the agent once torch knows more (backend, rank, GPU) than at the hello.

        Returns:
            True if the agent already knows the identity; False if it changed
            (the update is queued) or could not be read.
        """
        with self.health.guard("identity"):
            if not self.identity.refresh():
                return True
            self._link.send(hook_pb2.HookMessage(identity=self.identity.to_proto()))
        return False

    def _on_command(self, command: hook_pb2.HookCommand) -> None:
        kind = command.WhichOneof("kind")
        if kind == "checkpoint":
            with self._lock:
                earliest = None if self._step is None else self._step + (0 if self._in_step else 1)
            answer = self._checkpoints.request(command.checkpoint, earliest)
            if answer is not None:
                self._send_result(answer)
        elif kind == "checkpoint_state":
            self._checkpoints.set_state(command.checkpoint_state)
        elif kind == "batch_shares":
            shares = command.batch_shares
            with self.health.guard("batch shares"):
                self._batch_shares.set(shares.shares, shares.from_step)
                logger.warning(
                    "clusterwatch: from step %d this rank's share of the global batch is %.3f (%s)",
                    shares.from_step,
                    self.batch_shares(shares.from_step)[self.identity.rank],
                    shares.reason,
                )

    # -- checkpoints --------------------------------------------------------------

    def _save(self, step: int, command_ids: list[str]) -> None:
        """Run the user's save function once for every request for ``step``."""
        started_s = time.monotonic()
        path, error = "", ""
        if self._save_fn is None:
            error = "no checkpoint function registered (TrainingMonitor.on_checkpoint)"
        else:
            try:
                path = str(self._save_fn(step) or "")
            except Exception as exc:  # the user's save failed: report it, training goes on
                error = f"{type(exc).__name__}: {exc}"
                logger.exception("clusterwatch: checkpoint at step %d failed", step)
            else:
                if self._save_deferred:
                    self._deferred[step] = (command_ids, started_s)
                    return
        self._report_saved(step, command_ids, path, error, time.monotonic() - started_s)

    def _finish_saved(self, step: int, path: str, error: str, duration_s: float) -> None:
        with self.health.guard("checkpoint"):
            deferred = self._deferred.pop(step, None)
            if deferred is not None:
                command_ids, started_s = deferred
                self._report_saved(step, command_ids, path, error, time.monotonic() - started_s)
            else:  # the loop's own save: no request to answer
                self._report_saved(step, [""], path, error, duration_s)

    def _report_saved(
        self, step: int, command_ids: list[str], path: str, error: str, duration_s: float
    ) -> None:
        for command_id in command_ids:
            self._send_result(
                training_pb2.CheckpointResult(
                    command_id=command_id,
                    step=step,
                    ok=not error,
                    path=path,
                    duration_seconds=duration_s,
                    error=error,
                )
            )
        if not error:
            logger.info("clusterwatch: checkpoint at step %d saved to %s in %.2f s", step, path, duration_s)

    def _send_result(self, result: training_pb2.CheckpointResult) -> None:
        self._link.send(hook_pb2.HookMessage(checkpoint_result=result))


def _collective_proto(collective: InFlight) -> training_pb2.CollectiveInFlight:
    return training_pb2.CollectiveInFlight(
        op=collective.op,
        group_name=collective.group_name,
        sequence=collective.sequence,
        started_unix_seconds=collective.started_unix_s,
        elapsed_seconds=collective.elapsed_s,
        blocking=collective.blocking,
        size_bytes=collective.size_bytes,
        dtype=collective.dtype,
    )


_newest: weakref.ReferenceType[TrainingMonitor] | None = None


def current_monitor() -> TrainingMonitor | None:
    """The newest monitor of this process that is not closed, or None.

    Under ``clusterwatch run`` the script did not create one; this is how it
    reaches the one that was (``monitor.on_checkpoint(...)`` for a plain loop).
    (``TrainingMonitor()`` there returns the launcher's too; elsewhere a second
    live monitor in one process would leave its collectives untimed.)
    """
    monitor = _newest() if _newest is not None else None
    return None if monitor is None or monitor.closed else monitor


def _process_group_exists() -> bool:
    """Whether init_process_group has run (without importing torch: no torch, no process group)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())
