"""Cluster overview: is the fleet healthy, is every job training, what needs a person."""

from __future__ import annotations

from grafana.panels import RED_FROM_ONE, Annotation, Dashboard, Panel, Query, Row, Threshold, Variable

JOB = Variable("training_job", "Job", "clusterwatch_job_world_size", "Training jobs the coordinator knows.")
RESTARTS = Annotation(
    "Restarts",
    'changes(clusterwatch_restarts_total{training_job=~"$training_job"}[1m]) > 0',
    "restart of {{training_job}} ({{reason}})",
    "orange",
)
INCIDENTS = Annotation(
    "Incidents",
    'clusterwatch_incident_info{training_job=~"$training_job"}',
    "{{kind}} ({{severity}}): job {{training_job}} ranks {{ranks}} nodes {{nodes}}, cause {{cause}}",
    "red",
)


DASHBOARD = Dashboard(
    uid="clusterwatch-overview",
    title="clusterwatch / Cluster overview",
    description="The fleet and every training job at a glance; start here, then follow the links.",
    variables=(JOB,),
    annotations=(RESTARTS, INCIDENTS),
    rows=(
        Row(
            "Cluster now",
            (
                Panel(
                    "Nodes up",
                    "Nodes whose agent is streaming reports to the coordinator. Fewer than the fleet: see Nodes unreachable.",
                    (Query("sum(clusterwatch_node_up)"),),
                    "none",
                    kind="stat",
                    width=4,
                    height=4,
                ),
                Panel(
                    "Nodes unreachable",
                    "Nodes whose agent stopped reporting (no report for a few intervals). Above 0: the node "
                    "is down, partitioned, or its agent died; its ranks cannot be watched.",
                    (Query('sum(clusterwatch_coordinator_nodes{state="unreachable"})'),),
                    "none",
                    kind="stat",
                    thresholds=RED_FROM_ONE,
                    width=4,
                    height=4,
                ),
                Panel(
                    "GPUs",
                    "GPUs reported by all agents. Fewer than the fleet has: a GPU fell off the bus or its node is down.",
                    (Query("count(clusterwatch_gpu_utilization_ratio)"),),
                    "none",
                    kind="stat",
                    width=4,
                    height=4,
                ),
                Panel(
                    "Mean GPU utilisation",
                    "Share of time the GPUs ran a kernel, averaged over the fleet. Low while jobs run: input "
                    "pipeline, communication or a straggler is holding the GPUs back.",
                    (Query("avg(clusterwatch_gpu_utilization_ratio)"),),
                    "percentunit",
                    kind="stat",
                    thresholds=(Threshold(None, "red"), Threshold(0.5, "orange"), Threshold(0.8, "green")),
                    width=4,
                    height=4,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Open incidents",
                    "Incidents not resolved yet (open, acknowledged or acting). `clusterwatch incidents` "
                    "lists them with the rank, node and cause.",
                    (Query("sum(clusterwatch_incidents_open)"),),
                    "none",
                    kind="stat",
                    thresholds=(Threshold(None, "green"), Threshold(1, "orange")),
                    width=4,
                    height=4,
                ),
                Panel(
                    "Critical incidents",
                    "Incidents where training has stopped or will (hang, rank failure, lost node, XID). "
                    "Above 0: a job is not training; check the Incidents & recovery dashboard.",
                    (Query('sum(clusterwatch_incidents_open{severity="critical"})'),),
                    "none",
                    kind="stat",
                    thresholds=RED_FROM_ONE,
                    width=4,
                    height=4,
                ),
            ),
        ),
        Row(
            "Training jobs",
            (
                Panel(
                    "Step rate",
                    "Training steps per second, per job. A drop that other jobs do not share: a straggler, "
                    "a slow link or a hang in that job.",
                    (Query('clusterwatch_job_step_rate{training_job=~"$training_job"}', "{{training_job}}"),),
                    "suffix: steps/s",
                    width=8,
                ),
                Panel(
                    "Effective training time ratio (ETTR)",
                    "Productive training time over wall time since the job started: time lost to restarts "
                    "and redone steps counts against it. Below 0.9: failures cost a tenth of the job.",
                    (
                        Query(
                            'clusterwatch_job_effective_training_time_ratio{training_job=~"$training_job"}',
                            "{{training_job}}",
                        ),
                    ),
                    "percentunit",
                    thresholds=(Threshold(None, "red"), Threshold(0.8, "orange"), Threshold(0.95, "green")),
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Slowest rank against the others",
                    "The highest per-rank slowdown ratio of each job (compute time over the other ranks' "
                    "median). Above 1.05 for long: one rank holds the whole job back.",
                    (
                        Query(
                            'max by (training_job) (clusterwatch_rank_slowdown_ratio{training_job=~"$training_job"})',
                            "{{training_job}}",
                        ),
                    ),
                    "none",
                    thresholds=(Threshold(None, "green"), Threshold(1.05, "orange"), Threshold(1.1, "red")),
                    width=8,
                    decimals=3,
                ),
                Panel(
                    "Ranks by state",
                    "Ranks of each job by state. Fewer running than the world size, or any exited: the job "
                    "is missing ranks and cannot make progress.",
                    (
                        Query(
                            'sum by (training_job, state) (clusterwatch_job_ranks{training_job=~"$training_job"})',
                            "{{training_job}} {{state}}",
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    width=12,
                ),
                Panel(
                    "World size",
                    "Ranks each job was launched with; an elastic job that left a node out shows fewer.",
                    (
                        Query(
                            'clusterwatch_job_world_size{training_job=~"$training_job"}', "{{training_job}}"
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    width=12,
                ),
            ),
        ),
        Row(
            "Fleet",
            (
                Panel(
                    "GPU utilisation by node",
                    "Mean GPU utilisation of each node. A node far below its peers in the same job: look "
                    "at its GPUs and ranks.",
                    (Query("avg by (node) (clusterwatch_gpu_utilization_ratio)", "{{node}}"),),
                    "percentunit",
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Host CPU by node",
                    "Host CPU utilisation. Near 100 %: data loading or another process starves the ranks.",
                    (Query("clusterwatch_node_cpu_utilization_ratio", "{{node}}"),),
                    "percentunit",
                    thresholds=(Threshold(None, "green"), Threshold(0.9, "orange")),
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Failing collectors",
                    "Agent collectors (gpu, host, network, infiniband) whose last run failed. Above 0: part "
                    "of that node is not watched; the agent's log says why.",
                    (Query("sum by (node) (1 - clusterwatch_collector_success)", "{{node}}"),),
                    "none",
                    thresholds=RED_FROM_ONE,
                    width=8,
                ),
            ),
        ),
    ),
)
