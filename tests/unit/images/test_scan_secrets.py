"""The image scanner's secret classes (issue 23, item 9): each planted in a fake image tree is
a finding that names the file and the rule, never the value; each near miss is not a finding.
Key-shaped text and secret values are made at run time: none is in git."""

from __future__ import annotations

import base64
import codecs
import hashlib
import os
from pathlib import Path

import pytest

from nodeforge.images import scan, sealed_items
from tests.helpers import dpkg_ship, fake_image_tree

pytestmark = pytest.mark.unit

BEGIN = "-----BEGIN "
PRIV = "PRIVATE KEY-----"


def _secret(n: int = 30) -> str:
    """A fresh value in the alphabet cloud keys use (base64), different every run."""
    return base64.b64encode(os.urandom(n)).decode()


def _plant(t: Path, rel: str, data: str | bytes) -> None:
    p = t / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        p.write_text(data)
    else:
        p.write_bytes(data)


def _found(t: Path, secret: str = "") -> dict[str, str]:
    """{path: rule} of the scan; no finding's text holds *secret*."""
    findings = scan.scan(t)
    for f in findings:
        if secret:
            assert secret not in str(f) and secret not in repr(f), f"{f.kind} echoes the value"
    return {f.path: f.kind for f in findings}


# -- Kubernetes ------------------------------------------------------------------------------


def _jwt() -> str:
    def part(d: bytes) -> str:
        return base64.urlsafe_b64encode(d).decode().rstrip("=")

    return ".".join(
        (
            part(b'{"alg":"RS256","kid":"k1"}'),
            part(b'{"iss":"kubernetes/serviceaccount"}'),
            part(os.urandom(64)),
        )
    )


def test_kubeconfig_credentials(tmp_path):
    t = fake_image_tree(tmp_path)
    tok, key = _secret(24), base64.b64encode(f"{BEGIN}EC {PRIV}\nxx".encode()).decode()
    _plant(
        t,
        "root/.kube/config",
        f"apiVersion: v1\nkind: Config\nusers:\n- name: a\n  user:\n    token: {tok}\n",
    )
    _plant(
        t, "etc/kubernetes/admin.conf", f"users:\n- name: b\n  user:\n    client-key-data: {key}\n"
    )
    _plant(t, "opt/site/cluster-kubeconfig", f"users:\n- user:\n    id-token: '{tok}'\n")
    _plant(t, "srv/sa/token", _jwt())  # a service-account token copied anywhere
    _plant(t, "var/run/secrets/kubernetes.io/serviceaccount/token", "x")
    found = _found(t, tok)
    assert found == {
        "/root/.kube/config": "kube-credential",
        "/etc/kubernetes/admin.conf": "kube-credential",
        "/opt/site/cluster-kubeconfig": "kube-credential",
        "/srv/sa/token": "bearer-jwt",
        "/var/run/secrets/kubernetes.io/serviceaccount/token": "kube-service-account",
    }


def test_kubeconfig_near_misses(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(
        t,
        "root/.kube/config",
        'users:\n- user:\n    token: ""\n    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n',
    )
    _plant(
        t,
        "etc/kubernetes/kubelet.conf",
        "users:\n- user:\n    client-key: /var/lib/kubelet/pki/kubelet-client-current.pem\n",
    )
    _plant(t, "opt/app/settings.yaml", 'auth:\n  token_ttl: 3600\n  token: "{{ vault_token }}"\n')
    _plant(
        t, "opt/app/README", "a JWT starts with eyJ and has three parts: eyJhbGciOi.eyJzdWIi.sig\n"
    )
    _plant(t, "var/run/secrets/kubernetes.io/serviceaccount/token", "")  # empty mount point
    assert _found(t) == {}


# -- s3cmd -----------------------------------------------------------------------------------


def test_s3cfg_keys(tmp_path):
    t = fake_image_tree(tmp_path)
    s = _secret()
    _plant(t, "root/.s3cfg", f"[default]\naccess_key = AKIA{_secret(12)}\nsecret_key = {s}\n")
    _plant(t, "home/ops/.s3cfg", f"[default]\nsecret_key={s}\n")
    assert _found(t, s) == {"/root/.s3cfg": "s3cfg-key", "/home/ops/.s3cfg": "s3cfg-key"}


def test_s3cfg_near_miss(tmp_path):
    t = fake_image_tree(tmp_path)
    # s3cmd's own template: every credential empty; a non-s3cfg file with secret_key is code
    _plant(
        t,
        "root/.s3cfg",
        "[default]\naccess_key = \nsecret_key =\naccess_token = \nhost_base = s3.amazonaws.com\n",
    )
    _plant(t, "opt/app/conf.py", "secret_key = load_from_vault()\n")
    assert _found(t) == {}


# -- shell rc and environment files ----------------------------------------------------------


@pytest.mark.parametrize(
    "rel, line",
    [
        ("root/.bashrc", "export AWS_SECRET_ACCESS_KEY={v}\n"),
        ("home/ops/.profile", 'export AWS_SESSION_TOKEN="{v}"\n'),
        ("etc/profile.d/cloud.sh", "AZURE_CLIENT_SECRET='{v}'; export AZURE_CLIENT_SECRET\n"),
        ("etc/environment", "PATH=/usr/bin\nAZURE_STORAGE_KEY={v}\n"),
        ("etc/bash.bashrc", "export ARM_CLIENT_SECRET={v}\n"),
        ("home/ops/.zshrc", "export GOOGLE_API_KEY={v}\n"),
        (
            "etc/systemd/system/app.service.d/env.conf",
            "[Service]\nEnvironment=AWS_SECRET_ACCESS_KEY={v}\n",
        ),
        ("etc/boto.cfg", "[Credentials]\naws_secret_access_key = {v}\n"),
        (
            "opt/app/.env",
            "AZURE_STORAGE_CONNECTION_STRING=DefaultEndpointsProtocol=https;AccountName=a;AccountKey={v}\n",
        ),
    ],
)
def test_cloud_keys_in_rc_and_env_files(tmp_path, rel, line):
    t = fake_image_tree(tmp_path)
    v = _secret()
    _plant(t, rel, "# site settings\n" + line.format(v=v))
    found = _found(t, v)
    assert list(found) == [f"/{rel}"]
    assert found[f"/{rel}"] in {"cloud-env-key", "cloud-ini-key"}


def test_google_credentials_pointing_at_a_key_in_the_image(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "root/.bashrc", "export GOOGLE_APPLICATION_CREDENTIALS=/etc/gcp/sa.json\n")
    sa = f'{{"type": "service_account", "private_key": "{BEGIN}{PRIV}\\nMIIE\\n"}}'
    _plant(t, "etc/gcp/sa.json", sa)
    assert _found(t) == {"/etc/gcp/sa.json": "private-key"}


def test_cloud_key_near_misses(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(
        t,
        "root/.bashrc",
        'export AWS_SECRET_ACCESS_KEY="$(cat /run/secrets/aws)"\n'
        "export AWS_SESSION_TOKEN=$TOKEN_FROM_IMDS\n"
        "export AZURE_CLIENT_SECRET=\n"
        ': "${ARM_CLIENT_SECRET:?set it at runtime}"\n'
        "export GOOGLE_APPLICATION_CREDENTIALS=/run/secrets/gcp.json\n",  # not in the image
    )
    _plant(
        t,
        "etc/profile.d/aws.sh",
        "export AWS_DEFAULT_REGION=eu-west-1\nexport AWS_ACCESS_KEY_ID_FILE=/run/k\n",
    )
    _plant(
        t, "opt/app/s3.py", "client = boto3.client(\n    aws_secret_access_key=creds.secret,\n)\n"
    )
    assert _found(t) == {}


# -- PuTTY -----------------------------------------------------------------------------------


def test_putty_key(tmp_path):
    t = fake_image_tree(tmp_path)
    body = _secret(48)
    _plant(
        t,
        "home/ops/work.ppk",
        "PuTTY-User-Key-File-3: ssh-ed25519\r\nEncryption: none\r\nComment: ops\r\n"
        f"Public-Lines: 2\r\nAAAA\r\nBBBB\r\nPrivate-Lines: 1\r\n{body}\r\n",
    )
    found = scan.scan(t)
    assert [(f.path, f.kind) for f in found] == [("/home/ops/work.ppk", "putty-key")]
    assert body not in str(found[0]) and "PuTTY-User-Key-File-3" in str(found[0])


def test_putty_near_miss(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(
        t,
        "opt/doc/keys.txt",
        "Convert a file that starts with PuTTY-User-Key-File-3 using puttygen.\n",
    )
    _plant(t, "home/ops/.ssh/known.pub", "ssh-ed25519 AAAAC3Nza ops@host\n")
    assert _found(t) == {}


# -- UTF-16 PEM ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("bom", [True, False])
@pytest.mark.parametrize("lead", [0, 1, 7])  # bytes before the text: either alignment
def test_utf16_pem(tmp_path, codec, bom, lead):
    t = fake_image_tree(tmp_path)
    pem = f"{BEGIN}RSA {PRIV}\nMIIEowIBAAKCAQEA\n-----END RSA {PRIV}\n"
    data = (
        os.urandom(lead)
        + ((codecs.BOM_UTF16_LE if codec.endswith("le") else codecs.BOM_UTF16_BE) if bom else b"")
        + pem.encode(codec)
    )
    _plant(t, "opt/site/tls.key", data)
    found = scan.scan(t)
    assert [(f.path, f.kind) for f in found] == [("/opt/site/tls.key", "private-key")]
    assert "RSA" in found[0].detail


def test_utf16_pem_across_a_block_boundary(tmp_path):
    t = fake_image_tree(tmp_path)
    key = f"{BEGIN}{PRIV}".encode("utf-16-le")
    data = b"\x01\0" * (((1 << 20) - 20) // 2) + key  # straddles the first 1 MiB block
    _plant(t, "var/lib/blob.bin", data)
    assert _found(t) == {"/var/lib/blob.bin": "private-key"}


def test_utf16_near_miss(tmp_path):
    t = fake_image_tree(tmp_path)
    pub = f"{BEGIN}PUBLIC KEY-----\nMFkwEw\n-----END PUBLIC KEY-----\n"
    _plant(t, "opt/site/tls.pub", codecs.BOM_UTF16_LE + pub.encode("utf-16-le"))
    _plant(t, "var/lib/zeros.img", b"\0" * (3 << 20))
    assert _found(t) == {}


# -- package-owned config files --------------------------------------------------------------


def test_packaged_config_changed_by_the_build_is_read(tmp_path):
    """A conffile a package ships is public only while it is what the package shipped: dpkg's
    md5 says so. Given a password by the build, it is the build's file and a finding."""
    t = fake_image_tree(tmp_path)
    _plant(
        t,
        "etc/mysql/debian.cnf",
        "[client]\nuser = root\npassword = \nsocket = /run/mysqld/mysqld.sock\n",
    )
    _plant(t, "etc/slurm-llnl/slurmdbd.conf", "StorageUser=slurm\nStoragePass=\n")
    dpkg_ship(t, "mariadb-common", "etc/mysql/debian.cnf")
    dpkg_ship(t, "slurmdbd", "etc/slurm-llnl/slurmdbd.conf")
    assert _found(t) == {}  # as shipped (empty passwords): public
    pw = _secret(12)
    _plant(t, "etc/mysql/debian.cnf", f"[client]\nuser = root\npassword = {pw}\n")
    _plant(t, "etc/slurm-llnl/slurmdbd.conf", f"StorageUser=slurm\nStoragePass={pw}\n")
    found = scan.scan(t)
    assert {(f.path, f.kind) for f in found} == {
        ("/etc/mysql/debian.cnf", "db-password"),
        ("/etc/slurm-llnl/slurmdbd.conf", "db-password"),
    }
    assert all(pw not in str(f) for f in found)
    assert {f.detail.rpartition("(")[2] for f in found} == {"password)", "StoragePass)"}


def test_conffile_sums_come_from_the_status_file(tmp_path):
    t = fake_image_tree(tmp_path)
    text = "[mysqld]\npassword = shipped-example\n"
    _plant(t, "etc/app/app.cnf", text)
    (t / "var/lib/dpkg/info/app.list").write_text("/etc/app/app.cnf\n")
    md5 = hashlib.md5(text.encode()).hexdigest()
    (t / "var/lib/dpkg/status").write_text(
        f"Package: app\nStatus: install ok installed\nConffiles:\n /etc/app/app.cnf {md5}\nVersion: 1\n"
    )
    assert _found(t) == {}  # a package's own example password is in the archive: public
    _plant(t, "etc/app/app.cnf", text + "# edited\n")
    assert _found(t) == {"/etc/app/app.cnf": "db-password"}


def test_packaged_file_without_a_sum_is_read(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "usr/share/app/key.pem", f"{BEGIN}{PRIV}\n")
    (t / "var/lib/dpkg/info/app.list").write_text("/usr/share/app/key.pem\n")  # no md5sums
    assert _found(t) == {"/usr/share/app/key.pem": "private-key"}


def test_a_packaged_munge_key_is_still_a_finding(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "etc/munge/munge.key", os.urandom(128))
    dpkg_ship(t, "site-munge", "etc/munge/munge.key")
    assert _found(t) == {"/etc/munge/munge.key": "munge-key"}


def test_empty_password_does_not_reach_into_the_next_line(tmp_path):
    """`password =` with nothing after it, then another setting: not a password (the old rule's
    \\s* crossed the newline and took `socket` for the value)."""
    t = fake_image_tree(tmp_path)
    _plant(t, "etc/app/client.cnf", "[client]\npassword =\nsocket = /run/x.sock\n")
    _plant(t, "etc/app/quoted.ini", '[db]\npassword = ""\n')
    _plant(t, "etc/app/templ.conf", "password = {{ db_password }}\n")
    assert _found(t) == {}


def test_sealed_list_rules_load_with_their_selectors():
    sl = sealed_items.load()
    rules = {r.id: r for r in sl.content_rules}
    assert {"putty-key", "kube-credential", "bearer-jwt", "s3cfg-key", "cloud-env-key"} <= set(
        rules
    )
    assert rules["s3cfg-key"].applies_to(".s3cfg", "root/.s3cfg")
    assert not rules["s3cfg-key"].applies_to("app.conf", "etc/app.conf")
    assert rules["kube-credential"].applies_to("config", "home/a/.kube/config")
    assert rules["cloud-ini-key"].fold and rules["cloud-ini-key"].needles == (b"aws_s",)


@pytest.mark.parametrize(
    "rule, msg",
    [
        ({"id": "x", "files": "listed", "pattern": "a", "reason": "r"}, r"content_rules\[\d+\]"),
        ({"id": "x", "files": "any", "pattern": "a", "reason": "r", "needles": [""]}, r"needles"),
        ({"id": "x", "files": "any", "pattern": "a", "reason": "r", "paths": ["/etc"]}, r"globs"),
        ({"id": "x", "files": "any", "pattern": "(", "reason": "r"}, r"x\.pattern: not a regex"),
        ({"id": "x", "files": "any", "pattern": "a", "reason": "r", "extra": 1}, r"content_rules"),
    ],
)
def test_bad_content_rule_is_named(tmp_path, rule, msg):
    import yaml

    from nodeforge.errors import NodeforgeError

    data = yaml.safe_load(sealed_items.SEALED_FILE.read_text())
    data["content_rules"].append(rule)
    f = tmp_path / "sealed.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(NodeforgeError, match=msg):
        sealed_items.load(f)


def test_bytecode_of_a_linked_source_is_read_and_the_link_not_followed(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "usr/lib/python3/dist-packages/m/__pycache__/x.cpython-313.pyc", f"{BEGIN}{PRIV}")
    (t / "usr/lib/python3/dist-packages/m/x.py").symlink_to("/dev/zero")  # never read
    (t / "var/lib/dpkg/info/m.list").write_text("/usr/lib/python3/dist-packages/m/x.py\n")
    (t / "var/lib/dpkg/info/m.md5sums").write_text(
        f"{'0' * 32}  usr/lib/python3/dist-packages/m/x.py\n"
    )
    assert _found(t) == {
        "/usr/lib/python3/dist-packages/m/__pycache__/x.cpython-313.pyc": "private-key"
    }


# -- cloud CLI logins ------------------------------------------------------------------------


def test_cloud_cli_logins(tmp_path):
    t = fake_image_tree(tmp_path)
    tok = _secret(24)
    adc = f'{{"type": "authorized_user", "client_id": "x.apps", "refresh_token": "{tok}"}}'
    _plant(t, "root/.config/gcloud/application_default_credentials.json", adc)
    _plant(t, "home/ops/.azure/msal_token_cache.json", "{}")
    _plant(t, "opt/app/adc.json", adc)  # copied anywhere
    assert _found(t, tok) == {
        "/root/.config/gcloud": "gcloud-credentials",
        "/root/.config/gcloud/application_default_credentials.json": "oauth-secret",
        "/home/ops/.azure": "azure-cli-credentials",
        "/opt/app/adc.json": "oauth-secret",
    }


def test_oauth_near_miss(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "opt/app/oauth.json", '{"refresh_token": "", "client_secret": "${CLIENT_SECRET}"}')
    assert _found(t) == {}
