#!/bin/bash
# Example site extension in HyperPod's OnInitComplete shape, run by nodeforge as a hook
# (provisioning_parameters.json: nodeforge.hooks[] = {uri: s3://…/site/, script: this file}).
# nodeforge syncs the s3:// prefix with the instance role's credentials and runs this script
# inside the copy, after the role step and BEFORE the node may take a job; a non-zero exit
# leaves the node drained with "hook 60-site …" in `sinfo -R`. Environment: NODEFORGE_ROLE,
# NODEFORGE_CLUSTER, NODEFORGE_NODE, NODEFORGE_CONTROLLER, NODEFORGE_PARAMS (extensions/README.md).
set -euo pipefail
echo "site extension on $NODEFORGE_NODE ($NODEFORGE_ROLE) of $NODEFORGE_CLUSTER"
# e.g. mount the cluster's FSx for Lustre: HyperPod's fsx_dns_name/fsx_mountname reach hooks
# under extra.hyperpod in the JSON file NODEFORGE_PARAMS names:
#   jq -r .extra.hyperpod.fsx_dns_name "$NODEFORGE_PARAMS"
