"""Identity step: SSH host keys, machine-id, hostname, /etc/hosts, the cluster users' keypair.

All of these are sealed out of the image; each is created only if absent, so a rerun is a no-op.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic

from .host import Host, private_dir
from .params import Params, is_hostname, is_ip, is_node_name
from .paths import Paths

HOSTS_BEGIN = "# BEGIN nodeforge (managed by nodeforge node init)"
HOSTS_END = "# END nodeforge"


KEYGEN_UNIT = "nodeforge-ssh-keygen.service"


def host_keys_present(paths: Paths) -> bool:
    return any(paths.ssh_etc.glob("ssh_host_*_key"))


def keygen_unit_installed(paths: Paths) -> bool:
    """The image's first-boot unit makes the host keys, in parallel with the agent (ordered only
    before sshd). The agent then leaves them to it: two `ssh-keygen -A` at once could pair one
    run's private key with the other's public key, and waiting for it delays readiness."""
    return (paths.systemd_etc / KEYGEN_UNIT).is_file()


def machine_id_present(paths: Paths) -> bool:
    try:
        return bool(paths.machine_id.read_text().strip())
    except OSError:
        return False


def node_name(params: Params, current_hostname: str) -> str:
    """params.node_name (validated), else the first label of the hostname, which comes from
    outside too (DHCP, cloud-init) and must be a hostname label before Slurm sees it."""
    if params.node_name:
        return params.node_name
    name = current_hostname.split(".")[0]
    if not is_node_name(name):
        raise NodeforgeError(
            f"hostname {current_hostname!r}: {name!r} is not a usable node name (one RFC 1123 "
            "label: a-z, 0-9, inner '-'); set node_name in params"
        )
    return name


def users_keypair_paths(paths: Paths) -> tuple[Path, Path]:
    return paths.secrets / "users_id_ed25519", paths.secrets / "users_id_ed25519.pub"


def run(host: Host, paths: Paths, params: Params, hostname: str, hosts: dict[str, str]) -> dict:
    """Create what is missing. *hosts* maps names to addresses for the managed /etc/hosts block."""
    done: dict[str, object] = {}
    if not host_keys_present(paths) and not keygen_unit_installed(paths):
        argv = ["ssh-keygen", "-A"]
        if paths.root != Path("/"):
            argv += ["-f", str(paths.root)]
        paths.ssh_etc.mkdir(parents=True, exist_ok=True)
        host.run(argv, timeout=120)
        done["ssh_host_keys"] = "generated"
    if not machine_id_present(paths):
        argv = ["systemd-machine-id-setup"]
        if paths.root != Path("/"):
            argv.append(f"--root={paths.root}")
        host.run(argv, timeout=60)
        done["machine_id"] = "generated"
    name = node_name(params, hostname)
    if params.node_name and (_read(paths.hostname_file) != name or hostname != name):
        write_atomic(paths.hostname_file, name + "\n", 0o644)
        host.sethostname(name)
        done["hostname"] = name
    if hosts and update_hosts(paths.hosts_file, hosts):
        done["hosts"] = sorted(hosts)
    if params.users_keypair is not None:
        priv, pub = users_keypair_paths(paths)
        private_dir(paths.secrets)
        changed = write_atomic(priv, params.users_keypair.private, 0o600)
        changed |= write_atomic(pub, params.users_keypair.public + "\n", 0o644)
        if changed:
            done["users_keypair"] = str(priv)
    return done


def install_admin_keys(paths: Paths, keys: tuple[str, ...]) -> list[str]:
    """Add the instance's admin keys (IMDS public-keys, already checked one key line each) to
    root's authorized_keys, as cloud-init does for the default user; lines already there stay.

    Part of the identity step, so it runs once per node: a key the operator removed later is
    not put back at the next boot. Returns the keys added."""
    if not keys:
        return []
    ssh_dir = private_dir(paths.root_ssh)
    auth = ssh_dir / "authorized_keys"
    try:
        st = auth.lstat()
        if not auth.is_file() or auth.is_symlink():
            raise NodeforgeError(f"{auth}: not a regular file; remove it and boot again")
        if st.st_size > 1 << 20:
            raise NodeforgeError(f"{auth}: over 1 MiB; not an authorized_keys file")
        text = auth.read_text(errors="replace")
    except FileNotFoundError:
        text = ""
    have = {ln.strip() for ln in text.splitlines()}
    new = [k for k in keys if k not in have]
    if new:
        body = (text.rstrip("\n") + "\n" if text.strip() else "") + "\n".join(new) + "\n"
        write_atomic(auth, body, 0o600)
    return new


def verify(paths: Paths, params: Params, hostname: str, hosts: dict[str, str]) -> bool:
    if not machine_id_present(paths):
        return False
    if not (host_keys_present(paths) or keygen_unit_installed(paths)):
        return False
    if params.node_name and hostname != params.node_name:
        return False
    if hosts and _hosts_text(_read(paths.hosts_file), hosts) != _read(paths.hosts_file):
        return False  # someone rewrote /etc/hosts: the controller's name must resolve
    return params.users_keypair is None or users_keypair_paths(paths)[0].exists()


def update_hosts(path: Path, entries: dict[str, str]) -> bool:
    """Keep a managed block `address name` in /etc/hosts; other lines are left alone."""
    text = _read(path)
    new = _hosts_text(text, entries)
    if new == text:
        return False
    write_atomic(path, new, 0o644)
    return True


def hosts_lines(entries: dict[str, str]) -> list[str]:
    """`address name` lines; each name must be a hostname and each address an IP, so a line
    is exactly two fields (no newline, comment or extra alias can ride in on a value)."""
    out = []
    for name, addr in sorted(entries.items()):
        if not is_ip(addr):
            raise NodeforgeError(f"/etc/hosts: {name}: {addr!r} is not an IP address")
        if not is_hostname(name):
            raise NodeforgeError(f"/etc/hosts: {name!r} is not a hostname (RFC 1123)")
        out.append(f"{addr} {name}")
    return out


def parse_hosts_block(text: str) -> dict[str, list[str]]:
    """The managed block read back: address -> names (what the resolver would see)."""
    m = re.search(re.escape(HOSTS_BEGIN) + r"\n(.*?)" + re.escape(HOSTS_END), text, re.DOTALL)
    out: dict[str, list[str]] = {}
    for ln in (m.group(1) if m else "").splitlines():
        fields = ln.split("#", 1)[0].split()
        if fields:
            out.setdefault(fields[0], []).extend(fields[1:])
    return out


def _hosts_text(text: str, entries: dict[str, str]) -> str:
    block = "\n".join([HOSTS_BEGIN, *hosts_lines(entries), HOSTS_END])
    pat = re.compile(re.escape(HOSTS_BEGIN) + r".*?" + re.escape(HOSTS_END), re.DOTALL)
    if pat.search(text):
        return pat.sub(lambda _m: block, text)
    return (text.rstrip("\n") + "\n" if text.strip() else "") + block + "\n"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip("\n") if path.name == "hostname" else path.read_text()
    except OSError:
        return ""


def local_networks(host: Host) -> list[ipaddress.IPv4Network]:
    """The IPv4 subnets of this node's interfaces (`ip -o -4 addr show`), for the broadcast
    address of each; [] when `ip` is missing or says nothing."""
    try:
        cp = host.run(["ip", "-o", "-4", "addr", "show"], check=False, timeout=10)
    except NodeforgeError:
        return []
    out = []
    for line in (cp.stdout or "").splitlines()[:1024]:
        words = line.split()
        if "inet" in words[:-1]:
            try:
                out.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
            except ValueError:
                continue
    return [n for n in out if isinstance(n, ipaddress.IPv4Network)]


def detect_address(host: Host, target: str) -> str:
    """This node's address: the source of the route to *target* (nothing is sent), else the
    first IPv4 address `hostname -I` reports."""
    import ipaddress

    if target:
        try:
            ipaddress.ip_address(target)
        except ValueError:
            target = ""
    if target:
        src = host.source_address(target)
        if src and not src.startswith("127."):
            return src
    cp = host.run(["hostname", "-I"], check=False, timeout=10)
    addrs = [a for a in (cp.stdout or "").split() if ":" not in a]
    if not addrs:
        raise NodeforgeError(
            "cannot find this node's address (no route to the controller, `hostname -I` empty); "
            "set node_address in params"
        )
    return addrs[0]
