"""What the dashboards cost Prometheus: scrape size and time of the coordinator, and each dashboard's queries.

Usage:
    python -m bench.dashboards [--nodes 125] [--gpus-per-node 8] [--seconds 180] [--scrape-interval-s 5]

A real coordinator is fed by ``clusterwatch simulate`` (the thermal-throttle
scenario: NODES x GPUS ranks of one job, GPU, host, NIC and InfiniBand telemetry
at 1 Hz). Debian's Prometheus scrapes its /metrics every --scrape-interval-s.
After --seconds, every query of every dashboard in dashboards/ is run the way
Grafana runs it with "All" selected (range queries over the run at Grafana's
default resolution, instant ones at the end), one at a time, and timed. Prints
the coordinator's scrape (samples, seconds, from Prometheus' own
``scrape_*`` series) and per dashboard: queries, total and slowest query time,
series returned.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.coordinator_process import start_coordinator, stop_coordinator
from bench.prometheus import PrometheusServer

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
SCENARIO = ROOT / "bench" / "scenarios" / "thermal_throttle.toml"
# Grafana asks for about this many points per series (a panel's width in pixels, roughly).
MAX_POINTS = 300


def expand(expr: str, variables: list[str], range_s: int, rate_interval_s: int) -> str:
    """The expression as Grafana sends it with every variable on All (regex .*)."""
    expr = expr.replace("$__rate_interval", f"{rate_interval_s}s").replace("$__range", f"{range_s}s")
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", ".*").replace(f"${name}", ".*")
    return expr


def time_dashboard(
    prometheus: PrometheusServer, dashboard: dict[str, Any], window: tuple[float, float], rate_interval_s: int
) -> dict[str, Any]:
    start_s, end_s = window
    range_s = int(end_s - start_s)
    step_s = max(1.0, range_s / MAX_POINTS)
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    timings: list[tuple[float, str, int]] = []
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        for target in panel["targets"]:
            expr = expand(target["expr"], variables, range_s, rate_interval_s)
            began = time.perf_counter()
            if target["instant"]:
                result = prometheus.query(expr, end_s)
            else:
                result = prometheus.query_range(expr, start_s, end_s, step_s)
            timings.append((time.perf_counter() - began, panel["title"], len(result)))
    slowest = max(timings)
    return {
        "queries": len(timings),
        "total_s": round(sum(t for t, _, _ in timings), 3),
        "slowest_s": round(slowest[0], 3),
        "slowest_panel": slowest[1],
        "series": sum(n for _, _, n in timings),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=125)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--scrape-interval-s", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dashboards-") as tmp:
        workdir = Path(tmp)
        coordinator = start_coordinator(
            workdir / "state",
            "--hang-action",
            "alert",
            "--straggler-action",
            "alert",
            log_level="info",
            log=workdir / "coordinator.log",
        )
        prometheus = PrometheusServer(workdir / "prometheus", args.scrape_interval_s)
        simulate = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clusterwatch",
                "simulate",
                "--insecure",
                "--coordinator",
                coordinator.address,
                "--scenario",
                str(SCENARIO),
                "--nodes",
                str(args.nodes),
                "--gpus-per-node",
                str(args.gpus_per_node),
                "--step-s",
                "1",
                "--interval-s",
                "1",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(workdir / "simulate.log").open("wb"),
        )
        try:
            prometheus.scrape(f"http://127.0.0.1:{coordinator.metrics_port}/metrics")
            start_s = time.time()
            time.sleep(args.seconds)  # a benchmark's fixed run length, not a wait for a condition
            end_s = time.time()
            window = f"{int(end_s - start_s)}s"
            target = '{job="clusterwatch-coordinator"}'
            summary = {
                "samples per scrape, max": f"max_over_time(scrape_samples_scraped{target}[{window}])",
                "scrape seconds, median": f"quantile_over_time(0.5, scrape_duration_seconds{target}[{window}])",
                "scrape seconds, max": f"max_over_time(scrape_duration_seconds{target}[{window}])",
                "nodes up at the end": 'sum(clusterwatch_coordinator_nodes{state="up"})',
            }
            print(
                f"{args.nodes} nodes x {args.gpus_per_node} GPUs, {args.seconds:.0f} s, "
                f"scrape every {args.scrape_interval_s} s"
            )
            for name, expr in summary.items():
                result = prometheus.query(expr, end_s)
                value = f"{float(result[0]['value'][1]):.4g}" if result else "none"
                print(f"  coordinator {name}: {value}")
            rate_interval_s = 4 * args.scrape_interval_s
            for path in DASHBOARDS:
                dashboard = json.loads(path.read_text())
                print(
                    f"  {path.stem}: {time_dashboard(prometheus, dashboard, (start_s, end_s), rate_interval_s)}"
                )
        finally:
            simulate.terminate()
            simulate.wait(timeout=30)
            prometheus.close()
            stop_coordinator(coordinator.process, 30)


if __name__ == "__main__":
    main()
