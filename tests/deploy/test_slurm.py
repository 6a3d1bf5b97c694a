"""SLURM end to end: deploy/slurm/prolog.sh and epilog.sh run for real (bash, SLURM_* environment)
against a real coordinator; real hook processes started like `srun` tasks report through a real
agent; BeginJob/EndJob input checks; the SLURM launcher requeues the id the ranks reported.

scontrol is not installed here: the launcher test uses a STAND-IN (a small script named scontrol
that records its arguments), as tests/coordinator/recovery/test_launchers.py does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import (
    ADMIN_TOKEN_FILE,
    HOOK_WORKERS,
    ROOT,
    Cluster,
    Coordinator,
    Process,
    admin_channel,
    run_cli,
    samples_named,
    scrape,
    start_node,
    unused_port,
    wait_for,
)
from training_builders import T0, rank_report

from clusterwatch.config import CoordinatorSettings, RecoverySettings
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc

pytestmark = pytest.mark.timeout(120)

PROLOG = ROOT / "deploy" / "slurm" / "prolog.sh"
EPILOG = ROOT / "deploy" / "slurm" / "epilog.sh"
TASK = HOOK_WORKERS / "slurm_task.py"
CLUSTERWATCH_BIN = Path(sys.executable).parent / "clusterwatch"
JOB = "4242_7"  # task 7 of array job 4242, whose own job id is 4301
# What slurmd gives its Prolog and Epilog for that job (beside SLURM_SCRIPT_CONTEXT).
SLURMD_ENV = {
    "SLURM_JOB_ID": "4301",
    "SLURM_ARRAY_JOB_ID": "4242",
    "SLURM_ARRAY_TASK_ID": "7",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_ACCOUNT": "research",
    "SLURM_JOB_USER": "ml",
}
LABELS = {
    "slurm_job_id": "4301",
    "slurm_array_job_id": "4242",
    "slurm_array_task_id": "7",
    "slurm_nodelist": "gpu[01-02]",
    "slurm_partition": "gpu",
    "slurm_account": "research",
    "slurm_user": "ml",
}


def script_env(tmp_path: Path, coordinator: str, **extra: str) -> dict[str, str]:
    """A slurmd-like environment: SLURM's variables and a minimal PATH; the coordinator's address
    and the executable come from an environment file, as on a node (/etc/clusterwatch/clusterwatch.env)."""
    env_file = tmp_path / "clusterwatch.env"
    env_file.write_text(
        "# the agent's environment file\n"
        f'CLUSTERWATCH_AGENT_COORDINATOR="{coordinator}"\n'
        "CLUSTERWATCH_AGENT_INSECURE=true\n"
        f"CLUSTERWATCH_CLIENT_TOKEN_FILE={ADMIN_TOKEN_FILE}\n"
        f"CLUSTERWATCH_BIN={CLUSTERWATCH_BIN}\n"
        "CLUSTERWATCH_SLURM_TIMEOUT_S=2\n"
        f"CLUSTERWATCH_NOT_RUN=$(touch {tmp_path / 'never'})\n"
    )
    return {"PATH": "/usr/bin:/bin", "CLUSTERWATCH_ENV_FILE": str(env_file), **SLURMD_ENV, **extra}


def run_script(
    script: Path, env: dict[str, str], timeout_s: float = 30
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    return done, time.monotonic() - started


def status_json(coordinator: Coordinator) -> dict[str, Any]:
    done = run_cli("status", "--json", "--coordinator", coordinator.address)
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def job_json(coordinator: Coordinator, job: str) -> dict[str, Any] | None:
    return next((j for j in status_json(coordinator)["jobs"] if j["job"] == job), None)


def srun_task(cluster: Cluster, socket_path: Path, rank: int, stop_file: Path) -> Process:
    """One task of `srun --ntasks 2 python slurm_task.py` (no torchrun): SLURM's variables only."""
    env = {
        **os.environ,
        **SLURMD_ENV,
        "SLURM_JOB_NAME": "llama",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "CLUSTERWATCH_AGENT_SOCKET": str(socket_path),
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "CLUSTERWATCH_JOB"):
        env.pop(name, None)
    task = Process(
        [sys.executable, str(TASK), str(stop_file)], cluster.tmp_path / f"task-{rank}.log", env=env
    )
    cluster.processes.append(task)
    return task.start()


def test_prolog_ranks_and_epilog_end_to_end(cluster: Cluster, tmp_path: Path) -> None:
    coordinator, socket_path = start_node(cluster, node_id="gpu01")
    env = script_env(tmp_path, coordinator.address)

    begun, _ = run_script(PROLOG, {**env, "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"})
    assert begun.returncode == 0
    assert f"clusterwatch-slurm: job {JOB}: starting on 2 nodes (gpu01, gpu02)" in begun.stderr, begun.stderr
    assert not (tmp_path / "never").exists()  # the environment file is read, never run
    starting = job_json(coordinator, JOB)
    assert starting is not None
    assert (starting["phase"], starting["nodes"], starting["labels"]) == (
        "JOB_PHASE_STARTING",
        ["gpu01", "gpu02"],
        LABELS,
    )
    text = run_cli("status", "--coordinator", coordinator.address).stdout
    assert f"JOB {JOB}  starting on 2 nodes (gpu01, gpu02): no rank has reported yet" in text

    stop_file = tmp_path / "stop"
    tasks = [srun_task(cluster, socket_path, rank, stop_file) for rank in (0, 1)]

    def running() -> dict[str, Any] | None:
        job = job_json(coordinator, JOB)
        steps = [r.get("last_step", {}).get("step", 0) for r in job["ranks"]] if job else []
        return job if len(steps) == 2 and min(steps) >= 3 else None

    job = wait_for(running, 60, "both srun tasks stepping under the SLURM job's name")
    assert job["phase"] == "JOB_PHASE_RUNNING"
    assert job["world_size"] == 2
    assert [r["rank"] for r in job["ranks"]] == [0, 1]  # from SLURM_PROCID
    assert job["labels"] == {**LABELS, "slurm_job_name": "llama"}  # the ranks add what the Prolog lacked
    (info,) = samples_named(scrape(coordinator.metrics_url), "clusterwatch_job_info", training_job=JOB)
    assert info.labels == {"training_job": JOB, **LABELS, "slurm_job_name": "llama"}
    assert info.value == 1

    # scancel: SLURM kills the tasks before the Epilog runs; the first death is a rank failure.
    tasks[1].signal(signal.SIGKILL)
    with coordinator.client() as client:
        wait_for(
            lambda: [i for i in client.incidents(job=JOB) if i.kind == "rank_failure"], 30, "a rank failure"
        )

    ended, _ = run_script(EPILOG, {**env, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"})
    assert ended.returncode == 0
    assert f"clusterwatch-slurm: job {JOB} ended: 2 ranks dropped, 1 incident resolved" in ended.stderr, (
        ended.stderr
    )
    with coordinator.client() as client:
        assert client.incidents(job=JOB) == []
        (resolved,) = client.incidents(include_resolved=True, job=JOB)
        assert resolved.state == cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED
        assert "resolved: job ended (SLURM epilog_slurmd on " in resolved.summary
        assert [e.kind for e in client.events()][-1] == "job_ended"

    # The last task exits at teardown: the coordinator refuses its exit instead of a new failure.
    tasks[0].signal(signal.SIGTERM)
    wait_for(
        lambda: f"job '{JOB}' rank 0: the job was ended" in coordinator.log(),
        30,
        "the teardown report refused",
    )
    assert job_json(coordinator, JOB) is None
    assert [s for s in scrape(coordinator.metrics_url) if s.labels.get("training_job") == JOB] == []
    with coordinator.client() as client:
        assert [i for i in client.incidents() if i.job == JOB] == []


def test_with_the_coordinator_down_the_scripts_exit_0_quickly(tmp_path: Path) -> None:
    env = script_env(tmp_path, f"127.0.0.1:{unused_port()}")
    for script, action in ((PROLOG, "begin"), (EPILOG, "end")):
        done, took_s = run_script(script, env)
        assert done.returncode == 0
        assert took_s < 10, took_s  # 2 s of CLUSTERWATCH_SLURM_TIMEOUT_S, then on with the job
        assert (
            f"clusterwatch-slurm: SLURM job 4301: {action} failed (exit 1, coordinator 127.0.0.1:"
            in done.stderr
        )
        assert "the job goes on" in done.stderr
    no_binary, _ = run_script(PROLOG, {**env, "CLUSTERWATCH_BIN": str(tmp_path / "missing")})
    assert no_binary.returncode == 0
    assert "clusterwatch executable not found (set CLUSTERWATCH_BIN); nothing done" in no_binary.stderr
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    not_slurm, _ = run_script(EPILOG, outside)
    assert not_slurm.returncode == 0
    assert "SLURM_JOB_ID is not set" in not_slurm.stderr


def test_job_cli_bad_input_is_one_line_and_exit_2() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for args, line in (
        (("job", "begin"), "--job: required (or --slurm where SLURM_JOB_ID is set)"),
        (("job", "begin", "--job", "j", "--label", "nolabel"), "--label: 'nolabel' is not KEY=VALUE"),
        (("job", "begin", "--job", "j", "--label", "job=x"), "--label: key 'job' is reserved"),
        (("job", "begin", "--job", "j", "--nodes", "gpu[01-"), "--nodes: 'gpu[01-' is not a host list"),
        (("job", "end", "--job", "j", "--nodes", "gpu01"), "--nodes: only applies to `job begin`"),
        (("job", "begin", "--job", "j", "--reason", "x"), "--reason: only applies to `job end`"),
    ):
        done = run_cli(*args, "--coordinator", "127.0.0.1:1", env=env)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith(f"clusterwatch: invalid configuration: {line}"), done.stderr
        assert done.stderr.count("\n") == 1


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    # STAND-IN for scontrol: records its arguments, answers nothing, exits 0.
    scontrol.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(tmp_path / 'scontrol.calls')!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    scontrol.chmod(0o755)
    settings = CoordinatorSettings(
        listen="127.0.0.1:0", metrics_listen="", state_dir=tmp_path, admin_token_file=str(ADMIN_TOKEN_FILE)
    )
    srv = CoordinatorServer(settings, recovery=RecoverySettings(launcher="slurm", scontrol=str(scontrol)))
    await srv.start()
    yield srv
    await srv.stop()


async def test_begin_and_end_job_check_their_input(server: CoordinatorServer) -> None:
    async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = cluster_pb2_grpc.ClusterServiceStub(channel)
        for call, problem in (
            (stub.BeginJob(cluster_pb2.BeginJobRequest()), "job is empty"),
            (stub.EndJob(cluster_pb2.EndJobRequest(reason="epilog")), "job is empty"),
            (
                stub.BeginJob(cluster_pb2.BeginJobRequest(job="j", labels={"a b": "1"})),
                "labels: key 'a b' is not",
            ),
            (
                stub.BeginJob(cluster_pb2.BeginJobRequest(job="j", nodes=["gpu01", ""])),
                "nodes[1]: '' is not a node id",
            ),
            (
                stub.EndJob(cluster_pb2.EndJobRequest(job="j", reason="x" * 2000)),
                "reason: at most 1024 characters",
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (info.value.details() or "").startswith(problem), info.value.details()
        assert server.core.jobs.jobs == {}  # nothing changed

        status = await stub.BeginJob(
            cluster_pb2.BeginJobRequest(job=JOB, labels=LABELS, nodes=["gpu02", "gpu01"])
        )
        assert (status.job, status.phase, list(status.nodes)) == (
            JOB,
            cluster_pb2.JobPhase.JOB_PHASE_STARTING,
            ["gpu01", "gpu02"],
        )
        ended = await stub.EndJob(cluster_pb2.EndJobRequest(job=JOB, reason="test"))
        assert (ended.known, ended.ranks, ended.incidents_resolved) == (True, 0, 0)
        again = await stub.EndJob(cluster_pb2.EndJobRequest(job=JOB, reason="test"))
        assert not again.known
        assert (
            again.message
            == f"job {JOB} was not known (already ended, or no rank reported and not registered)"
        )


async def test_the_slurm_launcher_requeues_the_job_the_agent_verified_not_the_label(
    server: CoordinatorServer, tmp_path: Path
) -> None:
    report = rank_report(0, job=JOB, world_size=1)
    report.identity.labels.update(LABELS)
    server.core.jobs.ingest("gpu01", [report], now_mono=time.monotonic(), now_unix=T0)

    async def restart() -> cluster_pb2.ActionResponse:
        async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            return await cluster_pb2_grpc.ClusterServiceStub(channel).RequestAction(  # type: ignore[no-any-return]
                cluster_pb2.ActionRequest(job=JOB, action="restart")
            )

    # The rank's label alone is its own word: nothing is requeued on it.
    refused = await restart()
    assert "has no SLURM job id" in refused.message, refused.message
    assert not (tmp_path / "scontrol.calls").exists()
    # Its agent read the process's cgroup: that SLURM job is requeued.
    report.slurm_job_id = "4301"
    server.core.jobs.ingest("gpu01", [report], now_mono=time.monotonic(), now_unix=T0)
    response = await restart()
    assert response.message.startswith(f"done: requeued SLURM job 4301 (job '{JOB}' on 1 nodes)"), (
        response.message
    )
    calls = [json.loads(line) for line in (tmp_path / "scontrol.calls").read_text().splitlines()]
    assert calls == [["requeue", "4301"]]
