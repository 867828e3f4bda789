"""A committed results page is what its script renders from the committed JSON beside it, byte
for byte: nobody edited the page by hand, and the JSON holds everything the page says.

Covered: the scripts whose page is a function of the JSON alone (`markdown(result)`). The others
render from their command line too; they are listed in UNCOVERED until their JSON records it.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

RENDERED_BY = {  # results file (no suffix) -> the module whose markdown(result) writes its .md
    "h2h": "h2h_report", "h2h-noreuse": "h2h_report", "h2h-noreuse-rr": "h2h_report",
    "h2h-unprioritised": "h2h_report", "lora": "lora", "port_fidelity": "port_fidelity",
    "routing_at_scale": "routing_at_scale", "sim_pd": "sim_pd", "sim_speed": "sim_speed",
    "soak": "soak",
}
UNCOVERED = {  # rendered from the JSON and the command line, or by an earlier version
    "autoscaler", "dp_routing", "gateway", "pd", "resume_identity", "router_cost", "routing",
    "sim_autoscaling", "sim_autoscaling-ramp", "sim_fidelity", "sim_history",
    "sim_pd_autoscaling", "sim_pd_autoscaling-ramp", "sim_placement", "simulator",
    "simulator-history",
    "h2h_before",  # the path before its rewrite, written by h2h.py at commit f3a2ed8
}


def test_every_results_file_is_covered_or_listed() -> None:
    names = {path.stem for path in RESULTS.glob("*.json")}
    assert names == set(RENDERED_BY) | UNCOVERED


@pytest.mark.parametrize("name", sorted(RENDERED_BY))
def test_the_page_is_its_scripts_rendering_of_the_json(name: str, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the scripts import each other
    module = importlib.import_module(RENDERED_BY[name])
    result = json.loads((RESULTS / f"{name}.json").read_text())
    assert module.markdown(result) == (RESULTS / f"{name}.md").read_text()
    sys.modules.pop(RENDERED_BY[name], None)
