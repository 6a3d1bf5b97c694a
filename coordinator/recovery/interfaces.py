"""Where a job's collectives go instead of a bad interface: the worker environment of each node.

Pure: reads the job's ranks (which interfaces their sockets use) and the nodes'
latest reports (each NIC's link state and addresses), returns the environment
each node's workers start with (WorkerEnvCommand), or why there is none.

* An InfiniBand port (``mlx5_0/1``): NCCL_IB_HCA excludes it on its node
  (``^=mlx5_0:1``); NCCL's other HCAs carry the traffic; no other node changes.
* A network interface (``eth1``): socket transports (gloo; NCCL's sockets and
  bootstrap) use one interface per process, and a peer reaches a process on
  the address it advertises, so the whole job moves to another network: one
  of the bad node's other interfaces that is up, whose network (address and
  prefix) every other node of the job also has an up interface on. Each node
  gets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to its interface on that
  network. Candidates in order: the bad node's fastest interface first
  (NicSample.speed_bytes_per_second), then by name; link-local and loopback
  never.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from clusterwatch.coordinator.model.jobs import JobRecord
from clusterwatch.coordinator.model.networks import nics, node_networks
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.wire.worker_env import GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_SOCKET_IFNAME


def plan_worker_env(
    job: JobRecord, nodes: Mapping[str, NodeRecord], avoid: Collection[tuple[str, str]]
) -> dict[str, dict[str, str]] | str:
    """``{node: {variable: value}}`` that keeps ``job`` off ``avoid`` ((node, interface) pairs),
    or one sentence saying why no such move exists."""
    if not avoid:
        return "no interface to avoid was named"
    env: dict[str, dict[str, str]] = {}
    for node_id, interface in avoid:
        if "/" in interface:  # an InfiniBand port, DEVICE/PORT
            device, _, port = interface.partition("/")
            env.setdefault(node_id, {})[NCCL_IB_HCA] = f"^={device}:{port}"
    sockets = sorted({(n, i) for n, i in avoid if "/" not in i})
    if not sockets:
        return env
    job_nodes = sorted(job.nodes())
    by_node = {
        node_id: {network: at.interface for network, at in node_networks(nodes.get(node_id)).items()}
        for node_id in job_nodes
    }
    if missing := [n for n, networks in by_node.items() if not networks]:
        return f"no interface addresses known for {', '.join(missing)} (no report yet, or an agent that does not report them)"
    avoided = set(sockets)
    bad_nodes = {n for n, _ in sockets}
    speeds = {
        (node_id, nic.device): nic.speed_bytes_per_second
        for node_id in bad_nodes
        for nic in nics(nodes.get(node_id))
    }
    choices = sorted(
        {
            (network, node_id, interface)
            for node_id in bad_nodes
            for network, interface in by_node.get(node_id, {}).items()
            if (node_id, interface) not in avoided
        },
        key=lambda choice: (-speeds.get(choice[1:], 0.0), choice[2], str(choice[0])),
    )
    for network, _, _ in choices:
        on_network = {n: i for n, networks in by_node.items() if (i := networks.get(network)) is not None}
        if len(on_network) == len(by_node) and not avoided & set(on_network.items()):
            for node_id, interface in on_network.items():
                env.setdefault(node_id, {}).update(
                    {GLOO_SOCKET_IFNAME: interface, NCCL_SOCKET_IFNAME: interface}
                )
            return env
    named = ", ".join(f"{interface} on {node_id}" for node_id, interface in sockets)
    if not choices:
        return f"{' and '.join(sorted(bad_nodes))} has no other interface up with an address besides {named}"
    return (
        f"no network other than {named}'s reaches every node of job {job.job} "
        f"(tried {', '.join(str(network) for network, _, _ in choices)})"
    )
