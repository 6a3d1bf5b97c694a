"""The tests' Prometheus: bench.prometheus.PrometheusServer, and when its absence skips or fails a test.

Imported as ``prometheus_server``. ``./dev test`` installs Debian's ``prometheus``
package when it runs as root; elsewhere the tests that need it skip with the
reason, except under CI (``CI`` set), where a missing Prometheus fails them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench.prometheus import PrometheusServer

SCRAPE_INTERVAL_S = 1

__all__ = ["SCRAPE_INTERVAL_S", "PrometheusServer", "require", "start_prometheus"]


def require(tool: str) -> str:
    """The path of ``tool`` (prometheus, promtool); skip without it, fail under CI."""
    path = shutil.which(tool)
    if path is None:
        why = f"{tool} is not installed (apt-get install prometheus; ./dev test does it as root)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must not skip: {why}")
        pytest.skip(why)
    return path


def start_prometheus(workdir: Path) -> PrometheusServer:
    return PrometheusServer(workdir, SCRAPE_INTERVAL_S, binary=require("prometheus"))
