"""/metrics render time for a large cluster, and prometheus_client for comparison.

Usage:
    python -m bench.metrics_render [--nodes 1000] [--repeat 5]

Builds coordinator state for N nodes of 8 simulated GPUs (18 NVLinks each),
4 NICs and 2 InfiniBand ports, then times coordinator.metrics.page.render() (the
exact code behind GET /metrics) and the gzip a scraper asks for.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from collections.abc import Callable

from bench.synthetic import node_report
from clusterwatch.coordinator.metrics.page import render
from clusterwatch.coordinator.views.nodes import NodeView
from clusterwatch.exposition.http_server import GZIP_LEVEL
from clusterwatch.v1 import cluster_pb2


def views(nodes: int) -> list[NodeView]:
    template = node_report("template")
    out = []
    for i in range(nodes):
        node_id = f"gpu-node-{i:05d}"
        report = type(template)()
        report.CopyFrom(template)
        out.append(
            NodeView(
                node_id, node_id, "0.1.0", cluster_pb2.NodeState.NODE_STATE_UP, 1.8e9, 1, 1, 0, report, None
            )
        )
    return out


def prometheus_client_seconds(page: bytes) -> float:
    """Time prometheus_client to produce the same samples from ready-made families."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(page.decode()))

    class Replay:
        def collect(self):  # type: ignore[no-untyped-def]
            return families

    registry = CollectorRegistry()
    registry.register(Replay())
    started = time.perf_counter()
    generate_latest(registry)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--compare-nodes", type=int, default=100, help="nodes for the prometheus_client comparison"
    )
    args = parser.parse_args()
    state = views(args.nodes)
    times, page = [], b""
    for _ in range(args.repeat):
        started = time.perf_counter()
        page = render(state)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    compressed = gzip.compress(page, compresslevel=GZIP_LEVEL)
    gzip_s = time.perf_counter() - started
    samples = sum(1 for line in page.splitlines() if line and not line.startswith(b"#"))
    small = render(views(args.compare_nodes))
    small_samples = sum(1 for line in small.splitlines() if line and not line.startswith(b"#"))
    ours_small = min(_timed(lambda: render(views(args.compare_nodes))) for _ in range(3))
    theirs_small = prometheus_client_seconds(small)
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "gpus": args.nodes * 8,
                "samples": samples,
                "page_bytes": len(page),
                "gzip_bytes": len(compressed),
                "render_seconds_median": round(statistics.median(times), 3),
                "render_seconds_min": round(min(times), 3),
                "gzip_seconds": round(gzip_s, 3),
                "render_us_per_sample": round(statistics.median(times) / samples * 1e6, 3),
                "compare_nodes": args.compare_nodes,
                "compare_samples": small_samples,
                "prometheus_client_generate_latest_us_per_sample": round(
                    theirs_small / small_samples * 1e6, 3
                ),
                "ours_including_view_build_us_per_sample": round(ours_small / small_samples * 1e6, 3),
            },
            indent=2,
        )
    )
    return 0


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
