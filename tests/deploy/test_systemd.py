"""systemd deployment: the unit files verify, and the daemons speak the notify protocol.

The units are checked by the real ``systemd-analyze verify`` in a scratch root
that holds them unchanged, the host's own unit library, and the executables
their Exec lines name (``/usr/local/bin/clusterwatch`` is this virtualenv's
entry point there). The protocol is checked against real agent and coordinator
processes, with a datagram socket in the test standing in for systemd's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, Cluster, Process, clusterwatch_cmd, scrape, unused_port, wait_for

from clusterwatch import config
from clusterwatch.cli.common import LOG_LEVEL_ENV
from clusterwatch.runtime import sd_notify

pytestmark = pytest.mark.timeout(120)

DEPLOY = ROOT / "deploy" / "systemd"
AGENT_UNIT = "clusterwatch-agent.service"
COORDINATOR_UNIT = "clusterwatch-coordinator.service"
UNITS = (AGENT_UNIT, COORDINATOR_UNIT)
ENV_FILE = DEPLOY / "clusterwatch.env"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or ""
INSTALLED_CLUSTERWATCH = "/usr/local/bin/clusterwatch"
# systemd's unit library (sysinit.target and the like), where Debian and Fedora keep it.
UNIT_LIBRARIES = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
# The most `systemd-analyze security` may call each unit's exposure, in tenths (0-100).
# They were 2.7 and 1.2 when written (systemd 252); the margin absorbs other versions'
# weights, not a dropped protection.
EXPOSURE_LIMITS = {AGENT_UNIT: 30, COORDINATOR_UNIT: 15}
WATCHDOG_USEC = 400_000  # pings every 0.2 s
NODE = "node-sd"
SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


# --- the unit files -------------------------------------------------------------------


def unit_entries(unit: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit file, values in order (keys may repeat)."""
    entries: dict[str, list[str]] = {}
    for raw_line in (DEPLOY / unit).read_text().splitlines():
        line = raw_line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            entries.setdefault(key.strip(), []).append(value.strip())
    return entries


def executables(unit: str) -> set[str]:
    """The programs a unit's Exec lines run (prefixes such as '-' stripped)."""
    found = set()
    for key, values in unit_entries(unit).items():
        if key.startswith("Exec"):
            for value in values:
                found.add(value.split()[0].lstrip("-@:+!"))
    return found


@pytest.fixture
def unit_root(tmp_path: Path) -> Path:
    """A scratch root for ``systemd-analyze --root``: our units as they are, the host's unit
    library, and every program the units' Exec lines name."""
    if not SYSTEMD_ANALYZE:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    root = tmp_path / "root"
    library = next((path for path in UNIT_LIBRARIES if (path / "sysinit.target").exists()), None)
    if library is None:
        pytest.skip(
            f"no systemd unit library (sysinit.target) in any of {', '.join(map(str, UNIT_LIBRARIES))}"
        )
    shutil.copytree(library, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy2(DEPLOY / unit, root / "etc/systemd/system" / unit)
    entry_point = Path(sys.executable).parent / "clusterwatch"
    assert entry_point.is_file(), f"no clusterwatch entry point next to {sys.executable} (pip install -e .)"
    for program in set().union(*map(executables, UNITS)):
        assert program.startswith("/"), f"{program}: Exec lines name programs by absolute path"
        source = entry_point if program == INSTALLED_CLUSTERWATCH else Path(program)
        assert source.is_file(), f"the units run {program}, which this host does not have"
        (root / program.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, root / program.lstrip("/"))  # a copy: a symlink would resolve inside the root
    return root


@pytest.mark.parametrize("unit", UNITS)
def test_unit_passes_systemd_analyze_verify(unit_root: Path, unit: str) -> None:
    run = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={unit_root}", unit],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = run.stdout + run.stderr
    about_us = [line for line in output.splitlines() if "clusterwatch" in line]
    assert run.returncode == 0, output
    assert not about_us, output


@pytest.mark.parametrize("unit", UNITS)
def test_unit_hardening_exposure_stays_low(unit_root: Path, unit: str) -> None:
    run = subprocess.run(
        [
            SYSTEMD_ANALYZE,
            "security",
            "--offline=yes",
            f"--root={unit_root}",
            f"--threshold={EXPOSURE_LIMITS[unit]}",
            "--no-pager",
            unit,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if "--offline" in run.stderr and "unrecognized option" in run.stderr:
        pytest.skip("this systemd-analyze has no offline security analysis (systemd < 250)")
    summary = run.stdout.strip().splitlines()[-1:] or [run.stderr]
    assert run.returncode == 0, f"exposure above {EXPOSURE_LIMITS[unit] / 10}: {summary[0]}\n{run.stdout}"


def test_units_agree_with_the_settings_defaults() -> None:
    agent, coordinator = unit_entries(AGENT_UNIT), unit_entries(COORDINATOR_UNIT)
    for entries, command in ((agent, "agent"), (coordinator, "coordinator")):
        assert entries["Type"] == ["notify"]
        assert entries["ExecStart"] == [f"{INSTALLED_CLUSTERWATCH} {command}"]
        assert entries["EnvironmentFile"] == ["-/etc/clusterwatch/clusterwatch.env"]
        assert entries["NoNewPrivileges"] == ["yes"]
        assert entries["ProtectSystem"] == ["strict"]
    # The hook socket's directory is the runtime directory systemd makes writable for it.
    assert Path("/run", agent["RuntimeDirectory"][0]) == Path(config.AgentSettings().socket).parent
    # The SQLite state lives in the state directory systemd makes writable for it.
    assert Path("/var/lib", coordinator["StateDirectory"][0]) == config.CoordinatorSettings().state_dir
    capabilities = {"CAP_KILL", "CAP_SYS_PTRACE", "CAP_NET_ADMIN"}
    assert set(agent["CapabilityBoundingSet"][0].split()) == capabilities
    assert set(agent["AmbientCapabilities"][0].split()) == capabilities
    assert coordinator["CapabilityBoundingSet"] == [""]
    for hides_what_the_agent_watches in ("PrivateDevices", "ProtectProc", "ProcSubset", "DeviceAllow"):
        assert hides_what_the_agent_watches not in agent


# --- the environment file -------------------------------------------------------------

ENV_LINE = re.compile(r"^#?(CLUSTERWATCH_[A-Z0-9_]+)=(.*)$")


def env_file_defaults() -> dict[str, str]:
    return {m[1]: m[2] for line in ENV_FILE.read_text().splitlines() if (m := ENV_LINE.match(line))}


def test_env_file_names_only_real_settings_with_their_defaults() -> None:
    shown = env_file_defaults()
    sections = {
        section: cls for cls, section in config.SECTIONS.items() if section != "client"
    }  # the client section is for the CLI, not the services
    settings = {
        config.env_name(section, field.name): (cls, field.name)
        for section, cls in sections.items()
        for field in config.fields_of(cls)
    }
    others = {config.CONFIG_PATH_ENV, LOG_LEVEL_ENV}
    assert set(shown) <= set(settings) | others, set(shown) - set(settings) - others
    assert set(settings) <= set(shown), f"not described: {sorted(set(settings) - set(shown))}"
    for name, value in shown.items():
        if name in settings:
            cls, field_name = settings[name]
            loaded = config.load(cls, file_tables={}, environ={name: value})
            assert getattr(loaded, field_name) == getattr(cls(), field_name), (
                f"{name}={value} is not the default"
            )
    # Everything is commented out: a fresh install runs on the built-in defaults.
    assert not [line for line in ENV_FILE.read_text().splitlines() if line.startswith("CLUSTERWATCH_")]


# --- a stand-in for systemd's notify socket -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Notification:
    at_s: float  # time.monotonic() on receipt
    assignments: tuple[str, ...]


class NotifyRecorder:
    """Binds a datagram socket like systemd's NOTIFY_SOCKET and records what arrives.

    Args:
        address: a path, or an abstract name starting with NUL.
    """

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(address)
        self._sock.settimeout(0.05)
        self._lock = threading.Lock()
        self._received: list[Notification] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify-recorder", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            with self._lock:
                self._received.append(Notification(time.monotonic(), tuple(data.decode().split("\n"))))

    @property
    def received(self) -> list[Notification]:
        with self._lock:
            return list(self._received)

    def with_assignment(self, assignment: str) -> list[Notification]:
        return [n for n in self.received if assignment in n.assignments]

    def statuses(self) -> list[str]:
        return [
            a.removeprefix("STATUS=") for n in self.received for a in n.assignments if a.startswith("STATUS=")
        ]

    def wait_for(
        self, assignment: str, timeout_s: float, count: int = 1, after_s: float = 0.0
    ) -> list[Notification]:
        """The first ``count`` notifications carrying ``assignment`` received after ``after_s``."""

        def enough() -> list[Notification] | None:
            found = [n for n in self.with_assignment(assignment) if n.at_s > after_s]
            return found[:count] if len(found) >= count else None

        return wait_for(enough, timeout_s, f"{count} x {assignment} on the notify socket")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, NotifyRecorder]]:
    path = str(tmp_path / "notify.sock")
    recorder = NotifyRecorder(path)
    yield path, recorder
    recorder.close()


def without_systemd_environment() -> dict[str, str]:
    """This process's environment minus what systemd would have set (if it started pytest)."""
    return {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARIABLES}


def start_agent(cluster: Cluster, coordinator_address: str, env: dict[str, str]) -> Process:
    """An agent like ``Cluster.agent`` starts, with systemd's variables from ``env`` only."""
    argv = clusterwatch_cmd(
        "agent",
        "--coordinator",
        coordinator_address,
        "--node-id",
        NODE,
        "--interval-s",
        "0.2",
        "--reconnect-max-s",
        "0.5",
        "--log-level",
        "debug",
        "--socket",
        str(cluster.socket_path(NODE)),
    )
    agent = Process(
        argv, cluster.tmp_path / "agent-systemd.log", env={**without_systemd_environment(), **env}
    )
    cluster.processes.append(agent)
    return agent.start()


def assert_paced(pings: list[Notification], interval_s: float) -> None:
    """Pings come about every ``interval_s``: not in bursts (a generous floor for a loaded machine)."""
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(pings)]
    assert min(gaps) > interval_s / 4, gaps


# --- the real daemons -----------------------------------------------------------------


def test_agent_is_ready_only_once_a_report_reached_the_coordinator(
    cluster: Cluster, notify_socket: tuple[str, NotifyRecorder]
) -> None:
    path, recorder = notify_socket
    port = unused_port()
    agent = start_agent(
        cluster, f"127.0.0.1:{port}", {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    )

    # No coordinator yet: the agent is alive (its loop pings the watchdog) and has tried
    # and failed to connect, but it must not say it is ready.
    recorder.wait_for("WATCHDOG=1", 30, count=2)
    wait_for(lambda: "cannot reach coordinator" in agent.log(), 30, "the agent's failed connection attempt")
    assert not recorder.with_assignment("READY=1"), recorder.received
    assert f"connecting to coordinator 127.0.0.1:{port}" in recorder.statuses()

    coordinator = cluster.coordinator(grpc_port=port)
    (ready,) = recorder.wait_for("READY=1", 30)
    # The coordinator acknowledges a report only after applying it, so the node is there.
    assert coordinator.node(NODE) is not None
    assert f"STATUS=reporting to 127.0.0.1:{port}" in ready.assignments
    assert len(recorder.with_assignment("READY=1")) == 1

    # The watchdog goes on being fed, from the agent's loop, every WATCHDOG_USEC / 2.
    pings = recorder.wait_for("WATCHDOG=1", 15, count=4, after_s=ready.at_s)
    assert_paced(pings, WATCHDOG_USEC / 2e6)

    agent.signal(signal.SIGTERM)
    recorder.wait_for("STOPPING=1", 15)
    assert agent.wait(timeout_s=15) == 0, agent.log()


def test_agent_tells_systemd_when_it_loses_the_coordinator(
    cluster: Cluster, notify_socket: tuple[str, NotifyRecorder]
) -> None:
    path, recorder = notify_socket
    coordinator = cluster.coordinator()
    start_agent(cluster, coordinator.address, {"NOTIFY_SOCKET": path})
    recorder.wait_for("READY=1", 30)
    assert not recorder.with_assignment("WATCHDOG=1")  # no WATCHDOG_USEC: no pings
    coordinator.stop()
    wait_for(
        lambda: any(s.startswith(f"lost coordinator {coordinator.address}") for s in recorder.statuses()),
        30,
        "a STATUS line saying the coordinator is lost",
    )


def test_coordinator_is_ready_once_serving_then_watchdog_and_stopping(
    cluster: Cluster, notify_socket: tuple[str, NotifyRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, recorder = notify_socket
    with monkeypatch.context() as env:  # only the coordinator's environment
        env.delenv("WATCHDOG_PID", raising=False)
        env.setenv("NOTIFY_SOCKET", path)
        env.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        coordinator = cluster.coordinator()
    (ready,) = recorder.wait_for("READY=1", 30)
    expected = f"STATUS=serving gRPC on port {coordinator.grpc_port}, /metrics on {coordinator.metrics_port}"
    assert expected in ready.assignments
    assert scrape(coordinator.metrics_url)
    assert coordinator.snapshot() is not None

    pings = recorder.wait_for("WATCHDOG=1", 15, count=4, after_s=ready.at_s)
    assert_paced(pings, WATCHDOG_USEC / 2e6)

    coordinator.signal(signal.SIGTERM)
    recorder.wait_for("STOPPING=1", 15)
    assert coordinator.wait(timeout_s=15) == 0, coordinator.log()


# --- the notify module ----------------------------------------------------------------


def test_notify_reaches_an_abstract_socket() -> None:
    name = f"clusterwatch-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)
        receiver.settimeout(10)
        sent = sd_notify.notify(
            sd_notify.READY, sd_notify.status("two\nlines"), environ={"NOTIFY_SOCKET": "@" + name}
        )
        assert sent
        assert receiver.recv(4096) == b"READY=1\nSTATUS=two lines"


def test_notify_without_notify_socket_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.notify(sd_notify.READY) is False
    assert sd_notify.notify(sd_notify.READY, environ={"NOTIFY_SOCKET": ""}) is False
    assert sd_notify.start_watchdog() is None


def test_notify_to_an_unreachable_socket_logs_once_and_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    environ = {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")}
    caplog.set_level(logging.DEBUG, logger="clusterwatch.sd_notify")
    assert sd_notify.notify(sd_notify.READY, environ=environ) is False
    assert sd_notify.notify(sd_notify.WATCHDOG, environ=environ) is False
    levels = [r.levelno for r in caplog.records if r.name == "clusterwatch.sd_notify"]
    assert levels == [logging.WARNING, logging.DEBUG]
    too_long = {"NOTIFY_SOCKET": "/" + "x" * 200}  # longer than sockaddr_un allows
    assert sd_notify.notify(sd_notify.READY, environ=too_long) is False


def test_notify_never_blocks_on_a_receiver_that_stopped_reading(tmp_path: Path) -> None:
    path = str(tmp_path / "full.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)  # and never reads: its queue fills up
        results = []
        deadline = time.monotonic() + 30
        while len(results) < 500 and time.monotonic() < deadline:
            results.append(sd_notify.notify(sd_notify.WATCHDOG, environ={"NOTIFY_SOCKET": path}))
        assert len(results) == 500, "notify blocked"
        assert results[0] is True
        assert False in results  # the full queue dropped messages instead of blocking


@pytest.mark.parametrize(
    ("environ", "expected_s"),
    [
        ({"WATCHDOG_USEC": "400000"}, 0.2),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "4243"}, None),  # set for another process
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "pid"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process(
    environ: dict[str, str], expected_s: float | None
) -> None:
    assert sd_notify.watchdog_interval_s(environ, pid=4242) == expected_s


async def test_watchdog_task_pings_until_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "watchdog.sock")
    recorder = NotifyRecorder(path)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "100000")
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        task = sd_notify.start_watchdog()
        assert task is not None
        deadline = time.monotonic() + 15
        while len(recorder.with_assignment("WATCHDOG=1")) < 3:
            assert time.monotonic() < deadline, "no watchdog pings"
            await asyncio.sleep(0.01)
        await sd_notify.stop_watchdog(task)
        assert task.cancelled()
    finally:
        recorder.close()
