"""Step times in incident text: enough digits that millisecond steps of different lengths differ."""

from __future__ import annotations

import pytest

from clusterwatch.text.humanize import step_time

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.5, "0.500 s"),
        (0.1, "0.100 s"),
        (0.0999, "99.9 ms"),
        (0.00166, "1.66 ms"),
        (0.001, "1 ms"),
        (0.000125, "0.125 ms"),
    ],
)
def test_step_time(seconds: float, shown: str) -> None:
    assert step_time(seconds) == shown


def test_millisecond_steps_that_differ_print_differently() -> None:
    """The issue's example: "0.001 s per step vs 0.001 s on its peers (1.66x)"."""
    assert step_time(0.00166) != step_time(0.001)
