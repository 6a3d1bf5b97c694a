"""Series and bytes of one 8-GPU HGX node's /metrics page, NVLink per GPU (default) or per link.

    python -m bench.nvlink_series

The node is bench.synthetic's: 8 GPUs with 18 NVLinks each, 4 NICs, 2 InfiniBand ports.
"""

from __future__ import annotations

from bench.synthetic import node_report
from clusterwatch.exposition.node_metrics import register_node_families, write_node
from clusterwatch.exposition.promtext import Exposition


def main() -> None:
    report = node_report("node-0", 1)
    print(f"{len(report.gpus)} GPUs, {len(report.gpus[0].nvlinks)} NVLinks each")
    print(f"{'nvlink_series':<14} {'series':>7} {'nvlink':>7} {'bytes':>8}")
    for per_link in (False, True):
        exp = Exposition()
        register_node_families(exp)
        write_node(exp, "node-0", report, nvlink_per_link=per_link)
        page = exp.render().decode()
        series = [line for line in page.splitlines() if line and not line.startswith("#")]
        nvlink = [line for line in series if "_nvlink_" in line]
        print(f"{'link' if per_link else 'gpu':<14} {len(series):>7} {len(nvlink):>7} {len(page):>8}")


if __name__ == "__main__":
    main()
