"""Typed settings for every clusterwatch command, from file, environment and flags.

Precedence, highest first: command-line flag > ``CLUSTERWATCH_<SECTION>_<KEY>``
environment variable > TOML config file > built-in default.

The config file is ``--config PATH``, else ``$CLUSTERWATCH_CONFIG``, else
``/etc/clusterwatch/clusterwatch.toml`` when it exists. It has one table per
section::

    [agent]
    coordinator = "coordinator.example:50051"
    interval_s = 1.0

    [coordinator]
    state_dir = "/var/lib/clusterwatch"

Every setting is a field of one of the dataclasses below; its metadata names
its flag and help text, so the file keys, the environment variables and the
flags cannot drift apart. A bad value raises ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import socket
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from clusterwatch.errors import ConfigError
from clusterwatch.wire.recovery_names import (
    AVOID_INTERFACE,
    LAUNCHER_KINDS,
    NETWORK_ACTIONS,
    ORPHAN_ACTIONS,
    POLICY_ACTIONS,
    TORCHRUN,
)

DEFAULT_CONFIG_PATH = Path("/etc/clusterwatch/clusterwatch.toml")
ENV_PREFIX = "CLUSTERWATCH_"
CONFIG_PATH_ENV = "CLUSTERWATCH_CONFIG"

GPU_BACKENDS = ("auto", "nvml", "sim", "none")
# Who exports the per-GPU and other per-node hardware series (see CoordinatorSettings.hardware_series).
HARDWARE_SERIES = ("coordinator", "agents")
NVLINK_SERIES = ("gpu", "link")
COLLECTORS = ("gpu", "host", "network", "infiniband")


def setting(default: Any, help: str, old_flags: tuple[str, ...] = (), **checks: Any) -> Any:
    """Declare a setting: its default, help text, checks, and the flags it used to have.

    Its flag is its name in kebab-case (``interval_s``: ``--interval-s``); ``old_flags`` still
    work, with a note on stderr naming the new one (docs/changes.md lists them).

    Checks: ``positive=True`` (> 0), ``minimum=N``, ``choices=(...)``,
    ``host_port=True`` (HOST:PORT, empty allowed when ``optional=True``), ``host_ports=True``
    (HOST:PORT[,HOST:PORT...]).
    """
    meta = {"help": help, "old_flags": old_flags, **checks}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class TransportSettings:
    """How a process talks gRPC over the network: mutual TLS, or plaintext only when asked.

    Shared by the agent, the coordinator and the client commands (each in its
    own section). With TLS on, both ends present a certificate signed by
    ``tls_ca``; the coordinator knows a node by its certificate's name.
    """

    tls_cert: str = setting("", "PEM certificate of this process (with tls_key and tls_ca: mutual TLS)")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_ca: str = setting("", "PEM certificate of the CA that signs every clusterwatch certificate")
    insecure: bool = setting(
        False, "plaintext gRPC without TLS (anyone who reaches the port is trusted): loopback and tests only"
    )


@dataclasses.dataclass(frozen=True)
class AgentSettings(TransportSettings):
    """Settings of ``clusterwatch agent`` (section ``[agent]``)."""

    coordinator: str = setting(
        "127.0.0.1:50051",
        "coordinator gRPC address HOST:PORT, or several comma-separated (a group of coordinators: any "
        "one sends the agent to its node's home)",
        host_ports=True,
    )
    node_id: str = setting("", "node name in every report and metric (default: hostname)")
    interval_s: float = setting(1.0, "seconds between node reports", old_flags=("--interval",), positive=True)
    gpu_backend: str = setting(
        "auto", "GPU source: auto (NVML if it loads), nvml, sim (simulated), none", choices=GPU_BACKENDS
    )
    sim_gpus: int = setting(8, "number of simulated GPUs with --gpu-backend sim", minimum=0)
    metrics_listen: str = setting(
        "", "serve this node's /metrics on HOST:PORT (empty: off)", host_port=True, optional=True
    )
    collectors: list[str] = setting(
        list(COLLECTORS), "collectors to run (comma-separated)", choices=COLLECTORS
    )
    proc_root: Path = setting(Path("/proc"), "procfs root (a container may mount the host's elsewhere)")
    sys_root: Path = setting(Path("/sys"), "sysfs root")
    topology_interval_s: float = setting(
        60.0,
        "seconds between topology re-discoveries (GPU links, NICs, NUMA; 0: only at start)",
        minimum=0,
    )
    buffer_s: float = setting(600.0, "seconds of reports kept for replay while disconnected", positive=True)
    reconnect_max_s: float = setting(
        4.0,
        "cap of the reconnect backoff, seconds (full jitter: every agent is back within it once the "
        "coordinator listens)",
        positive=True,
    )
    socket: str = setting(
        "/run/clusterwatch/agent.sock",
        "Unix socket for training hooks, mode 0660 (empty: off); hooks read CLUSTERWATCH_AGENT_SOCKET",
    )
    socket_group: str = setting(
        "", "group that owns the hook socket, name or gid (empty: the agent's); training users join it"
    )
    max_steps_per_report: int = setting(
        512, "per rank, at most this many step summaries in one node report (newest kept)", positive=True
    )
    pod_resources_socket: str = setting(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet pod-resources socket: GPU series get pod, namespace and container labels from it "
        "while it exists (empty: off)",
    )
    nvlink_series: str = setting(
        "gpu",
        "NVLink traffic on this agent's /metrics (agents mode): gpu (summed over each GPU's links, "
        "as dcgm-exporter: 2 series a GPU) or link (one per link, labelled link: 36 a GPU with 18 links)",
        choices=NVLINK_SERIES,
    )
    probe_listen: str = setting(
        "0.0.0.0:0",
        "answer other agents' network probes on HOST:PORT (port 0: any free one, told to the coordinator; "
        "a fixed port where a firewall sits between nodes; empty: off)",
        host_port=True,
        optional=True,
    )
    web_config_file: str = setting(
        "",
        "this agent's /metrics over TLS and with basic auth, as a Prometheus exporter-toolkit web "
        "config file says (tls_server_config, basic_auth_users: the file node_exporter's "
        "--web.config.file reads); empty: plain HTTP",
    )

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings(TransportSettings):
    """Settings of ``clusterwatch coordinator`` (section ``[coordinator]``)."""

    listen: str = setting("0.0.0.0:50051", "gRPC listen address HOST:PORT (port 0: any)", host_port=True)
    metrics_listen: str = setting(
        "0.0.0.0:9470", "/metrics and /healthz on HOST:PORT (empty: off)", host_port=True, optional=True
    )
    api_listen: str = setting(
        "",
        "also serve ClusterService (status, top, incidents) on HOST:PORT from a thread of its own, "
        "which answers while agents keep the coordinator busy; point clients here at scale (empty: off)",
        host_port=True,
        optional=True,
    )
    state_dir: Path = setting(Path("/var/lib/clusterwatch"), "directory for the SQLite event database")
    history_retention_days: float = setting(
        30.0,
        "days of history the SQLite database keeps: older events, resolved incidents, actions and "
        "superseded checkpoints are deleted hourly (0: keep everything)",
        minimum=0,
    )
    unreachable_after_intervals: float = setting(
        3.0, "a node that misses this many report intervals is unreachable", positive=True
    )
    max_agent_streams: int = setting(
        0,
        "agent streams admitted at most; more are refused with a retry delay (0: no limit, only the "
        "coordinator's own lag and 200 new streams a second limit them)",
        minimum=0,
    )
    etcd: str = setting(
        "",
        "etcd endpoints http://HOST:PORT,...: join the group of coordinators that share this etcd "
        "(empty: a group of one, as before)",
    )
    etcd_tls_cert: str = setting(
        "", "PEM client certificate for an https etcd (with etcd_tls_key, etcd_tls_ca)"
    )
    etcd_tls_key: str = setting("", "PEM key of etcd_tls_cert")
    etcd_tls_ca: str = setting("", "PEM CA that signed etcd's server certificate")
    shard_id: str = setting("", "this coordinator's name in its group (default: hostname)")
    etcd_prefix: str = setting("/clusterwatch", "the cluster's key prefix in etcd (clusters may share one)")
    advertise: str = setting(
        "",
        "HOST:PORT agents and clients reach this coordinator at, as its group lists it; its API and "
        "/metrics are listed on the same host (default: hostname; port 0: the gRPC port)",
        host_port=True,
        optional=True,
    )
    ready_file: str = setting("", "write the bound ports as JSON to this file once serving")
    admin_token_file: str = setting(
        "",
        "file of admin tokens, one per line as NAME:TOKEN (or TOKEN); a client sending "
        "'authorization: Bearer TOKEN' may act (checkpoint, restart, settings, jobs)",
    )
    admin_names: list[str] = setting(
        [], "client certificate names (CN or DNS SAN) that may act like an admin token (comma-separated)"
    )
    # One switch for the fleet: the coordinator tells each agent on its stream which reports to send.
    hardware_series: str = setting(
        "coordinator",
        "who exports per-GPU and other per-node hardware series: coordinator (its /metrics has them all: "
        "one scrape) or agents (Prometheus scrapes each agent's /metrics; agents send the coordinator "
        "only the digest detection, status and top read: for ~1,000 nodes and more)",
        choices=HARDWARE_SERIES,
    )
    nvlink_series: str = setting(
        "gpu",
        "NVLink traffic on the coordinator's /metrics: gpu (summed over each GPU's links, as "
        "dcgm-exporter: 2 series a GPU) or link (one per link, labelled link: 36 a GPU with 18 links)",
        choices=NVLINK_SERIES,
    )
    web_config_file: str = setting(
        "",
        "the coordinator's /metrics over TLS and with basic auth, as a Prometheus exporter-toolkit "
        "web config file says (tls_server_config, basic_auth_users: the file node_exporter's "
        "--web.config.file reads); empty: plain HTTP",
    )


@dataclasses.dataclass(frozen=True)
class DetectionSettings:
    """Detection thresholds of the coordinator (section ``[detection]``).

    These change at run time: SIGHUP re-reads them from the config file
    (and environment), and the ``UpdateDetectionSettings`` API sets them by
    name.
    """

    straggler_threshold_ratio: float = setting(
        0.05, "a rank computing this fraction slower than the others is a straggler", positive=True
    )
    straggler_window_steps: int = setting(60, "longest window of steps a straggler is judged over", minimum=5)
    straggler_clear_after_steps: int = setting(
        20, "healthy steps before a straggler is cleared (hysteresis)", minimum=1
    )
    straggler_min_ranks: int = setting(3, "ranks a job needs before stragglers are looked for", minimum=3)
    slowdown_threshold_ratio: float = setting(
        0.15,
        "a job whose steps get this fraction slower than its own baseline has slowed down",
        positive=True,
    )
    slowdown_corroborated_s: float = setting(
        5.0,
        "a communication-bound slowdown that a node's transport counters explain (queue drops or "
        "held-back packets, TCP retransmits, errors, a link down) is flagged after this long, not the 30 s "
        "an unexplained one needs",
        positive=True,
    )
    network_probe: bool = setting(
        True,
        "while a job's communication slows down and its nodes' counters do not say why, have the agents "
        "of its nodes probe the paths between them (round trip, throughput; a few seconds, once per 15 s "
        "at most) to name the slow node or link",
    )
    network_probe_bytes: int = setting(
        4 << 20, "bytes each probed path's throughput is measured with (at most 64 MiB)", positive=True
    )
    hang_floor_s: float = setting(5.0, "never call a job hung sooner than this", positive=True)
    hang_p99_factor: float = setting(
        3.0, "a job is hung after this many times its recent p99 step time (or the floor)", positive=True
    )
    heartbeat_stale_s: float = setting(
        5.0, "a rank whose heartbeat stopped for this long is frozen", positive=True
    )
    stack_dumps: bool = setting(
        True, "on a hang, ask the agents for py-spy dumps of the culprit and a healthy rank"
    )


# A job's pods by default (launchers.DEFAULT_POD_SELECTOR); {job} is the job name.
DEFAULT_POD_SELECTOR = "clusterwatch.io/job={job}"


@dataclasses.dataclass(frozen=True)
class RecoverySettings:
    """What the coordinator does about incidents (section ``[recovery]``).

    Each ``*_action`` is one of alert, checkpoint, restart,
    checkpoint_and_restart, exclude_node_and_restart (``orphaned_ranks_action``:
    alert or stop_orphans). ``launcher`` says how a
    job is restarted; only the options of the chosen launcher are used.

    SIGHUP re-reads this section like ``[detection]``: the policy changes at
    once, but the launcher and what it is built from (``restart_grace_s``,
    ``slurm_job_ids``, ``scontrol``, ``kubernetes_*``, ``kubectl``) only
    when the coordinator starts again.
    """

    hang_action: str = setting(
        "restart",
        "on a hung job (it cannot checkpoint: resumes from the last complete one)",
        choices=POLICY_ACTIONS,
    )
    rank_failure_action: str = setting(
        "alert",
        "on a rank that died (torchrun restarts the group itself; recovery is measured)",
        choices=POLICY_ACTIONS,
    )
    straggler_action: str = setting(
        "exclude_node_and_restart",
        "on a straggler that persists straggler_persist_s: checkpoint, then restart without its node when "
        "the job can run without it (elastic torchrun --nnodes MIN:MAX above MIN, or a SLURM/Kubernetes "
        "launcher that replaces nodes), else alert",
        choices=POLICY_ACTIONS,
    )
    straggler_rebalance: bool = setting(
        True,
        "a persistent straggler with no fault found (cause compute) in a job that splits its batch by "
        "shares (BalancedBatchSampler) gets a smaller share of each global batch instead of straggler_action",
    )
    straggler_persist_s: float = setting(
        300.0, "a straggler must persist this long before its action", positive=True
    )
    orphaned_ranks_action: str = setting(
        "stop_orphans",
        "on ranks that run on after their launcher (torchrun) died: stop_orphans stops them (SIGTERM, grace, "
        "SIGKILL) on their nodes, freeing their GPUs and peers; or alert",
        choices=ORPHAN_ACTIONS,
    )
    node_failure_action: str = setting(
        "exclude_node_and_restart",
        "on an unreachable node, a critical XID, a lost GPU or a link down under a job: restart without "
        "that node when the job can run without it (as for straggler_action), else alert",
        choices=POLICY_ACTIONS,
    )
    network_slowdown_action: str = setting(
        AVOID_INTERFACE,
        "on a job slowed down by one node's network, named with its interface: avoid_interface "
        "checkpoints, then restarts the job with its collectives kept off that interface (GLOO_SOCKET_IFNAME, "
        "NCCL_SOCKET_IFNAME, NCCL_IB_HCA set for its workers by the agents) when every node of the job has "
        "another interface on one shared network, else restarts without the node (as for "
        "exclude_node_and_restart)",
        choices=NETWORK_ACTIONS,
    )
    avoid_interface_hold_s: float = setting(
        3600.0,
        "a job stays off an interface avoid_interface moved it from until the interface has measured "
        "healthy this long (probed every avoid_interface_recheck_s; without probes, this long after the "
        "move), or a person restores it (clusterwatch restore-interfaces)",
        positive=True,
    )
    avoid_interface_recheck_s: float = setting(
        60.0, "seconds between probes of the interfaces jobs are kept off", positive=True
    )
    max_restarts_per_hour: int = setting(
        3, "restarts of one job per hour before it is left to a person", minimum=0
    )
    cooldown_s: float = setting(60.0, "no new action on a job this soon after the previous one", minimum=0)
    restart_grace_s: float = setting(10.0, "SIGTERM to SIGKILL grace when stopping workers", positive=True)
    recovery_timeout_s: float = setting(
        300.0, "a restarted job that is not past its resume step by then is left to a person", positive=True
    )
    dry_run: bool = setting(False, "only record what would be done; stop nothing")
    opt_out_jobs: list[str] = setting([], "jobs the policy never acts on (comma-separated)")
    launcher: str = setting(
        TORCHRUN,
        "how a job is restarted: torchrun (the agents stop its workers, torchrun restarts them), "
        "slurm (scontrol requeue), kubernetes (kubectl delete of its pods)",
        choices=LAUNCHER_KINDS,
    )
    slurm_job_ids: list[str] = setting(
        [],
        "with launcher slurm: JOB=SLURM_JOB_ID pairs (comma-separated); a job not listed uses the "
        "SLURM_JOB_ID its ranks reported, else its name when numeric (torchrun --rdzv-id=$SLURM_JOB_ID)",
    )
    scontrol: str = setting("scontrol", "with launcher slurm: the scontrol executable (path or name on PATH)")
    kubernetes_namespace: str = setting(
        "", "with launcher kubernetes: the jobs' namespace (empty: kubectl's current context's)"
    )
    kubernetes_pod_selector: str = setting(
        DEFAULT_POD_SELECTOR, "with launcher kubernetes: label selector of a job's pods; {job} is its name"
    )
    kubectl: str = setting(
        "kubectl", "with launcher kubernetes: the kubectl executable (path or name on PATH)"
    )


@dataclasses.dataclass(frozen=True)
class ClientSettings(TransportSettings):
    """Settings of the client commands such as ``clusterwatch status`` (section ``[client]``)."""

    coordinator: str = setting("127.0.0.1:50051", "coordinator gRPC address HOST:PORT", host_port=True)
    timeout_s: float = setting(
        5.0, "seconds to wait for the coordinator", old_flags=("--timeout",), positive=True
    )
    token_file: str = setting("", "file holding the admin token sent with actions (checkpoint, restart, ...)")


SECTIONS: dict[type, str] = {
    AgentSettings: "agent",
    CoordinatorSettings: "coordinator",
    DetectionSettings: "detection",
    RecoverySettings: "recovery",
    ClientSettings: "client",
}

T = TypeVar("T")


def flag_name(field: dataclasses.Field[Any]) -> str:
    """The command-line flag of a setting: its name in kebab-case, units and all."""
    return "--" + field.name.replace("_", "-")


def env_name(section: str, field_name: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{field_name.upper()}"


def fields_of(cls: type) -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(cls))


def read_config_file(path: Path | None, environ: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """Load the TOML config file; return its tables and a name for messages.

    An explicitly named file must exist; the default path is optional.
    """
    explicit = path or (Path(environ[CONFIG_PATH_ENV]) if environ.get(CONFIG_PATH_ENV) else None)
    chosen = explicit or DEFAULT_CONFIG_PATH
    if explicit is None and not chosen.exists():
        return {}, ""
    try:
        with chosen.open("rb") as fh:
            tables = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"file {chosen} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{chosen} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {chosen}: {exc.strerror}") from None
    check_names(tables, str(chosen))
    return tables, str(chosen)


def check_names(tables: Mapping[str, Any], file_name: str) -> None:
    """Every section and key of the file is one clusterwatch knows, whichever command reads it: a
    misspelt ``[agnet]`` or ``intervall_s`` would otherwise be ignored by every command.

    Raises:
        ConfigError: naming the first unknown section or key, and the nearest known one.
    """
    by_section = {section: {f.name for f in fields_of(cls)} for cls, section in SECTIONS.items()}
    for section, table in tables.items():
        if section not in by_section:
            raise ConfigError(
                section, f"unknown section [{section}]{_nearest(section, by_section)}", file_name
            )
        if not isinstance(table, dict):
            raise ConfigError(section, "must be a table", file_name)
        for key in table:
            if key not in by_section[section]:
                message = f"unknown setting{_nearest(key, by_section[section])}"
                raise ConfigError(f"{section}.{key}", message, file_name)


def _nearest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(known))})"


def load(
    cls: type[T],
    *,
    file_tables: Mapping[str, Any],
    file_name: str = "",
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, str] | None = None,
) -> T:
    """Build a settings object of ``cls`` from file, environment and flags.

    Args:
        cls: one of the settings dataclasses in SECTIONS.
        file_tables: the parsed TOML document (all sections).
        file_name: the file's path, for error messages.
        environ: environment variables (default: os.environ).
        flags: field name -> raw string from the command line, only for flags given.

    Raises:
        ConfigError: naming the key of the first bad value.
    """
    section = SECTIONS[cls]
    environ = os.environ if environ is None else environ
    flags = flags or {}
    hints = get_type_hints(cls)
    table = file_tables.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(section, "must be a table", file_name)
    known = {f.name for f in fields_of(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"{section}.{key}", "unknown setting", file_name)
    values: dict[str, Any] = {}
    for field in fields_of(cls):
        key = f"{section}.{field.name}"
        env = env_name(section, field.name)
        if field.name in flags:
            raw, source = flags[field.name], flag_name(field)
        elif env in environ:
            raw, source = environ[env], env
        elif field.name in table:
            raw, source = table[field.name], file_name
        else:
            continue
        values[field.name] = _convert(key, raw, hints[field.name], field.metadata, source)
    return cls(**values)


def override(settings: T, values: Mapping[str, str], source: str) -> T:
    """``settings`` with the named fields replaced, each parsed and checked like a file value.

    Raises:
        ConfigError: naming the first unknown key or bad value (nothing is changed then).
    """
    cls = type(settings)
    section = SECTIONS[cls]
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields_of(cls)}
    changes: dict[str, Any] = {}
    for name, raw in values.items():
        field = known.get(name)
        if field is None:
            raise ConfigError(f"{section}.{name}", "unknown setting", source)
        changes[name] = _convert(f"{section}.{name}", raw, hints[name], field.metadata, source)
    return dataclasses.replace(settings, **changes)  # type: ignore[type-var]


def as_strings(settings: object) -> dict[str, str]:
    """Every field of a settings object as the string a file or flag would give."""
    values = {}
    for field in fields_of(type(settings)):
        value = getattr(settings, field.name)
        if isinstance(value, bool):
            values[field.name] = "true" if value else "false"
        elif isinstance(value, list):
            values[field.name] = ",".join(map(str, value))
        else:
            values[field.name] = str(value)
    return values


def _convert(key: str, raw: Any, annotation: Any, meta: Mapping[str, Any], source: str) -> Any:
    """Convert and check one raw value (a TOML value or a string)."""
    if get_origin(annotation) is list:
        (item_type,) = get_args(annotation)
        items = [s.strip() for s in raw.split(",") if s.strip()] if isinstance(raw, str) else raw
        if not isinstance(items, list):
            raise ConfigError(key, f"must be a list, got {raw!r}", source)
        value: Any = [_scalar(key, item, item_type, source) for item in items]
        for item in value:
            _check(key, item, meta, source)
        return value
    value = _scalar(key, raw, annotation, source)
    _check(key, value, meta, source)
    return value


_PARSERS: dict[type, Callable[[str], Any]] = {
    float: float,
    int: int,
    str: str,
    Path: Path,
}


def _scalar(key: str, raw: Any, typ: type, source: str) -> Any:
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        lowered = str(raw).strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(key, f"must be true or false, got {raw!r}", source)
    if isinstance(raw, bool) or (not isinstance(raw, str) and typ in {str, Path}):
        raise ConfigError(key, f"must be a {typ.__name__}, got {raw!r}", source)
    if typ is int and isinstance(raw, float):
        raise ConfigError(key, f"must be a whole number, got {raw!r}", source)
    try:
        value = _PARSERS[typ](raw.strip() if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        kind = {float: "a number", int: "a whole number"}.get(typ, typ.__name__)
        raise ConfigError(key, f"must be {kind}, got {raw!r}", source) from None
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(key, "must be a number, got NaN", source)
    return value


def _check(key: str, value: Any, meta: Mapping[str, Any], source: str) -> None:
    if meta.get("positive") and not value > 0:
        raise ConfigError(key, f"must be greater than 0, got {value!r}", source)
    if "minimum" in meta and value < meta["minimum"]:
        raise ConfigError(key, f"must be at least {meta['minimum']}, got {value!r}", source)
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got {value!r}", source)
    if meta.get("host_port") and not (meta.get("optional") and value == ""):
        try:
            split_host_port(value)
        except ValueError as exc:
            raise ConfigError(key, str(exc), source) from None
    if meta.get("host_ports"):
        try:
            for address in value.split(","):
                split_host_port(address.strip())
        except ValueError as exc:
            raise ConfigError(key, str(exc), source) from None


def split_host_port(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6) into host and port.

    Raises:
        ValueError: if the address has no port or the port is not 0..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"must be HOST:PORT, got {address!r}")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"port must be 0..65535, got {address!r}")
    return host.strip("[]"), int(port_text)
