"""Incidents & recovery: what went wrong, what clusterwatch did about it, and what it cost."""

from __future__ import annotations

from grafana.panels import RED_FROM_ONE, Dashboard, Panel, Query, Row, Threshold, Variable

JOB = Variable("training_job", "Job", "clusterwatch_job_world_size", "Training jobs the coordinator knows.")
JOBS = 'training_job=~"$training_job"'


def detections(metric: str, by: str = "training_job") -> str:
    return f"sum by ({by}) (increase({metric}{{{JOBS}}}[$__rate_interval]))"


def in_range(metric: str, by: str) -> str:
    return f"sum by ({by}) (increase({metric}{{{JOBS}}}[$__range]))"


DASHBOARD = Dashboard(
    uid="clusterwatch-incidents",
    title="clusterwatch / Incidents & recovery",
    description="Incidents the coordinator opened, the checkpoints and restarts it made, and what they cost.",
    variables=(JOB,),
    rows=(
        Row(
            "Incidents",
            (
                Panel(
                    "Open incidents by severity",
                    "Incidents not resolved yet. Critical: training has stopped or will; warning: it is "
                    "slower, or hardware needs a look.",
                    (Query("sum by (severity) (clusterwatch_incidents_open)", "{{severity}}"),),
                    "none",
                    kind="stat",
                    thresholds=RED_FROM_ONE,
                    width=6,
                ),
                Panel(
                    "Open incidents by kind",
                    "Incidents not resolved yet, by kind, over time.",
                    (Query("sum by (kind) (clusterwatch_incidents_open)", "{{kind}}"),),
                    "none",
                    stack=True,
                    width=18,
                ),
                Panel(
                    "Open incidents",
                    "Every incident not resolved yet, with the rank, node and cause clusterwatch named. "
                    "`clusterwatch incidents --stacks` shows the evidence and stack dumps.",
                    (Query(f"clusterwatch_incident_info{{{JOBS}}}"),),
                    "none",
                    kind="table",
                    width=24,
                ),
                Panel(
                    "Detections",
                    "Incidents opened per interval: stragglers by named cause, hangs, rank failures. "
                    "Repeated for one job: it keeps failing; look at its restarts.",
                    (
                        Query(
                            detections("clusterwatch_stragglers_detected_total", "training_job, cause"),
                            "{{training_job}} straggler ({{cause}})",
                        ),
                        Query(detections("clusterwatch_hangs_detected_total"), "{{training_job}} hang"),
                        Query(
                            detections("clusterwatch_rank_failures_total"), "{{training_job}} rank failure"
                        ),
                    ),
                    "none",
                    stack=True,
                    width=24,
                ),
            ),
        ),
        Row(
            "Recovery",
            (
                Panel(
                    "Restarts in range",
                    "Worker-group restarts by the incident kind that caused them (rank_failure: torchrun "
                    "restarted after a rank died; requested: an operator). Many for one job: it keeps "
                    "failing; the rate limit will leave it to a person.",
                    (
                        Query(
                            in_range("clusterwatch_restarts_total", "training_job, reason"),
                            "{{training_job}} {{reason}}",
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    thresholds=(Threshold(None, "green"), Threshold(3, "orange")),
                    width=8,
                ),
                Panel(
                    "Recovery actions in range",
                    "What the policy decided, by action and outcome. failed: recovery did not work; "
                    "skipped: cooldown, rate limit or opt-out left it to a person.",
                    (
                        Query(
                            in_range("clusterwatch_actions_total", "training_job, action, outcome"),
                            "{{training_job}} {{action}} {{outcome}}",
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    width=8,
                ),
                Panel(
                    "Time to recover",
                    "The job's latest recovery: from the incident opening to every rank past the resume "
                    "step. Minutes: the restart path (grace, rendezvous, start-up, loading) is slow.",
                    (Query(f"clusterwatch_recovery_seconds{{{JOBS}}}", "{{training_job}}"),),
                    "s",
                    thresholds=(Threshold(None, "green"), Threshold(60, "orange"), Threshold(300, "red")),
                    width=8,
                ),
                Panel(
                    "Steps lost in range",
                    "Steps done again after restarts (furthest step reached minus the step resumed from). "
                    "More than the checkpoint interval per restart: checkpoint more often.",
                    (Query(in_range("clusterwatch_steps_lost_total", "training_job"), "{{training_job}}"),),
                    "none",
                    kind="bargauge",
                    width=8,
                ),
                Panel(
                    "Effective training time ratio (ETTR)",
                    "Productive training time over wall time since the job started, the number Meta and "
                    "ByteDance report for large runs. Falling: failures and recovery eat the job.",
                    (Query(f"clusterwatch_job_effective_training_time_ratio{{{JOBS}}}", "{{training_job}}"),),
                    "percentunit",
                    thresholds=(Threshold(None, "red"), Threshold(0.8, "orange"), Threshold(0.95, "green")),
                    width=16,
                    min_value=0,
                    max_value=1,
                ),
            ),
        ),
        Row(
            "Checkpoints",
            (
                Panel(
                    "Coordinated checkpoints in range",
                    "Checkpoints the coordinator asked for, by outcome. complete: every rank saved; "
                    "incomplete or failed: a restart cannot resume from it.",
                    (
                        Query(
                            in_range("clusterwatch_checkpoints_total", "training_job, outcome"),
                            "{{training_job}} {{outcome}}",
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    width=8,
                ),
                Panel(
                    "Checkpoint save time",
                    "The slowest rank's save time of the newest complete checkpoint. Rising, or near the "
                    "checkpoint interval: storage is slow and training stalls on saves.",
                    (Query(f"clusterwatch_checkpoint_duration_seconds{{{JOBS}}}", "{{training_job}}"),),
                    "s",
                    width=8,
                ),
                Panel(
                    "Last complete checkpoint step",
                    "Newest step every rank checkpointed; a restart resumes from here.",
                    (Query(f"clusterwatch_last_complete_checkpoint_step{{{JOBS}}}", "{{training_job}}"),),
                    "none",
                    kind="stat",
                    width=8,
                ),
            ),
        ),
    ),
)
