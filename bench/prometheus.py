"""A real Prometheus on a loopback port the OS picks, scraping what the caller names; its HTTP API.

Used by bench.dashboards and by the tests (tests/prometheus_server.py adds the skip rules).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

START_TIMEOUT_S = 30.0


class PrometheusServer:
    """``prometheus`` (Debian's package) with a file_sd target list, storing into ``workdir``.

    Args:
        agent_job: settings of a second scrape job, ``clusterwatch-agent``, whose targets
            ``scrape_agents`` names (coordinator.hardware_series = "agents"); None: no such job.
        coordinator_job: more settings of the ``clusterwatch-coordinator`` job (scheme,
            tls_config, basic_auth...).

    Raises:
        FileNotFoundError: prometheus is not installed.
        RuntimeError: it exited or did not become ready within START_TIMEOUT_S.
    """

    def __init__(
        self,
        workdir: Path,
        scrape_interval_s: int = 1,
        binary: str | None = None,
        agent_job: Mapping[str, Any] | None = None,
        coordinator_job: Mapping[str, Any] | None = None,
    ) -> None:
        binary = binary or shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.targets_path = workdir / "targets.json"
        self.targets_path.write_text("[]")
        self.agent_targets_path = workdir / "agent-targets.json"
        self.agent_targets_path.write_text("[]")
        jobs: list[dict[str, Any]] = [
            {
                **(coordinator_job or {}),
                # As deploy/prometheus/prometheus.yml: no honor_labels (training series say training_job).
                "job_name": "clusterwatch-coordinator",
                "file_sd_configs": [{"files": [str(self.targets_path)]}],
            }
        ]
        if agent_job is not None:
            jobs.append(
                {
                    **agent_job,
                    "job_name": "clusterwatch-agent",
                    "file_sd_configs": [{"files": [str(self.agent_targets_path)]}],
                }
            )
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML; Prometheus re-reads file_sd targets when the file changes
                {
                    "global": {"scrape_interval": f"{scrape_interval_s}s", "evaluation_interval": "1s"},
                    "scrape_configs": jobs,
                }
            )
        )
        self.log_path = workdir / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    "--web.listen-address=127.0.0.1:0",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self._until(self._listening_port, 'listen')}"
        self._until(self._ready, "be ready")

    def _until(self, probe: Any, what: str) -> Any:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()}")
            try:
                value = probe()
            except OSError:
                value = None
            if value:
                return value
            time.sleep(0.1)
        self.close()
        raise RuntimeError(
            f"prometheus did not {what} within {START_TIMEOUT_S} s: {self.log_path.read_text()}"
        )

    def _listening_port(self) -> int | None:
        listening = [
            c for c in psutil.Process(self.process.pid).net_connections("tcp") if c.status == "LISTEN"
        ]
        return listening[0].laddr.port if listening else None

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:  # noqa: S310 - our http:// URL
            return bool(response.status == 200)

    def scrape(self, *urls: str) -> None:
        """Scrape these /metrics URLs from now on (job clusterwatch-coordinator)."""
        _write_targets(self.targets_path, urls)

    def scrape_agents(self, *urls: str) -> None:
        """Scrape these agents' /metrics URLs from now on (job clusterwatch-agent, see ``agent_job``)."""
        _write_targets(self.agent_targets_path, urls)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the ``data`` of a success, else AssertionError with Prometheus' error."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=60) as response:  # noqa: S310
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at_unix_s: float) -> list[Any]:
        return list(self.api("query", query=expr, time=f"{at_unix_s:.3f}")["result"])

    def query_range(
        self, expr: str, start_unix_s: float, end_unix_s: float, step_s: float = 1.0
    ) -> list[Any]:
        data = self.api(
            "query_range", query=expr, start=f"{start_unix_s:.3f}", end=f"{end_unix_s:.3f}", step=str(step_s)
        )
        return list(data["result"])

    def samples_per_metric(self, metrics: Iterable[str], window_s: float = 600) -> dict[str, int]:
        """For each metric, the most samples one of its series has over the last ``window_s``."""
        selector = '{__name__=~"%s"}[%ds]' % ("|".join(metrics), window_s)  # noqa: UP031 - braces in PromQL
        found: dict[str, int] = {}
        for series in self.query(selector, time.time()):
            name = series["metric"]["__name__"]
            found[name] = max(found.get(name, 0), len(series["values"]))
        return found

    def series(self, selector: str, window_s: float = 600) -> list[dict[str, str]]:
        """Label sets of the series ``selector`` matches over the last ``window_s``."""
        now = time.time()
        found = self.api(
            "series", **{"match[]": selector, "start": f"{now - window_s:.0f}", "end": f"{now:.0f}"}
        )
        return list(found)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def _write_targets(path: Path, urls: Iterable[str]) -> None:
    targets = [urllib.parse.urlsplit(url) for url in urls]
    groups = [{"targets": [t.netloc], "labels": {"__metrics_path__": t.path}} for t in targets]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)  # atomic: Prometheus never reads half a file
