"""What the hook and `clusterwatch job --slurm` read from SLURM's environment: job name, labels,
the rank of a task srun started without torchrun, host lists; and the label rules both sides check."""

from __future__ import annotations

import pytest

from clusterwatch.agent.hook_validation import InvalidHookMessageError, check_identity
from clusterwatch.hook.identity import RankInfo, job_name
from clusterwatch.wire.job_labels import MAX_VALUE_CHARS, clip_value, labels_problem
from clusterwatch.wire.slurm_env import SlurmTask, expand_hostlist, slurm_job_name, slurm_labels, slurm_task

pytestmark = pytest.mark.timeout(10)

# What SLURM sets in a task of `srun --nodes 2 --ntasks-per-node 4 python train.py` (rank 5),
# inside `sbatch --job-name llama -p gpu -A research`.
SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NAME": "llama",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_NODELIST": "gpu[01-02]",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_ACCOUNT": "research",
    "SLURM_JOB_USER": "ml",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}
# What torchrun adds for its workers (here torchrun itself was started by srun, one per node).
TORCHRUN_WORKER = {
    "RANK": "13",
    "LOCAL_RANK": "5",
    "WORLD_SIZE": "16",
    "TORCHELASTIC_RUN_ID": "rdzv-xyz",
    "TORCHELASTIC_RESTART_COUNT": "1",
}
LABELS = {
    "slurm_job_id": "4242",
    "slurm_job_name": "llama",
    "slurm_nodelist": "gpu[01-02]",
    "slurm_partition": "gpu",
    "slurm_account": "research",
    "slurm_user": "ml",
}


def test_a_task_srun_started_without_torchrun_takes_its_rank_from_slurm() -> None:
    info = RankInfo.from_environ(None, SRUN_TASK)
    assert (info.job, info.rank, info.local_rank, info.world_size, info.restart_count) == ("4242", 5, 1, 8, 0)
    assert info.labels == LABELS
    proto = info.to_proto()
    assert dict(proto.labels) == LABELS
    assert (proto.job, proto.rank, proto.world_size) == ("4242", 5, 8)


def test_torchruns_variables_win_under_slurm_and_the_job_is_still_slurms() -> None:
    info = RankInfo.from_environ(None, {**SRUN_TASK, **TORCHRUN_WORKER})
    assert (info.job, info.rank, info.local_rank, info.world_size, info.restart_count) == (
        "4242",
        13,
        5,
        16,
        1,
    )
    assert info.labels == LABELS


def test_a_batch_script_is_one_process_not_rank_0_of_the_allocation() -> None:
    # sbatch's own script has SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but no step.
    batch = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0"}
    info = RankInfo.from_environ(None, batch)
    assert (info.job, info.rank, info.world_size) == ("4242", 0, 1)
    assert slurm_task(batch) is None


def test_job_name_precedence() -> None:
    array = {**SRUN_TASK, "SLURM_JOB_ID": "4300", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}
    torchrun = {"TORCHELASTIC_RUN_ID": "rdzv-xyz"}
    assert job_name("explicit", {**array, "CLUSTERWATCH_JOB": "env"}) == "explicit"
    assert job_name(None, {**array, **torchrun, "CLUSTERWATCH_JOB": "env"}) == "env"
    assert job_name(None, {**array, **torchrun}) == "4242_7"  # an array task, as squeue shows it
    assert job_name(None, {**SRUN_TASK, **torchrun}) == "4242"  # SLURM's id before torchrun's run id
    assert job_name(None, torchrun) == "rdzv-xyz"
    assert job_name(None, {"TORCHELASTIC_RUN_ID": "none"}) == "default"
    assert job_name(None, {}) == "default"
    assert slurm_job_name({"SLURM_JOBID": "99"}) == "99"  # the old spelling alone
    assert slurm_job_name({"SLURM_JOB_ID": "not-a-number"}) == ""
    assert slurm_labels(array)["slurm_job_id"] == "4300"  # what scontrol takes for this one task
    assert (slurm_labels(array)["slurm_array_job_id"], slurm_labels(array)["slurm_array_task_id"]) == (
        "4242",
        "7",
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"SLURM_PROCID": "9"},  # beyond the step's tasks
        {"SLURM_PROCID": "x"},
        {"SLURM_STEP_NUM_TASKS": "", "SLURM_NTASKS": ""},
        {"SLURM_STEP_ID": "batch"},
    ],
)
def test_odd_slurm_task_values_leave_the_defaults(changes: dict[str, str]) -> None:
    environ = {**SRUN_TASK, **changes}
    assert slurm_task(environ) is None
    info = RankInfo.from_environ(None, environ)  # never raises: it runs inside training
    assert (info.rank, info.world_size) == (0, 1)


def test_the_step_task_count_comes_before_the_allocations() -> None:
    environ = {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "7"}
    assert slurm_task(environ) == SlurmTask(rank=1, local_rank=0, world_size=2)  # LOCALID out of range
    assert slurm_task({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": ""}) == SlurmTask(5, 1, 8)


def test_labels_outside_slurm_and_long_values() -> None:
    assert slurm_labels({"SLURM_JOB_NAME": "x"}) == {}  # no job id: not a SLURM job
    huge = "n" * (MAX_VALUE_CHARS + 100)
    labels = slurm_labels({**SRUN_TASK, "SLURM_JOB_NODELIST": huge})
    assert len(labels["slurm_nodelist"]) == MAX_VALUE_CHARS
    assert labels["slurm_nodelist"].endswith("...")
    assert labels_problem(labels) == ""
    assert clip_value("short") == "short"


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[1-2]y,x1y", ["x1y", "x2y"]),
        ("node7", ["node7"]),
        ("a[1-", None),
        ("a]", None),
        ("a[[1]]", None),
        ("a,,b", None),
        ("a[2-1]", None),
        ("a[x]", None),
        ("n[1-99999999]", None),  # a typo must not allocate millions of names
    ],
)
def test_host_lists(hostlist: str, expected: list[str] | None) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    ("labels", "problem"),
    [
        ({"slurm_job_id": "1", "team": "x"}, ""),
        ({"job": "x"}, "key 'job' is reserved"),
        ({"a b": "x"}, "key 'a b' is not a label name"),
        ({"__name__": "x"}, "key '__name__' is not a label name"),
        ({"1st": "x"}, "key '1st' is not a label name"),
        ({"k": "v" * (MAX_VALUE_CHARS + 1)}, "value of 'k' has 1025 characters; at most 1024"),
        ({f"k{i}": "v" for i in range(33)}, "at most 32 labels, got 33"),
    ],
)
def test_label_rules(labels: dict[str, str], problem: str) -> None:
    assert labels_problem(labels).startswith(problem)
    assert bool(labels_problem(labels)) == bool(problem)


def test_the_agent_refuses_a_hello_with_bad_labels_naming_the_field() -> None:
    identity = RankInfo.from_environ(None, SRUN_TASK).to_proto()
    check_identity(identity, "hello")  # what the hook sends passes
    identity.labels["job"] = "clash"
    with pytest.raises(InvalidHookMessageError, match=r"^hello\.labels: key 'job' is reserved") as info:
        check_identity(identity, "hello")
    assert info.value.field == "hello.labels"
