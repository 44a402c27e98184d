"""Run code as another uid in a forked child (the suite runs as root; refusals are tested for real)."""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Callable
from typing import Any

NOBODY, NOGROUP = 65534, 65534


def spawn_as(uid: int, body: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child that drops to ``uid`` (gid nogroup) for good and runs ``body(write_fd)``;
    it never returns into pytest. Returns its pid and the read end of its pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOGROUP)
            os.setuid(uid)
            body(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def as_uid(uid: int, fn: Callable[[], Any], *, timeout_s: float = 60.0) -> Any:
    """Run ``fn`` in a forked child that dropped to ``uid`` (gid nogroup); its JSON result."""

    def body(w: int) -> None:
        try:
            out = json.dumps({"ok": True, "value": fn()})
        except BaseException as err:
            out = json.dumps({"ok": False, "type": type(err).__name__, "message": str(err)})
        os.write(w, out.encode())

    pid, r = spawn_as(uid, body)
    data = read_all(r, timeout_s)
    os.waitpid(pid, 0)
    return json.loads(data)


def read_all(fd: int, timeout_s: float) -> bytes:

    chunks = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError("the child did not answer in time")
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)
