"""The recovery policy: which action an incident gets, and whether it may have it now.

Pure: decisions are a function of the incident, the settings and the job's
recent actions (kept here), with the clock as an argument. The recovery
executor (coordinator/recovery/executor.py) carries decisions out and records them.

Safety, in the order it is checked:

1. nothing new for a job within ``cooldown_s`` of its previous action: the
   decision waits until the cooldown is over;
2. an opted-out job gets nothing but alerts;
3. no more than ``max_restarts_per_hour`` restarts of a job: the next one
   is skipped and the incident says the job is left to a person;
4. no restart for a collective mismatch (ranks of one group in different
   collectives): it is the program taking different paths, and the restarted
   job would run into it again from its last checkpoint. It is alerted, with
   the stacks that show where.

Each incident is decided once (a straggler only once it persisted
``straggler_persist_s``); a skipped decision is recorded like a taken one.
Whether a job can do without a node (``exclusion_blocker``) and whether it
can checkpoint first (``checkpoints_first``) are decided here too, as pure
functions the executor calls with what it knows of the job and launcher.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection

from clusterwatch.config import RecoverySettings
from clusterwatch.coordinator.detection.causes.network import CORROBORATING_EVIDENCE
from clusterwatch.coordinator.model.incidents import Incident, Kind, Severity
from clusterwatch.wire.recovery_names import (
    ALERT,
    AVOID_INTERFACE,
    CHECKPOINT,
    CHECKPOINT_AND_RESTART,
    EXCLUDE_NODE_AND_RESTART,
    REBALANCE,
    RESTARTS,
)

HOUR_S = 3600.0
# A hang or failure whose ranks called different collectives (coordinator/detection/mismatch.py): a bug, not a fault.
COLLECTIVE_MISMATCH = "collective_mismatch"
NODE_KINDS = frozenset({Kind.NODE_UNREACHABLE, Kind.GPU_XID, Kind.GPU_LOST, Kind.INFINIBAND})
# Splits one straggler incident gets at most (see Policy._rebalanced).
MAX_REBALANCES = 3
# The cause of a job slowdown that names nodes (coordinator/detection/causes/network.py).
NETWORK_CAUSE = "network"
# A straggler's cause when no fault explains it: it is simply slower (coordinator/detection/causes/).
COMPUTE_CAUSE = "compute"
# Kinds whose job still makes progress, so it can checkpoint before a restart
# (a hung, crashed or node-less job cannot: it resumes from the last complete one).
PROGRESSING_KINDS = frozenset({Kind.STRAGGLER, Kind.JOB_SLOWDOWN})


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one incident.

    Attributes:
        skipped: why it will not be done ("" when it will).
        rate_limited: skipped because the job used up its restarts for the hour.
        exclude_nodes: nodes to restart without (exclude_node_and_restart).
        avoid_interfaces: (node, interface) to restart the job off (avoid_interface).
    """

    incident_id: str
    job: str
    action: str
    reason: str
    skipped: str = ""
    rate_limited: bool = False
    exclude_nodes: tuple[str, ...] = ()
    avoid_interfaces: tuple[tuple[str, str], ...] = ()


class Policy:
    """Decides, remembering each job's recent actions for the safety rules.

    Args:
        settings: the ``[recovery]`` settings.
    """

    def __init__(self, settings: RecoverySettings) -> None:
        self.settings = settings
        self._decided: set[str] = set()
        # A straggler rebalanced so far: (times, when last). It is decided again, once it has
        # persisted straggler_persist_s past the last split, up to MAX_REBALANCES times: a split
        # from one measurement can leave the rank a little slow, and the next one corrects it.
        self._rebalanced: dict[str, tuple[int, float]] = {}
        self._last_action_unix_s: dict[str, float] = {}
        self._restarts_unix_s: dict[str, collections.deque[float]] = {}

    def action_for(self, incident: Incident, *, rebalances: bool = False) -> str | None:
        """The configured action for the incident's kind; None for kinds the policy leaves alone.
        ``rebalances``: the incident's job splits its batch by shares (BalancedBatchSampler)."""
        s = self.settings
        by_kind = {
            Kind.HANG: s.hang_action,
            Kind.RANK_FAILURE: s.rank_failure_action,
            Kind.STRAGGLER: s.straggler_action,
            Kind.ORPHANED_RANKS: s.orphaned_ranks_action,
        }
        if (
            incident.kind == Kind.STRAGGLER
            and incident.cause == COMPUTE_CAUSE
            and s.straggler_rebalance
            and rebalances
        ):
            return REBALANCE
        if incident.kind in by_kind:
            return by_kind[incident.kind]
        if incident.kind in NODE_KINDS and incident.severity == Severity.CRITICAL:
            return s.node_failure_action
        if (
            incident.kind == Kind.JOB_SLOWDOWN
            and incident.cause == NETWORK_CAUSE
            and incident.nodes
            # Only what a node's transport says: nodes that merely measure slower (bus bandwidth,
            # transmit wait) may be a bad link's victims, and are alerted, not restarted without.
            and CORROBORATING_EVIDENCE & incident.evidence.keys()
        ):
            # No interface named (nothing on the node says which): its node, as for any node fault.
            action = s.network_slowdown_action
            return (
                EXCLUDE_NODE_AND_RESTART if action == AVOID_INTERFACE and not incident.interfaces else action
            )
        return None

    def decide(self, incident: Incident, now_unix_s: float, *, rebalances: bool = False) -> Decision | None:
        """A decision for an incident not decided yet, or None (not its time, not its kind, no job).
        ``rebalances``: the incident's job splits its batch by shares (see action_for)."""
        if incident.id in self._decided or not incident.job:
            return None
        action = self.action_for(incident, rebalances=rebalances)
        if action is None:
            return None
        if not self._due(incident, action, now_unix_s):
            return None
        if action == REBALANCE:
            times, _ = self._rebalanced.get(incident.id, (0, 0.0))
            self._rebalanced[incident.id] = (times + 1, now_unix_s)
        else:
            self._decided.add(incident.id)
        exclude = incident.nodes if action == EXCLUDE_NODE_AND_RESTART else ()
        avoid = incident.interfaces if action == AVOID_INTERFACE else ()
        decision = Decision(
            incident.id, incident.job, action, incident.summary, exclude_nodes=exclude, avoid_interfaces=avoid
        )
        skipped, rate_limited = self._why_not(decision, now_unix_s)
        if not skipped and action in RESTARTS and incident.cause == COLLECTIVE_MISMATCH:
            skipped = (
                "alerted instead: a collective mismatch is the program taking different paths on different "
                "ranks; a restart resumes from the last checkpoint and runs into it again (see the incident's "
                "stacks)"
            )
        if skipped:
            return dataclasses.replace(decision, skipped=skipped, rate_limited=rate_limited)
        self.note_action(incident.job, action, now_unix_s)
        return decision

    def _due(self, incident: Incident, action: str, now_unix_s: float) -> bool:
        """Whether the incident's action is due now: a straggler persisted (since its last split),
        fewer than MAX_REBALANCES splits, the job's cooldown over."""
        times, since_unix_s = self._rebalanced.get(incident.id, (0, incident.opened_unix_s))
        if action == REBALANCE and times >= MAX_REBALANCES:
            self._decided.add(incident.id)  # left as it is: the incident says how far it got
            return False
        if incident.kind == Kind.STRAGGLER and now_unix_s - since_unix_s < self.settings.straggler_persist_s:
            return False
        return action == ALERT or not self._cooling_down(incident.job, now_unix_s)

    def retain(self, live_incident_ids: set[str]) -> None:
        """Forget decisions about incidents that are no longer live (they never come back)."""
        self._decided &= live_incident_ids
        self._rebalanced = {i: kept for i, kept in self._rebalanced.items() if i in live_incident_ids}

    def note_action(self, job: str, action: str, now_unix_s: float) -> None:
        """Count an action against the job's cooldown and restart budget (operator requests too)."""
        if action == ALERT:
            return
        self._last_action_unix_s[job] = now_unix_s
        if action in RESTARTS:
            self._restarts_unix_s.setdefault(job, collections.deque()).append(now_unix_s)

    def restarts_in_last_hour(self, job: str, now_unix_s: float) -> int:
        times = self._restarts_unix_s.get(job)
        if times is None:
            return 0
        while times and now_unix_s - times[0] >= HOUR_S:
            times.popleft()
        return len(times)

    def _cooling_down(self, job: str, now_unix_s: float) -> bool:
        last = self._last_action_unix_s.get(job)
        return last is not None and now_unix_s - last < self.settings.cooldown_s

    def _why_not(self, decision: Decision, now_unix_s: float) -> tuple[str, bool]:
        """Why the decision will not be carried out ("" when it will), and whether that is the rate limit."""
        s = self.settings
        if decision.action == ALERT:
            return "", False
        if decision.job in s.opt_out_jobs:
            return f"job {decision.job} opted out of automatic actions", False
        if decision.action in RESTARTS:
            restarts = self.restarts_in_last_hour(decision.job, now_unix_s)
            if restarts >= s.max_restarts_per_hour:
                return (
                    f"rate limit: job {decision.job} was restarted {restarts} times in the last hour "
                    f"(max {s.max_restarts_per_hour}); left to a person"
                ), True
        return "", False


def checkpoints_first(action: str, kind: Kind | None) -> bool:
    """Whether ``action`` on an incident of ``kind`` saves a coordinated checkpoint before anything else.

    ``checkpoint`` always; the restarts that may checkpoint, only when the job
    still makes progress (None: an operator's request, which does not).
    """
    if action == CHECKPOINT:
        return True
    return (
        action in (CHECKPOINT_AND_RESTART, EXCLUDE_NODE_AND_RESTART, AVOID_INTERFACE)
        and kind in PROGRESSING_KINDS
    )


def exclusion_blocker(
    job_nodes: Collection[str],
    exclude: Collection[str],
    *,
    min_nodes: int,
    max_nodes: int,
    replaces_nodes: bool,
) -> str:
    """Why the job cannot run without ``exclude`` ("" when it can).

    Args:
        job_nodes: the nodes the job runs on.
        exclude: the nodes to restart it without.
        min_nodes / max_nodes: the launcher's node range (torchrun --nnodes;
            0 when unknown).
        replaces_nodes: the launcher gets other nodes in their place (SLURM,
            Kubernetes): then nothing blocks.
    """
    if replaces_nodes:
        return ""
    left = len(set(job_nodes) - set(exclude))
    if left == 0:
        return "it has no other node to run on"
    if min_nodes == 0:
        return "its node range is unknown (not launched with torchrun --nnodes MIN:MAX)"
    if min_nodes == max_nodes:
        return f"it is not elastic (torchrun --nnodes {min_nodes})"
    if left < min_nodes:
        return f"it needs at least {min_nodes} nodes (torchrun --nnodes {min_nodes}:{max_nodes}) and would have {left}"
    return ""
