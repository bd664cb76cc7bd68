"""Errors a user can act on. Every message names the field, file or artifact and says how to fix it."""

from . import redact


class NodeforgeError(Exception):
    """An error with a message meant for the operator (printed without a traceback)."""

    exit_code = 2

    def __init__(self, *args: object) -> None:
        # The message reaches stderr, logs, state.json and `node status`: whatever built it,
        # a URL's credentials and anything shaped like a key never do (nodeforge/redact.py).
        if len(args) == 1 and isinstance(args[0], str):
            args = (redact.text(args[0]),)
        super().__init__(*args)


class CommandError(NodeforgeError):
    """A subprocess failed; carries the command, exit status and the tail of its output."""

    exit_code = 1

    def __init__(self, argv: list[str], returncode: int, output: str = "", hint: str = ""):
        self.argv = argv
        self.returncode = returncode
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-25:])
        msg = f"command failed (exit {returncode}): {' '.join(argv)}"
        if tail:
            msg += f"\n--- last output ---\n{tail}"
        if hint:
            msg += f"\n{hint}"
        super().__init__(msg)


class MissingToolError(NodeforgeError):
    def __init__(self, tool: str, package: str):
        # *package* is a Debian package name, or a whole install command (pip-installed tools)
        how = package if " " in package else f"apt-get install {package}"
        super().__init__(f"required tool '{tool}' not found on PATH; install it with: {how}")


class MissingPackageError(NodeforgeError):
    """A Python package the build needs is not installed next to nodeforge."""

    def __init__(self, package: str, needed_for: str, install: str):
        super().__init__(
            f"required Python package '{package}' not found ({needed_for}); "
            f"install it with: {install}"
        )
