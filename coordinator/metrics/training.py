"""Prometheus families for training jobs, ranks and collectives, rendered from job views.

Cardinality is bounded by jobs x ranks x ops (ops per job are capped by the
job store); step and sequence numbers are values, never labels. Each HELP
says what a bad value means, since that is what someone reading a dashboard
at 3 a.m. needs.
"""

from __future__ import annotations

from collections import Counter

from clusterwatch.coordinator.model.checkpoints import CHECKPOINT_OUTCOMES
from clusterwatch.coordinator.views.jobs import JobView, RankView, TrainingView
from clusterwatch.exposition.promtext import Exposition, Family, counter, escape, gauge, histogram
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S

RankState = training_pb2.RankState

JOB_INFO = gauge(
    "clusterwatch_job_info",
    "A training job and its labels (under SLURM: slurm_job_id, slurm_job_name, slurm_array_job_id, "
    "slurm_array_task_id, slurm_nodelist, slurm_partition, slurm_account, slurm_user); value 1. Join on job "
    "to put SLURM's names on any training series.",
)
RANK_INFO = gauge(
    "clusterwatch_rank_info",
    "A training rank's placement and process; value 1. Join on job and rank; a changed pid or node means "
    "the rank restarted or moved.",
)
RANK_STEP = gauge(
    "clusterwatch_rank_step",
    "Newest step the rank finished. A rank behind the others is slow; one that stops rising is stuck.",
)
RANK_STEP_DURATION = gauge(
    "clusterwatch_rank_step_duration_seconds",
    "Wall time of the rank's newest finished step. Synchronous collectives make it equal across ranks, so "
    "compare clusterwatch_rank_compute_seconds to find the straggler.",
)
RANK_COMPUTE = gauge(
    "clusterwatch_rank_compute_seconds",
    "Newest step's time outside collectives (step minus communication). The rank well above the others is "
    "the straggler everyone else waits for.",
)
RANK_COMMUNICATION = gauge(
    "clusterwatch_rank_communication_seconds",
    "Newest step's time blocked in collectives. High on all ranks but one: that one is the straggler; high "
    "on all: the network is slow.",
)
RANK_LAST_PROGRESS = gauge(
    "clusterwatch_rank_last_progress_timestamp_seconds",
    "When the coordinator learned of the rank's newest finished step, Unix seconds. Far behind now: the rank "
    "makes no progress (hung, or its node stopped reporting).",
)
RANK_HEARTBEAT = gauge(
    "clusterwatch_rank_heartbeat_timestamp_seconds",
    "Time of the rank's latest heartbeat, Unix seconds, rank's clock. Heartbeats come from a background "
    "thread: stale means the process or its hook is gone; fresh with no progress means training is stuck.",
)
RANK_IN_COLLECTIVE = gauge(
    "clusterwatch_rank_in_collective",
    "1 while the running rank is inside a collective (latest heartbeat), else 0. 1 for long on all ranks but "
    "one: that one never joined the collective.",
)
RANK_HOOK_ERRORS = counter(
    "clusterwatch_rank_hook_errors_total",
    "Errors the clusterwatch hook caught inside the training process (it never raises into training). "
    "Rising: this rank's data may be incomplete; see the training log.",
)
RANK_HOOK_DROPPED = counter(
    "clusterwatch_rank_hook_messages_dropped_total",
    "Messages the hook dropped because its queue to the agent was full. Rising: the agent is slow or gone, "
    "and step data has gaps.",
)
RANK_STEPS_DROPPED = counter(
    "clusterwatch_rank_steps_dropped_total",
    "Step summaries the agent did not forward (more than it keeps per report). Rising: per-step detail has "
    "gaps; step rates stay right.",
)
BUS_BANDWIDTH = gauge(
    "clusterwatch_collective_bus_bandwidth_bytes_per_second",
    "Bus bandwidth of the rank's collectives of one op over its latest report (nccl-tests convention, "
    "comparable with link speed). Well below the fabric's speed or the other ranks: a slow link, NIC or port.",
)
COLLECTIVE_DURATION = histogram(
    "clusterwatch_collective_duration_seconds",
    "Duration of collectives as each rank of the job saw them. A long tail: a rank arrives late (straggler) "
    "or the network stalls.",
)
COLLECTIVES = counter(
    "clusterwatch_collectives_total",
    "Collectives completed, summed over the job's ranks. Flat while ranks run: the job is hung.",
)
COLLECTIVE_BYTES = counter(
    "clusterwatch_collective_bytes_total",
    "Bytes moved by the job's collectives (nccl-tests size per call), summed over its ranks.",
)
JOB_STEP_RATE = gauge(
    "clusterwatch_job_step_rate",
    "Steps per second of the job's slowest running rank over its recent steps; absent until known. A drop: a "
    "straggler; 0: the job is stalled.",
)
JOB_WORLD_SIZE = gauge(
    "clusterwatch_job_world_size",
    "Ranks the job was launched with. Fewer running ranks (clusterwatch_job_ranks) than this: ranks are missing.",
)
JOB_RANKS = gauge(
    "clusterwatch_job_ranks",
    "The job's ranks by state (running, disconnected, exited, unknown). Any exited or disconnected rank in a "
    "job that should be training needs attention.",
)
LAST_COMPLETE_CHECKPOINT_STEP = gauge(
    "clusterwatch_last_complete_checkpoint_step",
    "Newest step every rank checkpointed; a restart resumes from here. Far behind clusterwatch_rank_step: a "
    "failure now loses that much work.",
)
JOB_CHECKPOINT_TIME = gauge(
    "clusterwatch_job_latest_complete_checkpoint_timestamp_seconds",
    "When the newest complete checkpoint completed, Unix seconds. Old: checkpoints fail or are not taken.",
)
CHECKPOINT_DURATION = gauge(
    "clusterwatch_checkpoint_duration_seconds",
    "Slowest rank's save time of the newest complete checkpoint. Rising, or near the checkpoint interval: storage is slow and training stalls on saves.",
)
CHECKPOINTS = counter(
    "clusterwatch_checkpoints_total",
    "Checkpoints (steps of the job) by outcome: complete (every rank saved it); failed (a rank reported a "
    "failed save; counted once, at the first failure, and also complete if a retry then saved it); incomplete "
    "(no failure, but a newer checkpoint completed or newer pending ones pushed it out first). Rising failed "
    "or incomplete: restarts resume from older steps; see the ranks' training logs.",
)
CHECKPOINT_RESULTS = counter(
    "clusterwatch_job_checkpoint_results_total",
    "Per-rank checkpoint results received, by result (ok, failed). Any failed: that checkpoint cannot "
    "complete; the coordinator log and the rank's training log say why.",
)
RANK_REPORTS_REJECTED = counter(
    "clusterwatch_rank_reports_rejected_total",
    "Rank reports the coordinator rejected as malformed, by node and reason (its log names the rank). "
    "Non-zero: an agent or hook sends bad data and that rank's state is stale.",
)

TRAINING_FAMILIES: tuple[Family, ...] = (
    JOB_INFO,
    JOB_WORLD_SIZE,
    JOB_RANKS,
    JOB_STEP_RATE,
    LAST_COMPLETE_CHECKPOINT_STEP,
    JOB_CHECKPOINT_TIME,
    CHECKPOINT_DURATION,
    CHECKPOINTS,
    CHECKPOINT_RESULTS,
    COLLECTIVES,
    COLLECTIVE_BYTES,
    COLLECTIVE_DURATION,
    RANK_INFO,
    RANK_STEP,
    RANK_STEP_DURATION,
    RANK_COMPUTE,
    RANK_COMMUNICATION,
    RANK_LAST_PROGRESS,
    RANK_HEARTBEAT,
    RANK_IN_COLLECTIVE,
    RANK_HOOK_ERRORS,
    RANK_HOOK_DROPPED,
    RANK_STEPS_DROPPED,
    BUS_BANDWIDTH,
    RANK_REPORTS_REJECTED,
)

_STATES = (
    (RankState.RANK_STATE_RUNNING, "running"),
    (RankState.RANK_STATE_DISCONNECTED, "disconnected"),
    (RankState.RANK_STATE_EXITED, "exited"),
    (RankState.RANK_STATE_UNSPECIFIED, "unknown"),
)


def write_training(exp: Exposition, view: TrainingView) -> None:
    """Every training family (HELP and TYPE even when empty), then the samples."""
    for family in TRAINING_FAMILIES:
        exp.lines(family)
    for job in view.jobs:
        _write_job(exp, job)
    for (node_id, reason), count in sorted(view.rank_reports_rejected_total.items()):
        exp.add(RANK_REPORTS_REJECTED, f'node="{escape(node_id)}",reason="{escape(reason)}"', count)


def _write_job(exp: Exposition, job: JobView) -> None:
    j = f'training_job="{escape(job.job)}"'
    # Keys are label names other than the reserved ones (the coordinator checked them: clusterwatch/wire/job_labels.py).
    info = "".join(f',{key}="{escape(value)}"' for key, value in sorted(job.labels.items()))
    exp.add(JOB_INFO, j + info, 1)
    exp.add(JOB_WORLD_SIZE, j, job.world_size)
    states = Counter(r.state for r in job.ranks)
    for state, name in _STATES:
        exp.add(JOB_RANKS, f'{j},state="{name}"', states.get(state, 0))
    if job.step_rate is not None:
        exp.add(JOB_STEP_RATE, j, job.step_rate)
    latest = job.latest_checkpoint
    if latest is not None:
        exp.add(LAST_COMPLETE_CHECKPOINT_STEP, j, latest.step)
        exp.add(JOB_CHECKPOINT_TIME, j, latest.completed_unix_s)
        if latest.max_duration_s is not None:
            exp.add(CHECKPOINT_DURATION, j, latest.max_duration_s)
    # Every outcome from 0, so that increase() sees a job's first failure.
    for outcome in CHECKPOINT_OUTCOMES:
        exp.add(CHECKPOINTS, f'{j},outcome="{outcome}"', job.checkpoints_total.get(outcome, 0))
    for outcome, count in sorted(job.checkpoint_results_total.items()):
        exp.add(CHECKPOINT_RESULTS, f'{j},result="{outcome}"', count)
    for op, totals in sorted(job.collectives.items()):
        jo = f'{j},op="{escape(op)}"'
        exp.add(COLLECTIVES, jo, totals.calls)
        exp.add(COLLECTIVE_BYTES, jo, totals.bytes_total)
        exp.add_histogram(
            COLLECTIVE_DURATION, jo, COLLECTIVE_DURATION_BUCKETS_S, totals.bucket_counts, totals.duration_s
        )
    for rank in job.ranks:
        _write_rank(exp, j, rank)


def _write_rank(exp: Exposition, j: str, r: RankView) -> None:
    jr = f'{j},rank="{r.rank}"'
    identity = r.identity
    exp.add(
        RANK_INFO,
        f'{jr},node="{escape(r.node_id)}",local_rank="{identity.local_rank}",pid="{identity.pid}",'
        f'gpu_uuid="{escape(identity.gpu_uuid)}"',
        1,
    )
    step = r.last_step
    if step is not None:
        exp.add(RANK_STEP, jr, step.step)
        exp.add(RANK_STEP_DURATION, jr, step.step_s)
        exp.add(RANK_COMPUTE, jr, step.compute_s)
        exp.add(RANK_COMMUNICATION, jr, step.communication_s)
        exp.add(RANK_LAST_PROGRESS, jr, r.last_progress_unix_s)
    heartbeat = r.heartbeat
    if heartbeat is not None:
        exp.add(RANK_HEARTBEAT, jr, heartbeat.timestamp_unix_seconds)
        exp.add(RANK_HOOK_ERRORS, jr, heartbeat.health.errors_total)
        exp.add(RANK_HOOK_DROPPED, jr, heartbeat.health.messages_dropped_total)
        if r.state == RankState.RANK_STATE_RUNNING:
            exp.add(RANK_IN_COLLECTIVE, jr, 1 if heartbeat.HasField("collective") else 0)
    exp.add(RANK_STEPS_DROPPED, jr, r.steps_dropped_total)
    for op, busbw in sorted(r.bus_bandwidth_bytes_per_s.items()):
        exp.add(BUS_BANDWIDTH, f'{jr},op="{escape(op)}"', busbw)
