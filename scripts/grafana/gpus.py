"""GPUs: load, memory, power, heat, clocks and why they drop, XID and ECC errors."""

from __future__ import annotations

from grafana.panels import RED_FROM_ONE, Dashboard, Panel, Query, Row, Threshold, Variable

NODE = Variable("node", "Node", "clusterwatch_gpu_utilization_ratio", "Nodes with GPUs.")
GPU = Variable("gpu", "GPU", 'clusterwatch_gpu_utilization_ratio{node=~"$node"}', "GPU index on the node.")
SEL = 'node=~"$node",gpu=~"$gpu"'
LEGEND = "{{node}} GPU {{gpu}}"


def per_gpu(metric: str) -> str:
    return f"{metric}{{{SEL}}}"


DASHBOARD = Dashboard(
    uid="clusterwatch-gpus",
    title="clusterwatch / GPUs",
    description="Every GPU's load and health from NVML, per node and GPU index.",
    variables=(NODE, GPU),
    rows=(
        Row(
            "Load",
            (
                Panel(
                    "Utilisation",
                    "Share of time a kernel ran. One GPU of a job far below the others: its rank waits "
                    "(the others are faster) or it is the straggler's victim.",
                    (Query(per_gpu("clusterwatch_gpu_utilization_ratio"), LEGEND),),
                    "percentunit",
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Memory used",
                    "Frame-buffer memory in use over the total. Near 1: the next allocation may fail "
                    "(CUDA out of memory).",
                    (
                        Query(
                            f"{per_gpu('clusterwatch_gpu_memory_used_bytes')} / "
                            f"{per_gpu('clusterwatch_gpu_memory_total_bytes')}",
                            LEGEND,
                        ),
                    ),
                    "percentunit",
                    thresholds=(Threshold(None, "green"), Threshold(0.9, "orange"), Threshold(0.97, "red")),
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Memory bandwidth utilisation",
                    "Share of time device memory was read or written. High with low utilisation: the job "
                    "is memory-bound.",
                    (Query(per_gpu("clusterwatch_gpu_memory_bandwidth_utilization_ratio"), LEGEND),),
                    "percentunit",
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Utilisation over time",
                    "Each GPU's utilisation as a band: red is idle, green is busy. A band that turns red "
                    "while its neighbours stay green: that GPU's rank stopped.",
                    (Query(per_gpu("clusterwatch_gpu_utilization_ratio"), LEGEND),),
                    "percentunit",
                    kind="state-timeline",
                    thresholds=(Threshold(None, "red"), Threshold(0.3, "orange"), Threshold(0.7, "green")),
                    width=24,
                    height=10,
                    min_value=0,
                    max_value=1,
                ),
            ),
        ),
        Row(
            "Real work (NVML GPM, Hopper and newer)",
            (
                Panel(
                    "SM active",
                    "Share of the interval the SMs had work resident (dcgm-exporter's SM_ACTIVE). Unlike "
                    "utilisation, a stalled NCCL kernel does not count: utilisation near 1 with SM active "
                    "near 0 is a rank waiting in a collective. Empty before Hopper.",
                    (Query(per_gpu("clusterwatch_gpu_sm_active_ratio"), LEGEND),),
                    "percentunit",
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Tensor pipes active",
                    "Share of the interval a tensor pipe was busy (PIPE_TENSOR_ACTIVE): the matrix math "
                    "training is made of. One GPU far below its job's others does less real work: "
                    "clusterwatch names it as a straggler's cause.",
                    (Query(per_gpu("clusterwatch_gpu_tensor_active_ratio"), LEGEND),),
                    "percentunit",
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "DRAM active",
                    "Share of the interval the memory interface was busy (DRAM_ACTIVE). High with low "
                    "tensor activity: memory-bound kernels.",
                    (Query(per_gpu("clusterwatch_gpu_dram_active_ratio"), LEGEND),),
                    "percentunit",
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Clocks held down, by reason",
                    "Share of time the clocks were held below their target, from NVML's violation "
                    "counters: power or thermal limits cost this much of the GPU's speed.",
                    (
                        Query(
                            "sum by (node, gpu, reason) (rate(clusterwatch_gpu_throttle_violation_seconds_total"
                            f'{{{SEL},reason=~"power|thermal|board_limit|reliability|sync_boost"}}[$__rate_interval]))',
                            "{{node}} GPU {{gpu}} {{reason}}",
                        ),
                    ),
                    "percentunit",
                    width=24,
                    min_value=0,
                ),
            ),
        ),
        Row(
            "Power and heat",
            (
                Panel(
                    "Power",
                    "Board power draw. Sitting at the limit with the power clock-event reason active: the "
                    "GPU is power-capped and runs slower than its peers.",
                    (Query(per_gpu("clusterwatch_gpu_power_watts"), LEGEND),),
                    "watt",
                    width=8,
                ),
                Panel(
                    "Power over limit",
                    "Power draw over the enforced power limit. At 1: the GPU is power-throttled.",
                    (
                        Query(
                            f"{per_gpu('clusterwatch_gpu_power_watts')} / "
                            f"{per_gpu('clusterwatch_gpu_power_limit_watts')}",
                            LEGEND,
                        ),
                    ),
                    "percentunit",
                    thresholds=(Threshold(None, "green"), Threshold(0.97, "orange")),
                    width=8,
                    min_value=0,
                ),
                Panel(
                    "Temperature",
                    "GPU core temperature. Above ~83 °C most data-centre GPUs slow their clocks (thermal "
                    "slowdown); above ~90 °C check the cooling of that node.",
                    (
                        Query(per_gpu("clusterwatch_gpu_temperature_celsius"), "{{node}} GPU {{gpu}} core"),
                        Query(
                            per_gpu("clusterwatch_gpu_memory_temperature_celsius"),
                            "{{node}} GPU {{gpu}} memory",
                        ),
                    ),
                    "celsius",
                    thresholds=(Threshold(None, "green"), Threshold(83, "orange"), Threshold(90, "red")),
                    width=8,
                ),
            ),
        ),
        Row(
            "Clocks",
            (
                Panel(
                    "SM clock over its maximum",
                    "Streaming-multiprocessor clock over the GPU's maximum. Below ~0.9 while busy: the GPU "
                    "is throttled; the reasons panel says why.",
                    (
                        Query(
                            f"{per_gpu('clusterwatch_gpu_sm_clock_hertz')} / "
                            f"{per_gpu('clusterwatch_gpu_sm_clock_max_hertz')}",
                            LEGEND,
                        ),
                    ),
                    "percentunit",
                    thresholds=(Threshold(None, "red"), Threshold(0.8, "orange"), Threshold(0.9, "green")),
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "SM clock",
                    "Streaming-multiprocessor clock. Idle GPUs clock down; busy GPUs of one job should "
                    "match each other.",
                    (Query(per_gpu("clusterwatch_gpu_sm_clock_hertz"), LEGEND),),
                    "hertz",
                    width=8,
                ),
                Panel(
                    "Clock-event reasons active",
                    "GPUs with each clock-event (throttle) reason active, from NVML. sw_thermal, "
                    "hw_thermal, hw_power_brake or sw_power_cap on a busy GPU: it runs slower than its "
                    "peers and its rank becomes a straggler.",
                    (
                        Query(
                            f"sum by (reason) ({per_gpu('clusterwatch_gpu_clocks_event_active')})",
                            "{{reason}}",
                        ),
                    ),
                    "none",
                    stack=True,
                    width=8,
                ),
                Panel(
                    "Slowdown reasons per GPU",
                    "Slowdown reasons active on each GPU (idle and application-clock settings left out). "
                    "Red: that GPU is throttled now.",
                    (
                        Query(
                            "sum by (node, gpu) (clusterwatch_gpu_clocks_event_active{"
                            f'{SEL},reason!~"gpu_idle|applications_clocks_setting"}})',
                            LEGEND,
                        ),
                    ),
                    "none",
                    kind="state-timeline",
                    thresholds=RED_FROM_ONE,
                    width=24,
                    height=10,
                ),
            ),
        ),
        Row(
            "Errors",
            (
                Panel(
                    "XID errors in range",
                    "XID errors the driver raised, by code, over the dashboard's time range. 48 (double-bit "
                    "ECC), 63/64 (row remapping), 74 (NVLink), 79 (fallen off the bus), 94/95 (contained / "
                    "uncontained ECC): drain the node and have the GPU checked.",
                    (
                        Query(
                            "sum by (node, gpu, xid) (increase(clusterwatch_gpu_xid_errors_total{"
                            f"{SEL}}}[$__range]))",
                            "{{node}} GPU {{gpu}} XID {{xid}}",
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    thresholds=RED_FROM_ONE,
                    width=8,
                ),
                Panel(
                    "ECC errors",
                    "ECC errors per interval, corrected and uncorrected. Any uncorrected: the data on that "
                    "GPU may be wrong and the job should restart elsewhere.",
                    (
                        Query(
                            "sum by (node, gpu, kind) (increase(clusterwatch_gpu_ecc_errors_total{"
                            f"{SEL}}}[$__rate_interval]))",
                            "{{node}} GPU {{gpu}} {{kind}}",
                        ),
                    ),
                    "none",
                    thresholds=RED_FROM_ONE,
                    width=8,
                ),
                Panel(
                    "Remapped rows pending or failed",
                    "GPUs with a memory row remapping waiting for a reset (pending) or one that failed. "
                    "Pending: reset the GPU when the job allows; failed: replace it.",
                    (
                        Query(
                            f"{per_gpu('clusterwatch_gpu_remapped_rows_pending')} + "
                            f"{per_gpu('clusterwatch_gpu_remapped_rows_failure')}",
                            LEGEND,
                        ),
                    ),
                    "none",
                    thresholds=RED_FROM_ONE,
                    width=8,
                ),
            ),
        ),
    ),
)
