"""A small typed builder for Grafana dashboard JSON (schemaVersion 39).

Dashboards are written as Python values here and rendered to ``dashboards/*.json`` by
``scripts/gen_dashboards.py``, so every panel gets the same datasource wiring, layout
and defaults, and the test suite can read the same JSON Grafana imports.

The datasource is a ``datasource``-type template variable (``${datasource}``), never a
``${DS_PROMETHEUS}`` import input: file provisioning has no import step to fill such an
input in, which is why dcgm-exporter's dashboard breaks when provisioned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

SCHEMA_VERSION = 39
GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TAG = "clusterwatch"

PanelKind = Literal["timeseries", "stat", "heatmap", "state-timeline", "bargauge", "table"]
# Panels Grafana evaluates at one instant (the end of the range) rather than over the range.
INSTANT_KINDS = frozenset({"stat", "bargauge", "table"})

# Panels coloured by their thresholds; the others give each series its own colour.
THRESHOLD_COLOURED = frozenset({"stat", "bargauge", "state-timeline"})

Json = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Query:
    """One PromQL query of a panel; ``legend`` is Grafana's legendFormat (``{{node}}``)."""

    expr: str
    legend: str = ""


@dataclasses.dataclass(frozen=True)
class Threshold:
    """From ``value`` up, the colour is ``color``; the first step's value is None (the base)."""

    value: float | None
    color: str


GOOD_LOW = (Threshold(None, "green"),)
# Any at all is bad: errors, failures, links down.
RED_FROM_ONE = (Threshold(None, "green"), Threshold(1, "red"))


@dataclasses.dataclass(frozen=True)
class Panel:
    """A panel: what it shows, in which unit, and what a bad value means.

    Attributes:
        description: shown under the (i) of the panel; says what a bad value means.
        unit: a Grafana unit id ("s", "bytes", "Bps", "percentunit", "suffix:steps/s", ...).
        thresholds: colour steps; also drawn as lines on time series.
        width / height: grid cells (the grid is 24 wide; panels flow left to right).
        stack: stack the series of a time series (parts of a whole).
        min_value / max_value: fixed axis or gauge range.
        decimals: digits after the point.
    """

    title: str
    description: str
    queries: Sequence[Query]
    unit: str
    kind: PanelKind = "timeseries"
    thresholds: Sequence[Threshold] = GOOD_LOW
    width: int = 12
    height: int = 8
    stack: bool = False
    min_value: float | None = None
    max_value: float | None = None
    decimals: int | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """A titled row of panels."""

    title: str
    panels: Sequence[Panel]


@dataclasses.dataclass(frozen=True)
class Variable:
    """A query variable: ``label_values(<selector>, <label>)``, multi-select with All (regex ``.*``)."""

    name: str
    label: str
    selector: str
    description: str

    @property
    def query(self) -> str:
        return f"label_values({self.selector}, {self.name})"


@dataclasses.dataclass(frozen=True)
class Annotation:
    """Events drawn on every time series: a PromQL expression that is non-empty at the event."""

    name: str
    expr: str
    title: str
    color: str


@dataclasses.dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: Sequence[Variable]
    rows: Sequence[Row]
    annotations: Sequence[Annotation] = ()
    refresh: str = "30s"
    time_from: str = "now-1h"


def render(dashboard: Dashboard) -> Json:
    """The dashboard as Grafana's JSON model, ready for file provisioning or import."""
    panels: list[Json] = []
    ids = iter(range(1, 10_000))
    y = 0
    for row in dashboard.rows:
        panels.append(
            {
                "type": "row",
                "id": next(ids),
                "title": row.title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
            }
        )
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel(panel, next(ids), {"h": panel.height, "w": panel.width, "x": x, "y": y}))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": [TAG],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: the same moment on every panel
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": dashboard.refresh,
        "time": {"from": dashboard.time_from, "to": "now"},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "links": [
            {
                "type": "dashboards",
                "tags": [TAG],
                "asDropdown": True,
                "title": "clusterwatch",
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "annotations": {"list": [_builtin_annotation(), *(_annotation(a) for a in dashboard.annotations)]},
        "templating": {"list": [_datasource_variable(), *(_variable(v) for v in dashboard.variables)]},
        "panels": panels,
    }


def _panel(panel: Panel, panel_id: int, grid: Json) -> Json:
    instant = panel.kind in INSTANT_KINDS
    defaults: Json = {
        "unit": panel.unit,
        "color": {"mode": "thresholds" if panel.kind in THRESHOLD_COLOURED else "palette-classic"},
        "thresholds": {
            "mode": "absolute",
            "steps": [{"value": t.value, "color": t.color} for t in panel.thresholds],
        },
        "mappings": [],
    }
    for key, value in (("min", panel.min_value), ("max", panel.max_value), ("decimals", panel.decimals)):
        if value is not None:
            defaults[key] = value
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if panel.stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "off" if len(panel.thresholds) == 1 else "dashed"},
            "axisSoftMin": 0,
        }
    return {
        "type": panel.kind,
        "id": panel_id,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": q.expr,
                "legendFormat": q.legend or "__auto",
                "range": not instant,
                "instant": instant,
                "editorMode": "code",
                **({"format": "heatmap"} if panel.kind == "heatmap" else {}),
                **({"format": "table"} if panel.kind == "table" else {}),
            }
            for i, q in enumerate(panel.queries)
        ],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": _options(panel),
    }


def _options(panel: Panel) -> Json:
    if panel.kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        }
    if panel.kind == "bargauge":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "displayMode": "gradient",
            "orientation": "horizontal",
            "showUnfilled": True,
        }
    if panel.kind == "heatmap":
        return {
            "calculate": False,
            "yAxis": {"unit": panel.unit},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "tooltip": {"mode": "single", "yHistogram": True},
            "legend": {"show": True},
        }
    if panel.kind == "state-timeline":
        return {
            "showValue": "never",
            "mergeValues": True,
            "rowHeight": 0.9,
            "alignValue": "left",
            "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
        }
    if panel.kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    return {
        "legend": {
            "showLegend": True,
            "displayMode": "table",
            "placement": "right",
            "calcs": ["lastNotNull", "max"],
        },
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def _datasource_variable() -> Json:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
        "includeAll": False,
        "multi": False,
        "description": "The Prometheus that scrapes the clusterwatch coordinator.",
    }


def _variable(variable: Variable) -> Json:
    return {
        "name": variable.name,
        "label": variable.label,
        "description": variable.description,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": variable.query,
        "query": {
            "query": variable.query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
            "qryType": 1,
        },
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "refresh": 2,
        "sort": 1,
        "hide": 0,
        "regex": "",
        "options": [],
    }


def _builtin_annotation() -> Json:
    return {
        "builtIn": 1,
        "name": "Annotations & Alerts",
        "type": "dashboard",
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    }


def _annotation(annotation: Annotation) -> Json:
    return {
        "name": annotation.name,
        "datasource": DATASOURCE,
        "enable": True,
        "hide": False,
        "iconColor": annotation.color,
        "expr": annotation.expr,
        "step": "15s",
        "titleFormat": annotation.title,
        "textFormat": "",
        "useValueForTime": False,
    }
