"""Post-stop sealing: every item of the sealed-items list (images/sealed.yaml) applied to the
stopped tree.

The Ansible `seal` role seals what it can from inside the build; some items only settle once
systemd in the sandbox has powered off (journal, login records, machine-id), and only here is
the whole list applied with nothing running. Each item carries its reason; the build log lists
what was removed and why. Then the scanner checks the same list.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import IO

from . import sealed_items
from .sealed_items import SealItem, SealList


def _apply(path: Path, action: str, content: str = "") -> bool:
    if not (path.exists() or path.is_symlink()):
        return False
    if action == "replace":
        if path.is_symlink():
            path.unlink()
        path.write_text(content)
    elif action == "truncate":
        if path.is_symlink() or not path.is_file():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            path.write_text("")
        else:
            with open(path, "w"):
                pass
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    return True


def _selected(item: SealItem, rel: str, path: Path, is_dir: bool, owned: set[str]) -> bool:
    if item.action == "keep" or not item.matches(rel) or not item.applies_to(path, is_dir):
        return False
    if not item.owned and "/" + rel in owned:
        return False  # a file a Debian package ships is public
    if item.pattern is not None:
        return (
            not is_dir
            and path.is_file()
            and not path.is_symlink()
            and sealed_items.content_matches(path, item.pattern) is not None
        )
    return True


def finalize(tree: Path, logfile: IO[str], sealed: SealList | None = None) -> list[str]:
    sl = sealed or sealed_items.load()
    owned = sealed_items.dpkg_owned(tree)
    done = []
    for rel, path, is_dir in sealed_items.walk(tree):
        item = next((i for i in sl.items if _selected(i, rel, path, is_dir, owned)), None)
        if item is not None and _apply(path, item.action, item.content):
            done.append("/" + rel)
            logfile.write(f"seal: {item.action} /{rel} — {item.reason}\n")
    return done


def seal_and_scan(tree: Path, logfile: IO[str]) -> list[str]:
    """finalize(), then the secret scanner: any finding stops the build before export."""
    from nodeforge.errors import NodeforgeError

    from . import scan

    sl = sealed_items.load()
    done = finalize(tree, logfile, sl)
    findings = scan.scan(tree, sl)
    if findings:
        raise NodeforgeError(
            "the sealed image still holds secrets or per-node identity; refusing to publish:\n  "
            + "\n  ".join(str(f) for f in findings)
        )
    return done
