#!/usr/bin/env bash
# GPU checks that need real NVIDIA GPUs: run on a GPU compute node booted from the gpu image
# (`nodeforge build --variant gpu`) after `nodeforge node init` made it ready, as root.
# Prints each result; exits non-zero on the first check that fails, naming it.
#
#   sudo scripts/gpu-check.sh [--partition P] [--image docker://ubuntu:24.04]
#
# 1. detection: driver/module for this kernel, nvidia-smi, persistence mode, fabric manager
# 2. GRES: what slurmd autodetected with NVML (slurmd -G) and what slurmctld has for the node
# 3. a --gpus=1 job sees exactly one device (cgroup ConstrainDevices)
# 4. Enroot with the NVIDIA hook: nvidia-smi -L inside a container started with enroot
# 5. nodeforge node health (and its report), and the FIXTURE-format outputs for tests/fixtures/gpu
set -euo pipefail

PARTITION=""
IMAGE="docker://ubuntu:24.04"
while [ $# -gt 0 ]; do
  case "$1" in
    --partition) PARTITION=$2; shift 2 ;;
    --image) IMAGE=$2; shift 2 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${GPU_CHECK_OUT:-/var/tmp/nodeforge-gpu-check}
mkdir -p "$OUT"
NODE=$(python3 -c 'import json; print(json.load(open("/var/lib/nodeforge/params.json"))["node"])')
step() { printf '\n== %s\n' "$*"; }
fail() { echo "gpu-check: FAILED: $*" >&2; exit 1; }

step "1. detection"
uname -r
modinfo -F version nvidia || fail "no nvidia module for kernel $(uname -r) (see /etc/nodeforge/gpu.json)"
cat /etc/nodeforge/gpu.json
nvidia-smi -L || fail "nvidia-smi cannot list GPUs"
nvidia-smi --query-gpu=index,pci.bus_id,uuid,persistence_mode,ecc.errors.uncorrected.volatile.total,name \
  --format=csv,noheader,nounits | tee "$OUT/nvidia-smi-query.csv"
systemctl is-active nvidia-persistenced.service || fail "nvidia-persistenced is not active"
echo "fabric manager: $(systemctl is-active nvidia-fabricmanager.service || true) (skipped by its ExecCondition where there is no NVSwitch)"
journalctl -k -o cat --grep 'NVRM: Xid' -b > "$OUT/kmsg-xid.txt" || true

step "2. GRES"
GPUS=$(nvidia-smi -L | grep -c '^GPU ')
slurmd -G 2>&1 | tee "$OUT/slurmd-G.txt" || true
scontrol show node "$NODE" | tee "$OUT/scontrol-node.txt" | grep -E 'Gres=|State='
grep -q "Gres=gpu:[^ ]*$GPUS" "$OUT/scontrol-node.txt" || fail "slurmctld does not list $GPUS GPUs for $NODE"

step "3. a --gpus=1 job sees exactly one device"
SEEN=$(srun ${PARTITION:+-p "$PARTITION"} -w "$NODE" --gpus=1 -t 5 nvidia-smi -L | grep -c '^GPU ')
echo "devices seen by the job: $SEEN"
[ "$SEEN" -eq 1 ] || fail "a --gpus=1 job sees $SEEN devices (cgroup ConstrainDevices?)"
srun ${PARTITION:+-p "$PARTITION"} -w "$NODE" --gpus=1 -t 5 printenv CUDA_VISIBLE_DEVICES

step "4. Enroot with the NVIDIA hook"
ls /etc/enroot/hooks.d/ /usr/share/enroot/hooks.d/ 2>/dev/null || true
nvidia-container-cli info | head -5 || fail "nvidia-container-cli info (libnvidia-container) fails"
WORK=$(mktemp -d)
trap 'enroot remove -f nodeforge-gpu-check >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
enroot import -o "$WORK/img.sqsh" "$IMAGE"
enroot create -n nodeforge-gpu-check "$WORK/img.sqsh"
NVIDIA_VISIBLE_DEVICES=all enroot start nodeforge-gpu-check nvidia-smi -L || fail "nvidia-smi inside enroot (98-nvidia hook)"

step "5. node health"
time /usr/local/bin/nodeforge node health --no-slurm --json | tee "$OUT/health.json"
cat /var/lib/nodeforge/gang/nodeforge_health.prom
echo
echo "gpu-check: all checks passed on $NODE ($GPUS GPUs); outputs in $OUT (real recordings for tests/fixtures/gpu)"
