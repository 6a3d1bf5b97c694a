"""Write clusterwatch's Grafana dashboards (scripts/grafana/*.py) to dashboards/*.json.

Usage:
    python scripts/gen_dashboards.py           # rewrite dashboards/*.json
    python scripts/gen_dashboards.py --check   # exit 1 if the committed JSON is stale

The JSON is committed so operators can provision it without Python; the test
command runs --check so a dashboard change without regeneration fails CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana import gpus, incidents, network, overview, training
from grafana.panels import Dashboard, render

OUT_DIR = Path(__file__).resolve().parent.parent / "dashboards"
DASHBOARDS: dict[str, Dashboard] = {
    "clusterwatch-overview.json": overview.DASHBOARD,
    "clusterwatch-gpus.json": gpus.DASHBOARD,
    "clusterwatch-training.json": training.DASHBOARD,
    "clusterwatch-network.json": network.DASHBOARD,
    "clusterwatch-incidents.json": incidents.DASHBOARD,
}


def rendered() -> dict[str, str]:
    """File name -> JSON text, stable (sorted keys, two-space indent, final newline)."""
    return {
        name: json.dumps(render(d), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        for name, d in DASHBOARDS.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="fail if dashboards/*.json are stale")
    args = parser.parse_args()
    fresh = rendered()
    if args.check:
        committed = {p.name for p in OUT_DIR.glob("*.json")}
        stale = sorted(
            n for n, text in fresh.items() if not (OUT_DIR / n).is_file() or (OUT_DIR / n).read_text() != text
        )
        extra = sorted(committed - fresh.keys())
        if stale or extra:
            print(
                f"dashboards are stale: {', '.join(stale + extra)}; run python scripts/gen_dashboards.py",
                file=sys.stderr,
            )
            return 1
        print("dashboards are up to date")
        return 0
    for name, text in fresh.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {len(fresh)} dashboards to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
