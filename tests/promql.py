"""The series a Grafana dashboard's PromQL expressions read, found by parsing them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/dashboards/tokenfab.json"
# Grafana's built-in variables, replaced by what Grafana would put there
_GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}


def parse(expr: str) -> Any:
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def series(node: Any) -> set[str]:
    """Names of every series an expression selects."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        return {node.name}
    if kind == "MatrixSelector":
        return series(node.vector_selector)
    if kind == "BinaryExpr":
        return series(node.lhs) | series(node.rhs)
    if kind == "Call":
        return set().union(*(series(arg) for arg in node.args))
    if kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        return series(node.expr)
    return set()


def dashboard_series(model: dict[str, Any] | None = None, rows: set[str] | None = None,
                     except_rows: set[str] = frozenset()) -> set[str]:
    """The series the panels read: of the rows named in `rows` (all if None) but `except_rows`."""
    model = model or json.loads(DASHBOARD.read_text())
    found, row = set(), None
    for panel in model["panels"]:
        if panel.get("type") == "row":
            row = panel["title"]
            continue
        if (rows is None or row in rows) and row not in except_rows:
            for target in panel.get("targets", []):
                found |= series(parse(target["expr"]))
    return found


def dashboard_queries(model: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    model = model or json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in model["panels"]
            for target in panel.get("targets", [])]


def scrape(url: str, key: str | None = None) -> list[Any]:
    """Every sample a Prometheus endpoint exports now (presenting `key` as a bearer key)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(url, trust_env=False, timeout=10, headers=headers)
    response.raise_for_status()
    text = response.text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
