"""``clusterwatch agent``: the per-node daemon."""

from __future__ import annotations

import argparse

from clusterwatch.cli.common import add_settings_flags, run_until_signalled, settings_from_args
from clusterwatch.config import AgentSettings
from clusterwatch.runtime.tls import credentials, warn_if_plaintext


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "agent",
        help="run the node agent (GPUs, host, network, InfiniBand -> coordinator)",
        description="Collect this node's GPU (NVML), host, NIC and InfiniBand metrics every interval and "
        "stream them to the coordinator; buffers and replays reports across coordinator outages.",
    )
    add_settings_flags(parser, AgentSettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, AgentSettings)
    tls = credentials(settings, "agent")
    from clusterwatch.agent.runtime import Agent

    warn_if_plaintext(tls, f"the agent's stream to {settings.coordinator}")
    agent = Agent(settings, tls=tls)
    run_until_signalled(agent.run)
    return 0
