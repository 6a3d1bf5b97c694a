"""Settings: precedence flag > env > file > default, and one-line errors naming the key (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

from clusterwatch import config
from clusterwatch.cli import build_parser
from clusterwatch.config import AgentSettings, CoordinatorSettings, RecoverySettings
from clusterwatch.coordinator.recovery import launchers
from clusterwatch.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def test_defaults() -> None:
    settings = config.load(AgentSettings, file_tables={}, environ={})
    assert settings.interval_s == 1.0
    assert settings.gpu_backend == "auto"
    assert settings.collectors == ["gpu", "host", "network", "infiniband"]


def test_precedence_flag_over_env_over_file_over_default() -> None:
    tables = {"agent": {"interval_s": 2.0, "sim_gpus": 3, "node_id": "from-file"}}
    env = {"CLUSTERWATCH_AGENT_INTERVAL_S": "4", "CLUSTERWATCH_AGENT_SIM_GPUS": "5"}
    settings = config.load(AgentSettings, file_tables=tables, environ=env, flags={"interval_s": "8"})
    assert settings.interval_s == 8.0  # flag
    assert settings.sim_gpus == 5  # env
    assert settings.node_id == "from-file"  # file
    assert settings.gpu_backend == "auto"  # default


def test_lists_from_env_and_file() -> None:
    env = {"CLUSTERWATCH_AGENT_COLLECTORS": "host, network"}
    assert config.load(AgentSettings, file_tables={}, environ=env).collectors == ["host", "network"]
    tables = {"agent": {"collectors": ["gpu"]}}
    assert config.load(AgentSettings, file_tables=tables, environ={}).collectors == ["gpu"]


@pytest.mark.parametrize(
    ("tables", "env", "key"),
    [
        ({"agent": {"interval_s": "fast"}}, {}, "agent.interval_s"),
        ({"agent": {"interval_s": 0}}, {}, "agent.interval_s"),
        ({"agent": {"interval_s": True}}, {}, "agent.interval_s"),
        ({"agent": {"sim_gpus": 1.5}}, {}, "agent.sim_gpus"),
        ({"agent": {"sim_gpus": -1}}, {}, "agent.sim_gpus"),
        ({"agent": {"gpu_backend": "cuda"}}, {}, "agent.gpu_backend"),
        ({"agent": {"collectors": ["gpu", "disk"]}}, {}, "agent.collectors"),
        ({"agent": {"coordinator": "nohost"}}, {}, "agent.coordinator"),
        ({"agent": {"coordinator": "h:99999"}}, {}, "agent.coordinator"),
        ({"agent": {"intervall_s": 1}}, {}, "agent.intervall_s"),
        ({"agent": 5}, {}, "agent"),
        ({}, {"CLUSTERWATCH_AGENT_INTERVAL_S": "nan"}, "agent.interval_s"),
        ({}, {"CLUSTERWATCH_AGENT_BUFFER_S": ""}, "agent.buffer_s"),
    ],
)
def test_bad_values_name_the_key(tables: dict[str, object], env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(AgentSettings, file_tables=tables, environ=env)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")


def test_recovery_defaults_and_launcher_settings() -> None:
    defaults = config.load(RecoverySettings, file_tables={}, environ={})
    assert (defaults.straggler_action, defaults.node_failure_action) == ("exclude_node_and_restart",) * 2
    assert (defaults.hang_action, defaults.rank_failure_action) == ("restart", "alert")
    assert (defaults.launcher, defaults.slurm_job_ids, defaults.scontrol) == ("torchrun", [], "scontrol")
    assert (defaults.kubernetes_namespace, defaults.kubectl) == ("", "kubectl")
    # config cannot import the coordinator, so it repeats this one: they must agree.
    assert defaults.kubernetes_pod_selector == launchers.DEFAULT_POD_SELECTOR

    tables = {
        "recovery": {"launcher": "slurm", "slurm_job_ids": ["llama=777"], "scontrol": "/opt/slurm/scontrol"}
    }
    env = {"CLUSTERWATCH_RECOVERY_SLURM_JOB_IDS": "llama=777, array=12_3"}
    slurm = config.load(RecoverySettings, file_tables=tables, environ=env)
    assert (slurm.launcher, slurm.scontrol) == ("slurm", "/opt/slurm/scontrol")
    assert slurm.slurm_job_ids == ["llama=777", "array=12_3"]  # env over file
    kubernetes = config.load(
        RecoverySettings,
        file_tables={},
        environ={},
        flags={
            "launcher": "kubernetes",
            "kubernetes_namespace": "ml",
            "kubernetes_pod_selector": "app={job}",
        },
    )
    assert (kubernetes.launcher, kubernetes.kubernetes_namespace) == ("kubernetes", "ml")
    assert kubernetes.kubernetes_pod_selector == "app={job}"


@pytest.mark.parametrize(
    ("tables", "key"),
    [
        ({"recovery": {"launcher": "pbs"}}, launchers.LAUNCHER_KEY),
        ({"recovery": {"launcher": ["slurm"]}}, "recovery.launcher"),
        ({"recovery": {"slurm_job_ids": 777}}, "recovery.slurm_job_ids"),
        ({"recovery": {"straggler_action": "exclude"}}, "recovery.straggler_action"),
    ],
)
def test_bad_recovery_values_name_the_key(tables: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(RecoverySettings, file_tables=tables, environ={})
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")


def test_hardware_series_defaults_to_the_coordinator_and_refuses_anything_else(tmp_path: Path) -> None:
    """One scrape stays the default; a typo is one line naming the key and exit 2, nothing started."""
    assert config.load(CoordinatorSettings, file_tables={}, environ={}).hardware_series == "coordinator"
    env = {"CLUSTERWATCH_COORDINATOR_HARDWARE_SERIES": "agents"}
    assert config.load(CoordinatorSettings, file_tables={}, environ=env).hardware_series == "agents"
    with pytest.raises(ConfigError) as info:
        config.load(
            CoordinatorSettings, file_tables={"coordinator": {"hardware_series": "agent"}}, environ={}
        )
    assert info.value.key == "coordinator.hardware_series"
    refused = run_cli("coordinator", "--state-dir", str(tmp_path), "--hardware-series", "prometheus")
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "coordinator.hardware_series: must be one of coordinator, agents" in line, line
    assert not list(tmp_path.iterdir())  # refused before it opened its state


def test_an_agent_may_name_several_coordinators_and_a_bad_one_is_named() -> None:
    """A group of coordinators: any of them sends the agent to its node's home (agent/uplink.py)."""
    tables = {"agent": {"coordinator": "c1.example:50051, c2.example:50051"}}
    assert (
        config.load(AgentSettings, file_tables=tables, environ={}).coordinator
        == tables["agent"]["coordinator"]
    )
    with pytest.raises(ConfigError) as info:
        config.load(
            AgentSettings, file_tables={"agent": {"coordinator": "c1.example:50051,c2.example"}}, environ={}
        )
    assert info.value.key == "agent.coordinator"
    assert "c2.example" in str(info.value)


def test_config_file_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[agent\ninterval_s = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.read_config_file(broken, {})
    with pytest.raises(ConfigError, match="does not exist"):
        config.read_config_file(tmp_path / "missing.toml", {})
    good = tmp_path / "good.toml"
    good.write_text('[coordinator]\nstate_dir = "/tmp/x"\n')
    tables, name = config.read_config_file(None, {"CLUSTERWATCH_CONFIG": str(good)})
    assert name == str(good)
    assert config.load(CoordinatorSettings, file_tables=tables, environ={}).state_dir == Path("/tmp/x")


def _assert_exit_2_naming(result_stderr: str, returncode: int, key: str) -> None:
    assert returncode == 2, result_stderr
    lines = result_stderr.strip().splitlines()
    assert len(lines) == 1, result_stderr
    assert key in lines[0]


def test_cli_bad_flag_exits_2_with_one_line_naming_the_key() -> None:
    result = run_cli("agent", "--interval-s", "soon")
    _assert_exit_2_naming(result.stderr, result.returncode, "agent.interval_s")
    assert "(from --interval-s)" in result.stderr


def test_a_flags_former_name_still_works_and_says_the_new_one() -> None:
    """Flags are named as their settings are, units included; old spellings stay, with a note."""
    result = run_cli("agent", "--interval", "soon")
    assert result.returncode == 2
    assert (
        result.stderr.splitlines()[0]
        == "clusterwatch: --interval is now --interval-s (the old name still works)"
    )
    assert "agent.interval_s: must be a number, got 'soon'" in result.stderr
    parser = build_parser()
    for old, new, dest in (
        (["status", "--timeout", "3"], ["status", "--timeout-s", "3"], "setting__timeout_s"),
        (["top", "--interval", "2"], ["top", "--interval-s", "2"], "interval_s"),
        (["demo", "--duration", "5"], ["demo", "--duration-s", "5"], "duration_s"),
        (["demo", "--grpc-port", "7"], ["demo", "--listen", "127.0.0.1:7"], "listen"),
        (
            ["coordinator", "drain", "--drain-timeout", "9"],
            ["coordinator", "drain", "--drain-timeout-s", "9"],
            "drain_timeout_s",
        ),
    ):
        assert getattr(parser.parse_args(old), dest) == getattr(parser.parse_args(new), dest), old


def test_help_lists_the_choices_of_every_enumerated_setting() -> None:
    for cls in config.SECTIONS:
        for field in config.fields_of(cls):
            choices = field.metadata.get("choices")
            if not choices:
                continue
            command = {"agent": "agent", "client": "status"}.get(config.SECTIONS[cls], "coordinator")
            text = " ".join(run_cli(command, "--help").stdout.split())
            assert f"{config.flag_name(field)} {{{','.join(choices)}}}" in text, field.name


def test_cli_bad_env_exits_2(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "CLUSTERWATCH_COORDINATOR_UNREACHABLE_AFTER_INTERVALS": "-3"}
    result = run_cli("coordinator", "--state-dir", str(tmp_path), env=env)
    _assert_exit_2_naming(result.stderr, result.returncode, "coordinator.unreachable_after_intervals")


def test_cli_bad_file_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "clusterwatch.toml"
    path.write_text('[client]\ncoordinator = "no-port"\n')
    result = run_cli("status", "--config", str(path))
    _assert_exit_2_naming(result.stderr, result.returncode, "client.coordinator")


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--launcher", "pbs"], "recovery.launcher"),
        # Options of the chosen launcher are checked when the coordinator builds it.
        (["--launcher", "slurm", "--slurm-job-ids", "llama"], "recovery.slurm_job_ids"),
        (
            ["--launcher", "kubernetes", "--kubernetes-pod-selector", "{node}"],
            "recovery.kubernetes_pod_selector",
        ),
        (["--launcher", "kubernetes", "--kubernetes-namespace", "ML_Team"], "recovery.kubernetes_namespace"),
    ],
)
def test_cli_bad_launcher_exits_2(tmp_path: Path, flags: list[str], key: str) -> None:
    result = run_cli("coordinator", "--state-dir", str(tmp_path), *flags)
    _assert_exit_2_naming(result.stderr, result.returncode, key)
    assert not list(tmp_path.iterdir())  # refused before opening the state


def _commands() -> list[str]:
    """Every subcommand the parser knows, so a new one cannot be left out."""
    import argparse

    from clusterwatch.cli import build_parser

    (subparsers,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(subparsers.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_command_has_help(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0
    assert "usage: clusterwatch" in result.stdout
