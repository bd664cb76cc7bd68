#!/usr/bin/env bash
# The test command from the README: fast unit tier first (no root needed), then the e2e tier
# (root, real mmdebstrap/systemd-nspawn/packer/qemu/slurm). A missing tool fails, never skips.
#
# The e2e tier runs in lanes (tests/e2e/lanes.txt says which and why): the build lane first and
# alone, as one pytest; then every other lane at the same time, each its own pytest with its own
# E2E dir and the build lane's image, each of its lines prefixed with `[lane]` and kept whole in
# $NODEFORGE_E2E_DIR/lane-NAME.log. Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m pytest -m unit -q -p no:cacheprovider tests/unit "$@"
if [ "$(id -u)" -ne 0 ]; then
  echo "test: the e2e tier needs root; re-run with sudo" >&2
  exit 2
fi

E2E=(-m e2e -v -p no:cacheprovider --durations=25)
LANES=tests/e2e/lanes.txt
base=${NODEFORGE_E2E_DIR:-/var/tmp/nodeforge-e2e}
lane_paths() { sed -n "s/^$1: //p" "$LANES"; }
start=$(date +%s)

# 5 is pytest's "no tests collected": a lane that lost its tests fails, unless arguments chose
# the tests (`scripts/test.sh -k NAME` selects from every lane).
lane_failed() { [ "$1" -ne 0 ] && { [ "$1" -ne 5 ] || [ "$2" -eq 0 ]; }; }

rc=0
# shellcheck disable=SC2046  # the lane's paths are words
NODEFORGE_E2E_DIR=$base "$PY" -m pytest "${E2E[@]}" $(lane_paths build) "$@" || rc=$?
build_rc=$rc
echo "e2e: lane build ended with exit $build_rc after $(( $(date +%s) - start ))s"
lane_failed "$rc" $# || rc=0
image=${NODEFORGE_E2E_IMAGE:-$base/image}
if [ ! -f "$image/manifest.json" ]; then
  echo "e2e: the build lane left no image at $image; the other lanes boot it, so they did not run" >&2
  exit 1
fi

# Job control: each lane in its own process group, so that an interrupt (Ctrl-C here, or a
# TERM from CI) is passed on as SIGINT to every lane and their tests clean up their VMs,
# clusters and mounts as on Ctrl-C.
set -m
pids=()
names=()
for name in $(sed -n 's/^\([a-z0-9-]*\): .*/\1/p' "$LANES" | grep -vx build); do
  mkdir -p "$base/lane-$name"
  # shellcheck disable=SC2046
  NODEFORGE_E2E_DIR="$base/lane-$name" NODEFORGE_E2E_IMAGE="$image" \
    "$PY" -m pytest "${E2E[@]}" $(lane_paths "$name") "$@" \
    > >(tee "$base/lane-$name.log" | sed -u "s/^/[$name] /") 2>&1 &
  pids+=("$!")
  names+=("$name")
done
trap 'for p in "${pids[@]}"; do kill -INT -- "-$p" 2>/dev/null || true; done' INT TERM

lane_rcs=()
for i in "${!pids[@]}"; do
  r=0
  wait "${pids[$i]}" || r=$?
  # an interrupt ends `wait` early: wait on until the lane has cleaned up and exited
  while kill -0 "${pids[$i]}" 2>/dev/null; do
    r=0
    wait "${pids[$i]}" || r=$?
  done
  lane_rcs+=("$r")
done
trap - INT TERM
wait  # the output filters: every lane's last lines are printed before the summary
echo "e2e: lanes finished after $(( $(date +%s) - start ))s (build lane: exit $build_rc)"
for i in "${!names[@]}"; do
  log="$base/lane-${names[$i]}.log"
  echo "e2e: lane ${names[$i]} ended with exit ${lane_rcs[$i]}: $(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -n 1)"
  grep -E '^(FAILED|ERROR) ' "$log" | sed "s/^/e2e:   [${names[$i]}] /" || true
  if lane_failed "${lane_rcs[$i]}" $# && [ "$rc" -eq 0 ]; then
    rc=${lane_rcs[$i]}
  fi
done
exit "$rc"
