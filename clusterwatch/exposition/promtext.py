"""A small, fast writer for the Prometheus text exposition format (0.0.4).

Why not prometheus_client's generate_latest: a 1,000-node cluster with 8 GPUs
each is ~600,000 samples per scrape, and building a Sample object per value
then formatting it costs several seconds. Here label sets are escaped once per
node or GPU and every sample is one f-string appended to its family's list;
families are emitted in registration order, each with HELP and TYPE.
prometheus_client's parser reads the output (the tests parse every scrape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SPECIAL_FLOATS = {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}


@dataclass(frozen=True)
class Family:
    """One metric family: full sample name, TYPE and HELP."""

    name: str
    kind: str  # "gauge", "counter" or "histogram"
    help: str


def gauge(name: str, help: str) -> Family:
    return Family(name, "gauge", help)


def counter(name: str, help: str) -> Family:
    if not name.endswith("_total"):
        raise ValueError(f"counter {name} must end in _total")
    return Family(name, "counter", help)


def histogram(name: str, help: str) -> Family:
    """A histogram; write its series with Exposition.add_histogram()."""
    if name.endswith(("_bucket", "_sum", "_count", "_total")):
        raise ValueError(f"histogram {name} must be named without a sample suffix")
    return Family(name, "histogram", help)


def escape(value: str) -> str:
    """Escape a label value (backslash, double quote, newline)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def labels(**pairs: object) -> str:
    """Format label pairs as ``a="x",b="y"`` (no braces), escaping values."""
    return ",".join(f'{k}="{escape(str(v))}"' for k, v in pairs.items())


def format_value(value: float) -> str:
    """Format a sample value; integers stay exact, NaN/Inf use Prometheus spelling."""
    text = repr(value)  # int: exact digits; float: shortest round-trip form
    return _SPECIAL_FLOATS.get(text, text)


class Exposition:
    """Collects samples family by family and renders them as one text page."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[Family, list[str]]] = {}

    def lines(self, family: Family) -> list[str]:
        """The sample lines of ``family``; append ``name{labels} value`` strings to it."""
        entry = self._families.get(family.name)
        if entry is None:
            entry = self._families[family.name] = (family, [])
        return entry[1]

    def add(self, family: Family, label_text: str, value: float) -> None:
        """Add one sample; ``label_text`` is the output of labels() (may be empty)."""
        if label_text:
            self.lines(family).append(f"{family.name}{{{label_text}}} {format_value(value)}")
        else:
            self.lines(family).append(f"{family.name} {format_value(value)}")

    def add_histogram(
        self,
        family: Family,
        label_text: str,
        bounds: Sequence[float],
        bucket_counts: Sequence[int],
        sum_value: float,
    ) -> None:
        """Add one histogram series: ``_bucket`` per bound and +Inf, ``_sum`` and ``_count``.

        Args:
            bounds: upper bounds, ascending, without +Inf.
            bucket_counts: per bucket, *not* cumulative; one more than
                ``bounds`` (the last is the +Inf bucket).
        """
        if len(bucket_counts) != len(bounds) + 1:
            raise ValueError(f"{family.name}: {len(bucket_counts)} counts for {len(bounds)} bounds + Inf")
        lines = self.lines(family)
        bucket = f"{family.name}_bucket{{{label_text}," if label_text else f"{family.name}_bucket{{"
        cumulative = 0
        for bound, count in zip(bounds, bucket_counts, strict=False):
            cumulative += count
            lines.append(f'{bucket}le="{format_value(bound)}"}} {cumulative}')
        cumulative += bucket_counts[-1]
        lines.append(f'{bucket}le="+Inf"}} {cumulative}')
        series = f"{{{label_text}}}" if label_text else ""
        lines.append(f"{family.name}_sum{series} {format_value(sum_value)}")
        lines.append(f"{family.name}_count{series} {cumulative}")

    def render(self) -> bytes:
        """The whole page; families with no samples still get HELP and TYPE."""
        parts: list[str] = []
        for family, sample_lines in self._families.values():
            help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
            parts.append(f"# HELP {family.name} {help_text}\n# TYPE {family.name} {family.kind}\n")
            if sample_lines:
                parts.append("\n".join(sample_lines))
                parts.append("\n")
        return "".join(parts).encode()
