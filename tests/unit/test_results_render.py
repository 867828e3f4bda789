"""A committed results page is what its script renders from the committed JSON beside it, byte
for byte: nobody edited the page by hand, and the JSON holds everything the page says.

Covered: the scripts whose page is a function of the JSON alone (`markdown(result)`). The others
render from their command line too; they are listed in UNCOVERED until their JSON records it.
"""

from __future__ import annotations

import pytest

from benchmarks.common.results import PAGES, RESULTS, render

UNCOVERED = {  # rendered from the JSON and the command line, or by an earlier version
    # their JSON lacks arguments the page shows; the scripts record their `args` now, so the
    # next run of each covers it
    "autoscaler",  # --phases, --quiet-rps, --burst-rps, --engine-share, --ttft-slo, --itl-slo
    "dp_routing", "routing",  # --kv-cache
    "gateway",  # --requests, --seconds
    "pd",  # --seconds (its title)
    # their JSON lacks --min, --max and --rise (sim_pd_autoscaling's also --pd-max and
    # --pd-static), which the page's command line shows; the scripts record their `args` now, so
    # the next run of each (about 20 and 40 min) covers it
    "sim_autoscaling", "sim_autoscaling-ramp", "sim_pd_autoscaling", "sim_pd_autoscaling-ramp",
    "h2h_before",  # the path before its rewrite, written by h2h.py at commit f3a2ed8
}


def test_every_results_file_is_covered_or_listed() -> None:
    names = {path.stem for path in RESULTS.glob("*.json")}
    assert names == set(PAGES) | UNCOVERED


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_page_is_its_scripts_rendering_of_the_json(name: str) -> None:
    assert render(name) == (RESULTS / f"{name}.md").read_text(), \
        f"the page was edited by hand, or its script changed: python -m benchmarks.common.results {name}"
