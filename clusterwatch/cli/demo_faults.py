"""The demo's injected faults: ``--inject KIND@step=N,rank=R[,factor=F]``.

A fault is physical: it belongs to a process slot (node, local rank), found
from the rank it names in the first launch (ranks fill node 0 first, then
node 1, ...). It stays there when torchrun renumbers ranks after a restart
or after a node is left out. The training processes get the faults as JSON
in ``CLUSTERWATCH_DEMO_FAULTS``.

- ``straggler``: from step N on, the slot's compute takes ``factor`` times
  longer (default 1.4).
- ``hang``: at step N the slot stops before its all-reduce, once per demo
  run, and stays stopped until it is killed.
"""

from __future__ import annotations

import dataclasses
import json

from clusterwatch.errors import ConfigError

KINDS = ("straggler", "hang")
DEFAULT_FAULTS = ("straggler@step=30,rank=1,factor=1.4", "hang@step=80,rank=3")
ENV = "CLUSTERWATCH_DEMO_FAULTS"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault, at a process slot."""

    kind: str
    step: int
    rank: int
    node: int
    local_rank: int
    factor: float = 1.0

    @property
    def label(self) -> str:
        extra = f", {self.factor:g}x compute" if self.kind == "straggler" else ""
        return f"{self.kind} at step {self.step} on rank {self.rank}{extra}"


def parse_fault(spec: str, nodes: int, ranks_per_node: int) -> Fault:
    """``straggler@step=30,rank=1,factor=1.4`` -> Fault.

    Raises:
        ConfigError: naming ``--inject`` and what is wrong.
    """
    kind, _, rest = spec.partition("@")
    if kind not in KINDS:
        raise ConfigError("--inject", f"{spec!r}: the kind must be one of {', '.join(KINDS)}")
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ("step", "rank", "factor"):
            raise ConfigError("--inject", f"{spec!r}: expected step=N,rank=R[,factor=F], got {item!r}")
        values[key] = value
    try:
        step, rank = int(values["step"]), int(values["rank"])
        factor = float(values.get("factor", "1.4" if kind == "straggler" else "1"))
    except KeyError as missing:
        raise ConfigError("--inject", f"{spec!r}: {missing.args[0]}= is missing") from None
    except ValueError as exc:
        raise ConfigError("--inject", f"{spec!r}: {exc}") from None
    world = nodes * ranks_per_node
    if step < 0 or not 0 <= rank < world:
        raise ConfigError("--inject", f"{spec!r}: step must be >= 0 and rank in 0..{world - 1}")
    if kind == "straggler" and not factor > 1:
        raise ConfigError("--inject", f"{spec!r}: a straggler's factor must be > 1")
    return Fault(kind, step, rank, rank // ranks_per_node, rank % ranks_per_node, factor)


def to_json(faults: list[Fault]) -> str:
    return json.dumps([dataclasses.asdict(f) for f in faults])


def from_json(text: str) -> list[Fault]:
    return [Fault(**entry) for entry in json.loads(text)] if text else []
