#!/usr/bin/env bash
# The newcomer's path, timed: a fresh clone of REPO to a running local cluster with README's
# commands as written (setup-host, versions lock, build, cluster up), as root. One line per
# step in WORKDIR/path.log: "=== STEP: rc=N seconds=S", after the step's own output.
#
#   bench/newcomer_path.sh REPO WORKDIR [MIRROR]
#
# MIRROR: README's air-gapped fallback (`--artifact-mirror DIR` on lock and build), used when
# `versions lock` as written fails (no route to GitHub). The build gets an empty
# `--cache-dir WORKDIR/cache`, so it is cold whatever the machine's /var/cache/nodeforge holds.
# The build and the cluster hold /var/tmp/nf-e2e.lock (the e2e tier's lock); the cluster is
# README's (`--name` default) and is taken down at the end.
set -u
[ $# -ge 2 ] || { echo "usage: $0 REPO WORKDIR [MIRROR]" >&2; exit 2; }
REPO=$1 W=$2 MIRROR=${3:-}
LOG=$W/path.log
mkdir -p "$W" && : >"$LOG"

step() { # step NAME 'COMMAND': run COMMAND in bash from the clone, log output, status, seconds
  local name=$1 t0 rc
  t0=$(date +%s.%N)
  echo "=== $name: $2 (start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))" >>"$LOG"
  (cd "$W/clone" 2>/dev/null || cd "$W"; bash -c "$2") >>"$LOG" 2>&1
  rc=$?
  printf '=== %s: rc=%d seconds=%.1f\n' "$name" "$rc" "$(echo "$(date +%s.%N) - $t0" | bc)" >>"$LOG"
  return "$rc"
}

rm -rf "$W/clone" "$W/cache"
step clone "git clone -q '$REPO' '$W/clone'" || exit 1
step setup-host 'SUDO=$(command -v sudo); $SUDO scripts/setup-host.sh' || exit 1
MIR=()
if ! step versions-lock 'SUDO=$(command -v sudo); $SUDO .venv/bin/nodeforge versions lock'; then
  [ -n "$MIRROR" ] || exit 1
  MIR=(--artifact-mirror "$MIRROR")
  step versions-lock-mirror "SUDO=\$(command -v sudo); \$SUDO .venv/bin/nodeforge versions lock ${MIR[*]}" || exit 1
fi
exec 9>/var/tmp/nf-e2e.lock
echo "=== waiting for /var/tmp/nf-e2e.lock $(date -u +%H:%M:%S)" >>"$LOG"
flock 9
BUILD="SUDO=\$(command -v sudo); \$SUDO .venv/bin/nodeforge build ${MIR[*]} --cache-dir $W/cache"
step build-cold "$BUILD" || exit 1
step build-again "$BUILD"
step cluster-up '.venv/bin/nodeforge cluster up --computes 2 --join-interval 5'
step cluster-status '.venv/bin/nodeforge cluster status'
step sinfo ".venv/bin/nodeforge cluster exec ctl -- sinfo -R -o '%100E %12n %19H'"
step srun '.venv/bin/nodeforge cluster exec ctl -- srun -N2 hostname'
step cluster-down '.venv/bin/nodeforge cluster down'
echo "=== done $(date -u +%H:%M:%S)" >>"$LOG"
