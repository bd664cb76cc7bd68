#!/usr/bin/env bash
# The test command from the README: fast unit tier first (no root needed), then the e2e tier
# (root, real mmdebstrap/systemd-nspawn/packer/qemu/slurm). A missing tool fails, never skips.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m pytest -m unit -q -p no:cacheprovider tests/unit "$@"
if [ "$(id -u)" -ne 0 ]; then
  echo "test: the e2e tier needs root; re-run with sudo" >&2
  exit 2
fi
"$PY" -m pytest -m e2e -v -p no:cacheprovider --durations=25 tests/e2e tests/unit "$@"
