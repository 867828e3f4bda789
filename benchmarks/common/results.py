"""Where results live, and the one writer: a results file is its JSON, the Markdown page its
script renders from that JSON alone (`markdown(result)`), and a PNG where a curve says more.

`tests/unit/test_results_render.py` renders every committed page from its JSON again and
compares them byte for byte, so a page says nothing its JSON does not hold. After a change to a
script's `markdown`, `python -m benchmarks.common.results [NAME ...]` renders the pages again
from the committed JSON (all of `PAGES` without a name).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"  # Mooncake's public synthetic trace

PAGES = {  # results file (no suffix) -> the module whose markdown(result) renders its page
    "h2h": "benchmarks.h2h_report", "h2h-noreuse": "benchmarks.h2h_report",
    "h2h-noreuse-rr": "benchmarks.h2h_report", "h2h-unprioritised": "benchmarks.h2h_report",
    "channel_seal": "benchmarks.channel_seal", "lora": "benchmarks.lora_report", "port_fidelity": "benchmarks.port_fidelity",
    "soak": "benchmarks.soak", "soak-steady": "benchmarks.soak",
    "resume_identity": "benchmarks.resume_identity", "router_cost": "benchmarks.router_cost",
    "sim_fidelity": "benchmarks.sim_fidelity",
    "routing_at_scale": "benchmarks.simulated.routing_at_scale",
    "routing_at_scale-users": "benchmarks.simulated.routing_at_scale",
    "sim_pd": "benchmarks.simulated.sim_pd", "sim_speed": "benchmarks.simulated.sim_speed",
    "simulator": "benchmarks.simulated.simulator",
    "simulator-history": "benchmarks.simulated.simulator",
    "sim_history": "benchmarks.simulated.sim_history",
    "sim_placement": "benchmarks.simulated.sim_placement",
}


def command() -> str:
    """How this run was started, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def write(out: Path, result: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
          plot: Callable[[dict[str, Any], Path], None] | None = None) -> str:
    """Write `out` (.json), its page (.md) and, with `plot`, its figure (.png); return the page."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    page = markdown(result)
    out.with_suffix(".md").write_text(page)
    if plot is not None:
        plot(result, out.with_suffix(".png"))
    return page


def render(name: str) -> str:
    """The page `PAGES[name]`'s script renders from the committed `name.json`."""
    markdown = importlib.import_module(PAGES[name]).markdown
    return str(markdown(json.loads((RESULTS / f"{name}.json").read_text())))


def main() -> None:
    parser = argparse.ArgumentParser(description="Render results pages again from their JSON.")
    parser.add_argument("names", nargs="*", choices=[[], *sorted(PAGES)], metavar="NAME",
                        help=f"results files without suffix (default: all): {', '.join(PAGES)}")
    for name in parser.parse_args().names or sorted(PAGES):
        page, path = render(name), RESULTS / f"{name}.md"
        if path.read_text() != page:
            path.write_text(page)
            print(f"rendered {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
