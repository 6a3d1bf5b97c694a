"""A persistently slower rank rebalanced (issue 24): step time before and after, against the ideal,
over real runs of tests/e2e/test_rebalance.py.

Usage (root, a writable cgroup CPU controller):
    python -m bench.rebalance [--runs 3]

Each run is the end-to-end test: four gloo ranks of a 512-wide MLP, a global batch of 1,024 split by
BalancedBatchSampler, each rank held to 0.4 of a CPU by a cgroup quota and rank 3 to 0.2; the
straggler is found (cause compute), the coordinator sends the ranks' shares, and the step time
drops. The ideal is the global batch over the ranks' summed throughput before (samples over compute
time) plus the slowest rank's communication; target: >= 80 % of the ideal gain.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.scenario_runs import run_scenario

FIELDS = ("step_before_s", "step_after_s", "step_ideal_s", "share_of_ideal_gain")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    runs = run_scenario("tests/e2e/test_rebalance.py", FIELDS, parser.parse_args().runs)
    if runs is None:
        return 1
    for index, run in enumerate(runs):
        print(f"run {index}: samples per rank after {run['counts_after']}, {run['splits']} split(s)")
    share = statistics.median(r["share_of_ideal_gain"] for r in runs)
    print(f"share of the ideal gain: {share:.1%} (target >= 80 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
