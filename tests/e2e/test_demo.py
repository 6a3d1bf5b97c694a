"""`clusterwatch demo`: two simulated nodes, an elastic torchrun job, a straggler and a hang, both recovered."""

from __future__ import annotations

import json
import os

import pytest
from demo_run import DemoRun, demo_processes
from helpers import run_cli, wait_for
from prometheus_server import require

from clusterwatch.cli.demo_faults import Fault, parse_fault
from clusterwatch.cli.demo_training import CHECKPOINT_EVERY
from clusterwatch.errors import ConfigError

# The session's demo run (tests/demo_run.py) is started by whichever of this module and
# tests/deploy/test_dashboards.py asks first; waiting for its end takes a minute at most.
pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_the_demo_detects_and_recovers_from_a_straggler_and_a_hang(demo_run: DemoRun) -> None:
    try:
        demo_run.endpoints(60)
        status = wait_for(
            lambda: demo_run.status, 60, "both demo nodes in clusterwatch status, taken while it ran"
        )
        assert demo_run.wait(timeout_s=240) == 0, demo_run.log.read_text()
    finally:
        if demo_run.process is not None and demo_run.process.poll() is None:
            demo_run.process.kill()
    assert status.returncode == 0
    assert "demo-node-0" in status.stdout
    assert "(sim)" in status.stdout
    output = demo_run.log.read_text()
    for expected in (
        "detected  straggler: rank 1 on demo-node-0",
        "exclude node and restart: checkpoint complete",
        "detected  hang",
        "resumed   every rank past step",
        "finished  all 150 steps",
    ):
        assert expected in output, output
    summary = json.loads(demo_run.summary_path.read_text())
    assert summary["final_world_size"] == 2, output  # demo-node-0 was left out
    straggler, hang = summary["faults"]
    assert (straggler["cause"], straggler["action"]) == ("compute", "exclude node and restart"), output
    assert hang["action"] == "restart", output
    for fault in (straggler, hang):
        assert fault["recovery_s"] > 0, output
        assert 0 <= fault["steps_lost"] <= CHECKPOINT_EVERY, output
    assert 0 < summary["effective_training_time_ratio"] < 1, output
    assert summary["coordinated_checkpoint_delay_steps"] >= 0, output
    assert wait_for(lambda: demo_processes(demo_run.tmpdir) == [], 30, "nothing left of the demo")


@pytest.mark.slow
@pytest.mark.timeout(720)  # waits for the two runs before it
def test_with_two_coordinators_the_jobs_owner_is_killed_and_its_hang_still_recovered(
    group_demo_run: DemoRun,
) -> None:
    require("etcd", package="etcd-server")
    assert group_demo_run.wait_started(600), "the runs before it did not end"
    assert group_demo_run.wait(timeout_s=300) == 0, group_demo_run.log.read_text()
    output = group_demo_run.log.read_text()
    killed = output.index("killed    coordinator c")
    assert "detected  straggler" in output[:killed], output
    after = output[killed:]
    for expected in (
        "detected  hang",
        "restart:",
        "resumed   every rank past step",
        "finished  all 150 steps",
    ):
        assert expected in after, output
    summary = json.loads(group_demo_run.summary_path.read_text())
    hang = summary["faults"][-1]
    assert hang["action"] == "restart", output
    assert hang["recovery_s"] > 0, output
    assert wait_for(lambda: demo_processes(group_demo_run.tmpdir) == [], 30, "nothing left of the demo")


def test_without_training_the_demo_runs_the_services_until_its_duration(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tmpdir = tmp_path_factory.mktemp("idle")  # short: the agents' sockets go in a directory under it
    result = run_cli(
        "demo",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--duration-s",
        "2",
        "--no-train",
        timeout_s=60,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    assert result.returncode == 0, result.stderr
    assert "stopped" in result.stdout
    assert demo_processes(tmpdir) == []


def test_a_fault_is_tied_to_the_slot_of_the_rank_it_names() -> None:
    assert parse_fault("straggler@step=30,rank=1,factor=1.4", 2, 2) == Fault("straggler", 30, 1, 0, 1, 1.4)
    assert parse_fault("hang@step=80,rank=3", 2, 2) == Fault("hang", 80, 3, 1, 1, 1.0)


@pytest.mark.parametrize(
    "spec",
    [
        "crash@step=1,rank=0",
        "hang@step=1",
        "hang@step=1,rank=4",
        "straggler@step=1,rank=0,factor=0.5",
        "hang@step=x,rank=0",
        "hang@step=1,rank=0,when=now",
    ],
)
def test_a_bad_fault_is_refused_naming_the_flag(spec: str) -> None:
    with pytest.raises(ConfigError, match="--inject"):
        parse_fault(spec, 2, 2)
    result = run_cli("demo", "--inject", spec, timeout_s=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "--inject" in result.stderr
