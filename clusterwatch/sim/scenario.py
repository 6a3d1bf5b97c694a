"""Scenario files: what a simulated job looks like and which faults hit it, when.

A scenario is one TOML file (the benchmark's live in ``bench/scenarios/``)::

    name = "compute_straggler_10pct"     # default: the file name without .toml
    description = "rank 5 computes 10 % slower from step 40"
    seed = 7                             # the noise is reproducible per seed
    nodes = 2                            # run shape; flags override each of these
    gpus_per_node = 8
    step_s = 0.5                         # nominal step time
    duration_s = 60
    interval_s = 1.0                     # node report interval
    comm_fraction = 0.2                  # nominal share of a step spent in the all-reduce

    [noise]
    compute_cv = 0.02                    # per-rank per-step compute time CV (1-3 % is typical)
    rank_bias_cv = 0.002                 # fixed per-rank speed differences
    collective_cv = 0.05                 # jitter of the all-reduce's transfer time
    collective_spike_probability = 0.002 # a step whose all-reduce takes spike_ratio x longer
    collective_spike_ratio = 1.5
    drift_amplitude_ratio = 0.02         # slow drift of every rank's compute together
    drift_period_s = 300
    finish_jitter_s = 0.0003             # ranks leave a collective this far apart (mean)

    [[fault]]
    kind = "compute_straggler"
    rank = 5
    slowdown_ratio = 1.10
    at_step = 40

A scenario without ``[[fault]]`` tables is healthy. Fault kinds and their keys
(ranks are global rank numbers, nodes and GPUs 0-based indexes):

=====================  =============================================  =====================
kind                   keys                                            effect
=====================  =============================================  =====================
compute_straggler      rank, slowdown_ratio, at_step                   the rank computes slower
thermal_throttle       rank | node + gpu, slowdown_ratio, at_step      its GPU throttles (clock, temp)
cpu_contention         node, slowdown_ratio, at_step                   host CPU saturated, ranks slower
network_straggler      node, slowdown_ratio, at_step                   the node's link slows every all-reduce
hang                   rank, at_step                                   the rank never enters the collective
frozen                 rank, at_step                                   the whole process stops (no heartbeat)
crash                  rank, at_step, signal (default 9)               the process is killed
node_loss              node, at_step                                   the node's agent goes silent
=====================  =============================================  =====================

Every bad value raises ConfigError naming its key (``fault[0].rank``), so the
CLI prints one line and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clusterwatch.errors import ConfigError

MAX_SIGNAL = 64


class FaultKind(enum.StrEnum):
    COMPUTE_STRAGGLER = "compute_straggler"
    THERMAL_THROTTLE = "thermal_throttle"
    CPU_CONTENTION = "cpu_contention"
    NETWORK_STRAGGLER = "network_straggler"
    HANG = "hang"
    FROZEN = "frozen"
    CRASH = "crash"
    NODE_LOSS = "node_loss"


# Faults that slow ranks down (the job keeps going) and faults that stop it.
SLOWDOWN_KINDS = frozenset(
    {
        FaultKind.COMPUTE_STRAGGLER,
        FaultKind.THERMAL_THROTTLE,
        FaultKind.CPU_CONTENTION,
        FaultKind.NETWORK_STRAGGLER,
    }
)
STOPPING_KINDS = frozenset({FaultKind.HANG, FaultKind.FROZEN, FaultKind.CRASH, FaultKind.NODE_LOSS})

# Keys each kind takes besides ``kind`` (required ones first; see _parse_fault for the rest).
_FAULT_KEYS: dict[FaultKind, frozenset[str]] = {
    FaultKind.COMPUTE_STRAGGLER: frozenset({"rank", "slowdown_ratio", "at_step"}),
    FaultKind.THERMAL_THROTTLE: frozenset({"rank", "node", "gpu", "slowdown_ratio", "at_step"}),
    FaultKind.CPU_CONTENTION: frozenset({"node", "slowdown_ratio", "at_step"}),
    FaultKind.NETWORK_STRAGGLER: frozenset({"node", "slowdown_ratio", "at_step"}),
    FaultKind.HANG: frozenset({"rank", "at_step"}),
    FaultKind.FROZEN: frozenset({"rank", "at_step"}),
    FaultKind.CRASH: frozenset({"rank", "at_step", "signal"}),
    FaultKind.NODE_LOSS: frozenset({"node", "at_step"}),
}

# Upper limits of noise settings: beyond a CV of 0.2 the normal draws would need clamping all the time.
_NOISE_MAX = {
    "compute_cv": 0.2,
    "rank_bias_cv": 0.2,
    "collective_cv": 0.5,
    "collective_spike_probability": 1.0,
    "drift_amplitude_ratio": 0.5,
}

_TOP_KEYS = frozenset(
    {
        "name",
        "description",
        "seed",
        "nodes",
        "gpus_per_node",
        "step_s",
        "duration_s",
        "interval_s",
        "comm_fraction",
        "noise",
        "fault",
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class NoiseSettings:
    """How much the synthetic job varies (see the module docstring for each field)."""

    compute_cv: float = 0.02
    rank_bias_cv: float = 0.002
    collective_cv: float = 0.05
    collective_spike_probability: float = 0.002
    collective_spike_ratio: float = 1.5
    drift_amplitude_ratio: float = 0.02
    drift_period_s: float = 300.0
    finish_jitter_s: float = 0.0003


@dataclasses.dataclass(frozen=True, slots=True)
class FaultSpec:
    """One fault as the file states it.

    Attributes:
        index: position among the file's ``[[fault]]`` tables (for error keys).
        rank / node / gpu: who it hits; which are set depends on the kind.
        slowdown_ratio: compute (or, for network_straggler, all-reduce transfer)
            time multiplier from ``at_step`` on; 1.0 for stopping faults.
        signal: for crash, the signal that kills the process.
    """

    kind: FaultKind
    at_step: int
    index: int = 0
    rank: int | None = None
    node: int | None = None
    gpu: int | None = None
    slowdown_ratio: float = 1.0
    signal: int = 9

    @property
    def key(self) -> str:
        return f"fault[{self.index}]"


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    """A parsed scenario file; run-shape fields are None where the file leaves them to flags."""

    name: str
    description: str = ""
    seed: int = 0
    nodes: int | None = None
    gpus_per_node: int | None = None
    step_s: float | None = None
    duration_s: float | None = None
    interval_s: float | None = None
    comm_fraction: float = 0.2
    noise: NoiseSettings = NoiseSettings()
    faults: tuple[FaultSpec, ...] = ()
    source: str = ""


def load_scenario(path: Path) -> Scenario:
    """Read and check a scenario file.

    Raises:
        ConfigError: naming the first bad key (or ``scenario`` when the file is unreadable).
    """
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("scenario", f"file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("scenario", f"{path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("scenario", f"cannot read {path}: {exc.strerror}") from None
    return parse_scenario(doc, source=str(path), default_name=path.stem)


def parse_scenario(doc: Mapping[str, Any], source: str = "", default_name: str = "scenario") -> Scenario:
    """Check a parsed TOML document and build the Scenario.

    Raises:
        ConfigError: naming the first bad key.
    """
    _no_unknown(doc, _TOP_KEYS, "", source)
    name = _str(doc, "name", default_name, source)
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError("name", f"must be letters, digits, '-', '_' or '.', got {name!r}", source)
    noise_table = doc.get("noise", {})
    if not isinstance(noise_table, dict):
        raise ConfigError("noise", "must be a table", source)
    faults_list = doc.get("fault", [])
    if not isinstance(faults_list, list):
        raise ConfigError("fault", "must be an array of tables ([[fault]])", source)
    comm_fraction = _float(doc, "comm_fraction", 0.2, source, low=0.0, high=0.9, low_open=True)
    return Scenario(
        name=name,
        description=_str(doc, "description", "", source),
        seed=_int(doc, "seed", 0, source, low=0),
        nodes=_opt_int(doc, "nodes", source, low=1),
        gpus_per_node=_opt_int(doc, "gpus_per_node", source, low=1),
        step_s=_opt_float(doc, "step_s", source),
        duration_s=_opt_float(doc, "duration_s", source),
        interval_s=_opt_float(doc, "interval_s", source),
        comm_fraction=comm_fraction,
        noise=_parse_noise(noise_table, source),
        faults=tuple(_parse_fault(i, table, source) for i, table in enumerate(faults_list)),
        source=source,
    )


def check_fits(scenario: Scenario, nodes: int, gpus_per_node: int) -> None:
    """Check that every fault names a rank, node and GPU the run has.

    Raises:
        ConfigError: naming the fault's key.
    """
    world_size = nodes * gpus_per_node
    for fault in scenario.faults:
        if fault.rank is not None and fault.rank >= world_size:
            raise ConfigError(
                f"{fault.key}.rank",
                f"must be below the world size {world_size} ({nodes} nodes x {gpus_per_node} GPUs), "
                f"got {fault.rank}",
                scenario.source,
            )
        if fault.node is not None and fault.node >= nodes:
            raise ConfigError(
                f"{fault.key}.node", f"must be below {nodes} (nodes), got {fault.node}", scenario.source
            )
        if fault.gpu is not None and fault.gpu >= gpus_per_node:
            raise ConfigError(
                f"{fault.key}.gpu",
                f"must be below {gpus_per_node} (GPUs per node), got {fault.gpu}",
                scenario.source,
            )
        if fault.kind is FaultKind.CPU_CONTENTION and nodes < 2:
            raise ConfigError(
                f"{fault.key}.kind",
                "cpu_contention needs at least 2 nodes to compare against",
                scenario.source,
            )


def fault_rank(fault: FaultSpec, gpus_per_node: int) -> int | None:
    """The one rank a rank-scoped fault hits (thermal_throttle may name node + gpu instead)."""
    if fault.rank is not None:
        return fault.rank
    if fault.node is not None and fault.gpu is not None:
        return fault.node * gpus_per_node + fault.gpu
    return None


def affected_ranks(fault: FaultSpec, gpus_per_node: int) -> tuple[int, ...]:
    """Every rank the fault hits directly: its rank, or all ranks of its node."""
    rank = fault_rank(fault, gpus_per_node)
    if rank is not None:
        return (rank,)
    assert fault.node is not None  # noqa: S101 - the parser requires rank or node
    return tuple(range(fault.node * gpus_per_node, (fault.node + 1) * gpus_per_node))


def affected_nodes(fault: FaultSpec, gpus_per_node: int) -> tuple[int, ...]:
    """The node indexes of the ranks the fault hits."""
    return tuple(sorted({rank // gpus_per_node for rank in affected_ranks(fault, gpus_per_node)}))


# --- parsing helpers ---------------------------------------------------------------------------


def _parse_noise(table: Mapping[str, Any], source: str) -> NoiseSettings:
    defaults = NoiseSettings()
    names = [f.name for f in dataclasses.fields(NoiseSettings)]
    _no_unknown(table, frozenset(names), "noise.", source)
    values: dict[str, float] = {
        name: _float(
            table,
            name,
            getattr(defaults, name),
            source,
            key_prefix="noise.",
            low=0.0,
            high=_NOISE_MAX.get(name, math.inf),
        )
        for name in names
    }
    if values["collective_spike_ratio"] < 1.0:
        raise ConfigError(
            "noise.collective_spike_ratio",
            f"must be at least 1, got {values['collective_spike_ratio']!r}",
            source,
        )
    if values["drift_period_s"] <= 0:
        raise ConfigError("noise.drift_period_s", "must be greater than 0", source)
    return NoiseSettings(**values)


def _parse_fault(index: int, table: Any, source: str) -> FaultSpec:
    key = f"fault[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(key, "must be a table ([[fault]])", source)
    raw_kind = table.get("kind")
    if raw_kind is None:
        raise ConfigError(f"{key}.kind", "is required", source)
    try:
        kind = FaultKind(raw_kind)
    except ValueError:
        raise ConfigError(
            f"{key}.kind", f"must be one of {', '.join(k.value for k in FaultKind)}; got {raw_kind!r}", source
        ) from None
    allowed = _FAULT_KEYS[kind]
    _no_unknown(table, allowed | {"kind"}, f"{key}.", source)
    prefix = f"{key}."
    at_step = _int(table, "at_step", None, source, key_prefix=prefix, low=2)
    rank = _opt_int(table, "rank", source, key_prefix=prefix, low=0)
    node = _opt_int(table, "node", source, key_prefix=prefix, low=0)
    gpu = _opt_int(table, "gpu", source, key_prefix=prefix, low=0)
    if kind is FaultKind.THERMAL_THROTTLE:
        if rank is None and (node is None or gpu is None):
            raise ConfigError(f"{key}.rank", "is required (or node and gpu)", source)
        if rank is not None and (node is not None or gpu is not None):
            raise ConfigError(f"{key}.rank", "give either rank or node and gpu, not both", source)
    elif "rank" in allowed and rank is None:
        raise ConfigError(f"{key}.rank", "is required", source)
    elif "node" in allowed and "rank" not in allowed and node is None:
        raise ConfigError(f"{key}.node", "is required", source)
    slowdown_ratio = 1.0
    if kind in SLOWDOWN_KINDS:
        slowdown_ratio = _float(
            table, "slowdown_ratio", None, source, key_prefix=prefix, low=1.0, low_open=True
        )
    signal = _int(table, "signal", 9, source, key_prefix=prefix, low=1)
    if signal > MAX_SIGNAL:
        raise ConfigError(f"{key}.signal", f"must be at most {MAX_SIGNAL}, got {signal}", source)
    return FaultSpec(kind, at_step, index, rank, node, gpu, slowdown_ratio, signal)


def _no_unknown(table: Mapping[str, Any], known: frozenset[str], prefix: str, source: str) -> None:
    for name in table:
        if name not in known:
            raise ConfigError(f"{prefix}{name}", "unknown key", source)


def _str(table: Mapping[str, Any], name: str, default: str, source: str) -> str:
    value = table.get(name, default)
    if not isinstance(value, str):
        raise ConfigError(name, f"must be a string, got {value!r}", source)
    return value


def _int(
    table: Mapping[str, Any],
    name: str,
    default: int | None,
    source: str,
    *,
    key_prefix: str = "",
    low: int = 0,
) -> int:
    key = key_prefix + name
    value = table.get(name, default)
    if value is None:
        raise ConfigError(key, "is required", source)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be a whole number, got {value!r}", source)
    if value < low:
        raise ConfigError(key, f"must be at least {low}, got {value}", source)
    return value


def _opt_int(
    table: Mapping[str, Any], name: str, source: str, *, key_prefix: str = "", low: int = 0
) -> int | None:
    if name not in table:
        return None
    return _int(table, name, None, source, key_prefix=key_prefix, low=low)


def _float(
    table: Mapping[str, Any],
    name: str,
    default: float | None,
    source: str,
    *,
    key_prefix: str = "",
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = False,
) -> float:
    key = key_prefix + name
    value = table.get(name, default)
    if value is None:
        raise ConfigError(key, "is required", source)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(key, f"must be a number, got {value!r}", source)
    if value < low or (low_open and value == low):
        raise ConfigError(
            key, f"must be {'greater than' if low_open else 'at least'} {low:g}, got {value!r}", source
        )
    if value > high:
        raise ConfigError(key, f"must be at most {high:g}, got {value!r}", source)
    return float(value)


def _opt_float(table: Mapping[str, Any], name: str, source: str) -> float | None:
    if name not in table:
        return None
    return _float(table, name, None, source, low=0.0, low_open=True)
