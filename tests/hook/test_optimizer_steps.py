"""Step boundaries from torch's global optimizer-step hook (clusterwatch/hook/optimizer_steps.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from clusterwatch.hook import TrainingMonitor
from clusterwatch.hook.bootstrap import start_monitor
from clusterwatch.hook.frameworks import CALLBACKS_ENV
from clusterwatch.hook.optimizer_steps import OptimizerSteps

pytestmark = pytest.mark.timeout(30)


class Sink:
    def __init__(self) -> None:
        self.events: list[str] = []

    def begin_step(self, step: int) -> None:
        self.events.append(f"begin {step}")

    def end_step(self) -> None:
        self.events.append("end")


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def test_the_first_optimizer_to_step_sets_the_pace_and_the_first_step_starts_the_clock() -> None:
    sink = Sink()
    steps = OptimizerSteps(sink)
    steps.install()
    try:
        generator, discriminator = optimizer(), optimizer()
        for _ in range(3):  # a GAN: both step every iteration, the first one paces
            generator.step()
            discriminator.step()
    finally:
        steps.remove()
    assert sink.events == ["begin 1", "end", "begin 2", "end", "begin 3"]
    assert steps.steps == 3
    optimizer().step()  # removed: no more boundaries
    assert sink.events[-1] == "begin 3"


def test_a_new_optimizer_paces_once_the_first_is_gone() -> None:
    sink = Sink()
    steps = OptimizerSteps(sink)
    steps.install()
    try:
        first = optimizer()
        first.step()
        del first  # e.g. rebuilt after a restart from a checkpoint
        optimizer().step()
    finally:
        steps.remove()
    assert sink.events == ["begin 1", "end", "begin 2"]


def test_a_scripts_own_monitor_under_run_is_the_launchers_and_numbers_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's lines in a script launched by clusterwatch run: one monitor, the script's steps."""
    monkeypatch.setenv("CLUSTERWATCH_AGENT_SOCKET", str(tmp_path / "no-agent.sock"))
    monkeypatch.setenv(CALLBACKS_ENV, "0")  # start_monitor keeps what is set
    finders = list(sys.meta_path)
    launched = start_monitor()  # what clusterwatch run's bootstrap does first
    try:
        assert launched is not None
        assert launched.optimizer_steps is not None
        own = TrainingMonitor(job="explicit")
        assert own is launched
        assert launched.optimizer_steps is None  # the optimizer-step hook is gone
        optimizer().step()
        assert launched.steps_completed_total == 0
        assert not launched._in_step
        with own.step(0):
            pass
        assert own.steps_completed_total == 1
    finally:
        launched.close()
        sys.meta_path[:] = finders  # the Hugging Face import hook
