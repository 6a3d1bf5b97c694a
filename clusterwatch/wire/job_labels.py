"""Job labels: the key/value pairs that say where a job runs (SLURM job id, partition...).

The hook sends them in its RankIdentity, ``clusterwatch job begin`` in its
BeginJobRequest; the coordinator keeps them on the job and exports each one as
a label of ``clusterwatch_job_info``. So a key must be a Prometheus label name
that cannot collide with the family's own ``training_job`` label, nor with the
``job`` and ``instance`` labels Prometheus gives every target, and both the count
and the sizes are bounded: labels are held per job and rendered every scrape.
The agent and the coordinator check them with ``labels_problem``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_LABELS = 32
MAX_KEY_CHARS = 64
# A SLURM node list of a large, fragmented allocation runs to a few hundred characters.
MAX_VALUE_CHARS = 1024
# The label clusterwatch_job_info already has, and the two Prometheus gives every scrape target.
TRAINING_JOB_LABEL = "training_job"
RESERVED_KEYS = frozenset({TRAINING_JOB_LABEL, "job", "instance"})

_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def labels_problem(labels: Mapping[str, str]) -> str:
    """What is wrong with ``labels``, naming the key; '' when nothing is.

    Rules: at most MAX_LABELS pairs; keys are Prometheus label names of at
    most MAX_KEY_CHARS, not starting with ``__`` and not reserved; values at
    most MAX_VALUE_CHARS characters.
    """
    if len(labels) > MAX_LABELS:
        return f"at most {MAX_LABELS} labels, got {len(labels)}"
    for key, value in labels.items():
        if not _KEY.fullmatch(key) or len(key) > MAX_KEY_CHARS or key.startswith("__"):
            return (
                f"key {key!r} is not a label name ([a-zA-Z_][a-zA-Z0-9_]*, at most {MAX_KEY_CHARS} "
                "characters, not starting with __)"
            )
        if key in RESERVED_KEYS:
            return f"key {key!r} is reserved (the job's name is its training_job label; job and instance are Prometheus')"
        if len(value) > MAX_VALUE_CHARS:
            return f"value of {key!r} has {len(value)} characters; at most {MAX_VALUE_CHARS}"
    return ""


def clip_value(value: str) -> str:
    """``value`` cut to MAX_VALUE_CHARS (ending in "...") so that it is accepted."""
    if len(value) <= MAX_VALUE_CHARS:
        return value
    return value[: MAX_VALUE_CHARS - 3] + "..."
