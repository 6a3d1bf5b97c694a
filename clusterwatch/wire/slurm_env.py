"""What SLURM's environment says about a job and a task, read the same way by the hook and the CLI.

SLURM sets ``SLURM_*`` variables in a job's batch script, in every task
``srun`` starts, and in the Prolog/Epilog scripts slurmd runs on each node.
The training hook reads them for its job name, labels and (under ``srun``
without torchrun) rank; ``clusterwatch job begin|end --slurm`` reads them in
the Prolog/Epilog, so both sides name the job alike.

Nothing here raises on odd values: the hook runs inside training processes
(CONTRIBUTING.md #3: failure is data).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import NamedTuple

from clusterwatch.wire.job_labels import clip_value

# Label key -> the variables that give it, first set wins. SLURM_JOBID and
# SLURM_NODELIST are the older spellings, still set next to the new ones.
LABEL_SOURCES: dict[str, tuple[str, ...]] = {
    "slurm_job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "slurm_job_name": ("SLURM_JOB_NAME",),
    "slurm_array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "slurm_array_task_id": ("SLURM_ARRAY_TASK_ID",),
    "slurm_nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "slurm_partition": ("SLURM_JOB_PARTITION",),
    "slurm_account": ("SLURM_JOB_ACCOUNT",),
    "slurm_user": ("SLURM_JOB_USER",),
}
# A hostlist longer than this (after expansion) is not expanded: a typo such
# as n[1-99999999] must not allocate millions of names.
MAX_HOSTS = 65536

_DIGITS = re.compile(r"[0-9]+")
# One bracketed range set and what precedes it: "rack[1-2]" -> "rack", "1-2".
_BRACKET = re.compile(r"([^\[\]]*)\[([^\]]*)\]")


class SlurmTask(NamedTuple):
    """An ``srun`` task's place in its job step."""

    rank: int
    local_rank: int
    world_size: int


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    for name in names:
        value = environ.get(name, "")
        if value:
            return value
    return ""


def slurm_job_id(environ: Mapping[str, str]) -> str:
    """The SLURM job id (``SLURM_JOB_ID``); '' outside SLURM."""
    return _first(environ, LABEL_SOURCES["slurm_job_id"])


def slurm_job_name(environ: Mapping[str, str]) -> str:
    """The clusterwatch job name of a SLURM job; '' outside SLURM.

    ``<array job id>_<task id>`` for a task of a job array (how squeue and
    sacct show it, and what ``scontrol requeue`` takes), else the job id. Both
    stay the same when SLURM requeues the job, so a requeued job finds its
    checkpoints under the same name.
    """
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
    if _DIGITS.fullmatch(array_job) and _DIGITS.fullmatch(array_task):
        return f"{array_job}_{array_task}"
    job_id = slurm_job_id(environ)
    return job_id if _DIGITS.fullmatch(job_id) else ""


def slurm_labels(environ: Mapping[str, str]) -> dict[str, str]:
    """The job labels SLURM's variables give (keys in LABEL_SOURCES); {} outside SLURM."""
    if not slurm_job_id(environ):
        return {}
    labels = {}
    for key, names in LABEL_SOURCES.items():
        value = _first(environ, names)
        if value:
            labels[key] = clip_value(value)
    return labels


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if _DIGITS.fullmatch(value) else None


def slurm_task(environ: Mapping[str, str]) -> SlurmTask | None:
    """The task's rank, local rank and step size when ``srun`` started it; else None.

    Only in a task of a job step (``SLURM_STEP_ID`` set): a batch script has
    ``SLURM_PROCID=0`` and the allocation's ``SLURM_NTASKS`` too, but it is
    one process, not rank 0 of that many. The step's own task count
    (``SLURM_STEP_NUM_TASKS``) comes before ``SLURM_NTASKS``, which a step
    inherits from its allocation when srun is not given ``--ntasks``.
    """
    if _int(environ, "SLURM_STEP_ID") is None:
        return None
    rank = _int(environ, "SLURM_PROCID")
    world_size = _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS")
    if rank is None or not world_size or rank >= world_size:
        return None
    local_rank = _int(environ, "SLURM_LOCALID")
    return SlurmTask(
        rank, local_rank if local_rank is not None and local_rank < world_size else 0, world_size
    )


def expand_hostlist(hostlist: str) -> list[str] | None:
    """A SLURM host list ("gpu[01-03,07],login1") as names, in order; None when malformed or too long.

    Zero padding follows the range's first number, as in SLURM ("gpu[08-10]"
    is gpu08, gpu09, gpu10). Several bracketed sets in one name multiply
    ("r[1-2]n[1-2]" is r1n1, r1n2, r2n1, r2n2).
    """
    entries = _split_top_level(hostlist.strip())
    if entries is None:
        return None
    names: list[str] = []
    for entry in entries:
        expanded = _expand_entry(entry.strip(), MAX_HOSTS - len(names))
        if expanded is None:
            return None
        names.extend(expanded)
    return list(dict.fromkeys(names))


def _split_top_level(hostlist: str) -> list[str] | None:
    """The comma-separated entries outside brackets; None when a bracket is left open or closes twice."""
    entries, start, depth = [], 0, 0
    for index, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            entries.append(hostlist[start:index])
            start = index + 1
        if depth not in (0, 1):
            return None
    if depth != 0:
        return None
    entries.append(hostlist[start:])
    return entries


def _expand_entry(entry: str, budget: int) -> list[str] | None:
    parts: list[list[str]] = []
    position = 0
    for match in _BRACKET.finditer(entry):
        if match.start() != position:
            return None  # text the pattern skipped: an unbalanced bracket
        numbers = _expand_ranges(match.group(2), budget)
        if numbers is None:
            return None
        parts.extend(([match.group(1)], numbers))
        position = match.end()
    suffix = entry[position:]
    if "[" in suffix or "]" in suffix or not entry:
        return None
    parts.append([suffix])
    total = 1
    for part in parts:
        total *= len(part)
        if total > budget:
            return None
    return ["".join(combination) for combination in itertools.product(*parts)]


def _expand_ranges(ranges: str, budget: int) -> list[str] | None:
    numbers: list[str] = []
    for item in ranges.split(","):
        low, dash, high = item.strip().partition("-")
        if not _DIGITS.fullmatch(low) or (dash and not _DIGITS.fullmatch(high)):
            return None
        start, stop = int(low), int(high) if dash else int(low)
        if stop < start or len(numbers) + stop - start + 1 > budget:
            return None
        numbers.extend(str(n).zfill(len(low)) for n in range(start, stop + 1))
    return numbers
