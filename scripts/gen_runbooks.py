"""Write docs/runbooks.md from the alert rules' own annotations, one section per alert.

Usage:
    python scripts/gen_runbooks.py           # rewrite docs/runbooks.md
    python scripts/gen_runbooks.py --check   # exit 1 if the committed file is stale

Each alert's ``runbook_url`` points at its section here (as kube-prometheus' alerts point at
their runbooks); the text is the alert's summary, description and runbook, so the page and the
notification never disagree.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules" / "clusterwatch-alerts.yml"
OUT = ROOT / "docs" / "runbooks.md"
URL = "https://github.com/clusterwatch/clusterwatch/blob/main/docs/runbooks.md#"

HEADER = """# Runbooks

What each of clusterwatch's alerts means and what to do about it. Every alert
carries the same text in its annotations (`summary`, `description`, `runbook`)
and a `runbook_url` to its section here. Written from
`deploy/prometheus/rules/clusterwatch-alerts.yml` by `scripts/gen_runbooks.py`;
`{{ $labels.X }}` stands for the alert's label X.
"""


def alerts() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def anchor(alert: str) -> str:
    """The anchor GitHub gives a heading that is the alert's name."""
    return alert.lower()


def rendered() -> str:
    sections = [HEADER]
    for rule in alerts():
        notes = rule["annotations"]
        sections.append(
            f"\n## {rule['alert']}\n\n"
            f"Severity **{rule['labels']['severity']}**. {_one_line(notes['summary'])}\n\n"
            f"**What it means.** {_one_line(notes['description'])}\n\n"
            f"**What to do.** {_one_line(notes['runbook'])}\n\n"
            f"Fires on: `{_one_line(str(rule['expr']))}`"
            + (f" for {rule['for']}" if "for" in rule else "")
            + "\n"
        )
    return "".join(sections)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/runbooks.md is stale")
    args = parser.parse_args()
    text = rendered()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_runbooks.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
