"""The names recovery speaks in: actions and launcher kinds, once for config, API, policy and launchers.

They are wire and config vocabulary (``ActionRequest.action``,
``ActionRecord.action``, ``[recovery] *_action`` and ``launcher``), so they
live in the shared package: the CLI and the client send them, the
coordinator's policy, actions and launchers act on them.
"""

from __future__ import annotations

ALERT = "alert"
CHECKPOINT = "checkpoint"
RESTART = "restart"
CHECKPOINT_AND_RESTART = "checkpoint_and_restart"
EXCLUDE_NODE_AND_RESTART = "exclude_node_and_restart"
STOP_ORPHANS = "stop_orphans"
AVOID_INTERFACE = "avoid_interface"
REBALANCE = "rebalance"
RESTORE_INTERFACES = "restore_interfaces"

# What ``hang_action``, ``rank_failure_action``, ``straggler_action`` and ``node_failure_action`` may be.
POLICY_ACTIONS = (ALERT, CHECKPOINT, RESTART, CHECKPOINT_AND_RESTART, EXCLUDE_NODE_AND_RESTART)
# What ``network_slowdown_action`` may be.
NETWORK_ACTIONS = (*POLICY_ACTIONS, AVOID_INTERFACE)
# What ``orphaned_ranks_action`` may be.
ORPHAN_ACTIONS = (ALERT, STOP_ORPHANS)
# The actions that stop a job's workers for its launcher to start them again.
RESTARTS = frozenset({RESTART, CHECKPOINT_AND_RESTART, EXCLUDE_NODE_AND_RESTART, AVOID_INTERFACE})
# What an operator may ask for (RequestAction): the policy's decisions are its own.
REQUESTABLE = (CHECKPOINT, RESTART, EXCLUDE_NODE_AND_RESTART, RESTORE_INTERFACES)

# The launcher adapters of coordinator/recovery/launchers/ (registry.py builds each kind).
TORCHRUN, SLURM, KUBERNETES = "torchrun", "slurm", "kubernetes"
LAUNCHER_KINDS = (TORCHRUN, SLURM, KUBERNETES)


def restart_action(exclude_nodes: object) -> str:
    """The restart an operator asks for: without the named nodes when there are any."""
    return EXCLUDE_NODE_AND_RESTART if exclude_nodes else RESTART
