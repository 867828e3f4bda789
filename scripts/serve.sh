#!/usr/bin/env bash
# Set up, start a local Ray head, and serve deploy/topologies/local.yaml on
# http://127.0.0.1:8000/v1 until Ctrl-C (which removes the deployment and stops Ray).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TOKENFAB_VENV:-.venv}/bin/tokenfab" up "${1:-deploy/topologies/local.yaml}" --foreground
