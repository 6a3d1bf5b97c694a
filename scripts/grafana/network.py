"""Network fabric: Ethernet NICs and InfiniBand ports, traffic, waits, errors and link state."""

from __future__ import annotations

from grafana.panels import RED_FROM_ONE, Dashboard, Panel, Query, Row, Threshold, Variable

NODE = Variable("node", "Node", "clusterwatch_node_up", "Nodes the coordinator knows.")
NODES = 'node=~"$node"'
NIC = "{{node}} {{device}}"
PORT = "{{node}} {{device}}/{{port}}"


def rate(metric: str) -> str:
    return f"rate({metric}{{{NODES}}}[$__rate_interval])"


DASHBOARD = Dashboard(
    uid="clusterwatch-network",
    title="clusterwatch / Network fabric",
    description="Ethernet NICs and InfiniBand ports of every node: traffic, congestion, errors, link state.",
    variables=(NODE,),
    rows=(
        Row(
            "InfiniBand",
            (
                Panel(
                    "InfiniBand traffic",
                    "Bytes per second through each port (the counters are 4-byte words, already scaled). "
                    "One node's ports far below its peers' during all-reduce: its link is slow.",
                    (
                        Query(rate("clusterwatch_infiniband_port_transmit_bytes_total"), f"{PORT} transmit"),
                        Query(rate("clusterwatch_infiniband_port_receive_bytes_total"), f"{PORT} receive"),
                    ),
                    "Bps",
                    width=8,
                ),
                Panel(
                    "InfiniBand link utilisation",
                    "Transmit rate over the port's link rate. Near 1 during collectives: the fabric is the "
                    "bottleneck.",
                    (
                        Query(
                            f"{rate('clusterwatch_infiniband_port_transmit_bytes_total')} / "
                            f"clusterwatch_infiniband_port_rate_bytes_per_second{{{NODES}}}",
                            PORT,
                        ),
                    ),
                    "percentunit",
                    thresholds=(Threshold(None, "green"), Threshold(0.9, "orange")),
                    width=8,
                    min_value=0,
                    max_value=1,
                ),
                Panel(
                    "Transmit wait",
                    "Ticks per second a port had data to send but no credits from the other end "
                    "(port_xmit_wait). One port far above its peers: congestion or a slow receiver on that "
                    "path; the network straggler's node.",
                    (Query(rate("clusterwatch_infiniband_port_transmit_wait_total"), PORT),),
                    "suffix: ticks/s",
                    width=8,
                ),
                Panel(
                    "InfiniBand errors",
                    "Symbol and receive errors per interval. Rising: a bad cable or transceiver; expect "
                    "retransmits, slow collectives and eventually a link down.",
                    (
                        Query(
                            f"increase(clusterwatch_infiniband_symbol_errors_total{{{NODES}}}[$__rate_interval])",
                            f"{PORT} symbol",
                        ),
                        Query(
                            f"increase(clusterwatch_infiniband_port_receive_errors_total{{{NODES}}}"
                            "[$__rate_interval])",
                            f"{PORT} receive",
                        ),
                    ),
                    "none",
                    thresholds=RED_FROM_ONE,
                    width=8,
                ),
                Panel(
                    "Link downs in range",
                    "Times each port's link went down over the dashboard's time range. Any: collectives "
                    "through it failed or stalled; NCCL may have hung.",
                    (
                        Query(
                            f"increase(clusterwatch_infiniband_link_downed_total{{{NODES}}}[$__range])", PORT
                        ),
                    ),
                    "none",
                    kind="bargauge",
                    thresholds=RED_FROM_ONE,
                    width=8,
                ),
                Panel(
                    "Port state",
                    "Green: the port is ACTIVE and its physical link up; red: down. A red band on a "
                    "training node: its ranks cannot reach their peers.",
                    (Query(f"clusterwatch_infiniband_port_up{{{NODES}}}", PORT),),
                    "none",
                    kind="state-timeline",
                    thresholds=(Threshold(None, "red"), Threshold(1, "green")),
                    width=8,
                ),
            ),
        ),
        Row(
            "Ethernet",
            (
                Panel(
                    "NIC traffic",
                    "Bytes per second through each Ethernet interface (management, storage, checkpoints, "
                    "and collectives on clusters without InfiniBand).",
                    (
                        Query(rate("clusterwatch_network_transmit_bytes_total"), f"{NIC} transmit"),
                        Query(rate("clusterwatch_network_receive_bytes_total"), f"{NIC} receive"),
                    ),
                    "Bps",
                    width=8,
                ),
                Panel(
                    "NIC errors and drops",
                    "Errors and dropped packets per second, both directions. Rising: a bad link, or buffers "
                    "overrun under load.",
                    (
                        Query(
                            f"{rate('clusterwatch_network_receive_errors_total')} + "
                            f"{rate('clusterwatch_network_transmit_errors_total')}",
                            f"{NIC} errors",
                        ),
                        Query(
                            f"{rate('clusterwatch_network_receive_drops_total')} + "
                            f"{rate('clusterwatch_network_transmit_drops_total')}",
                            f"{NIC} drops",
                        ),
                    ),
                    "pps",
                    thresholds=(Threshold(None, "green"), Threshold(1, "orange")),
                    width=8,
                ),
                Panel(
                    "NIC link state",
                    "Green: the interface is up; red: down. A training node's interface down: its ranks lose their peers and the coordinator.",
                    (Query(f"clusterwatch_network_up{{{NODES}}}", NIC),),
                    "none",
                    kind="state-timeline",
                    thresholds=(Threshold(None, "red"), Threshold(1, "green")),
                    width=8,
                ),
            ),
        ),
        Row(
            "TCP",
            (
                Panel(
                    "TCP segments retransmitted",
                    "Share of the node's TCP segments sent again. gloo and NCCL over sockets ride TCP: a "
                    "lossy or throttled link shows here first, while its byte counters look normal. One "
                    "node far above its peers during training: its path is the slow one.",
                    (
                        Query(
                            f"{rate('clusterwatch_node_tcp_segments_retransmitted_total')} / "
                            f"{rate('clusterwatch_node_tcp_segments_sent_total')}",
                            "{{node}}",
                        ),
                    ),
                    "percentunit",
                    thresholds=(Threshold(None, "green"), Threshold(0.01, "orange")),
                    width=12,
                ),
                Panel(
                    "TCP retransmission timeouts",
                    "Retransmission timer expiries per second: a segment and its retransmissions went "
                    "unanswered for a whole RTO (200 ms or more), which stalls the collective waiting on it.",
                    (Query(rate("clusterwatch_node_tcp_timeouts_total"), "{{node}}"),),
                    "ops",
                    thresholds=(Threshold(None, "green"), Threshold(1, "orange")),
                    width=12,
                ),
            ),
        ),
        Row(
            "Topology",
            (
                Panel(
                    "GPU interconnect",
                    "GPU pairs per node by how they are joined, as `nvidia-smi topo -m` names it: NV# "
                    "(NVLink), PIX/PXB (PCIe switches), PHB/NODE (host bridges), SYS (across sockets). "
                    "`clusterwatch topology --node N` draws the matrix, the NICs and where each rank runs.",
                    (Query(f"count by (node, link) (clusterwatch_gpu_link_info{{{NODES}}}) / 2"),),
                    "none",
                    kind="table",
                    width=24,
                ),
            ),
        ),
    ),
)
