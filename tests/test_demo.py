"""`clusterwatch demo`: a coordinator and two simulated agents, stopped by Ctrl-C or --duration."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from helpers import clusterwatch_cmd, run_cli, wait_for

from clusterwatch.client import ClusterClient
from clusterwatch.v1 import cluster_pb2

pytestmark = pytest.mark.timeout(150)


def test_demo_runs_two_simulated_nodes_until_ctrl_c(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            clusterwatch_cmd("demo", "--grpc-port", "0", "--metrics-port", "0", "--interval", "0.3"),
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        line = wait_for(
            lambda: next((ln for ln in log.read_text().splitlines() if "clusterwatch status --coordinator" in ln), None),
            30, "the demo to print how to run status",
        )  # fmt: skip
        address = line.split("--coordinator", 1)[1].strip()
        with ClusterClient(address) as client:
            wait_for(
                lambda: sorted(n.node_id for n in client.snapshot().nodes
                               if n.state == cluster_pb2.NodeState.NODE_STATE_UP) == ["demo-node-0", "demo-node-1"],
                30, "both demo nodes up",
            )  # fmt: skip
            gpus = [n.report.gpu_inventory for n in client.snapshot().nodes]
            # The demo's training job reports through demo-node-0's agent.
            job = wait_for(
                lambda: next((j for j in client.snapshot().jobs if j.job == "demo-train" and len(j.ranks) == 3
                              and all(r.last_step.step > 0 for r in j.ranks)), None),
                60, "the demo training job's three ranks",
            )  # fmt: skip
            # Rank 2 computes 30 % longer: the coordinator names it.
            straggler = wait_for(
                lambda: next((i for i in client.incidents() if i.kind == "straggler"), None),
                90, "the demo's straggler incident",
            )  # fmt: skip
        assert list(straggler.ranks) == [2]
        assert straggler.cause == "compute"
        assert all(inv.simulated and inv.backend == "sim" for inv in gpus)
        assert {r.node_id for r in job.ranks} == {"demo-node-0"}
        status = run_cli("status", "--coordinator", address)
        assert status.returncode == 0
        assert "demo-node-0" in status.stdout
        assert "(sim)" in status.stdout
        assert "demo-train" in status.stdout
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=30) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
    output = log.read_text()
    assert "/metrics" in output
    assert output.rstrip().endswith("clusterwatch demo: stopped")


def test_demo_stops_by_itself_after_duration() -> None:
    result = run_cli(
        "demo", "--grpc-port", "0", "--metrics-port", "0", "--duration", "2", "--no-train", timeout_s=60
    )
    assert result.returncode == 0, result.stderr
    assert "stopped" in result.stdout
