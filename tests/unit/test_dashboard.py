"""The Grafana dashboard is the generated one, and every panel query is valid PromQL."""

from __future__ import annotations

import json

from orchestrator.dashboard import dashboard
from tests.promql import DASHBOARD, dashboard_series, parse


def test_committed_dashboard_is_the_generated_one() -> None:
    assert json.loads(DASHBOARD.read_text()) == dashboard(), (
        "regenerate it: tokenfab dashboard > deploy/dashboards/tokenfab.json")


def test_every_query_parses_and_uses_the_datasource_variable() -> None:
    model = dashboard()
    targets = [(p, t) for p in model["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 20
    for panel, target in targets:
        parse(target["expr"])  # raises on invalid PromQL
        assert panel["datasource"]["uid"] == target["datasource"]["uid"] == "${datasource}"
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids))


def test_panels_do_not_overlap() -> None:
    cells = set()
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                   for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & covered, panel["title"]
        cells |= covered


def test_series_are_found_through_joins_and_functions() -> None:
    found = dashboard_series({"panels": [{"targets": [{"expr":
        "histogram_quantile(0.9, sum by (pool, le) (rate(a_bucket[$__rate_interval]) "
        "* on (ReplicaId) group_left (pool) b_info)) / -(c)"}]}]})
    assert found == {"a_bucket", "b_info", "c"}


def test_the_docs_list_every_panel() -> None:
    """docs/observability.md lists the committed dashboard's panels, row by row."""
    rows: list[tuple[str, list[str]]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel.get("type") == "row":
            rows.append((panel["title"], []))
        else:
            rows[-1][1].append(panel["title"])
    listed = "\n".join(f"- **{row}**: " + "; ".join(panels) + "." for row, panels in rows)
    assert listed in (DASHBOARD.parents[2] / "docs/observability.md").read_text()
