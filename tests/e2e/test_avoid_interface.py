"""A throttled link, found and routed around, for real: two "nodes" in network namespaces joined
by two veth paths, a gloo job over path A under ``clusterwatch run``, path A shaped with
``tc ... tbf``. clusterwatch names the path-A interface, checkpoints, sets both nodes' GLOO_SOCKET_IFNAME
to their path-B interfaces and restarts the job, whose ranks then talk over path B (their sockets
say so) at the healthy step time. Two faults:

* the shaper on node 1's own end of path A: its queue's counters name node 1 and the interface;
* the shaper on a switch's port (path A runs through a bridge in a third namespace): no node's
  counters see it, so the agents probe the job's paths and the probes name path A's two ends.

    root namespace: coordinator (on node 1's management address), test, rendezvous store
    cwn1: agent n1, torchrun        cwn2: agent n2, torchrun
      A  10.81.1.1 ----veth---- 10.81.1.2   (the job's path; shaped on n1's end)
      B  10.81.2.1 ----veth---- 10.81.2.2   (the way around)
      S  10.81.5.1 ----veth---- 10.81.5.2   (torchrun's store for the workers: --local-addr)
      M  10.81.3.1 -- root 10.81.3.254      M  10.81.4.1 -- root 10.81.4.254  (agents, rendezvous)

The measurements (onset -> detection -> resumed; step time before, during, after) are printed
and written to ``$CLUSTERWATCH_BENCH_OUT`` when set (bench/avoid_interface.py).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from helpers import Cluster, Coordinator, incidents, job_status, wait_for

from clusterwatch.v1 import cluster_pb2
from clusterwatch.wire.worker_env import WorkerEnv, decode, env_file_path

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TRAIN = Path(__file__).resolve().parents[1] / "hook_workers" / "train_ddp.py"
JOB = "netjob"
COMPUTE_MS = 100
ALLREDUCE_BYTES = 1 << 20
SHAPER = ("root", "tbf", "rate", "20mbit", "burst", "32kb", "latency", "100ms")
# On the switch: a deeper queue that holds the job's bursts without dropping any, so no node's TCP
# retransmits either: nothing a node counts gives the slow port away.
SWITCH_SHAPER = ("root", "tbf", "rate", "20mbit", "burst", "32kb", "latency", "1s")
HEALTHY_S = 8.0  # healthy steps first (the slowdown baseline needs 40), and the false-positive check
RESOLVED = cluster_pb2.INCIDENT_STATE_RESOLVED


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class TwoNodes:
    """The namespaces and links of the module docstring; names carry the pid (parallel runs)."""

    def __init__(self, *, switched: bool) -> None:
        tag = os.getpid() % 100_000
        self.namespaces = (f"cwn1-{tag}", f"cwn2-{tag}")
        # Path A through a bridge in a namespace of its own (its ports: toward node 1, node 2).
        self.switch = f"cwsw-{tag}" if switched else ""
        self.switch_ports = (f"cwp{tag}x", f"cwp{tag}y")
        self.path_a = (f"cwa{tag}x", f"cwa{tag}y")
        self.path_b = (f"cwb{tag}x", f"cwb{tag}y")
        self.path_s = (f"cws{tag}x", f"cws{tag}y")
        self.management = ((f"cwm{tag}x", f"cwh{tag}x"), (f"cwm{tag}y", f"cwh{tag}y"))
        self.coordinator_host = "10.81.3.254"
        self.rendezvous_hosts = ("10.81.3.254", "10.81.4.254")

    def prefix(self, node: int) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespaces[node])

    def create(self) -> None:
        one, two = self.namespaces
        for namespace in (*self.namespaces, self.switch):
            if namespace:
                run("ip", "netns", "add", namespace)
                run("ip", "-n", namespace, "link", "set", "lo", "up")
        for (x, y), subnet in ((self.path_a, 1), (self.path_b, 2), (self.path_s, 5)):
            if subnet == 1 and self.switch:
                self._switched(x, y)
            else:
                run("ip", "link", "add", x, "netns", one, "type", "veth", "peer", "name", y, "netns", two)
            run("ip", "-n", one, "addr", "add", f"10.81.{subnet}.1/24", "dev", x)
            run("ip", "-n", two, "addr", "add", f"10.81.{subnet}.2/24", "dev", y)
            run("ip", "-n", one, "link", "set", x, "up")
            run("ip", "-n", two, "link", "set", y, "up")
        for node, (inside, outside) in enumerate(self.management):
            namespace, subnet = self.namespaces[node], 3 + node
            run("ip", "link", "add", inside, "netns", namespace, "type", "veth", "peer", "name", outside)
            run("ip", "-n", namespace, "addr", "add", f"10.81.{subnet}.1/24", "dev", inside)
            run("ip", "addr", "add", f"10.81.{subnet}.254/24", "dev", outside)
            run("ip", "-n", namespace, "link", "set", inside, "up")
            run("ip", "link", "set", outside, "up")
        # Node 2 reaches the coordinator's address (the root namespace's, on node 1's link) over its own.
        run("ip", "-n", two, "route", "add", f"{self.coordinator_host}/32", "via", "10.81.4.254")

    def _switched(self, x: str, y: str) -> None:
        """Path A as node 1 -- switch port -- bridge -- switch port -- node 2."""
        bridge = f"{self.switch_ports[0]}br"
        run("ip", "-n", self.switch, "link", "add", bridge, "type", "bridge")
        for port, end, namespace in zip(self.switch_ports, (x, y), self.namespaces, strict=True):
            run(
                "ip",
                "link",
                "add",
                port,
                "netns",
                self.switch,
                "type",
                "veth",
                "peer",
                "name",
                end,
                "netns",
                namespace,
            )
            run("ip", "-n", self.switch, "link", "set", port, "master", bridge)
            run("ip", "-n", self.switch, "link", "set", port, "up")
        run("ip", "-n", self.switch, "link", "set", bridge, "up")

    def delete(self) -> None:
        for namespace in (*self.namespaces, self.switch):  # their veths go with them, the root ends too
            if namespace:
                subprocess.run(["ip", "netns", "del", namespace], check=False, timeout=30)

    def unshape_path_a(self) -> None:
        run("tc", "-n", self.switch, "qdisc", "del", "dev", self.switch_ports[0], "root")

    def shape_path_a(self) -> None:
        """Node 1's end of path A; or, switched, the switch's port toward node 1 (what node 2 sends it)."""
        if self.switch:
            run("tc", "-n", self.switch, "qdisc", "add", "dev", self.switch_ports[0], *SWITCH_SHAPER)
        else:
            run("tc", "-n", self.namespaces[0], "qdisc", "add", "dev", self.path_a[0], *SHAPER)


@pytest.fixture(params=["shaped_node", "shaped_switch"])
def two_nodes(request: pytest.FixtureRequest) -> Iterator[TwoNodes]:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        if os.environ.get("CI"):
            pytest.fail("CI runs as root with iproute2 (./dev installs it)")
        pytest.skip("needs root and iproute2 (ip, tc) for network namespaces")
    nodes = TwoNodes(switched=request.param == "shaped_switch")
    try:
        nodes.create()
        yield nodes
    finally:
        nodes.delete()


@pytest.fixture
def rendezvous_port() -> Iterator[int]:
    """A c10d rendezvous store in the root namespace, which both nodes reach over their management links."""
    import torch.distributed as dist

    store = dist.TCPStore("10.81.3.254", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def processes_of(tmp_path: Path) -> list[psutil.Process]:
    """The job's processes (launchers, workers): those running the worker script for this test."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if str(TRAIN) in command and str(tmp_path) in command:
            found.append(process)
    return found


def stop_tree(pid: int) -> None:
    """SIGTERM a launcher (torchrun stops its workers), then SIGKILL whatever of its tree is left:
    its workers run in sessions of their own."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    root.terminate()
    _, alive = psutil.wait_procs(tree, timeout=15)
    for process in alive:
        process.kill()
    psutil.wait_procs(alive, timeout=10)


def on_path(coordinator: Coordinator, path: tuple[str, str]) -> bool:
    """Whether each node's running rank talks over its end of ``path`` and no other path (its
    sockets also reach the rendezvous store, over the management link)."""
    status = job_status(coordinator, JOB)
    running = {r.node_id: set(r.interfaces) for r in status.ranks if r.state == 1} if status else {}
    other = {
        name
        for name in running.get("n1", set()) | running.get("n2", set())
        if name.startswith(("cwa", "cwb"))
    }
    return len(running) == 2 and path[0] in running["n1"] and path[1] in running["n2"] and other == set(path)


def step_times(coordinator: Coordinator, seconds: float) -> list[float]:
    """Every new step time the job's ranks report over ``seconds`` (polled)."""
    seen: dict[tuple[int, int], float] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        status = job_status(coordinator, JOB)
        for rank in status.ranks if status is not None else ():
            if rank.HasField("last_step") and rank.state == 1:  # RANK_STATE_RUNNING
                seen[(rank.identity.rank, rank.last_step.step)] = rank.last_step.step_seconds
        time.sleep(0.25)
    return list(seen.values())


def entry_of(cluster: Cluster, node: str) -> WorkerEnv | None:
    """The job's live entry in ``node``'s worker environment file (what its agent gives new workers)."""
    path = Path(env_file_path(str(cluster.socket_path(node))))
    entry = decode(path.read_bytes()).get(JOB) if path.exists() else None
    return entry if entry is not None and entry.live(time.time()) else None


def lift_once_healthy(cluster: Cluster, two_nodes: TwoNodes, avoided: list[str]) -> None:
    """While the switch port is still shaped, the avoidance is renewed (probes find path A slow);
    once it is not, it lapses the hold after the last slow probe."""
    first = entry_of(cluster, "n1")
    assert first is not None
    assert sorted(first.avoided) == avoided
    renewed = wait_for(
        lambda: (
            (e := entry_of(cluster, "n1")) is not None and e.expires_unix_s > first.expires_unix_s + 1 and e
        ),
        30,
        "the avoidance renewed while path A probes slow",
    )
    two_nodes.unshape_path_a()
    healthy_since = time.time()
    wait_for(
        lambda: entry_of(cluster, "n1") is None and entry_of(cluster, "n2") is None,
        60,
        "the avoidance to lapse",
    )
    lapsed_after_s = time.time() - healthy_since
    # Not before the hold from the last renewal, which came no later than one recheck after the fix.
    assert lapsed_after_s >= renewed.expires_unix_s - healthy_since - 0.5, lapsed_after_s


def restore_by_request(cluster: Cluster, coordinator: Coordinator) -> None:
    """A person gives the interface back: both nodes forget the job's entry; once their next reports
    say so, there is nothing left to restore."""
    assert entry_of(cluster, "n1") is not None
    with coordinator.client() as client:
        response = client.restore_interfaces(JOB)
        assert "on n1, n2" in response.message, response.message
        assert entry_of(cluster, "n1") is None
        assert entry_of(cluster, "n2") is None

        def not_found() -> bool:
            try:
                client.restore_interfaces(JOB)
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.NOT_FOUND
            return False

        wait_for(not_found, 10, "the nodes' reports to say nothing is avoided")


def test_a_throttled_link_is_named_and_the_job_restarted_over_the_other_path(
    cluster: Cluster, tmp_path: Path, two_nodes: TwoNodes, rendezvous_port: int
) -> None:
    # Switched: the avoided port is probed every 2 s, held 20 s past its last slow probe (lifted below).
    holding = (
        ("--avoid-interface-recheck-s", "2", "--avoid-interface-hold-s", "20") if two_nodes.switch else ()
    )
    coordinator = cluster.coordinator(
        "--cooldown-s", "0", "--restart-grace-s", "3", *holding, host=two_nodes.coordinator_host
    )
    nodes = ("n1", "n2")
    for node, name in enumerate(nodes):
        cluster.agent(coordinator, name, interval_s=0.5, prefix=two_nodes.prefix(node))
        wait_for(cluster.socket_path(name).exists, 30, f"{name}'s hook socket")
    jobs = [
        cluster.torchrun(
            TRAIN,
            "--out-dir",
            str(tmp_path / name),
            "--job",
            JOB,
            "--until-file",
            str(tmp_path / "stop"),
            "--compute-ms",
            str(COMPUTE_MS),
            "--allreduce-bytes",
            str(ALLREDUCE_BYTES),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            nproc=1,
            socket=cluster.socket_path(name),
            max_restarts=2,
            # The job's own choice: path A. Lazy init lets a restarted gloo group form again.
            env={
                "GLOO_SOCKET_IFNAME": two_nodes.path_a[node],
                "TORCH_GLOO_LAZY_INIT": "1",
                "CLUSTERWATCH_JOB": JOB,
            },
            elastic=(f"{two_nodes.rendezvous_hosts[node]}:{rendezvous_port}", JOB),
            elastic_nnodes="2:2",
            launcher="clusterwatch.run",
            prefix=two_nodes.prefix(node),
            local_addr=f"10.81.5.{node + 1}",
        )
        for node, name in enumerate(nodes)
    ]
    try:
        wait_for(lambda: on_path(coordinator, two_nodes.path_a), 120, "both ranks training over path A")
        before = step_times(coordinator, HEALTHY_S)
        assert [i.summary for i in incidents(coordinator)] == [], "a healthy run is no finding"

        two_nodes.shape_path_a()
        onset_unix_s = time.time()

        def slowdown() -> cluster_pb2.Incident | None:
            return next((i for i in incidents(coordinator) if i.kind == "job_slowdown"), None)

        found = wait_for(slowdown, 60, "the slowdown to be found")
        assert found.cause == "network", found.summary
        x, y = two_nodes.path_a
        if two_nodes.switch:  # probes: path A's two ends (two nodes cannot say which end is slow)
            named, avoided = ["n1", "n2"], [f"n1/{x}", f"n2/{y}"]
            assert found.evidence["probe_slow_paths"] >= 1, found.summary
        else:  # the shaper's counters on node 1
            named, avoided = ["n1"], [f"n1/{x}"]
        assert list(found.nodes) == named, found.summary
        assert list(found.interfaces) == avoided, found.summary
        during = [found.evidence["recent_step_seconds"]]

        def resolved() -> cluster_pb2.Incident | None:
            return next((i for i in incidents(coordinator) if i.id == found.id and i.state == RESOLVED), None)

        recovered = wait_for(resolved, 180, "the job to resume over path B")
        # The restarted ranks' sockets confirm the move, in the incident's note.
        bx, by = two_nodes.path_b
        assert f"its ranks now talk over n1/{bx}, n2/{by}, bus bandwidth" in recovered.summary, (
            recovered.summary
        )
        assert recovered.evidence["moved_bus_bandwidth_bytes_per_second"] > 0
        with coordinator.client() as client:
            (action,) = [a for a in client.actions(JOB) if a.action == "avoid_interface"]
        assert action.outcome == "done", action.detail
        assert list(action.avoid_interfaces) == avoided
        x, y = two_nodes.path_b
        assert (
            f"n1: GLOO_SOCKET_IFNAME={x} NCCL_SOCKET_IFNAME={x}; n2: GLOO_SOCKET_IFNAME={y}" in action.detail
        )

        wait_for(lambda: on_path(coordinator, two_nodes.path_b), 60, "the restarted ranks' sockets on path B")
        after = step_times(coordinator, HEALTHY_S)
        if two_nodes.switch:
            lift_once_healthy(cluster, two_nodes, avoided)
        else:
            restore_by_request(cluster, coordinator)
        (tmp_path / "stop").touch()
        for job in jobs:
            assert job.wait(120) == 0, job.log()
    finally:
        (tmp_path / "stop").touch()
        for job in jobs:
            stop_tree(job.pid)
    assert processes_of(tmp_path) == [], "nothing of the job is left"
    measured = {
        "detection_s": found.opened_unix_seconds - onset_unix_s,
        "resumed_s": recovered.resolved_unix_seconds - onset_unix_s,
        "step_before_s": statistics.median(before),
        "step_during_s": statistics.median(during),
        "step_after_s": statistics.median(after),
    }
    print(f"avoid_interface ({'switch' if two_nodes.switch else 'node'}):", json.dumps(measured))
    if out := os.environ.get("CLUSTERWATCH_BENCH_OUT"):
        Path(out).write_text(json.dumps(measured))
    assert measured["step_during_s"] > 2 * measured["step_before_s"], measured  # the shaper bit
    assert measured["step_after_s"] <= 1.1 * measured["step_before_s"], measured
