"""The /metrics HTTP server (clusterwatch/exposition/http_server.py) on a real loopback socket."""

from __future__ import annotations

import contextlib
import http.client
import logging
import platform
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest
from prometheus_client.parser import text_string_to_metric_families

import clusterwatch
from clusterwatch.exposition.http_server import MetricsHttpServer

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


def test_every_page_ends_with_the_processs_own_series() -> None:
    """process_* and python_info, as every exporter serves them, after the page's own families."""
    page = b"# HELP clusterwatch_up Up.\n# TYPE clusterwatch_up gauge\nclusterwatch_up 1\n"
    with serving(lambda: page) as url:
        status, body = status_of(url)
    assert status == 200
    assert body.startswith(page)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert {"clusterwatch_up", "process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= set(
        families
    )
    (rss,) = families["process_resident_memory_bytes"].samples
    assert rss.value > 1 << 20  # this test process, a megabyte and more
    assert families["process_start_time_seconds"].samples[0].value <= time.time()
    (build,) = families["clusterwatch_build_info"].samples
    assert build.name == "clusterwatch_build_info"
    assert build.labels["version"] == clusterwatch.__version__
    assert build.labels["python_version"] == platform.python_version()
    assert build.value == 1


def test_head_answers_what_get_would_without_the_body() -> None:
    page = b"# HELP clusterwatch_up Up.\n# TYPE clusterwatch_up gauge\nclusterwatch_up 1\n"
    with serving(lambda: page) as url:
        _, body = status_of(url)
        for path, expected in ((url, 200), (url.replace("/metrics", "/healthz"), 200), (url + "x", 404)):
            request = urllib.request.Request(path, method="HEAD")
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    status, headers, got = response.status, response.headers, response.read()
            except urllib.error.HTTPError as exc:
                status, headers, got = exc.code, exc.headers, exc.read()
            assert status == expected, path
            assert got == b""
            if path == url:
                assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
                # The page's own process_* series (memory, CPU seconds) move between the GET and
                # the HEAD, a digit or two: the length is the page's, not an exact byte count.
                assert abs(int(headers["Content-Length"]) - len(body)) <= 32
        # On one kept-alive HTTP/1.1 connection, a GET after a HEAD gets its whole body.
        parts = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        try:
            for method in ("HEAD", "GET", "HEAD", "GET"):
                connection.request(method, parts.path)
                response = connection.getresponse()
                got = response.read()
                if method == "HEAD":
                    assert got == b""
                else:  # the whole page, its own series last (their values move between scrapes)
                    assert got.startswith(page)
                    assert got.endswith(b"\n")  # complete: the last line ends
                    assert b"clusterwatch_build_info" in got
        finally:
            connection.close()
