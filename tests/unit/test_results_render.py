"""A committed results page is what its script renders from the committed JSON beside it, byte
for byte: nobody edited the page by hand, and the JSON holds everything the page says.

Covered: the scripts whose page is a function of the JSON alone (`markdown(result)`). The others
render from their command line too; they are listed in UNCOVERED until their JSON records it.
"""

from __future__ import annotations

import pytest

from benchmarks.common.results import PAGES, RESULTS, render

UNCOVERED = {  # rendered from the JSON and the command line, or by an earlier version
    "autoscaler", "dp_routing", "gateway", "pd", "resume_identity", "router_cost", "routing",
    "sim_autoscaling", "sim_autoscaling-ramp", "sim_fidelity", "sim_history",
    "sim_pd_autoscaling", "sim_pd_autoscaling-ramp", "sim_placement", "simulator",
    "simulator-history",
    "h2h_before",  # the path before its rewrite, written by h2h.py at commit f3a2ed8
}


def test_every_results_file_is_covered_or_listed() -> None:
    names = {path.stem for path in RESULTS.glob("*.json")}
    assert names == set(PAGES) | UNCOVERED


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_page_is_its_scripts_rendering_of_the_json(name: str) -> None:
    assert render(name) == (RESULTS / f"{name}.md").read_text(), \
        f"the page was edited by hand, or its script changed: python -m benchmarks.common.results {name}"
