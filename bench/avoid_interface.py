"""A throttled link found and routed around (issue 24): onset -> detection -> resumed, and the step
time before, during and after, over real runs of tests/e2e/test_avoid_interface.py.

Usage (root, iproute2):
    python -m bench.avoid_interface [--runs 3]

Each run is the end-to-end test: two network namespaces joined by two veth paths, a gloo job of
two ranks under ``clusterwatch run`` over path A (100 ms of compute and a 1 MiB all-reduce a
step), 8 s healthy (no incident allowed), then ``tc qdisc ... tbf rate 20mbit`` on path A: on
node 1's end (its counters name it), then, as a second series, on a switch's port (path A through
a bridge in a third namespace: only probes of the paths name it).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.scenario_runs import run_scenario

FIELDS = ("detection_s", "resumed_s", "step_before_s", "step_during_s", "step_after_s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    count = parser.parse_args().runs
    for fault in ("shaped_node", "shaped_switch"):
        print(f"{fault}:")
        runs = run_scenario("tests/e2e/test_avoid_interface.py", FIELDS, count, select=fault)
        if runs is None:
            return 1
        ratio = statistics.median(r["step_after_s"] for r in runs) / statistics.median(
            r["step_before_s"] for r in runs
        )
        print(f"step time after / before: {ratio:.3f} (target <= 1.10); detection target <= 15 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
