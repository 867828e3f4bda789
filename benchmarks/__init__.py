"""Benchmarks: real-engine runs at the top, simulator studies in `simulated/`, and what they
share (client, traces, statistics, results writer, cluster harness) in `common/`.

Run a script from the repository root, as a file or a module: `python benchmarks/h2h.py` or
`python -m benchmarks.h2h`. Scripts import each other as `benchmarks.*` modules (the package is
part of the editable install `scripts/setup.sh` makes), never through `sys.path`.
"""
