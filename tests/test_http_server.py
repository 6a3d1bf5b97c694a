"""The /metrics HTTP server (clusterwatch/http_server.py) on a real loopback socket."""

from __future__ import annotations

import contextlib
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest

from clusterwatch.http_server import MetricsHttpServer

pytestmark = pytest.mark.timeout(30)


@contextlib.contextmanager
def serving(render: Callable[[], bytes]) -> Iterator[str]:
    server = MetricsHttpServer("127.0.0.1:0", render, lambda: True)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/metrics"
    finally:
        server.close()


def status_of(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_scrape_while_the_process_stops_is_503_and_no_error(caplog: pytest.LogCaptureFixture) -> None:
    def stopping() -> bytes:
        raise futures.CancelledError  # what run_coroutine_threadsafe(...).result() raises once the loop cancelled it

    with caplog.at_level(logging.DEBUG), serving(stopping) as url:
        assert status_of(url) == (503, b"stopping\n")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_failing_render_is_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> bytes:
        raise RuntimeError("boom")

    with serving(broken) as url:
        assert status_of(url)[0] == 500
    assert any("rendering /metrics failed" in r.getMessage() for r in caplog.records)
