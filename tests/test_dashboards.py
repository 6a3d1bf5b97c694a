"""The Grafana dashboards: importable as files, and every panel's query answered by a real Prometheus.

The live test runs ``clusterwatch demo`` (an elastic torchrun job with a straggler and a
hang, both recovered) and adds one node over the real agent protocol with what the demo
machine lacks (InfiniBand ports, one down; an XID; ECC errors; a rank that was killed).
A real Prometheus scrapes the demo's coordinator; every variable, panel query and
annotation of every dashboard is then run through Prometheus' HTTP API, the way Grafana
would with "All" selected, and must parse and return data.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import clusterwatch_cmd
from prometheus_server import SCRAPE_INTERVAL_S, PrometheusServer, start_prometheus
from training_builders import EXITED, AgentStream, rank_report, step

from bench.dashboards import expand
from clusterwatch.v1 import node_pb2, training_pb2

pytestmark = pytest.mark.timeout(300)

DASHBOARDS = sorted((Path(__file__).parent.parent / "dashboards").glob("*.json"))
METRIC = re.compile(r"\bclusterwatch_[a-z0-9_]+")
# Grafana's interval variables, as it would expand them for a short range at a 1 s scrape interval.
RATE_INTERVAL_S = 4 * SCRAPE_INTERVAL_S
FABRIC_NODE = "fabric-node"
MIN_SAMPLES = 6
# Values some variables must offer; none may offer Prometheus' own scrape job name (honor_labels).
EXPECTED_VALUES = {"job": {"demo-train", "fabric-job"}, "node": {"demo-node-1", FABRIC_NODE}}
SCRAPE_JOBS = {"clusterwatch-coordinator"}


def load(path: Path) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            yield panel


def query_variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets, variables, annotations."""
    found = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    found += [v["definition"] for v in query_variables(dashboard)]
    found += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return found


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_a_dashboard_provisions_from_a_file_as_it_is(path: Path) -> None:
    text = path.read_text()
    dashboard = load(path)
    assert dashboard["schemaVersion"] >= 39
    assert "${DS_" not in text
    assert "__inputs" not in dashboard  # an import-only section: file provisioning cannot fill it in
    assert 0 < len(dashboard["uid"]) <= 40  # Grafana's limit
    (datasource,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (datasource["name"], datasource["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        where = f"{path.stem}: {panel['title']}"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), where
        assert len(panel["description"]) > 40, where
        assert panel["fieldConfig"]["defaults"]["unit"], where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, where
    names = {v["name"] for v in dashboard["templating"]["list"]}
    for expr in expressions(dashboard):
        used = set(re.findall(r"\$(?:\{)?([a-z_]+)", expr)) - {"__rate_interval", "__range", "__interval"}
        assert used <= names, f"{path.stem}: {expr} uses undefined variables {used - names}"


def test_the_committed_dashboards_are_what_the_generator_writes() -> None:
    root = Path(__file__).parent.parent
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_dashboards.py"), "--check"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(DASHBOARDS) == 5


def fabric_hardware(xids: int) -> node_pb2.NodeReport:
    """What the demo's machine lacks: InfiniBand ports (one down), an XID, ECC errors."""
    report = node_pb2.NodeReport()
    report.gpus.add(
        index=0, uuid="GPU-fabric-0", name="NVIDIA H100 80GB HBM3", utilization_ratio=0.9,
        memory_used_bytes=60 << 30, memory_total_bytes=80 << 30, temperature_celsius=71.0, power_watts=500.0,
        power_limit_watts=700.0, sm_clock_hertz=1.98e9, sm_clock_max_hertz=1.98e9,
        ecc_corrected_errors_total=3, ecc_uncorrected_errors_total=0,
    )  # fmt: skip
    report.gpus[0].xid_errors.add(xid=79, count=xids)
    for port, up in ((0, True), (1, False)):
        report.ib_ports.add(
            device=f"mlx5_{port}", port=1, receive_bytes_total=10**12, transmit_bytes_total=10**12,
            transmit_wait_total=10**6, symbol_errors_total=0, link_downed_total=0 if up else 1,
            receive_errors_total=0, state="ACTIVE" if up else "DOWN",
            physical_state="LinkUp" if up else "Disabled", rate_bytes_per_second=50e9, link_layer="InfiniBand",
        )  # fmt: skip
    return report


async def feed_fabric_node(address: str, stop: asyncio.Event) -> None:
    """One node over the real agent protocol; its job's rank 1 is killed by SIGKILL."""
    killed = training_pb2.RankExit(
        timestamp_unix_seconds=time.time(), signal=9, description="killed by signal 9"
    )
    async with AgentStream(address, FABRIC_NODE) as node:
        beats = 0
        while not stop.is_set():
            beats += 1
            ranks = [rank_report(0, job="fabric-job", steps=[step(beats)])]
            if beats > 3:  # a clean start, then the failure
                ranks.append(rank_report(1, job="fabric-job", state=EXITED, exit=killed))
            await node.report(*ranks, hardware=fabric_hardware(xids=0 if beats < 3 else 1))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                continue


def label_values(prometheus: PrometheusServer, definition: str, variables: list[str]) -> set[str]:
    match = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", definition)
    assert match, f"not a label_values() variable: {definition}"
    selector, label = expand(match[1], variables, 60, RATE_INTERVAL_S), match[2]
    return {s[label] for s in prometheus.series(selector) if label in s}


def test_every_panel_of_every_dashboard_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    prometheus = start_prometheus(tmp_path / "prometheus")
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            clusterwatch_cmd("demo", "--grpc-port", "0", "--metrics-port", "0", "--steps", "300"),
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        asyncio.run(_scrape_the_demo_and_check(prometheus, demo, log))
    finally:
        if demo.poll() is None:
            demo.terminate()
            try:
                demo.wait(timeout=30)
            except subprocess.TimeoutExpired:
                demo.kill()
        prometheus.close()


async def _scrape_the_demo_and_check(
    prometheus: PrometheusServer, demo: subprocess.Popen[bytes], log: Path
) -> None:
    def banner(key: str) -> str | None:
        line = next((ln for ln in log.read_text().splitlines() if key in ln), None)
        return line.split(key, 1)[1].strip() if line else None

    address_and_url = await poll(
        lambda: (a, u) if (a := banner("status --insecure --coordinator")) and (u := banner("metrics:")) else None,
        90, "the demo's coordinator address and metrics URL", demo=demo, log=log,
    )  # fmt: skip
    address, metrics_url = address_and_url
    prometheus.scrape(metrics_url)
    started_s = time.time()
    dashboards = {p.stem: load(p) for p in DASHBOARDS}
    metrics = sorted({m for d in dashboards.values() for e in expressions(d) for m in METRIC.findall(e)})
    stop = asyncio.Event()
    fabric = asyncio.create_task(feed_fabric_node(address, stop))
    try:
        # Recovery series appear once the demo's straggler is recovered (~35 s in); rate() over
        # RATE_INTERVAL_S needs a few samples of each.
        def short() -> list[str]:
            counts = prometheus.samples_per_metric(metrics)
            return [f"{m} ({counts.get(m, 0)})" for m in metrics if counts.get(m, 0) < MIN_SAMPLES]

        await poll(
            lambda: not short(), 200, f"Prometheus to hold {MIN_SAMPLES} samples of every metric the dashboards use",
            demo=demo, log=log, detail=lambda: f"short of samples: {short()}",
        )  # fmt: skip
        failures = check_every_query(prometheus, dashboards, started_s)
    finally:
        stop.set()
        await fabric
    assert not failures, "\n".join(failures) + f"\n--- demo log ---\n{tail(log)}"


def check_every_query(
    prometheus: PrometheusServer, dashboards: dict[str, dict[str, Any]], start_s: float
) -> list[str]:
    now = time.time()
    range_s = max(60, int(now - start_s) + 1)
    failures: list[str] = []

    def run(where: str, expr: str, instant: bool) -> None:
        try:
            result = (
                prometheus.query(expr, now) if instant else prometheus.query_range(expr, now - range_s, now)
            )
        except AssertionError as exc:
            failures.append(f"{where}: {expr}: {exc}")
            return
        if not result:
            failures.append(f"{where}: {expr}: no data")

    for name, dashboard in dashboards.items():
        variables = [v["name"] for v in dashboard["templating"]["list"]]
        for variable in query_variables(dashboard):
            values = label_values(prometheus, variable["definition"], variables)
            expected = EXPECTED_VALUES.get(variable["name"], set())
            if not values or not expected <= values or values & SCRAPE_JOBS:
                failures.append(
                    f"{name}: variable {variable['name']}: {variable['definition']}: {sorted(values)}"
                )
        for panel in panels(dashboard):
            for target in panel["targets"]:
                run(
                    f"{name}: {panel['title']}",
                    expand(target["expr"], variables, range_s, RATE_INTERVAL_S),
                    target["instant"],
                )
        for annotation in dashboard["annotations"]["list"]:
            if "expr" in annotation:
                run(
                    f"{name}: annotation {annotation['name']}",
                    expand(annotation["expr"], variables, range_s, RATE_INTERVAL_S),
                    False,
                )
    return failures


def tail(log: Path) -> str:
    return log.read_text()[-4000:]


async def poll(
    predicate: Any,
    timeout_s: float,
    what: str,
    *,
    demo: subprocess.Popen[bytes],
    log: Path,
    detail: Any = None,
) -> Any:
    """Like helpers.wait_for, on the event loop (the fabric node keeps reporting), failing early if the demo died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if demo.poll() is not None:
            raise AssertionError(f"the demo exited ({demo.returncode}) before {what}:\n{tail(log)}")
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; {detail() if detail else ''}\n{tail(log)}")
