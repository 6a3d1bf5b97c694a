"""The host's TCP counters (agent/collectors/tcp.py): net/snmp and net/netstat read by name, from
written proc trees and from this machine, and what /metrics makes of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clusterwatch.agent.collectors.network import NetworkCollector
from clusterwatch.agent.collectors.tcp import parse_tables, read_tcp
from clusterwatch.exposition.node_metrics import write_node
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.report_digest import digest

pytestmark = pytest.mark.timeout(30)

SNMP = """Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens InSegs OutSegs RetransSegs InErrs OutRsts
Tcp: 1 200 120000 -1 10 5000 4000 37 2 9
Udp: InDatagrams NoPorts
Udp: 3 4
"""
NETSTAT = """TcpExt: SyncookiesSent TCPTimeouts TCPLostRetransmit DelayedACKs
TcpExt: 0 5 3 120
IpExt: InNoRoutes InOctets
IpExt: 0 9000
"""


def proc_tree(tmp_path: Path, snmp: str | None = SNMP, netstat: str | None = NETSTAT) -> Path:
    net = tmp_path / "proc" / "net"
    net.mkdir(parents=True)
    for name, text in (("snmp", snmp), ("netstat", netstat)):
        if text is not None:
            (net / name).write_text(text)
    return tmp_path / "proc"


def test_counters_are_read_by_name_from_both_files(tmp_path: Path) -> None:
    assert read_tcp(proc_tree(tmp_path)) == node_pb2.TcpSample(
        segments_sent_total=4000,
        segments_retransmitted_total=37,
        receive_errors_total=2,
        timeouts_total=5,
        lost_retransmits_total=3,
    )


def test_without_netstat_its_counters_stay_unset_and_without_snmp_there_is_no_sample(tmp_path: Path) -> None:
    sample = read_tcp(proc_tree(tmp_path / "a", netstat=None))
    assert sample is not None
    assert sample.segments_retransmitted_total == 37
    assert not sample.HasField("timeouts_total")
    assert read_tcp(proc_tree(tmp_path / "b", snmp=None)) is None
    assert read_tcp(tmp_path / "nowhere") is None


def test_a_malformed_table_is_left_out_and_the_others_are_read() -> None:
    text = "Tcp: InSegs OutSegs\nTcp: 1\nUdp: NoPorts\nUdp: x\nIcmp: InMsgs\nIcmp: 7\n"
    assert parse_tables(text) == {"Icmp": {"InMsgs": 7}}


def test_this_machine_has_tcp_counters() -> None:
    sample = read_tcp(Path("/proc"))
    assert sample is not None
    assert sample.HasField("segments_sent_total")
    assert sample.segments_retransmitted_total <= sample.segments_sent_total


def test_the_network_collector_reports_them_and_metrics_export_them_as_counters(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path)
    (proc / "net" / "dev").write_text(
        "Inter-| Receive | Transmit\n face |bytes packets errs drop fifo frame compressed multicast|"
        "bytes packets errs drop fifo colls carrier compressed\n"
        "  eth0: 100 2 0 0 0 0 0 0 200 3 0 0 0 0 0 0\n"
    )
    report = node_pb2.NodeReport()
    NetworkCollector(proc_root=proc, sys_root=tmp_path / "sys").collect(report)
    assert report.tcp.segments_retransmitted_total == 37
    exp = Exposition()
    write_node(exp, "node-1", report)
    families = {f.name: f for f in text_string_to_metric_families(exp.render().decode())}
    retransmitted = families["clusterwatch_node_tcp_segments_retransmitted"]
    assert retransmitted.type == "counter"
    assert [(s.labels, s.value) for s in retransmitted.samples] == [({"node": "node-1"}, 37.0)]
    assert [s.value for s in families["clusterwatch_node_tcp_timeouts"].samples] == [5.0]
    # The coordinator's network cause reads sent and retransmitted; the rest is for /metrics.
    lean = digest(report).tcp
    assert (lean.segments_sent_total, lean.segments_retransmitted_total) == (4000, 37)
    assert not lean.HasField("timeouts_total")
    empty = Exposition()
    write_node(empty, "node-2", node_pb2.NodeReport())
    assert "clusterwatch_node_tcp_segments_sent_total{" not in empty.render().decode()
