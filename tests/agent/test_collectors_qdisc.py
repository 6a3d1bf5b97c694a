"""Root qdisc statistics over rtnetlink (agent/collectors/qdisc.py) against a real kernel: a veth
pair in a network namespace of its own, one end shaped with `tc ... tbf` and flooded; what we read
must be what `tc -s` reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_for

from clusterwatch.agent.collectors.network import NetworkCollector
from clusterwatch.agent.collectors.qdisc import RootQdisc
from clusterwatch.exposition.node_metrics import write_node
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.v1 import node_pb2
from clusterwatch.wire.report_digest import digest

pytestmark = pytest.mark.timeout(60)

FLOOD = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("10.77.0.1", 0))
for _ in range(3000):
    try:
        s.sendto(b"x" * 1400, ("10.77.0.9", 9))
    except OSError:  # ENOBUFS once the queue is full: what the test is after
        pass
"""
READ = """
import dataclasses, json
from clusterwatch.agent.collectors.qdisc import read_root_qdiscs
print(json.dumps({name: dataclasses.asdict(q) for name, q in read_root_qdiscs().items()}))
"""


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def namespace() -> Iterator[str]:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        if os.environ.get("CI"):
            pytest.fail("CI runs as root with iproute2 (./dev installs it)")
        pytest.skip("needs root and iproute2 (ip, tc) for a network namespace")
    name = f"cw-qdisc-{os.getpid()}"
    run("ip", "netns", "add", name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)


def test_a_shaped_flooded_link_shows_overlimits_and_drops_as_tc_does(namespace: str) -> None:
    ns = ("ip", "-n", namespace)
    run(*ns, "link", "add", "cwa", "type", "veth", "peer", "name", "cwb")
    run(*ns, "addr", "add", "10.77.0.1/24", "dev", "cwa")
    for device in ("lo", "cwa", "cwb"):
        run(*ns, "link", "set", device, "up")
    # A peer that is not an address of this namespace (those go through lo): out through cwa.
    run(*ns, "neigh", "add", "10.77.0.9", "lladdr", "02:00:00:00:00:09", "dev", "cwa")
    tbf = ("root", "tbf", "rate", "1mbit", "burst", "10kb", "limit", "20kb")
    run("tc", "-n", namespace, "qdisc", "add", "dev", "cwa", *tbf)
    inside = ("ip", "netns", "exec", namespace, sys.executable, "-c")
    run(*inside, FLOOD)
    # Until the queue has drained (20 kB at 1 Mbit/s): then the counters hold still.
    wait_for(lambda: json.loads(run(*inside, READ))["cwa"]["backlog_bytes"] == 0, 20, "cwa's queue to drain")
    ours = json.loads(run(*inside, READ))
    (theirs,) = json.loads(run("tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", "cwa"))
    shaped = ours["cwa"]
    assert shaped["kind"] == "tbf"
    assert shaped["overlimits_total"] > 0
    assert shaped["drops_total"] > 0
    # The same numbers tc reads.
    assert (shaped["drops_total"], shaped["overlimits_total"], shaped["requeues_total"]) == (
        theirs["drops"],
        theirs["overlimits"],
        theirs["requeues"],
    )
    assert ours["cwb"]["kind"] != "tbf"  # the other end is not shaped
    assert ours["cwb"]["overlimits_total"] == 0


def test_each_interfaces_root_qdisc_goes_into_its_sample_and_metrics(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "dev").write_text(
        "Inter-| Receive | Transmit\n face |bytes packets errs drop fifo frame compressed multicast|"
        "bytes packets errs drop fifo colls carrier compressed\n"
        "  eth0: 100 2 0 0 0 0 0 0 200 3 0 0 0 0 0 0\n"
        "  eth1: 100 2 0 0 0 0 0 0 200 3 0 0 0 0 0 0\n"
    )
    shaped = RootQdisc("tbf", backlog_bytes=1500, drops_total=5, requeues_total=2, overlimits_total=7)
    collector = NetworkCollector(
        proc_root=proc, sys_root=tmp_path / "sys", read_qdiscs=lambda: {"eth0": shaped}
    )
    report = node_pb2.NodeReport()
    collector.collect(report)
    eth0, eth1 = report.nics
    assert (eth0.qdisc, eth0.qdisc_backlog_bytes, eth0.qdisc_drops_total, eth0.qdisc_overlimits_total) == (
        "tbf",
        1500,
        5,
        7,
    )
    assert not eth1.HasField("qdisc_drops_total")  # no qdisc read for it: absent, not zero
    exp = Exposition()
    write_node(exp, "n", report)
    page = exp.render().decode()
    assert 'clusterwatch_network_qdisc_overlimits_total{node="n",device="eth0"} 7' in page
    assert 'clusterwatch_network_qdisc_drops_total{node="n",device="eth1"}' not in page
    lean = digest(report).nics[0]
    assert (lean.qdisc_drops_total, lean.qdisc_overlimits_total) == (5, 7)  # the network cause reads both
    assert not lean.HasField("qdisc_backlog_bytes")  # dashboards only


def test_a_netlink_failure_leaves_the_qdisc_fields_unset_and_the_counters_in(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "dev").write_text("Inter-|\n face |\n  eth0: 100 2 0 0 0 0 0 0 200 3 0 0 0 0 0 0\n")

    def refused() -> dict[str, RootQdisc]:
        raise PermissionError(1, "Operation not permitted")

    report = node_pb2.NodeReport()
    NetworkCollector(proc_root=proc, sys_root=tmp_path / "sys", read_qdiscs=refused).collect(report)
    assert report.nics[0].receive_bytes_total == 100
    assert not report.nics[0].qdisc
