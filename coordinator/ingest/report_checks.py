"""Checks on what an agent sends the coordinator: its Hello, each NodeReport, each CommandResult.

One module of about 700 lines: the plans derived from the descriptors and the
fast and slow paths that read them must agree field by field
(tests/coordinator/test_hostile_input.py checks that they do); a split would publish the
plans' internals.

Rules, worked out once per message type from its descriptor (a *plan*):

* every ``double`` is finite and >= 0 (a temperature, a clock, a load, a
  duration, a byte rate: NVML and the kernel report none below zero); fields
  named ``*_ratio`` are within [0, 1]; ``NodeReport.timestamp_unix_seconds``
  is 0 (unset) or within MAX_CLOCK_SKEW_S of the coordinator's wall clock,
  ``HostSample.boot_time_seconds`` not after it, ``NodeReport.interval_seconds``
  0 (unset) or at most MAX_INTERVAL_S;
* every string is at most MAX_ID_CHARS (names and ids) or, for free text
  (TEXT_FIELDS), MAX_TEXT_CHARS; a py-spy stack dump MAX_STACK_DUMP_CHARS;
* every repeated field and map has at most MAX_ENTRIES[field] entries
  (DEFAULT_MAX_ENTRIES otherwise);
* every enum value is one the descriptor names;
* keys are unique within one report: GPU index, NIC device, InfiniBand
  (device, port), collector name, and (job, rank, instance) of the ranks;
* a rank names its job and instance and ``rank < world_size``.

A RankReport's steps and collectives are counted here but not read: the job
store validates them as it reads them (coordinator/model/rank_reports.py), and a bad
one costs that rank's report only, not the node's. Rank timestamps come from
the training host's clock and only order that rank's own events, so they are
only required to be finite and >= 0, not near the coordinator's clock.

Not checked, for cost: that NVLink link numbers and XID codes differ within
one GPU (reading them means a Python object per link, 144 per 8-GPU report;
a duplicate only doubles that GPU's series, it hurts no other node).

Performance: ``check_report`` runs for every report (~10,000/s at scale). It
reads each list of sub-messages (GPUs, NICs, ranks...) with one
``attrgetter`` per element and checks whole columns with ``min``/``max``/
``sum``/``set`` in C (a NaN or an infinity anywhere makes a column's sum
non-finite). Only when that finds something does a slower walk over the
message say which field, which index and which value. What remains is
protobuf's: ~80 ns per field read and ~0.3 us per sub-message or list
touched, so an 8-GPU report (4 NICs, 2 InfiniBand ports) costs ~50 us and
each rank ~6 us (measured in-process; bench/ingest.py measures the whole
coordinator). A generated straight-line checker per message type was tried
and saved nothing measurable: the reads are the cost, not the loops.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from operator import attrgetter, itemgetter, lt, methodcaller
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from clusterwatch.errors import InvalidReportError
from clusterwatch.v1 import agent_pb2, node_pb2
from clusterwatch.wire.limits import (
    DEFAULT_MAX_ENTRIES,
    DUMP_FIELDS,
    MAX_CLOCK_SKEW_S,
    MAX_ENTRIES,
    MAX_GPUS,
    MAX_ID_CHARS,
    MAX_INTERVAL_S,
    MAX_SEQUENCE_JUMP,
    MAX_STACK_DUMP_CHARS,
    MAX_TEXT_CHARS,
    MIN_INTERVAL_S,
    REPEATED_STRING_CHARS,
    TEXT_FIELDS,
    V1,
)

# Not read here at all: the job store checks a rank's labels (clusterwatch/wire/job_labels.py).
_SKIPPED = frozenset({f"{V1}RankIdentity.labels"})
# Counted, not descended into: the job store reads and checks these per rank.
_NOT_DESCENDED = frozenset({f"{V1}RankReport.steps", f"{V1}RankReport.collectives"})
# Lists whose elements must differ in these fields within one report.
_UNIQUE_KEYS: dict[str, tuple[str, ...]] = {
    f"{V1}NodeReport.gpus": ("index",),
    f"{V1}NodeReport.nics": ("device",),
    f"{V1}NodeReport.ib_ports": ("device", "port"),
    f"{V1}NodeReport.collectors": ("name",),
    f"{V1}NodeTopology.gpus": ("index",),
    f"{V1}NodeTopology.nics": ("device",),
    f"{V1}NodeTopology.gpu_links": ("gpu", "peer_gpu"),
    f"{V1}NodeTopology.gpu_nics": ("gpu", "nic"),
    f"{V1}NodeTopology.numa_nodes": ("id",),
}


class ReportProblem(enum.StrEnum):
    """What was wrong: the ``reason`` label of clusterwatch_reports_rejected_total."""

    MISSING = "missing"
    MALFORMED = "malformed"
    BAD_NUMBER = "bad_number"
    BAD_TIMESTAMP = "bad_timestamp"
    UNKNOWN_ENUM = "unknown_enum"
    TOO_LONG = "too_long"
    TOO_MANY = "too_many"
    DUPLICATE = "duplicate"
    RANK_OUT_OF_RANGE = "rank_out_of_range"


class ReportCheckError(InvalidReportError):
    """A message from an agent broke one of the rules above (INVALID_ARGUMENT).

    Attributes:
        problem: the counted category.
        field: where, e.g. ``gpus[3].utilization_ratio`` or ``hello.node_id``.
    """

    def __init__(self, problem: ReportProblem, field: str, detail: str, prefix: str = "") -> None:
        self.problem = problem
        self.field = field
        self.detail = detail
        super().__init__(f"{prefix}{field}: {detail}")

    def within(self, prefix: str) -> ReportCheckError:
        """The same problem, its message starting with ``prefix`` (``report 17: ``)."""
        return ReportCheckError(self.problem, self.field, self.detail, prefix)


class _Rule(enum.Enum):
    NON_NEGATIVE = "non_negative"
    RATIO = "ratio"
    WALL_TIME = "wall_time"
    HELLO_INTERVAL = "hello_interval"
    PAST_TIME = "past_time"
    INTERVAL = "interval"


_SPECIAL_RULES: dict[str, _Rule] = {
    f"{V1}NodeReport.timestamp_unix_seconds": _Rule.WALL_TIME,
    f"{V1}NodeReport.interval_seconds": _Rule.INTERVAL,
    f"{V1}HostSample.boot_time_seconds": _Rule.PAST_TIME,
    f"{V1}Hello.interval_seconds": _Rule.HELLO_INTERVAL,
}
_FLOATING = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)

Row = tuple[Any, ...]


def _string_limit(name: str) -> int:
    if name in DUMP_FIELDS:
        return MAX_STACK_DUMP_CHARS
    return MAX_TEXT_CHARS if name in TEXT_FIELDS else MAX_ID_CHARS


@dataclasses.dataclass(frozen=True, slots=True)
class _Child:
    """A message-typed field to descend into."""

    name: str
    repeated: bool
    plan: _Plan
    row_index: int  # where a repeated child's container sits in the parent's rows; -1 if singular
    unique_keys: tuple[int, ...]  # indices in the child's rows of what must differ; () if nothing
    has: Callable[[Any], bool]  # HasField(name) (singular children)
    get: Callable[[Any], Any]  # the field's value


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """What to check in one message type, and how to read it with one call per message.

    ``read`` returns the fields in ``names`` as a tuple (a *row*), laid out in
    segments so that each check takes one slice of every row: numbers (ratios
    first), then strings by limit, then enums, then repeated fields.
    ``numbers``, ``strings``, ``enums`` and ``sized`` also serve the walk.
    """

    names: tuple[str, ...]
    read: Callable[[Any], Row]
    numbers: tuple[tuple[str, _Rule], ...]
    strings: tuple[tuple[str, int], ...]
    enums: tuple[tuple[int, str, frozenset[int], str], ...]  # (row index, name, known values, enum name)
    sized: tuple[tuple[int, str, str, int], ...]  # (row index, name, full name, limit)
    children: tuple[_Child, ...]
    non_negative: itemgetter[Any] | None  # slice of every number without a special rule
    ratios: itemgetter[Any] | None
    strings_by_limit: tuple[tuple[itemgetter[Any], int], ...]
    string_map_keys: tuple[int, ...]  # row indices of maps whose keys are strings (ids)
    repeated_strings: tuple[tuple[int, int], ...]  # (row index, characters per element)
    # Every repeated field's slice of a row, and the smallest of their limits: one pass
    # when no list is that long, a pass per field only when one is.
    sizes: itemgetter[Any] | None
    smallest_limit: int

    @property
    def trivial(self) -> bool:
        return not (self.numbers or self.strings or self.enums or self.sized or self.children)


_PLANS: dict[str, _Plan] = {}


def _plan(descriptor: Descriptor, extra: Sequence[str] = ()) -> _Plan:
    """The plan of one message type (also reading ``extra`` fields), worked out on first use."""
    key = f"{descriptor.full_name}+{','.join(extra)}"
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _make_plan(descriptor, extra)
    return plan


def _segment(names: list[str], members: Sequence[str]) -> itemgetter[Any] | None:
    """Append ``members`` to ``names``; a getter of their slice of a row (None if empty)."""
    if not members:
        return None
    start = len(names)
    names.extend(members)
    return itemgetter(slice(start, len(names)))


@dataclasses.dataclass
class _Fields:
    """One message type's fields, sorted by what is checked in them."""

    numbers: list[tuple[str, _Rule]] = dataclasses.field(default_factory=list)
    strings: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    enums: list[FieldDescriptor] = dataclasses.field(default_factory=list)
    repeated: list[FieldDescriptor] = dataclasses.field(default_factory=list)
    children: list[FieldDescriptor] = dataclasses.field(default_factory=list)


def _sort_fields(descriptor: Descriptor) -> _Fields:
    fields = _Fields()
    for field in descriptor.fields:
        full = field.full_name
        if full in _SKIPPED:
            continue
        if field.is_repeated:
            fields.repeated.append(field)
        elif field.type in _FLOATING:
            default = _Rule.RATIO if field.name.endswith("_ratio") else _Rule.NON_NEGATIVE
            fields.numbers.append((field.name, _SPECIAL_RULES.get(full, default)))
        elif field.type == FieldDescriptor.TYPE_STRING:
            fields.strings.append((field.name, _string_limit(field.name)))
        elif field.type == FieldDescriptor.TYPE_ENUM:
            fields.enums.append(field)
        message_type = field.message_type
        if (
            message_type is not None
            and full not in _NOT_DESCENDED
            and not message_type.GetOptions().map_entry
        ):
            fields.children.append(field)
    return fields


def _make_plan(descriptor: Descriptor, extra: Sequence[str]) -> _Plan:
    fields = _sort_fields(descriptor)
    names: list[str] = []
    ratios = _segment(names, [name for name, rule in fields.numbers if rule is _Rule.RATIO])
    _segment(names, [name for name, rule in fields.numbers if rule is _Rule.NON_NEGATIVE])
    # The ratios and the other plain numbers are the first segments (special rules are read apart).
    non_negative = itemgetter(slice(0, len(names))) if names else None
    strings_by_limit = tuple(
        (getter, limit)
        for limit in sorted({limit for _, limit in fields.strings})
        if (getter := _segment(names, [name for name, each in fields.strings if each == limit])) is not None
    )
    enums = []
    for field in fields.enums:
        names.append(field.name)
        enum_type = field.enum_type
        assert enum_type is not None  # noqa: S101 - an enum field has its type
        known = frozenset(value.number for value in enum_type.values)
        enums.append((len(names) - 1, field.name, known, enum_type.name))
    sized = []
    string_map_keys = []
    repeated_strings = []
    for field in fields.repeated:
        names.append(field.name)
        limit = MAX_ENTRIES.get(field.full_name, DEFAULT_MAX_ENTRIES)
        sized.append((len(names) - 1, field.name, field.full_name, limit))
        if _is_string_map(field):
            string_map_keys.append(len(names) - 1)
        if field.full_name in REPEATED_STRING_CHARS:
            repeated_strings.append((len(names) - 1, REPEATED_STRING_CHARS[field.full_name]))
    children = []
    for field in fields.children:
        keys = _UNIQUE_KEYS.get(field.full_name, ())
        assert field.message_type is not None  # noqa: S101 - a child is message-typed
        child = _plan(field.message_type, keys)
        if not child.trivial or keys:
            row_index = names.index(field.name) if field.is_repeated else -1
            unique = tuple(child.names.index(key) for key in keys)
            has, get = methodcaller("HasField", field.name), attrgetter(field.name)
            children.append(_Child(field.name, field.is_repeated, child, row_index, unique, has, get))
    names.extend(name for name in extra if name not in names)
    return _Plan(
        names=tuple(names),
        read=_reader(names),
        numbers=tuple(fields.numbers),
        strings=tuple(fields.strings),
        enums=tuple(enums),
        sized=tuple(sized),
        children=tuple(children),
        non_negative=non_negative,
        ratios=ratios,
        strings_by_limit=strings_by_limit,
        string_map_keys=tuple(string_map_keys),
        repeated_strings=tuple(repeated_strings),
        sizes=itemgetter(slice(sized[0][0], sized[-1][0] + 1)) if sized else None,
        smallest_limit=min((limit for *_, limit in sized), default=0),
    )


def _is_string_map(field: FieldDescriptor) -> bool:
    entry = field.message_type
    return bool(
        entry is not None
        and entry.GetOptions().map_entry
        and entry.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING
    )


def _reader(names: Sequence[str]) -> Callable[[Any], Row]:
    if len(names) >= 2:
        return attrgetter(*names)  # a tuple for two names or more
    if len(names) == 1:
        name = names[0]
        return lambda message: (getattr(message, name),)
    return lambda message: ()


# --- the fast path: whole columns at a time, in C --------------------------------


def _columns(items: Sequence[Any], plan: _Plan, keep: list[Any]) -> list[Row] | None:
    """The rows of ``items`` (all of one type) when every one passes the plan; None: walk them.

    Special rules (timestamps, the interval) are the caller's: only singletons have them.
    """
    rows = list(map(plan.read, items))
    keep.append(rows)  # protobuf's wrappers stay alive: see check_report
    if not (_values_ok(rows, plan) and (not plan.sized or _sizes_ok(rows, plan))):
        return None
    for child in plan.children:
        if child.repeated:
            elements = list(chain.from_iterable(map(itemgetter(child.row_index), rows)))
        else:
            elements = list(map(child.get, filter(child.has, items)))
        if elements and not _child_ok(elements, child, keep):
            return None
    return rows


def _values_ok(rows: list[Row], plan: _Plan) -> bool:
    if plan.non_negative is not None:
        values = list(chain.from_iterable(map(plan.non_negative, rows)))
        # NaN and +-inf make the sum non-finite: one C pass instead of a test per value.
        if not (min(values) >= 0.0 and math.isfinite(sum(values))):
            return False
        if plan.ratios is not None and max(chain.from_iterable(map(plan.ratios, rows))) > 1.0:
            return False
    for getter, limit in plan.strings_by_limit:
        if max(map(len, chain.from_iterable(map(getter, rows)))) > limit:
            return False
    return all(set(map(itemgetter(index), rows)) <= known for index, _, known, _ in plan.enums)


def _sizes_ok(rows: list[Row], plan: _Plan) -> bool:
    assert plan.sizes is not None  # noqa: S101 - called when the plan has repeated fields
    if max(map(len, chain.from_iterable(map(plan.sizes, rows)))) > plan.smallest_limit:
        for index, _, _, limit in plan.sized:
            if max(map(len, map(itemgetter(index), rows))) > limit:
                return False
    for index in plan.string_map_keys:
        if max(map(len, chain.from_iterable(map(itemgetter(index), rows))), default=0) > MAX_ID_CHARS:
            return False
    for index, chars in plan.repeated_strings:
        if max(map(len, chain.from_iterable(map(itemgetter(index), rows))), default=0) > chars:
            return False
    return True


def _child_ok(elements: list[Any], child: _Child, keep: list[Any]) -> bool:
    keep.append(elements)
    rows = _columns(elements, child.plan, keep)
    if rows is None:
        return False
    if child.unique_keys:
        keys = list(map(itemgetter(*child.unique_keys), rows))
        return len(set(keys)) == len(keys)
    return True


# --- the slow path: say exactly what is wrong ---------------------------------


def _walk(message: Any, plan: _Plan, path: str, now_unix_s: float) -> None:
    """Raise for the first problem in ``message``, whose field path is ``path``."""
    for name, rule in plan.numbers:
        _check_number(getattr(message, name), rule, _join(path, name), now_unix_s)
    for name, limit in plan.strings:
        _check_length(getattr(message, name), limit, _join(path, name))
    for _, name, known, enum_name in plan.enums:
        value = getattr(message, name)
        if value not in known:
            raise ReportCheckError(
                ReportProblem.UNKNOWN_ENUM, _join(path, name), f"unknown {enum_name} value {value}"
            )
    for _, name, full, limit in plan.sized:
        _walk_repeated(getattr(message, name), full, limit, _join(path, name))
    for child in plan.children:
        where = _join(path, child.name)
        if not child.repeated:
            if message.HasField(child.name):
                _walk(getattr(message, child.name), child.plan, where, now_unix_s)
            continue
        elements = getattr(message, child.name)
        for index, element in enumerate(elements):
            _walk(element, child.plan, f"{where}[{index}]", now_unix_s)
        if child.unique_keys:
            _check_unique(elements, [child.plan.names[i] for i in child.unique_keys], where)


def _walk_repeated(container: Any, full_name: str, limit: int, path: str) -> None:
    if len(container) > limit:
        raise ReportCheckError(ReportProblem.TOO_MANY, path, f"at most {limit} entries, got {len(container)}")
    chars = REPEATED_STRING_CHARS.get(full_name)
    if chars is not None:
        for index, value in enumerate(container):
            _check_length(value, chars, f"{path}[{index}]")
    if isinstance(container, Mapping):
        for key in container:
            if isinstance(key, str) and len(key) > MAX_ID_CHARS:
                raise ReportCheckError(
                    ReportProblem.TOO_LONG,
                    f"{path}[{key[:32]!r}...]",
                    f"a key is at most {MAX_ID_CHARS} characters, got {len(key)}",
                )


def _check_number(value: float, rule: _Rule, path: str, now_unix_s: float) -> None:
    if rule is _Rule.NON_NEGATIVE:
        if not 0.0 <= value < math.inf:  # False for NaN too
            raise ReportCheckError(
                ReportProblem.BAD_NUMBER, path, f"must be a finite number >= 0, got {value!r}"
            )
    elif rule is _Rule.RATIO:
        if not 0.0 <= value <= 1.0:
            raise ReportCheckError(ReportProblem.BAD_NUMBER, path, f"must be within [0, 1], got {value!r}")
    elif rule is _Rule.INTERVAL:
        if not 0.0 <= value <= MAX_INTERVAL_S:
            raise ReportCheckError(
                ReportProblem.BAD_NUMBER,
                path,
                f"must be 0 (unset) or at most {MAX_INTERVAL_S:g} s, got {value!r}",
            )
    elif rule is _Rule.HELLO_INTERVAL:
        if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
            raise ReportCheckError(
                ReportProblem.BAD_NUMBER,
                path,
                f"must be within [{MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}] s, got {value!r}",
            )
    elif rule is _Rule.WALL_TIME:
        if value != 0.0 and not abs(value - now_unix_s) <= MAX_CLOCK_SKEW_S:
            raise ReportCheckError(
                ReportProblem.BAD_TIMESTAMP,
                path,
                f"must be 0 (unset) or within {MAX_CLOCK_SKEW_S:g} s of the coordinator's clock "
                f"({now_unix_s:.0f}), got {value!r}",
            )
    elif not 0.0 <= value <= now_unix_s + MAX_CLOCK_SKEW_S:  # _Rule.PAST_TIME
        raise ReportCheckError(
            ReportProblem.BAD_TIMESTAMP,
            path,
            f"must be a time before the coordinator's clock ({now_unix_s:.0f}), got {value!r}",
        )


def _check_length(value: str, limit: int, path: str) -> None:
    if len(value) > limit:
        raise ReportCheckError(
            ReportProblem.TOO_LONG, path, f"at most {limit} characters, got {len(value)} ({value[:32]!r}...)"
        )


def _check_unique(elements: Iterable[Any], keys: Sequence[str], path: str) -> None:
    read = attrgetter(*keys)
    seen: dict[Any, int] = {}
    for index, element in enumerate(elements):
        key = read(element)
        if key in seen:
            raise ReportCheckError(
                ReportProblem.DUPLICATE,
                f"{path}[{index}].{'/'.join(keys)}",
                f"{key!r} appears twice (also in {path}[{seen[key]}])",
            )
        seen[key] = index


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- what holds across fields of a rank ----------------------------------------

_HAS_IDENTITY = methodcaller("HasField", "identity")
_RANK_KEY = attrgetter("identity.job", "identity.rank", "identity.world_size", "identity.instance_id")


def _ranks_ok(ranks: Sequence[Any]) -> bool:
    if not all(map(_HAS_IDENTITY, ranks)):
        return False
    jobs, numbers, world_sizes, instances = zip(*map(_RANK_KEY, ranks), strict=True)
    return (
        all(jobs)
        and all(instances)
        and all(map(lt, numbers, world_sizes))
        and len(set(zip(jobs, numbers, instances, strict=True))) == len(ranks)
    )


def _walk_ranks(ranks: Iterable[Any]) -> None:
    seen: dict[tuple[str, int, str], int] = {}
    for index, rank in enumerate(ranks):
        path = f"ranks[{index}].identity"
        if not rank.HasField("identity"):
            raise ReportCheckError(ReportProblem.MISSING, path, "every rank report needs one")
        identity = rank.identity
        for name in ("job", "instance_id"):
            if not getattr(identity, name):
                raise ReportCheckError(ReportProblem.MISSING, f"{path}.{name}", "must not be empty")
        if identity.rank >= identity.world_size:
            raise ReportCheckError(
                ReportProblem.RANK_OUT_OF_RANGE,
                f"{path}.rank",
                f"must be below world_size {identity.world_size}, got {identity.rank}",
            )
        key = (identity.job, identity.rank, identity.instance_id)
        if key in seen:
            raise ReportCheckError(
                ReportProblem.DUPLICATE,
                f"ranks[{index}]",
                f"job {identity.job!r} rank {identity.rank} instance {identity.instance_id!r} "
                f"appears twice (also ranks[{seen[key]}])",
            )
        seen[key] = index


# --- entry points ----------------------------------------------------------------

_REPORT = _plan(node_pb2.NodeReport.DESCRIPTOR)
_HOST = _plan(node_pb2.HostSample.DESCRIPTOR)
_LISTS = tuple(child for child in _REPORT.children if child.repeated)
_SINGLES = tuple(child for child in _REPORT.children if not child.repeated and child.name != "host")
_GPU_INDEX = attrgetter("index")


def check_report(report: node_pb2.NodeReport, now_unix_s: float, last_sequence: int = 0) -> list[Any]:
    """Refuse a node report no honest agent sends (its ranks' steps and collectives are the job store's).

    Args:
        report: as it arrived.
        now_unix_s: the coordinator's wall clock.
        last_sequence: the node's last sequence applied (or refused).

    Returns:
        What was read (protobuf wrappers among them): hold it until the
        report's ranks are applied, so that the job store gets the same
        objects back instead of creating them again.

    Raises:
        ReportCheckError: naming the field, e.g. ``report 17: gpus[3].utilization_ratio: must be
            within [0, 1], got nan``.
    """
    keep: list[Any] = []
    sequence = report.sequence
    if sequence == 0:
        raise ReportCheckError(ReportProblem.MISSING, "sequence", "must start at 1", "report 0: ")
    if sequence > last_sequence + MAX_SEQUENCE_JUMP:
        raise ReportCheckError(
            ReportProblem.MALFORMED,
            "sequence",
            f"jumps from {last_sequence} to {sequence}",
            f"report {sequence}: ",
        )
    # A report with a topology (rare: the wiring changed) takes the full walk.
    if not report.HasField("topology") and _fast_ok(report, now_unix_s, keep):
        return keep
    try:
        _walk(report, _REPORT, "", now_unix_s)
        for index, gpu in enumerate(report.gpus):
            if gpu.index >= MAX_GPUS:
                raise ReportCheckError(
                    ReportProblem.BAD_NUMBER,
                    f"gpus[{index}].index",
                    f"must be below {MAX_GPUS}, got {gpu.index}",
                )
        _walk_ranks(report.ranks)
        if report.HasField("topology"):
            check_topology(report.topology, "topology")
    except ReportCheckError as exc:
        raise exc.within(f"report {report.sequence}: ") from None
    return keep  # the column checks are conservative: a huge but finite sum overflows


def _fast_ok(report: node_pb2.NodeReport, now_unix_s: float, keep: list[Any]) -> bool:
    timestamp = report.timestamp_unix_seconds
    if not (
        (timestamp == 0.0 or abs(timestamp - now_unix_s) <= MAX_CLOCK_SKEW_S)
        and 0.0 <= report.interval_seconds <= MAX_INTERVAL_S
    ):
        return False
    if report.HasField("host"):
        host = report.host
        if not 0.0 <= host.boot_time_seconds <= now_unix_s + MAX_CLOCK_SKEW_S:
            return False
        if _columns([host], _HOST, keep) is None:
            return False
    for child in _SINGLES:
        if report.HasField(child.name) and _columns([getattr(report, child.name)], child.plan, keep) is None:  # type: ignore[arg-type]  # a field name from the descriptor
            return False
    return all(_list_ok(getattr(report, child.name), child, keep) for child in _LISTS)


def _list_ok(container: Any, child: _Child, keep: list[Any]) -> bool:
    if not container:
        return True
    if len(container) > MAX_ENTRIES[f"{V1}NodeReport.{child.name}"]:
        return False
    elements = list(container)
    if not _child_ok(elements, child, keep):
        return False
    if child.name == "gpus":
        return bool(max(map(_GPU_INDEX, elements)) < MAX_GPUS)
    if child.name == "ranks":
        return _ranks_ok(elements)
    return True


_HELLO = _plan(agent_pb2.Hello.DESCRIPTOR)
_RESULT = _plan(agent_pb2.CommandResult.DESCRIPTOR)


def check_hello(hello: agent_pb2.Hello) -> None:
    """Refuse a hello no honest agent sends.

    Raises:
        ReportCheckError: naming the field, e.g. ``hello.interval_seconds: must be within [0.05, 3600] s, got 0.0``.
    """
    for name in ("node_id", "instance_id"):
        if not getattr(hello, name):
            raise ReportCheckError(ReportProblem.MISSING, f"hello.{name}", "must not be empty")
    _walk(hello, _HELLO, "hello", 0.0)
    if hello.HasField("topology"):
        check_topology(hello.topology, "hello.topology")
    node_id = hello.node_id
    if not node_id.isprintable() or any(c.isspace() for c in node_id):
        raise ReportCheckError(
            ReportProblem.MALFORMED,
            "hello.node_id",
            f"must be printable without spaces, got {node_id[:64]!r}",
        )


def check_topology(topology: node_pb2.NodeTopology, path: str) -> None:
    """Links must join devices the topology lists, each GPU pair once in order (gpu < peer_gpu).

    Raises:
        ReportCheckError: naming the field, e.g. ``hello.topology.gpu_links[3].peer_gpu: no GPU 9``.
    """
    gpus = {gpu.index for gpu in topology.gpus}
    nics = {nic.device for nic in topology.nics}
    for index, gpu in enumerate(topology.gpus):
        if gpu.index >= MAX_GPUS:
            raise ReportCheckError(
                ReportProblem.BAD_NUMBER, f"{path}.gpus[{index}].index", f"must be below {MAX_GPUS}"
            )
    for index, link in enumerate(topology.gpu_links):
        field = f"{path}.gpu_links[{index}]"
        for name in ("gpu", "peer_gpu"):
            if getattr(link, name) not in gpus:
                raise ReportCheckError(
                    ReportProblem.MALFORMED, f"{field}.{name}", f"no GPU {getattr(link, name)}"
                )
        if not link.gpu < link.peer_gpu:
            raise ReportCheckError(
                ReportProblem.MALFORMED,
                field,
                f"gpu must be below peer_gpu, got {link.gpu} and {link.peer_gpu}",
            )
    for index, affinity in enumerate(topology.gpu_nics):
        field = f"{path}.gpu_nics[{index}]"
        if affinity.gpu not in gpus:
            raise ReportCheckError(ReportProblem.MALFORMED, f"{field}.gpu", f"no GPU {affinity.gpu}")
        if affinity.nic not in nics:
            raise ReportCheckError(ReportProblem.MALFORMED, f"{field}.nic", f"no NIC {affinity.nic!r}")


def check_command_result(result: agent_pb2.CommandResult) -> None:
    """Refuse a command result no honest agent sends (an unknown status, a 10 MB message...).

    Raises:
        ReportCheckError: naming the field, e.g. ``command_result.status: unknown Status value 9``.
    """
    _walk(result, _RESULT, "command_result", 0.0)
