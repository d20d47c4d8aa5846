"""The dump credential of an agent that has no token.

An agent that listens on loopback without ``--token-file`` answers reads to
anyone on the node, but not dump requests: a dump costs disk and, with
``--max-dumps``, may displace another.  Unless given one
(``--dump-token-file``), it makes a dump-only credential at start and writes
it, readable by root only, to a file named by its network namespace and
address under ``RUN_DIR``; ``stallwatch dump`` run on the node (as root)
reads it from there when it is given no token.  The file is removed when
the agent stops.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

RUN_DIR = Path("/run/stallwatch")


def local_token_path(host: str, port: int) -> Path:
    """Where the agent listening on ``host:port`` in this network namespace
    keeps its dump credential."""
    netns = os.stat("/proc/self/ns/net").st_ino
    return RUN_DIR / f"dump-{netns}-{host.strip('[]')}-{port}.token"


def new_token() -> str:
    return secrets.token_urlsafe(24)


def write_local_token(host: str, port: int, token: str) -> Path | None:
    """Keep ``token`` where ``stallwatch dump`` on this node finds it; the
    file, or None if it could not be written (then only the agent knows it)."""
    path = local_token_path(host, port)
    temp = path.with_name(path.name + ".new")
    try:
        RUN_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
        os.replace(temp, path)
    except OSError:
        return None
    return path


def read_local_token(host: str, port: int) -> str | None:
    """The dump credential of the agent at ``host:port``, if this process
    can read it."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return local_token_path(host, port).read_text().strip() or None
    return None


def remove_local_token(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()
