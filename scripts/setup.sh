#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv. The Dockerfile and CI run this same script.
# torch goes in first and pinned: an unpinned torch would pull a multi-GB CUDA build. The two
# distributions of the repository go in last, editable and without dependencies (those came from
# requirements/): the client SDK (raincheck_client/, raincheck-client) and the server (raincheck-serve).
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install -c requirements/constraints.txt "torch==2.13.0"
"${PIP[@]}" install -c requirements/constraints.txt -r requirements/runtime.txt -r requirements/dev.txt
"${PIP[@]}" install -c requirements/constraints.txt --no-deps -e ./raincheck_client -e .
touch "$VENV/.installed"
