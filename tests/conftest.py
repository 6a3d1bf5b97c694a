"""Fixtures shared by the tests: a Cluster of real processes, torn down after each test, the
session's one ``clusterwatch demo`` run (tests/demo_run.py) and its one etcd (tests/etcd_server.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from etcd_server import EtcdServer, start_etcd
from helpers import ADMIN_TOKEN_FILE, Cluster

if TYPE_CHECKING:
    from demo_run import DemoRun

# Every process the tests start talks plaintext on loopback, as a user would
# say with --insecure; the TLS tests turn it off (tests/coordinator/test_security.py).
for _section in ("AGENT", "COORDINATOR", "CLIENT"):
    os.environ.setdefault(f"CLUSTERWATCH_{_section}_INSECURE", "true")
# Coordinators accept, and clients send, one admin token (actions need one).
os.environ.setdefault("CLUSTERWATCH_COORDINATOR_ADMIN_TOKEN_FILE", str(ADMIN_TOKEN_FILE))
os.environ.setdefault("CLUSTERWATCH_CLIENT_TOKEN_FILE", str(ADMIN_TOKEN_FILE))


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(c.logs())


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    """The demo, started by the first test that asks (it pays for none of the waiting: each test
    waits for what it needs), stopped at the end of the session if it is still running."""
    from demo_run import DemoRun  # loaded only by sessions that run the demo

    run = DemoRun(tmp_path_factory.mktemp("demo"))
    yield run
    run.close()


@pytest.fixture(scope="session")
def lean_demo_run(tmp_path_factory: pytest.TempPathFactory, demo_run: DemoRun) -> Iterator[DemoRun]:
    """The demo in the large-cluster mode (coordinator.hardware_series = "agents"), started when
    ``demo_run`` has ended so that the two never compete for the machine's cores."""
    from demo_run import DemoRun

    run = DemoRun(tmp_path_factory.mktemp("lean-demo"), hardware_series="agents", after=demo_run)
    yield run
    run.close()


@pytest.fixture(scope="session")
def group_demo_run(tmp_path_factory: pytest.TempPathFactory, lean_demo_run: DemoRun) -> Iterator[DemoRun]:
    """The demo with two coordinators on etcd (the job's owner is killed midway), started when
    ``lean_demo_run`` has ended."""
    from demo_run import DemoRun

    run = DemoRun(tmp_path_factory.mktemp("group-demo"), after=lean_demo_run, coordinators=2)
    yield run
    run.close()


@pytest.fixture(scope="session", autouse=True)
def _demo_early(request: pytest.FixtureRequest) -> None:
    """Start the demos with the session's first test when a selected test will look at them:
    each trains in the background for a minute while other tests run, instead of being waited for."""
    for name in ("demo_run", "lean_demo_run", "group_demo_run"):
        if any(name in getattr(item, "fixturenames", ()) for item in request.session.items):
            request.getfixturevalue(name)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    setattr(item, "rep_" + report.when, report)
    return report


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session; each test keeps to its own prefix (``etcd_prefix``)."""
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    return f"/clusterwatch-tests/{request.node.name}/{uuid.uuid4().hex[:8]}"
