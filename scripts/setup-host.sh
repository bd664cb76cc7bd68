#!/usr/bin/env bash
# Prepare a fresh Debian 12/13 or Ubuntu 22.04+ machine to build nodeforge images and run
# its tests: system packages (from .ci/apt-packages.txt) and a venv with nodeforge in it.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "setup-host: run as root (it installs system packages): sudo $0" >&2
  exit 2
fi
export DEBIAN_FRONTEND=noninteractive
mapfile -t pkgs < <(grep -Ev '^\s*(#|$)' .ci/apt-packages.txt | sort -u)
echo "setup-host: apt-get install ${pkgs[*]}"
apt-get update
apt-get install -y --no-install-recommends "${pkgs[@]}"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --upgrade pip
.venv/bin/python -m pip install -e '.[dev]'
echo "setup-host: ready (.venv/bin/nodeforge)"
