"""/metrics behind TLS and basic auth from an exporter-toolkit web config file, scraped by a real
Prometheus over mutual TLS; everything else is refused, and a bad file stops the process naming
the key."""

from __future__ import annotations

import base64
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml
from helpers import Cluster, run_cli, wait_for
from prometheus_server import start_prometheus

from clusterwatch.cli import certs
from clusterwatch.errors import ConfigError
from clusterwatch.exposition.web_config import load_web_config
from clusterwatch.runtime.cert_terms import Role

pytestmark = pytest.mark.timeout(120)

PASSWORD = "scrape-me"  # noqa: S105 - this test's own credential


def web_config(tmp_path: Path, **overrides: object) -> Path:
    pki = tmp_path / "pki"
    if not pki.exists():
        certs.create_ca(pki)
        certs.issue(pki, "metrics", role=Role.COORDINATOR, extra_sans=["127.0.0.1"])
        certs.issue(pki, "prometheus", role=Role.USER)
    document = {
        "tls_server_config": {
            "cert_file": "pki/metrics.crt",  # relative to the file, as the toolkit reads it
            "key_file": "pki/metrics.key",
            "client_auth_type": "RequireAndVerifyClientCert",
            "client_ca_file": "pki/ca.crt",
            "min_version": "TLS12",
        },
        "basic_auth_users": {
            "prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
        },
        **overrides,
    }
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def client_context(tmp_path: Path, with_certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tmp_path / "pki" / "ca.crt"))
    if with_certificate:
        context.load_cert_chain(tmp_path / "pki" / "prometheus.crt", tmp_path / "pki" / "prometheus.key")
    return context


def get(url: str, context: ssl.SSLContext | None, password: str | None = None, method: str = "GET") -> int:
    request = urllib.request.Request(url, method=method)
    if password is not None:
        token = base64.b64encode(f"prometheus:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_prometheus_scrapes_over_mutual_tls_with_basic_auth_and_nothing_else_gets_in(
    cluster: Cluster, tmp_path: Path
) -> None:
    coordinator = cluster.coordinator("--web-config-file", str(web_config(tmp_path)))
    metrics = f"https://127.0.0.1:{coordinator.metrics_port}/metrics"
    prometheus = start_prometheus(
        tmp_path / "prometheus",
        coordinator_job={
            "scheme": "https",
            "tls_config": {
                "ca_file": str(tmp_path / "pki" / "ca.crt"),
                "cert_file": str(tmp_path / "pki" / "prometheus.crt"),
                "key_file": str(tmp_path / "pki" / "prometheus.key"),
            },
            "basic_auth": {"username": "prometheus", "password": PASSWORD},
        },
    )
    try:
        prometheus.scrape(metrics)

        def scraped() -> bool:
            now = time.time()
            up = prometheus.query('up{job="clusterwatch-coordinator"}', now)
            build = prometheus.query("clusterwatch_build_info", now)
            return bool(up) and up[0]["value"][1] == "1" and bool(build)

        wait_for(scraped, 60, "Prometheus to scrape the coordinator over TLS with basic auth")
    finally:
        prometheus.close()
    assert get(metrics, client_context(tmp_path), PASSWORD) == 200
    assert get(metrics, client_context(tmp_path), PASSWORD, method="HEAD") == 200
    assert get(metrics, client_context(tmp_path), "wrong") == 401
    assert get(metrics, client_context(tmp_path)) == 401
    # /healthz is for probes: TLS, no password.
    assert get(metrics.replace("/metrics", "/healthz"), client_context(tmp_path)) == 200
    # Without a client certificate the handshake fails; plain HTTP is not answered.
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        get(metrics, client_context(tmp_path, with_certificate=False), PASSWORD)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        get(metrics.replace("https://", "http://"), None, PASSWORD)
    # The server is still serving after all that.
    assert get(metrics, client_context(tmp_path), PASSWORD) == 200
    assert "Traceback" not in coordinator.log()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"http_server_config": {"http2": True}}, "http_server_config is not supported by clusterwatch"),
        (
            {"basic_auth_users": {"prometheus": "plain-text"}},
            "basic_auth_users.prometheus is not a bcrypt hash",
        ),
        ({"tls_srever_config": {}}, "tls_srever_config is not a web config key"),
    ],
)
def test_a_bad_web_config_names_what_is_wrong(
    tmp_path: Path, change: dict[str, object], expected: str
) -> None:
    path = web_config(tmp_path, **change)
    with pytest.raises(ConfigError, match=expected):
        load_web_config(str(path), "agent.web_config_file")


def test_tls_options_the_toolkit_has_and_we_do_not_are_refused_by_name(tmp_path: Path) -> None:
    path = web_config(tmp_path)
    document = yaml.safe_load(path.read_text())
    document["tls_server_config"]["client_auth_type"] = "RequireAnyClientCert"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match="RequireAnyClientCert is not supported by clusterwatch"):
        load_web_config(str(path), "coordinator.web_config_file")
    document["tls_server_config"]["client_auth_type"] = "NoClientCert"
    document["tls_server_config"]["cipher_suites"] = ["TLS_AES_128_GCM_SHA256"]
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match=r"tls_server_config\.cipher_suites is not supported"):
        load_web_config(str(path), "coordinator.web_config_file")


def test_the_coordinator_will_not_start_on_a_bad_web_config(tmp_path: Path) -> None:
    path = web_config(tmp_path, basic_auth_users={"x": "nope"})
    result = run_cli(
        "coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
        "--state-dir", str(tmp_path / "state"), "--web-config-file", str(path),
        timeout_s=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"coordinator.web_config_file: {path}: basic_auth_users.x is not a bcrypt hash" in result.stderr
