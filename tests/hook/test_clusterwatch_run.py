"""`clusterwatch run`: an unmodified DDP script under real torchrun on gloo reports its steps (one per
optimizer step) and its DDP buckets, without one line of clusterwatch in it."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
from helpers import (
    HOOK_WORKERS,
    Cluster,
    Coordinator,
    Process,
    incident_of,
    incidents,
    ranks_of,
    samples_named,
    scrape,
    start_node,
    stopped_rank_hang,
    wait_for,
    wait_for_ranks_past,
)

from clusterwatch.cli.run_cmd import BOOTSTRAP, torchrun_argv

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = HOOK_WORKERS / "plain_ddp.py"


def test_torchruns_options_stay_and_only_the_worker_command_changes() -> None:
    assert torchrun_argv(["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "3"]) == [
        "--standalone", "--nproc-per-node", "2", "-m", BOOTSTRAP, "train.py", "--lr", "3",
    ]  # fmt: skip
    assert torchrun_argv(["--nnodes=1:2", "-m", "pkg.train", "-m", "x"]) == [
        "--nnodes=1:2", "-m", BOOTSTRAP, "--module", "pkg.train", "-m", "x",
    ]  # fmt: skip
    assert torchrun_argv(["--no-python", "echo", "hi"]) == ["--no-python", "echo", "hi"]
    assert torchrun_argv(["--run-path", "/abs/train.py"]) == ["-m", BOOTSTRAP, "/abs/train.py"]


def launch(cluster: Cluster, socket: Path, job: str, *args: str, nproc: int = 2) -> Process:
    """``clusterwatch run --standalone --nproc-per-node NPROC plain_ddp.py ARGS`` (as ``python -m
    clusterwatch.run``), the script knowing nothing of clusterwatch."""
    return cluster.torchrun(
        SCRIPT, *args, nproc=nproc, socket=socket, env={"CLUSTERWATCH_JOB": job}, launcher="clusterwatch.run"
    )


def test_an_unmodified_ddp_script_reports_a_step_per_optimizer_step_and_its_buckets(
    cluster: Cluster,
) -> None:
    coordinator, socket = start_node(cluster)
    steps, accumulate = 12, 4  # numbered 0..11 as the optimizer steps; 1..11 are timed
    job = launch(cluster, socket, "plain", "--steps", str(steps), "--accumulate", str(accumulate))
    assert job.wait(180) == 0, job.log()[-4000:]
    assert "rank 0 pid" in job.log()  # the script's own output passes through

    def all_steps() -> bool:
        ranks = ranks_of(coordinator, "plain")
        return len(ranks) == 2 and all(r.last_step.step == steps - 1 for r in ranks.values())

    wait_for(all_steps, 60, "every rank's last optimizer step at the coordinator")
    for rank in ranks_of(coordinator, "plain").values():
        # A step ends at an optimizer step and spans its four micro-batches (5 ms of work each).
        assert rank.last_step.step_seconds >= accumulate * 0.005
    samples = scrape(coordinator.metrics_url)
    buckets = samples_named(
        samples, "clusterwatch_collectives_total", training_job="plain", op="ddp_all_reduce"
    )
    explicit = samples_named(samples, "clusterwatch_collectives_total", training_job="plain", op="all_reduce")
    assert sum(s.value for s in buckets) > 0  # DDP watched without watch()
    assert sum(s.value for s in explicit) > 0


@pytest.mark.parametrize(
    ("die", "expected"),
    [(("--exit-code", "3"), 3), (("--die-by-signal", str(int(signal.SIGKILL))), 128 + signal.SIGKILL)],
    ids=["exit-3", "killed"],
)
def test_the_scripts_exit_code_is_the_runs(cluster: Cluster, die: tuple[str, str], expected: int) -> None:
    _, socket = start_node(cluster)
    job = launch(cluster, socket, "failing", "--steps", "2", *die)
    assert job.wait(180) == expected, job.log()[-4000:]
    assert "rank 0 pid" in job.log()
    assert "FAILED" in job.log()  # torchrun's own report, naming the first failure


def test_a_sigterm_to_run_stops_the_workers_and_ends_run_by_that_signal(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A scheduler's SIGTERM to the launcher: torchrun passes it to the workers, and clusterwatch run
    then ends as if the signal had ended it (what a shell or srun reads)."""
    coordinator, socket = start_node(cluster)
    job = launch(cluster, socket, "terminated", "--compute-ms", "20", "--until-file", str(tmp_path / "never"))
    wait_for_ranks_past(coordinator, "terminated", 2, 3, 120)
    workers = [r.identity.pid for r in ranks_of(coordinator, "terminated").values()]
    job.signal(signal.SIGTERM)
    assert job.wait(60) == -signal.SIGTERM, job.log()[-4000:]
    wait_for(
        lambda: (
            not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in workers)
        ),
        30,
        "the workers to be gone",
    )


def test_a_stopped_rank_under_run_is_a_hang_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    # Detection only: under the default policy the coordinator would restart the hung job.
    coordinator, socket = start_node(cluster, "--hang-action", "alert")
    until = tmp_path / "stop"
    job = launch(cluster, socket, "stopped", "--compute-ms", "20", "--until-file", str(until))
    wait_for_ranks_past(coordinator, "stopped", 2, 5, 120)
    # The monitor existed before the script's init_process_group: the Flight Recorder is on, and
    # every rank's heartbeat (one a second) comes to carry its group's status.
    wait_for(
        lambda: all(
            r.heartbeat.flight_recorder_enabled
            and [g.group_name for g in r.heartbeat.flight_recorder] == ["0"]
            for r in ranks_of(coordinator, "stopped").values()
        ),
        30,
        "every rank's Flight Recorder status for group 0",
    )
    victim = ranks_of(coordinator, "stopped")[1].identity.pid
    hang = stopped_rank_hang(coordinator, victim, rank=1, world_size=2)
    assert list(hang.ranks) == [1]
    assert hang.cause == "process_stopped"
    until.touch()
    assert job.wait(120) == 0, job.log()[-4000:]


def test_an_unwatched_ddp_rank_30_percent_slower_is_a_compute_straggler(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The script never calls watch(), and DDP's gradient all-reduce is its only collective: its
    DDP model is watched when it is built, so the fast ranks' wait for the slow one inside
    backward is communication, not compute (issue 23, item 3). Unwatched, every rank's step
    is the same length and all of it compute: no straggler."""
    coordinator, socket = start_node(cluster)
    until = tmp_path / "stop"
    job = launch(
        cluster,
        socket,
        "unwatched",
        "--compute-ms",
        "40",
        "--slow-rank",
        "2",
        "--no-explicit-all-reduce",
        "--until-file",
        str(until),
        nproc=3,
    )
    straggler = wait_for(
        lambda: incident_of(coordinator, "straggler", 2), 120, "a straggler incident for rank 2"
    )
    until.touch()
    assert list(straggler.ranks) == [2]
    assert straggler.cause == "compute"
    assert not [i for i in incidents(coordinator) if i.kind == "straggler" and 2 not in i.ranks]
    assert job.wait(120) == 0, job.log()[-4000:]


def collectives_by_op(coordinator: Coordinator, job: str) -> dict[str, tuple[int, int]]:
    """(count, bytes) per op of ``job``'s collectives, summed over ranks, as the coordinator exports them."""
    samples = scrape(coordinator.metrics_url)
    found: dict[str, tuple[int, int]] = {}
    for name, index in (("clusterwatch_collectives_total", 0), ("clusterwatch_collective_bytes_total", 1)):
        for sample in samples_named(samples, name, training_job=job):
            totals = list(found.get(sample.labels["op"], (0, 0)))
            totals[index] += int(sample.value)
            found[sample.labels["op"]] = (totals[0], totals[1])
    return found


@pytest.mark.parametrize("explicit", [False, True], ids=["run", "explicit"])
def test_run_and_the_explicit_hook_report_the_same(cluster: Cluster, tmp_path: Path, explicit: bool) -> None:
    """The same 3-rank job under clusterwatch run, or with the README's three lines (issue 23, item
    6), checked against the same expectations: step numbers (run's first optimizer step ends the
    setup, not a step), collectives by count and bytes, the straggler incident."""
    coordinator, socket = start_node(cluster)
    ranks, bucket_bytes = 3, (64 * 64 + 64) * 4  # one DDP bucket: Linear(64, 64)'s gradients
    until = tmp_path / "stop"
    args = ["--compute-ms", "40", "--slow-rank", "2", "--steps", "0", "--until-file", str(until)]
    if explicit:
        job = cluster.torchrun(
            SCRIPT, *args, "--explicit", nproc=ranks, socket=socket, env={"CLUSTERWATCH_JOB": "same"}
        )
    else:
        job = launch(cluster, socket, "same", *args, nproc=ranks)
    try:
        straggler = wait_for(lambda: incident_of(coordinator, "straggler", 2), 120, "a straggler incident")
    finally:
        until.touch()
    assert job.wait(120) == 0, job.log()[-4000:]
    assert (list(straggler.ranks), straggler.cause) == ([2], "compute")
    assert [i.ranks for i in incidents(coordinator) if i.kind == "straggler"] == [[2]]
    (steps,) = {int(m) for m in re.findall(r"done after (\d+) optimizer steps", job.log())}
    # Every explicit all-reduce, the stop checks (at 0, 20, ... steps) but the last (after the last
    # step, in no step either way), one DDP bucket per step.
    checks = steps // 20
    expected = {
        "ddp_all_reduce": (ranks * steps, ranks * steps * bucket_bytes),
        "all_reduce": (ranks * (steps + checks), ranks * (steps * 4096 + checks * 4)),
    }

    def reported() -> bool:
        found = collectives_by_op(coordinator, "same")
        assert found == expected, found  # the last error, should the wait time out
        return True

    wait_for(reported, 30, f"the collectives {expected}")
    for rank in ranks_of(coordinator, "same").values():
        assert rank.last_step.step == steps - 1  # step n ends with optimizer step n (from 0)
        assert rank.heartbeat.steps_completed_total == (steps if explicit else steps - 1)
