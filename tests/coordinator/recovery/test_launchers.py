"""Launcher adapters: the exact scontrol/kubectl command lines, their order, and
every way a command can fail turning into a failed LaunchOutcome.

scontrol and kubectl are not installed here, so the SLURM and Kubernetes
adapters run against STAND-INS: small Python scripts written into the test's
tmp dir under the real tool's name (see ``write_standin``). A stand-in is not
the real tool: it appends its argv as one JSON line to a log, then answers as
the test's rules say (output, exit status, or sleeping past the timeout). The
torchrun adapter's summary is tested on real CommandResult protos.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for

from clusterwatch.coordinator.recovery.launchers.kubernetes import KubernetesLauncher
from clusterwatch.coordinator.recovery.launchers.registry import make_launcher
from clusterwatch.coordinator.recovery.launchers.slurm import (
    SlurmLauncher,
    current_exc_node_list,
    merge_exc_node_list,
    parse_slurm_job_ids,
)
from clusterwatch.coordinator.recovery.launchers.torchrun import TorchrunLauncher, summarise_stops
from clusterwatch.errors import ConfigError
from clusterwatch.runtime.external_commands import run_command
from clusterwatch.v1 import agent_pb2

pytestmark = pytest.mark.timeout(30)

Status = agent_pb2.CommandResult.Status

STANDIN = '''#!{python}
"""STAND-IN for `{name}`, written by tests/coordinator/recovery/test_launchers.py: not the real tool.

Appends {{"argv": [...], "pid": N}} as one JSON line to {log}, then answers with
the first rule whose "args" prefix the arguments: "stdout", "stderr", "exit"
(default 0), "sleep_s" (sleep before answering), "child_sleep_s" (leave a
child process sleeping that holds stdout open).
"""
import json, os, subprocess, sys, time

RULES = {rules!r}
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps({{"argv": args, "pid": os.getpid()}}) + "\\n")
rule = next((r for r in RULES if args[: len(r["args"])] == r["args"]), {{}})
if rule.get("child_sleep_s"):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(%s)" % rule["child_sleep_s"]])
time.sleep(rule.get("sleep_s", 0))
sys.stdout.write(rule.get("stdout", ""))
sys.stderr.write(rule.get("stderr", ""))
sys.exit(rule.get("exit", 0))
'''


def write_standin(bin_dir: Path, name: str, rules: Sequence[dict[str, Any]] = ()) -> Path:
    """Write the stand-in executable ``bin_dir/name``; its calls go to ``bin_dir/name.calls``."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(
        STANDIN.format(python=sys.executable, name=name, log=str(calls_file(path)), rules=list(rules))
    )
    path.chmod(0o755)
    return path


def calls_file(standin: Path) -> Path:
    return standin.with_name(standin.name + ".calls")


def calls(standin: Path) -> list[list[str]]:
    """The argv of every call the stand-in got, in order."""
    log = calls_file(standin)
    if not log.exists():
        return []
    return [json.loads(line)["argv"] for line in log.read_text().splitlines()]


def pids(standin: Path) -> list[int]:
    return [json.loads(line)["pid"] for line in calls_file(standin).read_text().splitlines()]


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The whole PATH, for stand-ins found by name like the real tools.

    Nothing else is on it, so a real scontrol or kubectl on this machine is
    never run (the stand-ins name their interpreter by absolute path).
    """
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


# ---------------------------------------------------------------- SLURM

SHOW_JOB = (
    "JobId=777 JobName=llama UserId=ml(1000) JobState=RUNNING Requeue=1 Restarts=0 "
    "NodeList=gpu[01-04] ReqNodeList=(null) ExcNodeList={exc} Features=(null)\n"
)


def verified_slurm(**options: Any) -> SlurmLauncher:
    """A SLURM launcher whose jobs' ranks run in the SLURM job of the job's name (numeric names), as
    their agents read it from the processes' cgroups."""
    return SlurmLauncher(verified_job_ids=lambda job: {job} if job.isdigit() else set(), **options)


async def test_slurm_restart_is_one_requeue_of_the_verified_job(bin_dir: Path) -> None:
    scontrol = write_standin(bin_dir, "scontrol")
    outcome = await verified_slurm().restart("4242", ["gpu01", "gpu02"], [], "hang incident hang-1")
    assert calls(scontrol) == [["requeue", "4242"]]
    assert outcome.ok, outcome.detail
    assert outcome.detail.startswith("requeued SLURM job 4242 (job '4242' on 2 nodes) in ")
    assert outcome.per_node == {}


async def test_slurm_exclusion_is_set_while_the_requeued_job_is_held(bin_dir: Path) -> None:
    scontrol = write_standin(
        bin_dir,
        "scontrol",
        [{"args": ["--oneliner", "show", "job"], "stdout": SHOW_JOB.format(exc="gpu[01-02]")}],
    )
    launcher = SlurmLauncher(job_ids={"llama": "777"})
    outcome = await launcher.restart("llama", ["gpu03", "gpu04"], ["gpu04", "gpu02", "gpu04"], "xid 79")
    assert calls(scontrol) == [
        ["--oneliner", "show", "job", "777"],
        ["requeuehold", "777"],
        ["update", "JobId=777", "ExcNodeList=gpu[01-02],gpu04,gpu02"],
        ["release", "777"],
    ]
    assert outcome.ok, outcome.detail
    assert "requeued SLURM job 777 (job 'llama') excluding 2 nodes (gpu04, gpu02)" in outcome.detail
    assert "ExcNodeList=gpu[01-02],gpu04,gpu02; 4 scontrol calls in " in outcome.detail
    assert outcome.per_node == {
        "gpu04": "excluded from SLURM job 777 (ExcNodeList)",
        "gpu02": "excluded from SLURM job 777 (ExcNodeList)",
    }


async def test_slurm_exclusion_of_a_job_without_one(bin_dir: Path) -> None:
    scontrol = write_standin(
        bin_dir, "scontrol", [{"args": ["--oneliner", "show"], "stdout": SHOW_JOB.format(exc="(null)")}]
    )
    outcome = await verified_slurm().restart("777", ["gpu03"], ["gpu03"], "")
    assert ["update", "JobId=777", "ExcNodeList=gpu03"] in calls(scontrol)
    assert outcome.ok, outcome.detail


async def test_slurm_requeues_only_a_verified_job_id_never_what_the_ranks_say(bin_dir: Path) -> None:
    """A rank's slurm_job_id label and a numeric job name are the user's word: a job named '888888',
    or labelled 777777, must not get someone else's SLURM job requeued."""
    scontrol = write_standin(bin_dir, "scontrol")
    verified = {"llama": {"4300"}, "4242_7": {"4301"}, "split": {"4300", "4301"}, "odd": {"x"}}
    launcher = SlurmLauncher(job_ids={"mapped": "777"}, verified_job_ids=lambda job: verified.get(job, set()))
    assert (await launcher.restart("llama", ["gpu01"], [], "hang")).ok
    assert (await launcher.restart("4242_7", ["gpu01"], [], "hang")).ok
    # The static mapping wins over what is verified.
    verified["mapped"] = {"4300"}
    assert (await launcher.restart("mapped", ["gpu01"], [], "hang")).ok
    assert calls(scontrol) == [["requeue", "4300"], ["requeue", "4301"], ["requeue", "777"]]
    numeric = await launcher.restart("888888", ["gpu01"], [], "hang")
    assert numeric.detail == (
        "job '888888' has no SLURM job id: not in recovery.slurm_job_ids, and none verified (no rank's "
        "process is in a SLURM job's cgroup, no SLURM Prolog registered it)"
    )
    assert not (await launcher.restart("odd", ["gpu01"], [], "hang")).ok  # not an id: ignored
    split = await launcher.restart("split", ["gpu01"], [], "hang")
    assert split.detail == "job 'split' runs in several SLURM jobs (4300, 4301): not one to requeue"
    assert len(calls(scontrol)) == 3


def test_exc_node_list_parsing_and_merging() -> None:
    assert current_exc_node_list(SHOW_JOB.format(exc="(null)")) == ""
    assert current_exc_node_list(SHOW_JOB.format(exc="n[1-3,5],gpu7")) == "n[1-3,5],gpu7"
    assert current_exc_node_list("   ExcNodeList=n1\n   Features=(null)") == "n1"
    assert current_exc_node_list("JobId=1 JobState=RUNNING") == ""
    assert merge_exc_node_list("n[1-3,5],gpu7", ["gpu7", "gpu8"]) == "n[1-3,5],gpu7,gpu8"
    assert merge_exc_node_list("", ["a", "b", "a"]) == "a,b"


async def test_slurm_job_without_an_id_runs_nothing(bin_dir: Path) -> None:
    scontrol = write_standin(bin_dir, "scontrol")
    unmapped = await SlurmLauncher(job_ids={"other": "1"}).restart("llama", ["gpu01"], [], "")
    assert not unmapped.ok
    assert unmapped.detail.startswith("job 'llama' has no SLURM job id: not in recovery.slurm_job_ids")
    bad_node = await verified_slurm().restart("4242", ["gpu01"], ["--all"], "")
    assert not bad_node.ok
    assert bad_node.detail == "not a SLURM node name: '--all'; nothing done"
    assert calls(scontrol) == []


async def test_slurm_nonzero_exit_is_a_failed_outcome_with_stderrs_first_line(bin_dir: Path) -> None:
    stderr = "scontrol: error: Requested operation is presently disabled for job 4242\nsecond line\n"
    write_standin(bin_dir, "scontrol", [{"args": ["requeue"], "exit": 1, "stderr": stderr}])
    outcome = await verified_slurm().restart("4242", ["gpu01"], [], "")
    assert not outcome.ok
    assert outcome.detail == (
        "SLURM job 4242 (job '4242') not requeued: `scontrol requeue 4242` failed "
        "(exit 1: scontrol: error: Requested operation is presently disabled for job 4242)"
    )


async def test_slurm_failed_hold_leaves_the_job_running(bin_dir: Path) -> None:
    scontrol = write_standin(
        bin_dir, "scontrol", [{"args": ["requeuehold"], "exit": 1, "stderr": "Job is pending execution\n"}]
    )
    outcome = await verified_slurm().restart("777", ["gpu01"], ["gpu01"], "")
    assert [argv[0] for argv in calls(scontrol)] == ["--oneliner", "requeuehold"]
    assert not outcome.ok
    assert (
        "not requeued: `scontrol requeuehold 777` failed (exit 1: Job is pending execution)" in outcome.detail
    )


async def test_slurm_failed_exclusion_still_releases_the_held_job(bin_dir: Path) -> None:
    scontrol = write_standin(
        bin_dir, "scontrol", [{"args": ["update"], "exit": 1, "stderr": "Invalid node name specified\n"}]
    )
    outcome = await verified_slurm().restart("777", ["gpu01"], ["gpu09"], "")
    assert [argv[0] for argv in calls(scontrol)] == ["--oneliner", "requeuehold", "update", "release"]
    assert not outcome.ok
    assert outcome.detail == (
        "SLURM job 777 (job '777') requeued WITHOUT excluding 1 nodes (gpu09): "
        "`scontrol update JobId=777 ExcNodeList=gpu09` failed (exit 1: Invalid node name specified)"
    )
    assert outcome.per_node["gpu09"].startswith("not excluded: `scontrol update")


async def test_slurm_failed_release_says_how_to_release(bin_dir: Path) -> None:
    write_standin(
        bin_dir, "scontrol", [{"args": ["release"], "exit": 1, "stderr": "Access/permission denied\n"}]
    )
    outcome = await verified_slurm().restart("777", ["gpu01"], ["gpu09"], "")
    assert not outcome.ok
    assert (
        "but still held: `scontrol release 777` failed (exit 1: Access/permission denied)" in outcome.detail
    )
    assert outcome.detail.endswith("release it with `scontrol release 777`")


async def test_slurm_missing_scontrol(bin_dir: Path, tmp_path: Path) -> None:
    on_path = await verified_slurm().restart("4242", ["gpu01"], [], "")  # bin_dir has no scontrol
    assert not on_path.ok
    assert on_path.detail.endswith(
        "`scontrol requeue 4242` failed (scontrol not found (looked for 'scontrol' on PATH))"
    )
    missing = tmp_path / "slurm" / "bin" / "scontrol"
    by_path = await verified_slurm(scontrol=str(missing)).restart("4242", ["gpu01"], [], "")
    assert not by_path.ok
    assert f"scontrol not found (looked for {missing})" in by_path.detail


async def test_slurm_timeout_kills_scontrol(bin_dir: Path) -> None:
    scontrol = write_standin(bin_dir, "scontrol", [{"args": ["requeue"], "sleep_s": 60}])
    started = time.monotonic()
    outcome = await verified_slurm(command_timeout_s=0.5).restart("4242", ["gpu01"], [], "")
    assert time.monotonic() - started < 10
    assert not outcome.ok
    assert outcome.detail.endswith("`scontrol requeue 4242` failed (no answer within 0.5 s (killed))")
    assert_gone(pids(scontrol)[0])


def test_slurm_job_ids_config() -> None:
    assert parse_slurm_job_ids(["llama = 777", "array=12_3"]) == {"llama": "777", "array": "12_3"}
    for bad in ("llama", "llama=abc", "=777"):
        with pytest.raises(ConfigError, match=r"^recovery\.slurm_job_ids: "):
            parse_slurm_job_ids([bad])
    with pytest.raises(
        ConfigError, match=r"^recovery\.slurm_job_ids: job 'llama': '7 7' is not a SLURM job id"
    ):
        SlurmLauncher(job_ids={"llama": "7 7"})
    launcher = SlurmLauncher(job_ids={"llama": "777"})
    assert (launcher.slurm_job_id("llama"), launcher.slurm_job_id("123"), launcher.slurm_job_id("x")) == (
        "777",
        None,
        None,
    )


# ---------------------------------------------------------------- Kubernetes


async def test_kubernetes_restart_deletes_the_jobs_pods(bin_dir: Path) -> None:
    kubectl = write_standin(
        bin_dir, "kubectl", [{"args": ["delete"], "stdout": "pod/llama-0\npod/llama-1\n"}]
    )
    outcome = await KubernetesLauncher(namespace="train").restart("llama", ["node-a", "node-b"], [], "")
    assert calls(kubectl) == [
        [
            "delete",
            "pod",
            "--namespace=train",
            "--selector=clusterwatch.io/job=llama",
            "--wait=false",
            "--output=name",
        ]
    ]
    assert outcome.ok, outcome.detail
    assert outcome.detail.startswith(
        "deleted 2 pods of job 'llama' (clusterwatch.io/job=llama in namespace train) for their controller "
        "to recreate; cordoned 0 nodes first; 1 kubectl calls in "
    )


async def test_kubernetes_cordons_excluded_nodes_before_deleting(bin_dir: Path) -> None:
    kubectl = write_standin(bin_dir, "kubectl", [{"args": ["delete"], "stdout": "pod/llama-worker-0\n"}])
    launcher = KubernetesLauncher(pod_selector="app=trainer,run={job}")
    outcome = await launcher.restart("llama", ["node-a", "node-b"], ["node-b", "node-c"], "")
    seen = calls(kubectl)
    assert sorted(seen[:2]) == [["cordon", "node-b"], ["cordon", "node-c"]]
    assert seen[2:] == [
        ["delete", "pod", "--selector=app=trainer,run=llama", "--wait=false", "--output=name"]
    ]
    assert outcome.ok, outcome.detail
    assert (
        "deleted 1 pods of job 'llama' (app=trainer,run=llama in kubectl's default namespace)"
        in outcome.detail
    )
    assert "cordoned 2 nodes first; 3 kubectl calls" in outcome.detail
    assert outcome.per_node == {"node-b": "cordoned", "node-c": "cordoned"}


async def test_kubernetes_failed_cordon_deletes_nothing(bin_dir: Path) -> None:
    kubectl = write_standin(
        bin_dir,
        "kubectl",
        [
            {
                "args": ["cordon", "node-x"],
                "exit": 1,
                "stderr": 'Error from server (NotFound): nodes "node-x" not found\n',
            }
        ],
    )
    outcome = await KubernetesLauncher().restart("llama", ["node-a"], ["node-a", "node-x"], "")
    assert sorted(calls(kubectl)) == [["cordon", "node-a"], ["cordon", "node-x"]]
    assert not outcome.ok
    assert outcome.detail == (
        "cordoned 1/2 nodes, so no pods of job 'llama' were deleted; node-x: `kubectl cordon node-x` failed "
        '(exit 1: Error from server (NotFound): nodes "node-x" not found)'
    )
    assert outcome.per_node["node-a"] == "cordoned"
    assert outcome.per_node["node-x"].startswith("not cordoned: `kubectl cordon node-x` failed (exit 1: ")


async def test_kubernetes_no_matching_pods_is_a_failure(bin_dir: Path) -> None:
    write_standin(bin_dir, "kubectl", [{"args": ["delete"], "stderr": "No resources found\n"}])
    outcome = await KubernetesLauncher(namespace="train").restart("llama", ["node-a"], [], "")
    assert not outcome.ok
    assert (
        outcome.detail
        == "no pods match clusterwatch.io/job=llama in namespace train: nothing to restart for job 'llama'"
    )


async def test_kubernetes_failed_delete(bin_dir: Path) -> None:
    """kubectl's klog lines before its own error are not the line worth quoting."""
    error = 'Error from server (Forbidden): pods is forbidden: User "cw" cannot delete resource "pods"'
    klog = 'E1121 17:28:38.573130   26919 memcache.go:265] "Unhandled Error" err="couldn\'t get ..."'
    write_standin(bin_dir, "kubectl", [{"args": ["delete"], "exit": 1, "stderr": f"{klog}\n{error}\n"}])
    outcome = await KubernetesLauncher().restart("llama", ["node-a"], [], "")
    assert not outcome.ok
    assert outcome.detail.startswith("pods of job 'llama' not deleted: `kubectl delete pod --selector=")
    assert outcome.detail.endswith(f"(exit 1: {error})")


async def test_kubernetes_missing_kubectl_and_timeout(bin_dir: Path) -> None:
    missing = await KubernetesLauncher().restart("llama", ["node-a"], ["node-a"], "")
    assert not missing.ok
    assert "kubectl not found (looked for 'kubectl' on PATH)" in missing.detail
    kubectl = write_standin(bin_dir, "kubectl", [{"args": ["cordon"], "sleep_s": 60}])
    started = time.monotonic()
    slow = await KubernetesLauncher(command_timeout_s=0.5).restart("llama", ["node-a"], ["node-a"], "")
    assert time.monotonic() - started < 10
    assert not slow.ok
    assert "`kubectl cordon node-a` failed (no answer within 0.5 s (killed))" in slow.detail
    assert calls(kubectl) == [["cordon", "node-a"]]
    assert_gone(pids(kubectl)[0])


async def test_kubernetes_refuses_names_it_cannot_pass_safely(bin_dir: Path) -> None:
    kubectl = write_standin(bin_dir, "kubectl")
    bad_job = await KubernetesLauncher().restart("llama,app=x", ["node-a"], [], "")
    assert (bad_job.ok, bad_job.detail) == (
        False,
        "job name 'llama,app=x' is not a Kubernetes label value; nothing done",
    )
    bad_node = await KubernetesLauncher().restart("llama", ["node-a"], ["-A"], "")
    assert not bad_node.ok
    assert calls(kubectl) == []


def test_kubernetes_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^recovery\.kubernetes_pod_selector: 'app=\{name\}'"):
        KubernetesLauncher(pod_selector="app={name}")
    with pytest.raises(ConfigError, match=r"^recovery\.kubernetes_pod_selector: must not be empty"):
        KubernetesLauncher(pod_selector=" ")
    with pytest.raises(ConfigError, match=r"^recovery\.kubernetes_namespace: 'Train_1'"):
        KubernetesLauncher(namespace="Train_1")


# ---------------------------------------------------------------- commands


async def test_timeout_kills_what_the_command_started(tmp_path: Path) -> None:
    """A child left holding the output pipe must not keep run_command waiting."""
    tool = write_standin(tmp_path / "bin", "tool", [{"args": [], "child_sleep_s": 60, "sleep_s": 60}])
    started = time.monotonic()
    run = await run_command([str(tool), "x"], timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert (run.returncode, run.failure) == (None, "no answer within 0.5 s (killed)")


async def test_cancelled_command_is_killed(tmp_path: Path) -> None:
    tool = write_standin(tmp_path / "bin", "tool", [{"args": [], "sleep_s": 60}])
    task = asyncio.create_task(run_command([str(tool)], timeout_s=30))
    await asyncio.to_thread(wait_for, calls_file(tool).exists, 10, "the stand-in to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_gone(pids(tool)[0])


async def test_not_executable(tmp_path: Path) -> None:
    path = tmp_path / "scontrol"
    path.write_text("not a program")
    run = await run_command([str(path), "requeue", "1"], timeout_s=5)
    assert not run.ok
    assert run.failure == "scontrol could not start: Permission denied"


# ---------------------------------------------------------------- torchrun


def stopped(*outcomes: str) -> list[agent_pb2.StoppedProcess]:
    return [
        agent_pb2.StoppedProcess(pid=100 + i, rank=i, outcome=outcome, seconds=0.5)
        for i, outcome in enumerate(outcomes)
    ]


def test_stop_summary_all_nodes_ok() -> None:
    answers: dict[str, agent_pb2.CommandResult | str] = {
        "node-a": agent_pb2.CommandResult(
            status=Status.STATUS_OK, duration_seconds=2.5, stopped=stopped("sigterm", "sigterm", "sigkill")
        ),
        "node-b": agent_pb2.CommandResult(
            status=Status.STATUS_OK, duration_seconds=0.4, stopped=stopped("sigterm", "already_gone")
        ),
    }
    outcome = summarise_stops("llama", answers, excluded={"node-b"})
    assert outcome.ok, outcome.detail
    assert outcome.detail == (
        "stopped 5 processes of job 'llama' on 2/2 nodes (3 sigterm, 1 sigkill, 1 already_gone) in 2.5 s; "
        "left out 1 nodes (launcher stopped, cordoned): node-b"
    )
    assert outcome.per_node == {
        "node-a": "stopped 3 processes (2 sigterm, 1 sigkill) in 2.5 s",
        "node-b": "stopped 2 processes (1 sigterm, 1 already_gone) in 0.4 s; launcher stopped, node cordoned",
    }


def test_stop_summary_names_every_problem() -> None:
    answers: dict[str, agent_pb2.CommandResult | str] = {
        "node-a": agent_pb2.CommandResult(
            status=Status.STATUS_OK, duration_seconds=1.0, stopped=stopped("sigterm")
        ),
        "node-b": agent_pb2.CommandResult(
            status=Status.STATUS_OK, duration_seconds=12.0, stopped=stopped("sigkill", "survived")
        ),
        "node-c": agent_pb2.CommandResult(
            status=Status.STATUS_FAILED, message="no workers of job llama here"
        ),
        "node-d": agent_pb2.CommandResult(status=Status.STATUS_UNSUPPORTED),
        "node-e": "not connected",
    }
    outcome = summarise_stops("llama", answers, excluded=())
    assert not outcome.ok
    assert outcome.detail == (
        "stopped 3 processes of job 'llama' on 1/5 nodes (1 sigterm, 1 sigkill, 1 survived) in 12.0 s; "
        "node-b: 1 of 2 processes survived SIGKILL; node-c: failed: no workers of job llama here; "
        "node-d: unsupported; node-e: not connected"
    )
    assert outcome.per_node["node-b"] == (
        "1 of 2 processes survived SIGKILL; stopped 2 processes (1 sigkill, 1 survived) in 12.0 s"
    )
    assert outcome.per_node["node-e"] == "not connected"
    assert outcome.per_node["node-c"] == "failed: no workers of job llama here"
    assert not summarise_stops("llama", {}, ()).ok


def test_an_excluded_node_that_does_not_answer_is_left_out_all_the_same() -> None:
    answers: dict[str, agent_pb2.CommandResult | str] = {
        "node-a": agent_pb2.CommandResult(
            status=Status.STATUS_OK, duration_seconds=1.0, stopped=stopped("sigterm")
        ),
        "node-b": "not connected",  # unreachable: the reason it is left out
    }
    outcome = summarise_stops("llama", answers, excluded={"node-b"})
    assert outcome.ok, outcome.detail
    assert outcome.detail == (
        "stopped 1 processes of job 'llama' on 1/2 nodes (1 sigterm) in 1.0 s; "
        "left out without an answer, not stopped: node-b (not connected)"
    )
    assert not summarise_stops("llama", answers, excluded=()).ok  # a node that must restart


async def test_torchrun_stops_every_node_and_the_launcher_on_excluded_ones() -> None:
    sent: list[tuple[str, agent_pb2.StopWorkersCommand, float]] = []

    async def send_stop(
        node: str, command: agent_pb2.StopWorkersCommand, timeout_s: float
    ) -> agent_pb2.CommandResult:
        sent.append((node, command, timeout_s))
        if node == "node-c":
            raise KeyError(node)
        return agent_pb2.CommandResult(status=Status.STATUS_OK, stopped=stopped("sigterm"))

    launcher = TorchrunLauncher(send_stop, grace_s=5.0)
    outcome = await launcher.restart(
        "llama", ["node-a", "node-b"], ["node-b", "node-c"], "hang incident hang-1"
    )
    assert [(node, c.job, c.grace_seconds, c.stop_launcher, c.reason, t) for node, c, t in sent] == [
        ("node-a", "llama", 5.0, False, "hang incident hang-1", 15.0),
        ("node-b", "llama", 5.0, True, "hang incident hang-1", 15.0),
        ("node-c", "llama", 5.0, True, "hang incident hang-1", 15.0),
    ]
    assert outcome.ok  # node-c is being left out; that it cannot be reached is why, not a failure
    assert outcome.detail.endswith(
        "; left out 1 nodes (launcher stopped, cordoned): node-b; "
        "left out without an answer, not stopped: node-c (not connected)"
    )


# ---------------------------------------------------------------- factory


async def _never(
    node: str, command: agent_pb2.StopWorkersCommand, timeout_s: float
) -> agent_pb2.CommandResult:
    raise AssertionError("not used")


def test_make_launcher() -> None:
    assert isinstance(make_launcher("torchrun", _never), TorchrunLauncher)
    slurm = make_launcher("slurm", _never, slurm_job_ids={"llama": "777"})
    assert isinstance(slurm, SlurmLauncher)
    assert slurm.slurm_job_id("llama") == "777"
    kubernetes = make_launcher("kubernetes", _never, kubernetes_pod_selector="run={job}")
    assert isinstance(kubernetes, KubernetesLauncher)
    assert kubernetes.selector_for("llama") == "run=llama"
    assert [make_launcher(kind, _never).name for kind in ("torchrun", "slurm", "kubernetes")] == [
        "torchrun",
        "slurm",
        "kubernetes",
    ]
    with pytest.raises(
        ConfigError,
        match=r"^recovery\.launcher: unknown launcher 'pbs' \(one of: torchrun, slurm, kubernetes\)$",
    ):
        make_launcher("pbs", _never)


def test_the_registry_builds_every_launcher_kind_the_settings_accept() -> None:
    from clusterwatch.coordinator.recovery.launchers.registry import BUILDERS
    from clusterwatch.wire.recovery_names import LAUNCHER_KINDS

    assert sorted(BUILDERS) == sorted(LAUNCHER_KINDS)
