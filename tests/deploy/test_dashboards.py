"""The Grafana dashboards: importable as files, and every panel's query answered by a real Prometheus.

The live test looks at the session's ``clusterwatch demo`` run (tests/demo_run.py: an elastic
torchrun job with a straggler and a hang, both recovered), to which one node was added over
the real agent protocol with what the demo machine lacks (InfiniBand ports, one down; an XID;
ECC errors; a rank that was killed). A real Prometheus scraped the demo's coordinator from its
start; once it holds enough samples of every metric the dashboards use, every variable, panel
query and annotation of every dashboard is run through Prometheus' HTTP API at that moment,
the way Grafana would with "All" selected, and must parse and return data.

The same holds in the large-cluster mode (coordinator.hardware_series = "agents"): a second
demo run (``lean_demo_run``, after the first) whose agents send the coordinator report
digests and serve the hardware series themselves, scraped by Prometheus as
deploy/prometheus/prometheus-agents.yml says. The dashboards are not changed for it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from demo_run import FABRIC_JOB, FABRIC_NODE, DemoRun
from helpers import ROOT
from prometheus_server import SCRAPE_INTERVAL_S, PrometheusServer, require

from bench.dashboards import expand

# The session's demo run (tests/demo_run.py) is started by whichever of this module and
# tests/e2e/test_demo.py asks first; the samples this test waits for are there within a minute.
pytestmark = pytest.mark.timeout(300)

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
METRIC = re.compile(r"\bclusterwatch_[a-z0-9_]+")
# Grafana's interval variables, as it would expand them for a short range at a 1 s scrape interval.
RATE_INTERVAL_S = 4 * SCRAPE_INTERVAL_S
MIN_SAMPLES = 6
# Values some variables must offer; none may offer Prometheus' own scrape job name.
EXPECTED_VALUES = {"training_job": {"demo-train", FABRIC_JOB}, "node": {"demo-node-1", FABRIC_NODE}}
SCRAPE_JOBS = {"clusterwatch-coordinator", "clusterwatch-agent"}


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
    root = ROOT
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert len(DASHBOARDS) == 5


def label_values(
    prometheus: PrometheusServer, definition: str, variables: list[str], window: tuple[float, float]
) -> set[str]:
    match = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", definition)
    assert match, f"not a label_values() variable: {definition}"
    selector, label = expand(match[1], variables, 60, RATE_INTERVAL_S), match[2]
    start_s, end_s = window
    found = prometheus.api(
        "series", **{"match[]": selector, "start": f"{start_s:.0f}", "end": f"{end_s:.0f}"}
    )
    return {s[label] for s in found if label in s}


def samples_of(
    prometheus: PrometheusServer, metrics: list[str], window: tuple[float, float]
) -> dict[str, list[float]]:
    """For each metric, the sample times of its series with the most samples in ``window``."""
    start_s, end_s = window
    selector = '{__name__=~"%s"}[%ds]' % ("|".join(metrics), int(end_s - start_s) + 1)  # noqa: UP031 - braces in PromQL
    found: dict[str, list[float]] = {}
    for series in prometheus.query(selector, end_s):
        name = series["metric"]["__name__"]
        times = [float(t) for t, _ in series["values"]]
        if len(times) > len(found.get(name, [])):
            found[name] = times
    return found


def test_every_panel_of_every_dashboard_returns_data_from_a_real_prometheus(demo_run: DemoRun) -> None:
    check_every_dashboard(demo_run)


# Waits for the default run to end, then for its own (a minute each).
@pytest.mark.timeout(540)
def test_in_agents_mode_every_panel_returns_data_and_the_coordinator_got_digests(
    lean_demo_run: DemoRun,
) -> None:
    """Agents -> coordinator (digests) for detection; agents' /metrics -> Prometheus -> dashboards."""
    assert lean_demo_run.wait_started(300), "the default demo did not end"
    at_s = check_every_dashboard(lean_demo_run)
    prometheus = lean_demo_run.prometheus
    assert prometheus is not None
    window = f"{int(at_s - (lean_demo_run.scraped_since_s or at_s)) + 1}s"
    # Every hardware series came from the agents; the coordinator exported none.
    from_coordinator = f'count(count_over_time({{__name__=~"clusterwatch_gpu_.+",job="clusterwatch-coordinator"}}[{window}]))'
    assert prometheus.query(from_coordinator, at_s) == []
    gpus = prometheus.query(
        f"count by (job) (count_over_time(clusterwatch_gpu_utilization_ratio[{window}]))", at_s
    )
    assert {g["metric"]["job"] for g in gpus} == {"clusterwatch-agent"}
    # The coordinator held digests: what detection and top read, no per-link NVLink or energy.
    snapshot = lean_demo_run.snapshot
    assert snapshot is not None, lean_demo_run.tail()
    reports = [n.report for n in snapshot.nodes if n.node_id.startswith("demo-node-")]
    assert len(reports) == 2
    for report in reports:
        assert report.gpus, report
        for gpu in report.gpus:
            assert gpu.HasField("sm_clock_hertz")
            assert gpu.HasField("utilization_ratio")
            assert not gpu.nvlinks
            assert not gpu.HasField("energy_joules_total")
    # ... and detected and recovered from both faults as in the default mode (tests/e2e/test_demo.py).
    assert lean_demo_run.wait(timeout_s=240) == 0, lean_demo_run.tail()
    summary = json.loads(lean_demo_run.summary_path.read_text())
    straggler, hang = summary["faults"]
    assert (straggler["cause"], straggler["action"]) == ("compute", "exclude node and restart"), summary
    assert hang["action"] == "restart", summary


def check_every_dashboard(demo_run: DemoRun) -> float:
    """Every query of every dashboard against what Prometheus scraped of ``demo_run``; when they ran."""
    require("prometheus")
    prometheus = demo_run.prometheus
    assert prometheus is not None, f"Prometheus did not start: {demo_run.prometheus_error}"
    demo_run.endpoints()
    scraped_since_s = wait_for_demo(
        lambda: demo_run.scraped_since_s, 30, "Prometheus to scrape the demo", demo_run
    )
    dashboards = {p.stem: load(p) for p in DASHBOARDS}
    metrics = sorted({m for d in dashboards.values() for e in expressions(d) for m in METRIC.findall(e)})

    # Recovery series appear once the demo's straggler is recovered (~35 s in); rate() over
    # RATE_INTERVAL_S needs a few samples of each. The moment Prometheus first held MIN_SAMPLES
    # of every metric is when the dashboards are queried (the demo may have ended since).
    def short() -> list[str]:
        samples = samples_of(prometheus, metrics, (scraped_since_s, time.time()))
        return [f"{m} ({len(samples.get(m, []))})" for m in metrics if len(samples.get(m, [])) < MIN_SAMPLES]

    def ready_at() -> float | None:
        samples = samples_of(prometheus, metrics, (scraped_since_s, time.time()))
        if any(len(samples.get(m, [])) < MIN_SAMPLES for m in metrics):
            return None
        return max(samples[m][MIN_SAMPLES - 1] for m in metrics)

    at_s = wait_for_demo(
        ready_at,
        200,
        f"Prometheus to hold {MIN_SAMPLES} samples of every metric the dashboards use",
        demo_run,
        detail=lambda: f"short of samples: {short()}",
    )
    failures = check_every_query(prometheus, dashboards, (scraped_since_s, at_s))
    fabric = f"the fabric node's stream failed: {demo_run.fabric_error!r}\n" if demo_run.fabric_error else ""
    assert not failures, "\n".join(failures) + f"\n{fabric}--- demo log ---\n{demo_run.tail()}"
    return float(at_s)


def check_every_query(
    prometheus: PrometheusServer, dashboards: dict[str, dict[str, Any]], window: tuple[float, float]
) -> list[str]:
    """Every query as Grafana runs it for a range from ``window``'s start to its end (a moment in the past)."""
    start_s, at_s = window
    range_s = max(60, int(at_s - start_s) + 1)
    failures: list[str] = []

    def run(where: str, expr: str, instant: bool) -> None:
        try:
            result = (
                prometheus.query(expr, at_s)
                if instant
                else prometheus.query_range(expr, at_s - range_s, at_s)
            )
        except AssertionError as exc:
            failures.append(f"{where}: {expr}: {exc}")
            return
        if not result:
            failures.append(f"{where}: {expr}: no data")

    named = {v["name"] for d in dashboards.values() for v in d["templating"]["list"]}
    assert EXPECTED_VALUES.keys() <= named  # each expectation is about a variable that exists
    for name, dashboard in dashboards.items():
        variables = [v["name"] for v in dashboard["templating"]["list"]]
        for variable in query_variables(dashboard):
            values = label_values(prometheus, variable["definition"], variables, (at_s - range_s, at_s))
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


def wait_for_demo(
    predicate: Callable[[], Any], timeout_s: float, what: str, demo_run: DemoRun, detail: Any = None
) -> Any:
    """Like helpers.wait_for, failing as soon as the demo has ended without it (nothing more will come)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ended = demo_run.ended()  # before the predicate: what it saw then is all there will be
        value = predicate()
        if value:
            return value
        if ended:
            why = f"the demo ended ({demo_run.process.returncode}) before {what}"
            raise AssertionError(f"{why}; {detail() if detail else ''}\n{demo_run.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}; {detail() if detail else ''}\n{demo_run.tail()}"
            )
        time.sleep(0.5)
