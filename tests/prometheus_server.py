"""The tests' Prometheus: bench.prometheus.PrometheusServer, and when its absence skips or fails a test.

Imported as ``prometheus_server``. ``./dev test`` installs Debian's ``prometheus``
package when it runs as root; elsewhere the tests that need it skip with the
reason, except under CI (``CI`` set), where a missing Prometheus fails them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT

from bench.prometheus import PrometheusServer

SCRAPE_INTERVAL_S = 1

__all__ = ["SCRAPE_INTERVAL_S", "PrometheusServer", "deployed_agent_job", "require", "start_prometheus"]


def require(tool: str, package: str = "prometheus") -> str:
    """The path of ``tool`` (prometheus, promtool; etcd from etcd-server); skip without it, fail under CI."""
    path = shutil.which(tool)
    if path is None:
        why = f"{tool} is not installed (apt-get install {package}; ./dev test does it as root)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must not skip: {why}")
        pytest.skip(why)
    return path


def start_prometheus(
    workdir: Path, agent_job: dict[str, Any] | None = None, coordinator_job: dict[str, Any] | None = None
) -> PrometheusServer:
    return PrometheusServer(
        workdir,
        SCRAPE_INTERVAL_S,
        binary=require("prometheus"),
        agent_job=agent_job,
        coordinator_job=coordinator_job,
    )


def deployed_agent_job() -> dict[str, Any]:
    """deploy/prometheus/prometheus-agents.yml's agent job as the tests' Prometheus runs it.

    Its label handling (honor_labels, the metric relabelling that leaves node_up
    to the coordinator) is the file's; targets and timing are the test's. The
    instance relabelling is left out: it shows a node's host name, and every
    test agent's host is 127.0.0.1, so their targets would collapse into one.
    """
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus-agents.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "clusterwatch-agent"]
    return {k: v for k, v in job.items() if k in ("honor_labels", "metric_relabel_configs")}
