"""deploy/prometheus: the scrape configuration and alert rules pass promtool, and every alert has a unit test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from prometheus_server import require

pytestmark = pytest.mark.timeout(60)

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "clusterwatch-alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "tests" / "clusterwatch-alerts.test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require("promtool"), *args],
        capture_output=True,
        text=True,
        cwd=PROMETHEUS_DIR,
        timeout=50,
        check=False,
    )


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-agents.yml"])
def test_the_scrape_configuration_is_valid(config: str) -> None:
    """One per coordinator.hardware_series: "coordinator" (the default) and "agents"."""
    result = promtool("check", "config", config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_alert_rules_are_valid() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_and_a_runbook() -> None:
    rules = [
        r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"] if "alert" in r
    ]
    alerts = {r["alert"] for r in rules}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    assert alerts == tested
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        notes = rule["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= notes.keys(), rule["alert"]
        # As kube-prometheus' alerts do: a link to the alert's own section of docs/runbooks.md.
        page, _, section = notes["runbook_url"].partition("#")
        assert page.endswith("/docs/runbooks.md"), rule["alert"]
        assert f"\n## {rule['alert']}\n" in runbooks
        assert section == rule["alert"].lower()  # GitHub's anchor of that heading


def test_every_recording_rule_is_unit_tested() -> None:
    rules = [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    assert recorded
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    exercised = " ".join(e["expr"] for t in tests for e in t.get("promql_expr_test", []))
    assert all(name in exercised for name in recorded)


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests can fail: the hang alert with a wrong kind no longer fires."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(RULES.read_text().replace('kind="hang"', 'kind="hung"'))
    (tmp_path / "tests" / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = subprocess.run(
        [require("promtool"), "test", "rules", f"tests/{RULE_TESTS.name}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=50,
        check=False,
    )
    assert result.returncode != 0
    assert "ClusterwatchHang" in result.stdout + result.stderr
