"""GPU -> pod attribution from the kubelet's pod-resources API, against a real gRPC server.

The server is a real grpc server on a Unix socket in the test's tmp_path that
implements ``v1.PodResourcesLister/List`` from the generated kubelet stubs,
as the kubelet serves it on /var/lib/kubelet/pod-resources/kubelet.sock.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from helpers import Cluster, samples_named, scrape, wait_for
from prometheus_client.samples import Sample

from clusterwatch.agent.collectors.gpu import GpuCollector
from clusterwatch.agent.gpu.sim_backend import SimulatedBackend
from clusterwatch.agent.pod_resources import PodRef, PodResources, gpu_assignments
from clusterwatch.kubelet import podresources_v1_pb2 as pr
from clusterwatch.kubelet import podresources_v1_pb2_grpc as pr_grpc
from clusterwatch.v1 import node_pb2

pytestmark = pytest.mark.timeout(60)

GPU = "nvidia.com/gpu"


def pod(name: str, namespace: str, *containers: tuple[str, str, list[str]]) -> pr.PodResources:
    """A pod whose containers are (name, resource, device ids)."""
    return pr.PodResources(
        name=name,
        namespace=namespace,
        containers=[
            pr.ContainerResources(
                name=container, devices=[pr.ContainerDevices(resource_name=resource, device_ids=ids)]
            )
            for container, resource, ids in containers
        ],
    )


class KubeletServicer(pr_grpc.PodResourcesListerServicer):
    """Answers List with ``response``; or with ``error``; or not before ``released`` is set."""

    def __init__(self) -> None:
        self.response = pr.ListPodResourcesResponse()
        self.error: grpc.StatusCode | None = None
        self.released = threading.Event()
        self.released.set()
        self.calls = 0

    def List(  # noqa: N802 - the kubelet's method name
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        self.calls += 1
        self.released.wait(timeout=30)
        if self.error is not None:
            context.abort(self.error, "kubelet says no")
        return self.response


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[KubeletServicer, Path]]:
    """A real PodResourcesLister server on a Unix socket; the servicer and the socket path."""
    path = tmp_path / "kubelet.sock"
    servicer = KubeletServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield servicer, path
    servicer.released.set()  # let a stalled call finish so the server can stop
    server.stop(grace=None).wait(timeout=10)


def sim_uuids(node_id: str, count: int) -> list[str]:
    """The UUIDs the simulated backend gives ``node_id``'s GPUs (an agent started with --node-id)."""
    return [s.uuid for s in SimulatedBackend(count, node_id=node_id).sample()]


def test_gpu_uuids_map_to_their_container_and_other_ids_are_ignored() -> None:
    response = pr.ListPodResourcesResponse(
        pod_resources=[
            pod("train-0", "ml", ("trainer", GPU, ["GPU-aaa", "GPU-bbb"]), ("sidecar", "cpu", [])),
            # Time-slicing replicas name their GPU before "::"; a shared GPU goes to the
            # first container by (namespace, pod, container).
            pod("notebook", "zz", ("jupyter", GPU, ["GPU-ccc::1"])),
            pod("infer", "ab", ("server", "nvidia.com/gpu.shared", ["GPU-ccc::0"])),
            # Not whole GPUs, not NVIDIA GPUs, or not UUIDs: ignored.
            pod("mig", "ml", ("worker", "nvidia.com/mig-1g.10gb", ["MIG-ddd"])),
            pod("mig-single", "ml", ("worker", GPU, ["MIG-eee"])),
            pod("by-index", "ml", ("worker", GPU, ["3"])),
            pod("fpga", "ml", ("worker", "example.com/fpga", ["GPU-fff"])),
        ]
    )
    assert gpu_assignments(response) == {
        "GPU-aaa": PodRef(namespace="ml", pod="train-0", container="trainer"),
        "GPU-bbb": PodRef(namespace="ml", pod="train-0", container="trainer"),
        "GPU-ccc": PodRef(namespace="ab", pod="infer", container="server"),
    }


def test_lists_over_the_unix_socket_and_leaves_unassigned_gpus_out(
    kubelet: tuple[KubeletServicer, Path],
) -> None:
    servicer, path = kubelet
    servicer.response.pod_resources.append(pod("train-0", "ml", ("trainer", GPU, ["GPU-aaa"])))
    assignments = PodResources(path).assignments()
    assert assignments == {"GPU-aaa": PodRef(namespace="ml", pod="train-0", container="trainer")}
    assert "GPU-unassigned" not in assignments
    assert servicer.calls == 1


def test_asks_the_kubelet_at_most_once_per_refresh(kubelet: tuple[KubeletServicer, Path]) -> None:
    servicer, path = kubelet
    now_s = [100.0]
    resources = PodResources(path, refresh_s=5.0, clock=lambda: now_s[0])
    servicer.response.pod_resources.append(pod("a", "ml", ("c", GPU, ["GPU-aaa"])))
    assert set(resources.assignments()) == {"GPU-aaa"}
    servicer.response = pr.ListPodResourcesResponse(pod_resources=[pod("b", "ml", ("c", GPU, ["GPU-bbb"]))])
    now_s[0] += 4.9
    assert set(resources.assignments()) == {"GPU-aaa"}  # cached
    assert servicer.calls == 1
    now_s[0] += 0.1
    assert set(resources.assignments()) == {"GPU-bbb"}  # the pod moved; the new answer wins
    assert servicer.calls == 2


def test_no_socket_means_no_labels_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now_s = [0.0]
    resources = PodResources(tmp_path / "absent.sock", refresh_s=1.0, clock=lambda: now_s[0])
    with caplog.at_level(logging.INFO, logger="clusterwatch.agent.pod_resources"):
        for _ in range(3):
            assert resources.assignments() == {}
            now_s[0] += 1.0
    assert caplog.text.count("no kubelet pod-resources socket") == 1


def test_an_erroring_kubelet_means_no_labels_until_it_answers(
    kubelet: tuple[KubeletServicer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    servicer, path = kubelet
    servicer.response.pod_resources.append(pod("a", "ml", ("c", GPU, ["GPU-aaa"])))
    servicer.error = grpc.StatusCode.INTERNAL
    now_s = [0.0]
    resources = PodResources(path, refresh_s=1.0, clock=lambda: now_s[0])
    with caplog.at_level(logging.INFO, logger="clusterwatch.agent.pod_resources"):
        for _ in range(3):
            assert resources.assignments() == {}
            now_s[0] += 1.0
        servicer.error = None
        assert set(resources.assignments()) == {"GPU-aaa"}
    failures = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failures) == 1  # once when it starts failing, not at every refresh
    assert "INTERNAL: kubelet says no" in failures[0].getMessage()
    assert "answers: 1 GPUs assigned" in caplog.text
    assert servicer.calls == 4


def test_a_slow_kubelet_costs_one_timeout_and_no_labels(kubelet: tuple[KubeletServicer, Path]) -> None:
    servicer, path = kubelet
    servicer.response.pod_resources.append(pod("a", "ml", ("c", GPU, ["GPU-aaa"])))
    servicer.released.clear()
    resources = PodResources(path, refresh_s=60.0, timeout_s=0.2)
    started_s = time.monotonic()
    assert resources.assignments() == {}
    assert time.monotonic() - started_s < 5.0
    started_s = time.monotonic()
    assert resources.assignments() == {}  # cached: no second wait before the refresh is due
    assert time.monotonic() - started_s < 0.1


def test_a_socket_nobody_serves_means_no_labels(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))  # bound, never listening: connect() is refused
        assert PodResources(path, timeout_s=2.0).assignments() == {}


def test_gpu_collector_labels_only_the_assigned_gpu(kubelet: tuple[KubeletServicer, Path]) -> None:
    servicer, path = kubelet
    first, _second = sim_uuids("node-k", 2)
    servicer.response.pod_resources.append(pod("train-0", "ml", ("trainer", GPU, [first])))
    collector = GpuCollector(SimulatedBackend(2, node_id="node-k"), PodResources(path))
    report = node_pb2.NodeReport()
    collector.collect(report)
    assigned, unassigned = report.gpus
    assert (assigned.pod, assigned.namespace, assigned.container) == ("train-0", "ml", "trainer")
    assert (unassigned.pod, unassigned.namespace, unassigned.container) == ("", "", "")


def test_gpu_series_on_the_coordinator_carry_pod_labels(
    cluster: Cluster, kubelet: tuple[KubeletServicer, Path]
) -> None:
    servicer, path = kubelet
    node = "node-k8s"
    first, _second = sim_uuids(node, 2)
    servicer.response.pod_resources.extend(
        [
            pod("llama-worker-0", "training", ("pytorch", GPU, [first])),
            pod("other", "training", ("pytorch", GPU, ["GPU-on-another-node"])),
        ]
    )
    coordinator = cluster.coordinator()
    agent = cluster.agent(
        coordinator,
        node,
        "--gpu-backend",
        "sim",
        "--sim-gpus",
        "2",
        "--pod-resources-socket",
        str(path),
        "--metrics-listen",
        "127.0.0.1:0",
    )
    labels = {"pod": "llama-worker-0", "namespace": "training", "container": "pytorch"}

    def labelled(url: str) -> list[Sample] | None:
        samples = scrape(url)
        return samples if samples_named(samples, "clusterwatch_gpu_utilization_ratio", **labels) else None

    samples = wait_for(lambda: labelled(coordinator.metrics_url), 30, "pod labels on the coordinator")
    # The wiring (GPU links, nearest NICs) is the node's, whoever uses the GPU: those series
    # carry no pod labels, so they do not change when pods come and go.
    wiring = {"clusterwatch_gpu_link_info", "clusterwatch_gpu_nic_affinity_info"}
    assert samples_named(samples, "clusterwatch_gpu_link_info", node=node, gpu="0")
    assert all(not {"pod", "namespace", "container"} & s.labels.keys() for s in samples if s.name in wiring)
    per_gpu = [
        s
        for s in samples
        if s.name.startswith("clusterwatch_gpu_") and "gpu" in s.labels and s.name not in wiring
    ]
    for sample in per_gpu:
        if sample.labels["gpu"] == "0":
            assert {k: sample.labels.get(k) for k in labels} == labels, sample
        else:
            assert not {"pod", "namespace", "container"} & sample.labels.keys(), sample
    assert samples_named(samples, "clusterwatch_gpu_info", node=node, gpu="0", uuid=first, **labels)
    assert samples_named(samples, "clusterwatch_gpu_nvlink_transmit_bytes_total", gpu="0", **labels)
    # The agent's own /metrics says the same.
    port = wait_for(agent.logged_metrics_port, 30, "the agent's metrics port in its log")
    assert wait_for(lambda: labelled(f"http://127.0.0.1:{port}/metrics"), 30, "pod labels on the agent")
