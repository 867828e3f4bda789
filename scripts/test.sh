#!/usr/bin/env bash
# Set up, then run the whole suite: unit tests, then real engines on a local Ray cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TOKENFAB_VENV:-.venv}/bin/python" -m pytest "$@"
