"""Carries out the recovery policy's decisions and tracks each restarted job back to health.

One module of about 550 lines: deciding, acting and tracking a restart back to
health share the per-job records (``_Restarted``) and the counts; the pure
parts already live apart (policy.py, launchers/).

Every 0.5 s: live incidents the policy has not decided get a decision
(coordinator/recovery/policy.py); each decision becomes an ActionRecord (SQLite, the
ListActions API) and, unless skipped or in dry-run mode, an action:

- ``checkpoint``: the coordinated checkpoint of RequestAction;
- ``restart``: the incident goes to ACTING, the launcher stops the job's
  workers (torchrun restarts the group, the hooks resume from the newest
  complete checkpoint);
- ``checkpoint_and_restart``: a checkpoint first (waited for, with a
  timeout) when the job still makes progress (a hung, crashed or node-less
  job cannot checkpoint: it resumes from the last complete one), then the
  restart;
- ``exclude_node_and_restart``: the same, with the incident's nodes stopped
  for good (their launcher too) so an elastic job re-forms without them;
  only if the job can run without them (policy.exclusion_blocker), else
  the incident is alerted and says why;
- ``stop_orphans``: the ranks whose launcher died are stopped by their nodes'
  agents (SIGTERM, grace, SIGKILL, reaped, GPU memory checked), whatever the
  launcher kind: nothing is left to restart them, and they hold their GPUs and
  peers. The incident resolves when their exits are reported.

While the coordinator is behind (coordinator/model/lag.py) nothing is decided
and no restart is judged: its verdicts could come from its own lag. Nor while
it is fenced: one of several coordinators that no longer surely holds its
lease in etcd (coordinator/group/membership.py), whose jobs another may own.

An ``alert`` on a rank failure still tracks the restart torchrun makes by
itself. A restarted job is recovered when every rank of a newer generation
has finished a step at or past the resume step: the incident is resolved
then, with the recovery time (incident opened -> resumed) and the steps lost
in its evidence and counted, with the unproductive time the ETTR is made of.
One that has not recovered within ``recovery_timeout_s`` goes back to
ACKNOWLEDGED, for a person.

After a coordinator restart (same database) nothing is done twice
(``take_over``): an incident that already had an action is not decided
again; the actions of the past hour still count against each job's cooldown
and restart budget; an action still ``pending`` was in flight when the
previous coordinator died, and is recorded ``failed`` (interrupted), not
redone: how much of it reached the agents is unknown, and doing it again
could stop a job that its first half already restarted. Its incident, and
any other that recovery was acting on (whose tracking was in the dead
process's memory), goes to a person (ACKNOWLEDGED) and resolves by itself
once its condition clears.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

from clusterwatch import config
from clusterwatch.config import RecoverySettings
from clusterwatch.coordinator.background import BackgroundTasks, every
from clusterwatch.coordinator.detection.causes.network import job_bus_bandwidth, job_interfaces
from clusterwatch.coordinator.detection.diagnosis import SendCommand
from clusterwatch.coordinator.detection.orphans import orphan_pids
from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.incidents import Incident, IncidentState, Kind
from clusterwatch.coordinator.model.jobs import RUNNING, JobRecord, RankConflict
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.coordinator.recovery.balance import batch_shares, current_shares, first_step, worth_changing
from clusterwatch.coordinator.recovery.interfaces import plan_worker_env
from clusterwatch.coordinator.recovery.launchers.protocol import Launcher, SendStop
from clusterwatch.coordinator.recovery.launchers.torchrun import (
    STOP_ANSWER_MARGIN_S,
    stop_on_node,
    summarise_stops,
)
from clusterwatch.coordinator.recovery.node_commands import describe, send_each, worker_env_commands
from clusterwatch.coordinator.recovery.policy import (
    HOUR_S,
    Decision,
    Policy,
    checkpoints_first,
    exclusion_blocker,
)
from clusterwatch.v1 import agent_pb2, cluster_pb2
from clusterwatch.wire.recovery_names import (
    ALERT,
    AVOID_INTERFACE,
    CHECKPOINT,
    EXCLUDE_NODE_AND_RESTART,
    REBALANCE,
    RESTARTS,
    STOP_ORPHANS,
    restart_action,
)
from clusterwatch.wire.worker_env import GLOO_SOCKET_IFNAME

logger = logging.getLogger(__name__)

PERIOD_S = 0.5
CHECKPOINT_TIMEOUT_S = 60.0
PENDING, DONE, FAILED, SKIPPED = "pending", "done", "failed", "skipped"
# The restart reason of an operator's restart (the others are incident kinds).
REQUESTED = "requested"
# Action records read at start (the newest this many), to take over from the previous coordinator.
MAX_ACTIONS_LOADED = 10_000

# Asks every rank of a job to checkpoint; returns the step, once complete (raises on failure/timeout).
CheckpointNow = Callable[[str, float], Awaitable[int]]


@dataclasses.dataclass
class _Restarted:
    """A restart under way, until the job runs past its resume step.

    Attributes:
        restart_count: the job's generation when it was restarted (the
            resumed one is newer).
        furthest_step: the furthest step a rank had finished: the steps from
            resume_step to it are done again.
        last_progress_unix_s: when the job last finished a step before the
            restart; from then to the resume no training happened.
        step_s: the job's step time then, to price the steps done again.
    """

    incident_id: str
    job: str
    reason: str
    restart_count: int
    resume_step: int
    furthest_step: int
    opened_unix_s: float
    started_unix_s: float
    last_progress_unix_s: float
    step_s: float
    # avoid_interface: the interface each node's workers were given, and those they were moved off.
    moved_to: dict[str, str] = dataclasses.field(default_factory=dict)
    avoided: tuple[str, ...] = ()


@dataclasses.dataclass
class RecoveryCounts:
    """For /metrics, per job.

    Attributes:
        restarts: by (job, incident kind or "requested").
        steps_lost: steps done again after restarts.
        last_recovery_s: the latest recovery's incident -> resumed time.
        actions: by (job, action, outcome).
        rate_limited: restarts not made because the job reached max_restarts_per_hour.
        unproductive_s: training time lost to faults: from the last step
            before each restart to the resume, plus the steps done again.
        first_seen_unix_s: when this coordinator first saw the job, the start
            of its effective-training-time ratio.
    """

    restarts: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    steps_lost: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    rate_limited: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    last_recovery_s: dict[str, float] = dataclasses.field(default_factory=dict)
    actions: collections.Counter[tuple[str, str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    unproductive_s: dict[str, float] = dataclasses.field(default_factory=dict)
    first_seen_unix_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def forget(self, job: str) -> None:
        """Drop every count of ``job`` (it ended on purpose: its series go)."""
        for counter in (self.restarts, self.actions):
            for key in [k for k in counter if k[0] == job]:
                del counter[key]
        for per_job in (
            self.steps_lost,
            self.rate_limited,
            self.last_recovery_s,
            self.unproductive_s,
            self.first_seen_unix_s,
        ):
            per_job.pop(job, None)

    def effective_training_time_ratio(self, job: str, now_unix_s: float) -> float | None:
        """Productive time / wall time since the job was first seen (the ETTR); None before any time passed."""
        first_seen = self.first_seen_unix_s.get(job)
        if first_seen is None or now_unix_s <= first_seen:
            return None
        wall_s = now_unix_s - first_seen
        return max(0.0, 1.0 - self.unproductive_s.get(job, 0.0) / wall_s)


class Recovery:
    """The policy's hands.

    Args:
        settings: ``[recovery]``.
        watchdog: the incidents (moved to ACTING / RESOLVED / ACKNOWLEDGED through it).
        event_log: where action records persist.
        jobs: the job store's jobs (read each round).
        latest_checkpoint: job -> newest complete checkpoint step, or None.
        checkpoint_now: the coordinated checkpoint.
        launcher: how a job is restarted (torchrun via the agents, SLURM, Kubernetes).
        wall_clock: seconds since the epoch.
        send_stop: how a node's agent is told to stop workers (orphans); None: it cannot be.
        fenced: why this coordinator may not act now, or None when it may: with several
            coordinators, it no longer surely holds its lease in etcd (coordinator/group/), so
            another may own its jobs. Nothing is decided while it says so.
    """

    def __init__(
        self,
        settings: RecoverySettings,
        *,
        watchdog: Watchdog,
        event_log: EventLog,
        jobs: Callable[[], Mapping[str, JobRecord]],
        latest_checkpoint: Callable[[str], int | None],
        checkpoint_now: CheckpointNow,
        launcher: Launcher,
        wall_clock: Callable[[], float],
        send_stop: SendStop | None = None,
        fenced: Callable[[], str | None] = lambda: None,
        nodes: Callable[[], Mapping[str, NodeRecord]] = dict,
        send_command: SendCommand | None = None,
    ) -> None:
        self.settings = settings
        self._fenced = fenced
        self.policy = Policy(settings)
        self.counts = RecoveryCounts()
        self._watchdog = watchdog
        self._event_log = event_log
        self._jobs = jobs
        self._latest_checkpoint = latest_checkpoint
        self._checkpoint_now = checkpoint_now
        self._launcher = launcher
        self._wall = wall_clock
        self._send_stop = send_stop
        self._nodes = nodes
        self._send_command = send_command
        self._restarted: dict[str, _Restarted] = {}
        self._actions = BackgroundTasks()
        # Why decisions are held now (round logs each change), or None.
        self._holding: str | None = None
        # Live incidents a previous coordinator already acted on: never decided again.
        self._decided_before: set[str] = set()
        # With several coordinators: makes the job's records durable in etcd before an action is
        # carried out (coordinator/group/job_state.py); an action whose record cannot be is not.
        self.before_acting: Callable[[str], Awaitable[None]] | None = None
        self.take_over(event_log.actions(limit=MAX_ACTIONS_LOADED))

    def apply_settings(self, settings: RecoverySettings) -> None:
        """New ``[recovery]`` settings (SIGHUP); decisions already made and the restart budget stay."""
        self.settings = self.policy.settings = settings
        logger.info("recovery settings now %s", config.as_strings(settings))

    async def run(self, period_s: float = PERIOD_S) -> None:
        """Rounds forever (cancel to stop)."""
        try:
            await every(period_s, self.round, "recovery round")
        finally:
            await self._actions.close()

    def round(self) -> None:
        """Decide on new incidents, start their actions, and check restarted jobs.

        Nothing is decided or judged while the coordinator's verdicts are held (it is behind:
        coordinator/model/lag.py; a restart that does not seem to recover may be its own lag) or
        while it is fenced (see the module doc).
        """
        hold = self._hold()
        if hold is not None:
            if hold != self._holding:
                logger.warning("recovery holds its decisions: %s", hold)
            self._holding = hold
            return
        if self._holding is not None:
            logger.info("recovery decides again (it held them: %s)", self._holding)
            self._holding = None
        now = self._wall()
        for name in self._jobs():
            self.counts.first_seen_unix_s.setdefault(name, now)
        live = self._watchdog.book.live()
        live_ids = {incident.id for incident in live}
        self.policy.retain(live_ids)
        self._decided_before &= live_ids
        for incident in live:
            if incident.id in self._decided_before:
                continue
            decision = self.policy.decide(incident, now, rebalances=self._rebalances(incident.job))
            if decision is not None:
                self._actions.start(self._carry_out(decision, incident), f"action on {incident.id}")
        self._track(now)

    def _hold(self) -> str | None:
        """Why nothing may be decided now: the coordinator is behind, or fenced; else None."""
        held = self._watchdog.held()
        if held is not None:
            return f"the coordinator is behind ({held.figures()})"
        return self._fenced()

    def take_over(
        self, records: Sequence[cluster_pb2.ActionRecord], incidents: Collection[str] | None = None
    ) -> None:
        """Carry on from the coordinator that used this database before, or from the previous owner of
        ``job`` (another coordinator of the group: coordinator/recovery/adoption.py); see the module
        docstring.

        Args:
            records: its action records, oldest first.
            incidents: of the incidents recovery was acting on, only these go to a person (the ones
                adopted with a job; None: every one, at start).
        """
        now = self._wall()
        interrupted: list[cluster_pb2.ActionRecord] = []
        for record in records:
            if record.incident_id:
                self._decided_before.add(record.incident_id)
            if record.outcome != SKIPPED and now - record.decided_unix_seconds < HOUR_S:
                self.policy.note_action(record.job, record.action, record.decided_unix_seconds)
            if record.outcome == PENDING:
                interrupted.append(record)
        for record in interrupted:
            so_far = f"{record.detail}; " if record.detail else ""
            self._finish(
                record,
                FAILED,
                f"{so_far}interrupted: the coordinator carrying it out stopped or handed the job on; "
                "not redone, since how much of it was carried out is unknown",
            )
            if record.incident_id:
                self._give_back(
                    record.incident_id,
                    f"{record.action.replace('_', ' ')} {record.id} was interrupted (coordinator restarted or replaced) "
                    "and is not redone; left to a person (resolves by itself once the condition clears)",
                )
        for incident in self._watchdog.book.live():
            if incident.state == IncidentState.ACTING and (incidents is None or incident.id in incidents):
                self._give_back(
                    incident.id,
                    "the coordinator that was acting on it stopped or handed the job on, and this one does not "
                    "track that recovery; left to a person (resolves by itself once the condition clears)",
                )
        if records:
            logger.info(
                "recovery: took over %d action record(s) of the previous coordinator; %d interrupted, not redone",
                len(records),
                len(interrupted),
            )

    def forget_job(self, job: str) -> None:
        """A job ended on purpose (EndJob): stop tracking its restart and drop its counts.

        The policy keeps its restart budget: a job SLURM requeues under the same
        name is still rate-limited.
        """
        self._restarted.pop(job, None)
        self.counts.forget(job)

    async def restart(
        self, job: str, reason: str, exclude_nodes: Sequence[str] = ()
    ) -> cluster_pb2.ActionRecord:
        """An operator's restart (RequestAction): the same path as the policy's, minus its safety rules."""
        action = restart_action(exclude_nodes)
        decision = Decision("", job, action, reason, exclude_nodes=tuple(exclude_nodes))
        self.policy.note_action(job, action, self._wall())
        return await self._carry_out(decision, None)

    async def _carry_out(self, decision: Decision, incident: Incident | None) -> cluster_pb2.ActionRecord:
        plan: dict[str, dict[str, str]] = {}
        if decision.action == AVOID_INTERFACE and not decision.skipped:
            decision, plan = self._plan_avoidance(decision)
        record = cluster_pb2.ActionRecord(
            id=f"{decision.action}-{uuid.uuid4().hex[:10]}",
            job=decision.job,
            action=decision.action,
            reason=decision.reason,
            incident_id=decision.incident_id,
            dry_run=self.settings.dry_run,
            outcome=PENDING,
            decided_unix_seconds=self._wall(),
            exclude_nodes=decision.exclude_nodes,
            avoid_interfaces=[f"{node}/{interface}" for node, interface in decision.avoid_interfaces],
        )
        settled = self._settled_without_acting(decision)
        if settled is not None:
            if incident is not None and incident.kind == Kind.RANK_FAILURE and settled[0] == DONE:
                self._watch_launcher_restart(incident)
            return self._finish(record, *settled)
        self._save(record)
        try:
            await self._record_beyond_this_process(record.job)
            if checkpoints_first(decision.action, incident.kind if incident else None):
                step = await self._checkpoint_now(decision.job, CHECKPOINT_TIMEOUT_S)
                record.detail = f"checkpoint complete at step {step}"
                if decision.action == CHECKPOINT:
                    return self._finish(record, DONE, record.detail)
            if decision.action in RESTARTS:
                return await self._restart(record, incident, plan)
            acts = {STOP_ORPHANS: self._stop_orphans, REBALANCE: self._rebalance}
            if (act := acts.get(decision.action)) is not None:
                return await act(record)
        except Exception as exc:  # a failed action is recorded, never raised into the loop
            logger.exception("action %s on job %s failed", record.id, record.job)
            return self._finish(record, FAILED, f"{record.detail + '; ' if record.detail else ''}{exc}")
        return self._finish(record, FAILED, f"unknown action {decision.action!r}")

    def _plan_avoidance(self, decision: Decision) -> tuple[Decision, dict[str, dict[str, str]]]:
        """The worker environment that keeps the job off the decision's interfaces; where there
        is none, the decision becomes exclude_node_and_restart of their nodes (and says why)."""
        job = self._jobs().get(decision.job)
        plan = (
            plan_worker_env(job, self._nodes(), decision.avoid_interfaces)
            if job is not None
            else f"job {decision.job} is gone"
        )
        if isinstance(plan, dict):
            return decision, plan
        nodes = tuple(dict.fromkeys(node for node, _ in decision.avoid_interfaces))
        return (
            dataclasses.replace(
                decision,
                action=EXCLUDE_NODE_AND_RESTART,
                exclude_nodes=nodes,
                avoid_interfaces=(),
                reason=f"{decision.reason}; no interface to move to ({plan}): without {', '.join(nodes)}",
            ),
            {},
        )

    def _rebalances(self, job_name: str) -> bool:
        """Whether every running rank of the job splits its batch by shares (BalancedBatchSampler)."""
        job = self._jobs().get(job_name)
        ranks = job.running_ranks() if job is not None else []
        return bool(ranks) and all(r.identity.rebalances for r in ranks)

    async def _rebalance(self, record: cluster_pb2.ActionRecord) -> cluster_pb2.ActionRecord:
        """Send every node of the job the ranks' new shares of the global batch."""
        job = self._jobs().get(record.job)
        shares = batch_shares(job) if job is not None else f"job {record.job} is gone"
        if job is None or isinstance(shares, str):
            return self._finish(record, FAILED, str(shares))
        current = current_shares(job)
        shown = ", ".join(f"rank {rank} {share:.3f}" for rank, share in enumerate(shares))
        if not worth_changing(current, shares):
            return self._finish(record, DONE, f"already balanced ({shown})")
        if self._send_command is None:
            return self._finish(record, FAILED, "this coordinator cannot reach agents to send batch shares")
        from_step = first_step(job)
        rebalance = agent_pb2.RebalanceCommand(
            job=record.job, shares=shares, from_step=from_step, reason=f"{record.action} {record.id}"
        )
        answers = await send_each(self._send_command, dict.fromkeys(job.nodes(), rebalance))
        if not_taken := [f"{node} ({why})" for node, why in answers.items() if why]:
            # Ranks splitting by different shares would overlap and miss samples: the nodes that
            # took the new ones get the split in force again, from the same step.
            keep = agent_pb2.RebalanceCommand(
                job=record.job,
                shares=current or [1.0 / job.world_size] * job.world_size,
                from_step=from_step,
                reason=f"undone: {rebalance.reason}",
            )
            await send_each(self._send_command, {node: keep for node, why in answers.items() if not why})
            return self._finish(record, FAILED, f"batch shares not relayed on {', '.join(not_taken)}")
        return self._finish(record, DONE, f"batch shares from step {from_step}: {shown}")

    async def _move_workers(self, record: cluster_pb2.ActionRecord, plan: dict[str, dict[str, str]]) -> str:
        """Give every node's agent the environment the restarted workers start with; "" when all
        took it, else why the restart is not made (it would not move the job)."""
        prefix = f"{record.detail}; " if record.detail else ""
        if self._send_command is None:
            return f"{prefix}this coordinator cannot reach agents to set the workers' environment"
        expires_unix_s = self._wall() + self.settings.avoid_interface_hold_s
        reason = f"{record.action} {record.id}: {record.reason}"
        answers = await send_each(
            self._send_command,
            worker_env_commands(
                record.job,
                plan,
                reason=reason,
                expires_unix_s=expires_unix_s,
                avoided=record.avoid_interfaces,
            ),
        )
        if not_taken := [f"{node} ({why})" for node, why in answers.items() if why]:
            # Half a move is worse than none: the nodes that took it forget it again.
            took: dict[str, dict[str, str]] = {node: {} for node, why in answers.items() if not why}
            undo = worker_env_commands(record.job, took, reason=f"undone: {reason}", expires_unix_s=0.0)
            await send_each(self._send_command, undo)
            return f"{prefix}not restarted: the workers' environment was not set on {', '.join(not_taken)}"
        record.detail = f"{prefix}workers start with {describe(plan)}"
        return ""

    async def _record_beyond_this_process(self, job: str) -> None:
        """Make the job's records durable for the rest of the group first (``before_acting``).

        Raises:
            RuntimeError: they could not be: the action is not carried out.
        """
        if self.before_acting is None:
            return
        try:
            await self.before_acting(job)
        except Exception as exc:
            raise RuntimeError(
                f"not carried out: it could not be recorded for the rest of the group ({exc})"
            ) from exc

    def _settled_without_acting(self, decision: Decision) -> tuple[str, str] | None:
        """(outcome, detail) for decisions that act on nothing: skipped, alerts, dry runs."""
        if decision.skipped:
            if decision.rate_limited:
                self.counts.rate_limited[decision.job] += 1
            return SKIPPED, decision.skipped
        if decision.action == ALERT:
            return DONE, "alerted (the incident is the alert)"
        # Only the policy's decisions: an operator who restarts a contested job has looked.
        if decision.incident_id and (conflicts := self._conflicts(decision.job)):
            return (
                SKIPPED,
                f"alerted instead: two nodes claim ranks of job {decision.job}, so what they report of it cannot "
                f"be trusted: {'; '.join(c.describe() for c in conflicts)}",
            )
        # Only the policy's exclusions (they have an incident): an operator may know of a replacement node.
        if (
            decision.incident_id
            and decision.action == EXCLUDE_NODE_AND_RESTART
            and (blocker := self._exclusion_blocker(decision))
        ):
            return (
                SKIPPED,
                f"alerted instead: job {decision.job} cannot run without {', '.join(decision.exclude_nodes)}: {blocker}",
            )
        if self.settings.dry_run:
            return DONE, f"dry run: would {decision.action.replace('_', ' ')} job {decision.job}"
        return None

    def _conflicts(self, job_name: str) -> list[RankConflict]:
        job = self._jobs().get(job_name)
        return job.conflicts(self._wall()) if job is not None else []

    def _exclusion_blocker(self, decision: Decision) -> str:
        job = self._jobs().get(decision.job)
        if job is None:
            return "it is gone"
        return exclusion_blocker(
            job.nodes(),
            decision.exclude_nodes,
            min_nodes=job.min_nodes,
            max_nodes=job.max_nodes,
            replaces_nodes=self._launcher.replaces_nodes,
        )

    def _watch_launcher_restart(self, incident: Incident) -> None:
        """A rank died: its launcher (torchrun --max-restarts) restarts the group; measure the recovery.

        Not for an opted-out job: its incidents are left as they are, to people.
        """
        job = self._jobs().get(incident.job)
        if job is None or incident.job in self._restarted or incident.job in self.settings.opt_out_jobs:
            return
        watch = self._restart_watch(job, incident, self._wall())
        generation = incident.key[-1]  # the failed generation (the finding's key ends with it)
        if isinstance(generation, int):  # the restarted group may have reported already
            watch.restart_count = min(watch.restart_count, generation)
        self._track_restart(watch)
        self._watchdog.note_recovery(
            incident.id,
            f"waiting for the launcher to restart the worker group, resuming from step "
            f"{self._restarted[incident.job].resume_step}",
        )
        if incident.state in (IncidentState.OPEN, IncidentState.ACKNOWLEDGED):
            self._watchdog.move(incident.id, IncidentState.ACTING)

    def _track_restart(self, watch: _Restarted) -> None:
        self._restarted[watch.job] = watch
        self.counts.restarts[(watch.job, watch.reason)] += 1

    def _restart_watch(self, job: JobRecord, incident: Incident | None, started_unix_s: float) -> _Restarted:
        """What recovery tracking needs to know about a job at its restart."""
        latest = self._latest_checkpoint(job.job)
        finished = [r.last_step for r in job.ranks.values() if r.last_step is not None]
        step_times = sorted(s.step_s for s in finished)
        return _Restarted(
            incident_id=incident.id if incident else "",
            job=job.job,
            reason=incident.kind.value if incident else REQUESTED,
            restart_count=job.restart_count,
            resume_step=latest + 1 if latest is not None else 0,
            furthest_step=max((s.step for s in finished), default=0),
            opened_unix_s=incident.opened_unix_s if incident else started_unix_s,
            started_unix_s=started_unix_s,
            last_progress_unix_s=max(
                (r.last_progress_unix_s for r in job.ranks.values() if r.last_progress_unix_s),
                default=started_unix_s,
            ),
            step_s=step_times[len(step_times) // 2] if step_times else 0.0,
        )

    async def _restart(
        self,
        record: cluster_pb2.ActionRecord,
        incident: Incident | None,
        worker_env: dict[str, dict[str, str]] | None = None,
    ) -> cluster_pb2.ActionRecord:
        """Restart the job through its launcher, its workers given ``worker_env`` first (by node)."""
        job = self._jobs().get(record.job)
        if job is None:
            return self._finish(record, FAILED, f"job {record.job} is gone")
        if worker_env and (not_taken := await self._move_workers(record, worker_env)):
            return self._finish(record, FAILED, not_taken)
        watch = self._restart_watch(job, incident, self._wall())
        if worker_env:
            watch.moved_to = {n: i for n, env in worker_env.items() if (i := env.get(GLOO_SOCKET_IFNAME))}
            watch.avoided = tuple(record.avoid_interfaces)
        record.resume_step = watch.resume_step
        if incident is not None and incident.state in (IncidentState.OPEN, IncidentState.ACKNOWLEDGED):
            self._watchdog.move(incident.id, IncidentState.ACTING)
        outcome = await self._launcher.restart(
            record.job, job.nodes(), list(record.exclude_nodes), record.reason
        )
        prefix = f"{record.detail}; " if record.detail else ""
        if not outcome.ok:
            if incident is not None:
                self._give_back(incident.id, f"restart failed: {outcome.detail}")
            return self._finish(record, FAILED, prefix + outcome.detail)
        self._track_restart(watch)
        where = (
            f"resumes from step {record.resume_step}"
            if record.resume_step
            else "starts over (no complete checkpoint)"
        )
        return self._finish(record, DONE, f"{prefix}{outcome.detail}; the job {where}")

    async def _stop_orphans(self, record: cluster_pb2.ActionRecord) -> cluster_pb2.ActionRecord:
        """Have each node's agent stop the job's orphaned ranks there (see the module docstring)."""
        job = self._jobs().get(record.job)
        if job is None:
            return self._finish(record, FAILED, f"job {record.job} is gone")
        if self._send_stop is None:
            return self._finish(record, FAILED, "this coordinator cannot reach agents to stop processes")
        targets = {node: pids for node in job.nodes() if (pids := orphan_pids(job, node))}
        if not targets:
            return self._finish(record, DONE, "no orphaned rank left to stop")
        grace_s = self.settings.restart_grace_s
        commands = {
            node: agent_pb2.StopWorkersCommand(
                job=record.job, grace_seconds=grace_s, reason=record.reason, pids=pids
            )
            for node, pids in targets.items()
        }
        answers = await asyncio.gather(
            *(
                stop_on_node(self._send_stop, n, c, grace_s + STOP_ANSWER_MARGIN_S)
                for n, c in commands.items()
            )
        )
        outcome = summarise_stops(record.job, dict(zip(commands, answers, strict=True)), ())
        return self._finish(record, DONE if outcome.ok else FAILED, f"orphans: {outcome.detail}")

    def _track(self, now_unix_s: float) -> None:
        jobs = self._jobs()
        for name, restarted in list(self._restarted.items()):
            job = jobs.get(name)
            if job is not None and _resumed(job, restarted):
                del self._restarted[name]
                recovery_s = now_unix_s - restarted.opened_unix_s
                lost = max(0, restarted.furthest_step + 1 - restarted.resume_step)
                self.counts.last_recovery_s[name] = recovery_s
                self.counts.steps_lost[name] += lost
                self.counts.unproductive_s[name] = (
                    self.counts.unproductive_s.get(name, 0.0)
                    + max(0.0, now_unix_s - restarted.last_progress_unix_s)
                    + lost * restarted.step_s
                )
                logger.warning(
                    "job %s recovered: every rank past step %d, %.1f s after the incident opened; %d steps lost",
                    name,
                    restarted.resume_step,
                    recovery_s,
                    lost,
                )
                if restarted.incident_id and self._watchdog.book.get(restarted.incident_id) is not None:
                    moved, moved_evidence = _moved(job, restarted) if restarted.avoided else ("", {})
                    self._watchdog.note_recovery(
                        restarted.incident_id,
                        f"recovered {recovery_s:.1f} s after it opened: every rank past step "
                        f"{restarted.resume_step}, {lost} steps done again{moved}",
                        {
                            "recovery_seconds": recovery_s,
                            "steps_lost": float(lost),
                            "resume_step": float(restarted.resume_step),
                            **moved_evidence,
                        },
                    )
                    self._watchdog.move(restarted.incident_id, IncidentState.RESOLVED)
            elif now_unix_s - restarted.started_unix_s > self.settings.recovery_timeout_s:
                del self._restarted[name]
                if restarted.incident_id:
                    self._give_back(
                        restarted.incident_id,
                        f"job {name} did not get past step {restarted.resume_step} within "
                        f"{self.settings.recovery_timeout_s:g} s of the restart; left to a person",
                    )

    def _give_back(self, incident_id: str, why: str) -> None:
        incident = self._watchdog.book.get(incident_id)
        if incident is None:
            return
        self._watchdog.note_recovery(incident_id, why)
        if incident.state in (IncidentState.OPEN, IncidentState.ACTING):
            self._watchdog.move(incident_id, IncidentState.ACKNOWLEDGED)

    def _finish(
        self, record: cluster_pb2.ActionRecord, outcome: str, detail: str
    ) -> cluster_pb2.ActionRecord:
        record.outcome, record.detail = outcome, detail
        record.finished_unix_seconds = self._wall()
        self.counts.actions[(record.job, record.action, outcome)] += 1
        level = logging.WARNING if outcome in (FAILED, SKIPPED) else logging.INFO
        logger.log(
            level, "action %s %s on job %s: %s (%s)", record.id, outcome, record.job, detail, record.reason
        )
        if outcome == SKIPPED and record.incident_id:
            self._watchdog.note_recovery(
                record.incident_id, f"no {record.action.replace('_', ' ')}: {detail}"
            )
        self._save(record)
        return record

    def _save(self, record: cluster_pb2.ActionRecord) -> None:
        try:
            self._event_log.save_action(record)
        except Exception:
            logger.exception("could not persist action %s", record.id)


def _resumed(job: JobRecord, restarted: _Restarted) -> bool:
    """Every rank of a newer generation finished a step at or past the resume step."""
    if job.restart_count <= restarted.restart_count:
        return False
    ranks = [r for r in job.ranks.values() if r.identity.restart_count == job.restart_count]
    return len(ranks) >= job.world_size and all(
        r.state == RUNNING and r.last_step is not None and r.last_step.step >= restarted.resume_step
        for r in ranks
    )


def _moved(job: JobRecord, restarted: _Restarted) -> tuple[str, dict[str, float]]:
    """Whether the restarted ranks talk where avoid_interface moved them (their agents read their sockets),
    for the incident's note, and the bus bandwidth they reach there."""
    used = job_interfaces(job)
    avoided = [name.partition("/") for name in restarted.avoided]
    still = sorted(f"{node}/{iface}" for node, _, iface in avoided if iface in used.get(node, ()))
    busbw = job_bus_bandwidth(job)
    evidence = {"moved_bus_bandwidth_bytes_per_second": busbw} if busbw is not None else {}
    shown = f", bus bandwidth {busbw / 1e9:.2f} GB/s" if busbw is not None else ""
    if still:
        return f"; but its ranks still use {', '.join(still)}: not moved{shown}", evidence
    on = sorted(
        f"{node}/{iface}" for node, iface in restarted.moved_to.items() if iface in used.get(node, ())
    )
    if not on:
        return f"; which interfaces its ranks use now is not known yet{shown}", evidence
    return f"; its ranks now talk over {', '.join(on)}{shown}", evidence
