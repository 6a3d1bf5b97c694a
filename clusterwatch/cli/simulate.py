"""``clusterwatch simulate``: synthetic agents carrying a synthetic training job, with injected faults."""

from __future__ import annotations

import argparse
import asyncio
import datetime
from pathlib import Path

from clusterwatch.cli.common import add_settings_flags, run_until_signalled, settings_from_args
from clusterwatch.config import AgentSettings, TransportSettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate",
        help="drive simulated agents and a training job with injected faults against a coordinator",
        description="Open one agent stream per simulated node to the coordinator and report, in real time, "
        "a synchronous training job on their GPUs (steps, collectives, heartbeats, Flight Recorder status) "
        "with GPU, host and InfiniBand telemetry. The scenario file (TOML) sets the noise and the faults; "
        "--ground-truth-out writes what was injected, when and on whom (see bench/detection.py). "
        "Flags override the scenario file's run settings. It reports as agents do, with [agent]'s TLS "
        "settings: one node certificate per simulated node, named by {node} in --tls-cert and --tls-key "
        "(e.g. --tls-cert pki/{node}.crt --tls-key pki/{node}.key --tls-ca pki/ca.crt), or --insecure.",
    )
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="coordinator gRPC address")
    parser.add_argument("--scenario", required=True, type=Path, metavar="FILE", help="scenario file (TOML)")
    parser.add_argument("--nodes", type=int, default=None, metavar="N", help="simulated nodes")
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, metavar="G", help="GPUs (and ranks) per node (default 8)"
    )
    parser.add_argument("--job", default=None, metavar="NAME", help="job name (default: the scenario's name)")
    parser.add_argument(
        "--step-s", type=float, default=None, metavar="S", help="nominal step time (default 1)"
    )
    parser.add_argument(
        "--duration-s", type=float, default=None, metavar="S", help="run this long (default: until Ctrl-C)"
    )
    parser.add_argument(
        "--interval-s",
        type=float,
        default=None,
        metavar="S",
        help="report interval of every node (default 1)",
    )
    parser.add_argument(
        "--node-prefix", default=None, metavar="PREFIX", help="node j is named PREFIX<j> (default: JOB-node-)"
    )
    parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the scenario's)")
    parser.add_argument(
        "--ground-truth-out", type=Path, default=None, metavar="FILE.json", help="write the ground truth here"
    )
    # It speaks for agents, so as agents do: [agent]'s TLS, with {node} in the certificate and key
    # paths naming each simulated node's own (the coordinator checks a node's name against it).
    add_settings_flags(parser, AgentSettings, only=TransportSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from clusterwatch.sim.runner import Simulation, resolve_settings
    from clusterwatch.sim.scenario import load_scenario
    from clusterwatch.sim.truth import GroundTruth

    scenario = load_scenario(args.scenario)
    transport = settings_from_args(args, AgentSettings)
    settings = resolve_settings(
        scenario,
        tls=transport if not transport.insecure else None,
        coordinator=args.coordinator,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        step_s=args.step_s,
        interval_s=args.interval_s,
        duration_s=args.duration_s,
        job=args.job,
        node_prefix=args.node_prefix,
        ground_truth_out=args.ground_truth_out,
        seed=args.seed,
    )
    print(
        f"clusterwatch simulate: job {settings.job}, {settings.world_size} ranks on {settings.nodes} nodes "
        f"({settings.node_prefix}0..), step {settings.step_s:g} s, scenario {scenario.name} "
        f"({len(scenario.faults)} fault{'s' if len(scenario.faults) != 1 else ''}), coordinator {settings.coordinator}",
        flush=True,
    )
    truths: list[GroundTruth] = []

    async def main(stop: asyncio.Event) -> None:
        truths.append(await Simulation(settings).run(stop))

    run_until_signalled(main)
    truth = truths[0]
    for fault in truth.faults:
        when = (
            f"at step {fault.onset_step} ({_clock(fault.onset_unix_s)})"
            if fault.onset_unix_s is not None
            else "never (the run ended first)"
        )
        print(f"  {fault.kind}: ranks {_short(fault.ranks)} on {', '.join(fault.nodes)} took effect {when}")
    stats = truth.stats
    print(
        f"  {stats['steps_done']:.0f} steps, {stats['reports_total']:.0f} reports "
        f"({stats['reports_per_s']:g}/s), {stats['build_ms_per_report']:g} ms CPU to build each, "
        f"max lag {stats['max_lag_s']:g} s, simulator CPU {100 * stats['cpu_ratio']:.0f} %",
        flush=True,
    )
    return 0


def _clock(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s).strftime("%H:%M:%S.%f")[:-3]


def _short(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
