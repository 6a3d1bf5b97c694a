"""The Grafana dashboards and Prometheus alert rules that ship inside clusterwatch.

A wheel carries them as the data-only packages ``clusterwatch.dashboards`` and
``clusterwatch.rules`` (pyproject.toml maps the repository's ``dashboards/``
and ``deploy/prometheus/rules/`` there). An editable install of a checkout
cannot import folders without Python, so there they are read where they live.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Bundle:
    package: str
    checkout_folder: str
    pattern: str
    what: str


BUNDLES = {
    "dashboards": Bundle("clusterwatch.dashboards", "dashboards", "*.json", "Grafana dashboards"),
    "rules": Bundle("clusterwatch.rules", "deploy/prometheus/rules", "*.yml", "Prometheus alert rules"),
}


def bundled_files(kind: str) -> list[Traversable]:
    """The files of ``kind`` (a key of BUNDLES), sorted by name."""
    bundle = BUNDLES[kind]
    folder: Traversable
    try:
        folder = importlib.resources.files(bundle.package)
    except ModuleNotFoundError:  # an editable install: the checkout's own folder
        folder = CHECKOUT / bundle.checkout_folder
    found = [f for f in folder.iterdir() if f.is_file() and fnmatch.fnmatch(f.name, bundle.pattern)]
    return sorted(found, key=lambda f: f.name)
