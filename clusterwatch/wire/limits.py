"""What a wire message may hold, in one table for every side that checks one.

The agent checks what hooks send (agent/hook_validation.py) with the same
limits the coordinator checks node reports (coordinator/ingest/report_checks.py) and
API requests (coordinator/api/request_checks.py) with: whatever the agent forwards
must pass the coordinator, or it refuses a whole rank's report. A limit lives
here once; each checker reads it.

Strings: ids at most MAX_ID_CHARS characters, free text (TEXT_FIELDS) at most
MAX_TEXT_CHARS, stack dumps (DUMP_FIELDS) at most MAX_STACK_DUMP_CHARS.
Repeated fields: at most MAX_ENTRIES[full name], else DEFAULT_MAX_ENTRIES;
each element of a repeated string at most REPEATED_STRING_CHARS[full name].
Times: a ``*_unix_seconds`` more than MAX_CLOCK_SKEW_S from the checker's clock
is refused.
"""

from __future__ import annotations

from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S

MAX_ID_CHARS = 256
# Free text: errors, exit descriptions, checkpoint paths (PATH_MAX is 4096).
MAX_TEXT_CHARS = 4096
TEXT_FIELDS = frozenset({"error", "last_error", "description", "path", "message", "reason"})
# `py-spy dump` of every thread of a training process.
MAX_STACK_DUMP_CHARS = 1 << 20
DUMP_FIELDS = frozenset({"stack_dump"})

# A node with NTP is within milliseconds; a day leaves room for a broken clock
# while refusing what is plainly not a time (0 stays allowed: unset).
MAX_CLOCK_SKEW_S = 86_400.0
# Declared report intervals: the token bucket (coordinator/ingest/admission.py) paces a
# node by its interval, so the shortest one bounds what one node may send.
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 3600.0
# No agent numbers this many reports in its life (136 years at 1 Hz): a jump
# this far past the last one is a broken sequence, not reports that were lost.
MAX_SEQUENCE_JUMP = 1 << 32

# More GPUs than NVML could report on one node: the largest single-host
# systems have 16 (HGX-2/DGX-2 class); 8 GPUs x 7 MIG instances each is 56.
MAX_GPUS = 64
# NVML_NVLINK_MAX_LINKS is 18 (nvml.h, Hopper and Blackwell); room for growth.
MAX_NVLINKS = 64
# One duration bucket per bound plus +Inf.
DURATION_BUCKETS = len(COLLECTIVE_DURATION_BUCKETS_S) + 1

V1 = "clusterwatch.v1."
# Repeated fields and their most entries (DEFAULT_MAX_ENTRIES otherwise).
MAX_ENTRIES: dict[str, int] = {
    # --- what a hook sends (hook.proto, training.proto)
    # One StepBatch: the hook's queue holds 1024 by default.
    f"{V1}StepBatch.steps": 4096,
    # Kinds of collective in one step (op x group x dtype x size bucket).
    f"{V1}StepSummary.collectives": 1024,
    f"{V1}Heartbeat.flight_recorder": 1024,
    f"{V1}Heartbeat.blind_spots": 16,
    # Groups one rank belongs to, and the members of one listed (not evenly spaced) group.
    f"{V1}Heartbeat.process_groups": 1024,
    f"{V1}ProcessGroupMembership.ranks": 1024,
    f"{V1}CollectiveSummary.duration_bucket_counts": DURATION_BUCKETS,
    # --- what an agent sends (node.proto, agent.proto)
    f"{V1}NodeReport.gpus": MAX_GPUS,
    # Kubernetes nodes carry one veth per pod (110 by default), plus bridges and VLANs.
    f"{V1}NodeReport.nics": 4096,
    # HCAs x ports, SR-IOV functions included.
    f"{V1}NodeReport.ib_ports": 256,
    f"{V1}NodeReport.collectors": 64,
    # One per training process on the node (one per core for CPU jobs), plus those that exited
    # (agent/hook_limits.py keeps a node's live ranks at most this many).
    f"{V1}NodeReport.ranks": 1024,
    # One per job the agent gives starting workers an environment (avoid_interface).
    f"{V1}NodeReport.worker_env": 1024,
    f"{V1}WorkerEnvEntry.avoided_interfaces": 64,
    f"{V1}GpuSample.nvlinks": MAX_NVLINKS,
    # Distinct XID codes (they are below 200 today).
    f"{V1}GpuSample.xid_errors": 1024,
    # Processes holding memory on one GPU (MPS allows 48 clients per GPU).
    f"{V1}GpuSample.processes": 4096,
    f"{V1}GpuInventory.query_errors": 1024,
    # mlx5 exposes ~100 hw_counters per port.
    f"{V1}IbPortSample.hw_counters": 1024,
    # The agent keeps at most max_steps_per_report (default 512) per rank.
    f"{V1}RankReport.steps": 4096,
    # The agent merges at most agent/hook_limits.py's MAX_COLLECTIVE_KINDS per rank and report.
    f"{V1}RankReport.collectives": 4096,
    # The agent keeps at most 64 per rank between two reports.
    f"{V1}RankReport.checkpoint_results": 256,
    f"{V1}Hello.capabilities": 64,
    f"{V1}CommandResult.diagnoses": 4096,
    f"{V1}CommandResult.stopped": 4096,
    f"{V1}CommandResult.probes": 16,  # agent/commands.py MAX_PROBE_TARGETS
}
DEFAULT_MAX_ENTRIES = 1024
# Repeated strings, and how long each element may be (ids; blind spots are sentences).
REPEATED_STRING_CHARS: dict[str, int] = {
    f"{V1}Hello.capabilities": MAX_ID_CHARS,
    f"{V1}TopologyNic.interfaces": MAX_ID_CHARS,
    f"{V1}NodeTopology.problems": MAX_ID_CHARS,
    f"{V1}Heartbeat.blind_spots": MAX_TEXT_CHARS,
    f"{V1}NicSample.addresses": MAX_ID_CHARS,
    f"{V1}RankReport.interfaces": MAX_ID_CHARS,
    f"{V1}WorkerEnvEntry.avoided_interfaces": MAX_ID_CHARS,
}
