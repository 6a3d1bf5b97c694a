"""The worker environment, end to end on one node: a WorkerEnvCommand through the agent's real
CommandHandler into the file next to the hook socket, and a real TrainingMonitor that takes it."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from clusterwatch.agent.commands import CommandHandler
from clusterwatch.agent.worker_env import WorkerEnvBook
from clusterwatch.hook import TrainingMonitor
from clusterwatch.hook.worker_env import apply_worker_env
from clusterwatch.v1 import agent_pb2
from clusterwatch.wire.worker_env import WorkerEnv, WorkerEnvError, check_env, decode, encode, env_file_path

pytestmark = pytest.mark.timeout(60)
Status = agent_pb2.CommandResult.Status
MOVE = {"GLOO_SOCKET_IFNAME": "cwb1", "NCCL_SOCKET_IFNAME": "^cwa1"}


def command(
    job: str, env: dict[str, str], expires_unix_s: float = 0.0, command_id: str = "env-1"
) -> agent_pb2.Command:
    return agent_pb2.Command(
        command_id=command_id,
        worker_env=agent_pb2.WorkerEnvCommand(
            job=job, env=env, reason="incident job_slowdown-1", expires_unix_seconds=expires_unix_s
        ),
    )


def handle(handler: CommandHandler, command: agent_pb2.Command) -> agent_pb2.CommandResult:
    return asyncio.run(handler.handle(command))


@pytest.fixture
def socket_path(tmp_path: Path) -> str:
    return str(tmp_path / "agent.sock")


def test_a_command_sets_the_jobs_entry_readable_by_every_user(socket_path: str) -> None:
    handler = CommandHandler(worker_env=WorkerEnvBook(Path(env_file_path(socket_path))))

    result = handle(handler, command("train", MOVE))

    assert result.status == Status.STATUS_OK, result.message
    assert "GLOO_SOCKET_IFNAME=cwb1" in result.message
    path = Path(env_file_path(socket_path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert decode(path.read_bytes()) == {"train": WorkerEnv(MOVE, "incident job_slowdown-1", 0.0)}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing staged is left behind


def test_entries_of_other_jobs_stay_and_an_empty_env_clears_one(socket_path: str) -> None:
    book = WorkerEnvBook(Path(env_file_path(socket_path)))
    handler = CommandHandler(worker_env=book)
    handle(handler, command("train", MOVE, command_id="a"))
    handle(handler, command("eval", {"GLOO_SOCKET_IFNAME": "eth1"}, command_id="b"))

    cleared = handle(handler, command("train", {}, command_id="c"))

    assert cleared.status == Status.STATUS_OK
    assert "cleared" in cleared.message
    assert set(decode(book.path.read_bytes())) == {"eval"}
    assert set(WorkerEnvBook(book.path).entries()) == {"eval"}, "a restarted agent reads the file back"


def test_what_an_entry_keeps_the_job_off_is_kept_and_reported(socket_path: str) -> None:
    book = WorkerEnvBook(Path(env_file_path(socket_path)))
    set_it = command("train", MOVE)
    set_it.worker_env.avoided_interfaces.extend(["n1/cwa1", "n2/cwa2"])
    set_it.worker_env.expires_unix_seconds = 4e9

    assert handle(CommandHandler(worker_env=book), set_it).status == Status.STATUS_OK

    (reported,) = WorkerEnvBook(book.path).report()  # read back as a restarted agent would
    assert (reported.job, dict(reported.env), list(reported.avoided_interfaces)) == (
        "train",
        MOVE,
        ["n1/cwa1", "n2/cwa2"],
    )
    assert (reported.reason, reported.expires_unix_seconds) == ("incident job_slowdown-1", 4e9)


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD is not a variable clusterwatch sets"),
        ({"GLOO_SOCKET_IFNAME": "eth0; rm -rf /"}, "is not an interface list"),
        ({"NCCL_IB_HCA": ""}, "is not an interface list"),
    ],
)
def test_anything_but_an_interface_list_is_refused_and_changes_nothing(
    socket_path: str, env: dict[str, str], wanted: str
) -> None:
    book = WorkerEnvBook(Path(env_file_path(socket_path)))
    handler = CommandHandler(worker_env=book)
    handle(handler, command("train", MOVE, command_id="first"))
    before = book.path.read_bytes()

    result = handle(handler, command("train", env, command_id="bad"))

    assert result.status == Status.STATUS_FAILED
    assert wanted in result.message
    assert book.path.read_bytes() == before


def test_an_agent_without_a_hook_socket_says_it_cannot() -> None:
    result = handle(CommandHandler(), command("train", MOVE))
    assert result.status == Status.STATUS_UNSUPPORTED


def test_a_file_that_is_not_one_is_refused() -> None:
    for data in (b"", b"[]", b'{"version": 2, "jobs": {}}', b'{"version": 1, "jobs": {"j": {"env": 3}}}'):
        with pytest.raises(WorkerEnvError):
            decode(data)
    with pytest.raises(WorkerEnvError, match="PATH is not a variable"):
        decode(encode({"j": WorkerEnv({"PATH": "/bin"})}))
    check_env({"NCCL_IB_HCA": "=mlx5_0:1,mlx5_2:1"})  # NCCL's exact-match syntax is an interface list


# --- the hook's side ---------------------------------------------------------------------------


def write(socket_path: str, entries: dict[str, WorkerEnv]) -> None:
    Path(env_file_path(socket_path)).write_bytes(encode(entries))


def test_the_hook_sets_its_jobs_entry_and_replaces_what_the_user_set(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    write(
        socket_path,
        {"train": WorkerEnv(MOVE, "cwa1 on node-1 is avoided"), "other": WorkerEnv({"NCCL_IB_HCA": "x"})},
    )
    environ = {"GLOO_SOCKET_IFNAME": "cwa1", "NCCL_SOCKET_IFNAME": "^cwa1"}

    applied = apply_worker_env(socket_path, "train", environ, process_group_exists=False)

    assert applied == {"GLOO_SOCKET_IFNAME": "cwb1"}
    assert environ == MOVE
    assert (
        "GLOO_SOCKET_IFNAME=cwb1 replaces GLOO_SOCKET_IFNAME=cwa1 (cwa1 on node-1 is avoided)" in caplog.text
    )


def test_too_late_for_a_process_group_changes_nothing_and_says_why(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    write(socket_path, {"train": WorkerEnv(MOVE)})
    environ: dict[str, str] = {}

    assert apply_worker_env(socket_path, "train", environ, process_group_exists=True) == {}
    assert environ == {}
    assert "the process group already chose its interfaces" in caplog.text


def test_a_lapsed_entry_a_missing_file_and_a_malformed_one_change_nothing(
    socket_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    environ: dict[str, str] = {}
    assert apply_worker_env(socket_path, "train", environ, process_group_exists=False) == {}
    write(socket_path, {"train": WorkerEnv(MOVE, expires_unix_s=1000.0)})
    assert (
        apply_worker_env(socket_path, "train", environ, process_group_exists=False, now_unix_s=1000.0) == {}
    )
    Path(env_file_path(socket_path)).write_text(
        json.dumps({"version": 1, "jobs": {"train": {"env": {"PATH": "x"}}}})
    )
    assert apply_worker_env(socket_path, "train", environ, process_group_exists=False) == {}
    assert environ == {}
    assert "PATH is not a variable clusterwatch sets" in caplog.text


def test_a_training_monitor_takes_its_jobs_entry_when_it_starts(socket_path: str) -> None:
    write(socket_path, {"unit": WorkerEnv(MOVE, "moved")})
    environ = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    monitor = TrainingMonitor("unit", socket_path=socket_path, environ=environ, instrument_collectives=False)
    try:
        assert monitor.worker_env == MOVE
        assert {key: environ[key] for key in MOVE} == MOVE
    finally:
        monitor.close()
    assert os.environ.get("GLOO_SOCKET_IFNAME") != "cwb1", "the monitor set the environment it was given"
