#!/bin/bash
# nodeforge's LifeCycleConfig.OnCreate for SageMaker HyperPod (docs/hyperpod.md).
#
# HyperPod copies the SourceS3Uri prefix (this script, provisioning_parameters.json and, if
# you put it there, munge.key) to the node and runs this script as root from that copy, after
# the nodeforge AMI booted. nodeforge-init.service already ran at boot and found no params
# (HyperPod's files were not in place yet); this script puts them where the agent reads them
# and runs the agent again. Everything else (role, Slurm, the site's extension hooks, the
# readiness gate, drains with a reason) is nodeforge's own path.
#
# NODEFORGE_ROOT (empty on a node) prefixes every path this script writes; tests set it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=${NODEFORGE_ROOT:-}
conf="$root/opt/ml/config"
secrets="$root/etc/nodeforge/secrets"
# HyperPod names its resource config in this variable; its default place otherwise.
rc_src=${SAGEMAKER_RESOURCE_CONFIG_PATH:-$conf/resource_config.json}

fail() { echo "nodeforge on_create: $*" >&2; exit 1; }
[ -f "$rc_src" ] || fail "HyperPod's resource config $rc_src is missing (SAGEMAKER_RESOURCE_CONFIG_PATH)"
[ -f "$here/provisioning_parameters.json" ] || fail "provisioning_parameters.json is not in the SourceS3Uri prefix ($here)"

# Root-only copies: the agent accepts secrets (munge_key_file) only from root-only files.
umask 077
install -d -m 0755 "$conf"
if [ "$rc_src" != "$conf/resource_config.json" ]; then
    install -m 0600 "$rc_src" "$conf/resource_config.json.new"
    mv -f "$conf/resource_config.json.new" "$conf/resource_config.json"
fi
install -m 0600 "$here/provisioning_parameters.json" "$conf/provisioning_parameters.json.new"
if [ -f "$here/munge.key" ]; then
    install -d -m 0700 "$secrets"
    install -m 0400 "$here/munge.key" "$secrets/munge.key.new"
    mv -f "$secrets/munge.key.new" "$secrets/munge.key"
fi
# The params file last, so the agent never sees params whose munge key is not there yet.
mv -f "$conf/provisioning_parameters.json.new" "$conf/provisioning_parameters.json"

# nodeforge's path: the agent under its unit (journal, timeout, resume from its state file).
# A failure (a refused param, a failed hook) leaves the node drained with the reason in
# `sinfo -R`, and this script fails with it, so HyperPod reports the node's creation failure.
exec systemctl restart nodeforge-init.service
