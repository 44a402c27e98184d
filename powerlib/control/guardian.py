"""The guardian: a watchdog process that restores a session's devices when its owner dies.

Started by a :class:`~powerlib.control.ControlSession` (by default where changes outlive the
process and are made by it, docs/real-gpu.md §6) as ``python -m powerlib.control.guardian`` in its own
process session, with a pipe from the owner on stdin. It waits until the pipe closes or the owner
stops running (it polls both, every 0.2 s, so a pipe held open by the owner's forked children does
not delay it), then restores every journal that owner left, and exits. An owner that finished
cleanly has already restored and removed its journals, and says so (:data:`CLEAN_CLOSE` down the
pipe): the guardian then exits at once.

It ignores SIGINT and SIGHUP (a Ctrl-C or a closed terminal aimed at the job must not take the
guardian down first). Results go to ``<state dir>/guardian.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from powerlib.config import child_environment

if TYPE_CHECKING:
    from powerlib.config import Settings
    from powerlib.control.state import Owner

__all__ = ["CLEAN_CLOSE", "main", "start", "stop", "wait_for_owner_exit"]

#: What the owner writes before closing the pipe when its session restored everything itself.
CLEAN_CLOSE = b"clean-close\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m powerlib.control.guardian``."""
    parser = argparse.ArgumentParser(prog="python -m powerlib.control.guardian")
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--owner-start-time", type=float, required=True)
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)

    from powerlib.config import Settings  # noqa: PLC0415 - after the signal setup: imports take a moment
    from powerlib.control.restore import restore_journals  # noqa: PLC0415 - after the signal setup: imports take a moment
    from powerlib.control.state import Owner  # noqa: PLC0415 - after the signal setup: imports take a moment
    from powerlib.errors import PowerlibError  # noqa: PLC0415 - after the signal setup: imports take a moment

    owner = Owner(
        pid=args.owner_pid, start_time_s=args.owner_start_time, hostname=socket.gethostname()
    )
    if wait_for_owner_exit(owner, sys.stdin.fileno()):
        return 0  # the owner closed its session cleanly: nothing is left to restore
    deadline = time.monotonic() + 0.5  # a clean close: the owner is still alive and has restored
    while owner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if owner.is_alive():
        return 0
    settings = Settings.from_env()
    try:
        outcomes = [o.to_json() for o in restore_journals(settings, owner=owner)]
    except PowerlibError as err:  # an untrusted or unreadable state folder: log it, no traceback
        outcomes = [{"ok": False, "error": str(err), "error_code": err.exit_code}]
    if outcomes:
        record = {
            "time_s": time.time(),
            "guardian_pid": os.getpid(),
            "owner_pid": owner.pid,
            "outcomes": outcomes,
        }
        try:
            with open(settings.state_dir / "guardian.log", "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
        except OSError:
            pass
    return 0 if all(o["ok"] for o in outcomes) else 1


def wait_for_owner_exit(owner: Owner, stream_fd: int, poll_s: float = 0.2) -> bool:
    """Block until ``stream_fd`` reaches EOF or ``owner`` stops running (the guardian's wait).

    Polling the owner as well as the pipe covers a pipe kept open by the owner's forked children.

    Returns:
        True when the owner wrote :data:`CLEAN_CLOSE`: its session restored everything itself.
    """
    received = b""
    while True:
        readable, _, _ = select.select([stream_fd], [], [], poll_s)
        if readable:
            chunk = os.read(stream_fd, 4096)
            received = (received + chunk)[-len(CLEAN_CLOSE) :]  # bounded: only the tail matters
            if received == CLEAN_CLOSE:
                return True
            if not chunk:
                return False
        if not owner.is_alive():
            return False


# -- the owner's side -------------------------------------------------------------------------

_GUARDIAN_EXIT_WAIT_S = 2.0  # a cleanly closed guardian exits in milliseconds once started


def start(settings: Settings, owner: Owner) -> subprocess.Popen[bytes]:
    """Start ``python -m powerlib.control.guardian`` in its own session, holding a pipe from us."""
    env = child_environment({"POWERLIB_STATE_DIR": str(settings.state_dir)})
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "powerlib.control.guardian",
            "--owner-pid",
            str(owner.pid),
            "--owner-start-time",
            repr(owner.start_time_s),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # survives a Ctrl-C or kill of our process group
        close_fds=True,
        cwd="/",  # `-m` puts the cwd first on sys.path: never let a job's folder shadow powerlib
        env=env,
    )


def stop(proc: subprocess.Popen[bytes], *, clean: bool) -> None:
    """Tell the guardian we finished cleanly and close its pipe; reap it off this thread.

    ``clean`` is False in a forked child of the owner that closes a copy of the session: the
    guardian must keep watching the owner itself. The guardian exits at once on a clean close,
    so close() waits for it (at most ``_GUARDIAN_EXIT_WAIT_S``: it may still be starting, about
    0.1 s); one that takes longer is reaped by a daemon thread, so close() never hangs.
    """
    try:
        if proc.stdin is not None:
            if clean:
                proc.stdin.write(CLEAN_CLOSE)
            proc.stdin.close()
    except OSError:
        pass  # it has exited already
    try:
        proc.wait(timeout=_GUARDIAN_EXIT_WAIT_S if clean else 0.0)
    except subprocess.TimeoutExpired:
        threading.Thread(
            target=_reap, args=(proc,), name="powerlib-guardian-reaper", daemon=True
        ).start()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
