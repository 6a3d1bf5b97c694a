"""The hook says what it cannot see (issue 23, item 4): a Flight Recorder that is off, collectives
it did not time, DDP models it left alone. BlindSpots on its own, then real torchrun jobs whose
monitor was created after init_process_group, read back through `clusterwatch status`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import HOOK_WORKERS, Cluster, ranks_of, run_cli, start_node, wait_for

from clusterwatch.hook.blind_spots import BlindSpots
from clusterwatch.v1 import cluster_pb2, training_pb2

pytestmark = pytest.mark.timeout(240)

LATE_MONITOR = HOOK_WORKERS / "late_monitor.py"


def recorded(**enqueued: int) -> list[training_pb2.FlightRecorderGroup]:
    return [
        training_pb2.FlightRecorderGroup(group_name=n, last_enqueued_collective=v)
        for n, v in enqueued.items()
    ]


def test_a_recorder_turned_off_is_said_at_once_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    blind = BlindSpots(recorder_requested=False, created_after_init=False)
    with caplog.at_level(logging.WARNING, logger="clusterwatch.hook.blind_spots"):
        first = blind.sentences()
        assert blind.sentences() == first
    assert blind.recorder_on is False
    assert first == [
        "the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0): a hang is named by heartbeats only, "
        "without the collective each rank last entered"
    ]
    assert len(caplog.records) == 1


def test_a_recorder_is_judged_by_what_it_records_once_the_hook_timed_a_collective() -> None:
    blind = BlindSpots(recorder_requested=True, created_after_init=True)
    blind.update([], {}, None)
    assert blind.recorder_on is None  # nothing launched yet: an empty recorder proves nothing
    blind.update([], {"0": 0}, None)
    assert blind.recorder_on is None
    blind.update([], {"0": 1}, None)
    assert blind.recorder_on is False
    assert "created after init_process_group" in blind.sentences()[0]
    blind.update(recorded(**{"0": 5}), {"0": 5}, 3)  # never judged again
    assert blind.recorder_on is False
    on = BlindSpots(recorder_requested=True, created_after_init=True)
    on.update(recorded(**{"0": 1}), {"0": 1}, None)
    assert on.recorder_on is True
    assert on.sentences() == []


def test_untimed_collectives_count_from_the_first_step_and_are_said_past_one_percent() -> None:
    blind = BlindSpots(recorder_requested=True, created_after_init=False)
    # Setup: DDP's construction ran 3 collectives from C++ before any step.
    blind.update(recorded(**{"0": 3}), {"0": 0}, None)
    assert blind.untimed is None
    blind.update(recorded(**{"0": 13}), {"0": 10}, 1)  # the first step: the baseline
    assert blind.untimed == 0
    blind.update(recorded(**{"0": 213, "1": 5}), {"0": 209}, 40)  # 1 + 5 (a group only C++ used)
    assert blind.untimed == 6
    assert blind.sentences()[0].startswith("6 of 205 collectives since step 1 were not timed")
    # The hook ahead of the recorder (read in between) never counts as negative.
    blind.update(recorded(**{"0": 1213, "1": 5}), {"0": 1214}, 80)
    assert blind.untimed == 2
    assert blind.sentences() == []  # 2 of 1205: under 1 %
    blind.update([], {"0": 1214}, 80)  # destroyed: the last count stays
    assert blind.untimed == 2
    # A functional collective's backward: torch launches it, the hook times only its wait.
    backward = BlindSpots(recorder_requested=True, created_after_init=False)
    backward.update(recorded(**{"2": 10}), {"2": 5}, 1, waited=5)
    backward.update(recorded(**{"2": 30}), {"2": 15}, 2, waited=15)
    assert backward.untimed == 0


def test_the_trackers_own_blind_spots_follow_and_the_list_is_bounded() -> None:
    blind = BlindSpots(recorder_requested=False, created_after_init=False)
    ddp = [f"DDP gradient buckets are not timed (model {i})" for i in range(20)]
    said = blind.sentences(ddp)
    assert len(said) == 16
    assert said[0].startswith("the Flight Recorder is off")
    assert said[1] == ddp[0]


def status_json(coordinator_address: str) -> dict[str, object]:
    result = run_cli("status", "--json", "--insecure", "--coordinator", coordinator_address)
    assert result.returncode == 0, result.stderr
    document: dict[str, object] = json.loads(result.stdout)
    return document


def heartbeats(document: dict[str, object], job: str) -> dict[int, dict[str, object]]:
    (found,) = [j for j in document["jobs"] if j["job"] == job]  # type: ignore[attr-defined]
    return {rank["rank"]: rank.get("heartbeat", {}) for rank in found["ranks"]}


@pytest.mark.slow
@pytest.mark.parametrize("recorder", ["default", "off"])
def test_a_monitor_created_after_init_process_group_says_what_it_cannot_see(
    cluster: Cluster, tmp_path: Path, recorder: str
) -> None:
    coordinator, socket = start_node(cluster)
    until = tmp_path / "stop"
    env = {"CLUSTERWATCH_JOB": f"late-{recorder}"}
    if recorder == "off":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
    job = cluster.torchrun(LATE_MONITOR, "--until-file", str(until), nproc=2, socket=socket, env=env)
    name = env["CLUSTERWATCH_JOB"]
    try:

        def said() -> bool:
            ranks = ranks_of(coordinator, name)
            return (
                len(ranks) == 2
                and all(
                    any("were not timed" in s for s in r.heartbeat.blind_spots) or recorder == "off"
                    for r in ranks.values()
                )
                and all(r.heartbeat.steps_completed_total > 0 for r in ranks.values())
            )

        wait_for(said, 60, "both ranks' blind spots")
        beats = heartbeats(status_json(coordinator.address), name)
        text = run_cli("status", "--insecure", "--coordinator", coordinator.address).stdout
    finally:
        until.touch()
    assert job.wait(120) == 0, job.log()[-4000:]
    print(text)
    for beat in beats.values():
        spots = beat.get("blind_spots", [])
        if recorder == "default":
            # torch 2.13 records every group by default: created late, the recorder is still on.
            assert beat["flight_recorder_enabled"] is True
            assert not [s for s in spots if "Flight Recorder" in s]
            # One all-reduce a step comes from a function imported before the monitor.
            assert int(beat["untimed_collectives"]) > 0
        else:
            assert beat.get("flight_recorder_enabled", False) is False
            assert spots[0].startswith("the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0)")
            assert "untimed_collectives" not in beat  # unknown without the recorder
    if recorder == "default":
        assert "were not timed" in text
        assert "blind: rank" in text
    else:
        assert "blind: ranks 0, 1: the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0)" in text
        # One warning per rank, in the job's own output.
        assert job.log().count("clusterwatch: the Flight Recorder is off") == 2


def test_status_lists_a_blind_spot_once_with_the_ranks_that_report_it() -> None:
    from clusterwatch.cli.status import blind_spot_lines

    job = cluster_pb2.JobStatus(job="j")
    for rank, spots in enumerate([["a"], ["a", "b"], []]):
        job.ranks.add(
            identity=training_pb2.RankIdentity(rank=rank), heartbeat=training_pb2.Heartbeat(blind_spots=spots)
        )
    assert blind_spot_lines(job) == ["blind: ranks 0, 1: a", "blind: rank 1: b"]
    many = cluster_pb2.JobStatus(job="k")
    many.ranks.add(heartbeat=training_pb2.Heartbeat(blind_spots=[str(i) for i in range(12)]))
    lines = blind_spot_lines(many)
    assert len(lines) == 8
    assert lines[-1] == "blind: 5 more (status --json: ranks[].heartbeat.blind_spots)"
