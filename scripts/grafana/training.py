"""Training & collectives: per-rank step time, compute against communication, slowdown, busbw."""

from __future__ import annotations

from grafana.panels import Dashboard, Panel, Query, Row, Threshold, Variable

JOB = Variable("training_job", "Job", "clusterwatch_job_world_size", "Training jobs the coordinator knows.")
RANK = Variable(
    "rank",
    "Rank",
    'clusterwatch_rank_step{training_job=~"$training_job"}',
    "Global ranks of the selected jobs.",
)
SEL = 'training_job=~"$training_job",rank=~"$rank"'
JOBS = 'training_job=~"$training_job"'
LEGEND = "{{training_job}} rank {{rank}}"
COLLECTIVE_BUCKETS = f"rate(clusterwatch_collective_duration_seconds_bucket{{{JOBS}}}[$__rate_interval])"

DASHBOARD = Dashboard(
    uid="clusterwatch-training",
    title="clusterwatch / Training & collectives",
    description="What every rank of a job is doing: steps, compute against communication, collectives.",
    variables=(JOB, RANK),
    rows=(
        Row(
            "Steps",
            (
                Panel(
                    "Step time per rank",
                    "Wall time of each rank's latest step. In a synchronous job every rank's step time is "
                    "about the same (the collective waits for the slowest), so look at compute time to "
                    "find the straggler.",
                    (Query(f"clusterwatch_rank_step_duration_seconds{{{SEL}}}", LEGEND),),
                    "s",
                    width=8,
                ),
                Panel(
                    "Slowdown ratio",
                    "Each rank's compute time over the median of the other ranks' (1 = as fast as the "
                    "others). Persistently above 1.05: this rank is a straggler and the whole job runs at "
                    "its pace; the straggler incident names the cause.",
                    (Query(f"clusterwatch_rank_slowdown_ratio{{{SEL}}}", LEGEND),),
                    "none",
                    thresholds=(Threshold(None, "green"), Threshold(1.05, "orange"), Threshold(1.1, "red")),
                    width=8,
                    decimals=3,
                ),
                Panel(
                    "Steps behind the furthest rank",
                    "How many steps each rank is behind the furthest rank of its job. Growing for one "
                    "rank: it is stuck (hang) or far slower than the others.",
                    (
                        Query(
                            f"max by (training_job) (clusterwatch_rank_step{{{JOBS}}}) - on (training_job) group_right () "
                            f"clusterwatch_rank_step{{{SEL}}}",
                            LEGEND,
                        ),
                    ),
                    "none",
                    thresholds=(Threshold(None, "green"), Threshold(2, "orange"), Threshold(10, "red")),
                    width=8,
                ),
            ),
        ),
        Row(
            "Compute and communication",
            (
                Panel(
                    "Compute against communication",
                    "Mean time per step spent computing and blocked in collectives. Communication growing "
                    "while compute stays flat: the network or a slow peer is the bottleneck.",
                    (
                        Query(
                            f"avg by (training_job) (clusterwatch_rank_compute_seconds{{{SEL}}})",
                            "{{training_job}} compute",
                        ),
                        Query(
                            f"avg by (training_job) (clusterwatch_rank_communication_seconds{{{SEL}}})",
                            "{{training_job}} communication",
                        ),
                    ),
                    "s",
                    stack=True,
                    width=8,
                ),
                Panel(
                    "Compute time per rank",
                    "Step time minus time blocked in collectives. The straggler is the rank whose compute "
                    "time is above the others' (it waits least in the all-reduce).",
                    (Query(f"clusterwatch_rank_compute_seconds{{{SEL}}}", LEGEND),),
                    "s",
                    width=8,
                ),
                Panel(
                    "Heartbeat age",
                    "Seconds since each rank's hook last heartbeat (sent from a background thread, so a "
                    "rank blocked in a collective still beats). Above ~10 s: the process is frozen "
                    "(stopped, swapping, or stuck with the GIL held) or gone.",
                    (Query(f"time() - clusterwatch_rank_heartbeat_timestamp_seconds{{{SEL}}}", LEGEND),),
                    "s",
                    thresholds=(Threshold(None, "green"), Threshold(5, "orange"), Threshold(15, "red")),
                    width=8,
                ),
                Panel(
                    "Ranks inside a collective",
                    "Ranks blocked in a collective at their last heartbeat. All but one for long: the "
                    "others wait for that one (the hang incident names it).",
                    (
                        Query(
                            f"sum by (training_job) (clusterwatch_rank_in_collective{{{JOBS}}})",
                            "{{training_job}}",
                        ),
                    ),
                    "none",
                    width=12,
                ),
                Panel(
                    "Collectives per second",
                    "Collectives completed per second by operation, over the job's ranks. Flat at 0 while "
                    "ranks run: the job is hung.",
                    (
                        Query(
                            f"sum by (training_job, op) (rate(clusterwatch_collectives_total{{{JOBS}}}[$__rate_interval]))",
                            "{{training_job}} {{op}}",
                        ),
                    ),
                    "ops",
                    width=12,
                ),
            ),
        ),
        Row(
            "Collectives",
            (
                Panel(
                    "Bus bandwidth by operation",
                    "Collective bus bandwidth (nccl-tests' busbw: comparable across world sizes), mean over "
                    "ranks. Far below the fabric's rate: a slow link, congestion, or small messages.",
                    (
                        Query(
                            f"avg by (training_job, op) (clusterwatch_collective_bus_bandwidth_bytes_per_second{{{SEL}}})",
                            "{{training_job}} {{op}}",
                        ),
                    ),
                    "Bps",
                    width=8,
                ),
                Panel(
                    "Collective latency, p50 and p99",
                    "Collective duration quantiles by operation, as ranks saw them. A p99 far above the p50: "
                    "a rank arrives late now and then, or the network stalls.",
                    (
                        Query(
                            f"histogram_quantile(0.5, sum by (training_job, op, le) ({COLLECTIVE_BUCKETS}))",
                            "{{training_job}} {{op}} p50",
                        ),
                        Query(
                            f"histogram_quantile(0.99, sum by (training_job, op, le) ({COLLECTIVE_BUCKETS}))",
                            "{{training_job}} {{op}} p99",
                        ),
                    ),
                    "s",
                    width=8,
                ),
                Panel(
                    "Collective latency heat map",
                    "How many collectives took how long, over time. A second band above the main one: some "
                    "collectives wait for a late rank.",
                    (Query(f"sum by (le) ({COLLECTIVE_BUCKETS})", "{{le}}"),),
                    "s",
                    kind="heatmap",
                    width=8,
                ),
            ),
        ),
        Row(
            "Checkpoints",
            (
                Panel(
                    "Newest step and last complete checkpoint",
                    "The furthest step of each job and the newest step every rank checkpointed. The gap is "
                    "the work a failure now would lose.",
                    (
                        Query(
                            f"max by (training_job) (clusterwatch_rank_step{{{JOBS}}})",
                            "{{training_job}} newest step",
                        ),
                        Query(
                            f"clusterwatch_last_complete_checkpoint_step{{{JOBS}}}",
                            "{{training_job}} last complete checkpoint",
                        ),
                    ),
                    "none",
                    width=12,
                ),
                Panel(
                    "Age of the last complete checkpoint",
                    "Seconds since every rank last finished a checkpoint. Beyond the checkpoint interval: "
                    "checkpoints fail or stopped; a restart would lose all that time.",
                    (
                        Query(
                            f"time() - clusterwatch_job_latest_complete_checkpoint_timestamp_seconds{{{JOBS}}}",
                            "{{training_job}}",
                        ),
                    ),
                    "s",
                    thresholds=(Threshold(None, "green"), Threshold(1800, "orange"), Threshold(3600, "red")),
                    width=12,
                ),
            ),
        ),
    ),
)
