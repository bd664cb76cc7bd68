"""The image option that keeps the instance metadata service root-only (role node_agent,
node_agent_imds_root_only): the rendered nftables ruleset, checked by `nft -c` in a fresh
network namespace, and the agent's reading of it. Nothing here contacts 169.254.169.254."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.unit.support import ROLES_DIR, ansible_render

pytestmark = pytest.mark.unit


def rules() -> str:
    return ansible_render(
        "node_agent", "imds-root-only.nft.j2", {"node_agent_imds_root_only": True}
    )


def test_ruleset_drops_non_root_to_imds_only():
    text = rules()
    body = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert body[:2] == [
        "table inet nodeforge_imds",
        "delete table inet nodeforge_imds",
    ]  # reload-safe
    drops = [ln for ln in body if ln.endswith("drop")]
    assert drops == [
        "ip daddr 169.254.169.254 meta skuid != 0 counter drop",
        "ip6 daddr fd00:ec2::254 meta skuid != 0 counter drop",
        "ip daddr 169.254.169.254 counter drop",  # forward: containers behind a bridge
        "ip6 daddr fd00:ec2::254 counter drop",
    ]
    # Both chains accept everything else: the guard blocks nothing but IMDS.
    assert len(re.findall(r"policy accept;", text)) == 2 and "policy drop" not in text


def test_ruleset_passes_nft_check():
    nft, unshare = shutil.which("nft"), shutil.which("unshare")
    if not nft or not unshare:
        pytest.fail("required tools missing: nft (apt-get install nftables), unshare (util-linux)",
                    pytrace=False)  # fmt: skip
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"nodeforge-imds-{os.getpid()}.nft")
    with open(path, "w") as f:
        f.write(rules())
    try:
        # A fresh network namespace (user namespace too when not root): the check cannot touch
        # this machine's firewall, and -c never commits anyway.
        ns = ["-n"] if os.geteuid() == 0 else ["-rn"]
        res = subprocess.run([unshare, *ns, nft, "-c", "-f", path], capture_output=True, text=True,
                             timeout=30, check=False)  # fmt: skip
    finally:
        os.unlink(path)
    assert res.returncode == 0, res.stderr


def test_unit_loads_rules_before_network_and_agent():
    unit = ansible_render("node_agent", "nodeforge-imds-guard.service.j2")
    assert "ExecStart=/usr/sbin/nft -f /etc/nodeforge/imds-root-only.nft" in unit
    assert re.search(r"^Before=network-pre\.target nodeforge-init\.service", unit, re.MULTILINE)
    assert "RequiredBy=nodeforge-init.service" in unit and "DefaultDependencies=no" in unit


def test_option_off_by_default_and_path_matches_agent():
    from nodeforge.bootstrap.params_sources import IMDS_GUARD_RULES

    d = yaml.safe_load((ROLES_DIR / "node_agent/defaults/main.yml").read_text())
    assert d["node_agent_imds_root_only"] is False
    assert d["node_agent_imds_rules"] == str(IMDS_GUARD_RULES)
    tasks = (ROLES_DIR / "node_agent/tasks/install.yml").read_text()
    assert tasks.count("when: node_agent_imds_root_only") == 3
