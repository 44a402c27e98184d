"""The agent's client connection: what the ``agent`` backend and ``powerlib agent leases`` use.

Requests and responses are :mod:`powerlib.agent.protocol` lines, in order, one caller at a time.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from pathlib import Path
from typing import Any

from powerlib.agent import protocol
from powerlib.errors import BackendUnavailableError, DeviceLostError
from powerlib.inputs import show_path

__all__ = ["AgentConnection"]

_TIMEOUT_S = 30.0


class AgentConnection:
    """One connection to the agent: requests and responses in order, one caller at a time.

    Args:
        path: The agent's socket.
        timeout_s: How long to wait for the agent to answer one request.

    Raises:
        BackendUnavailableError: No agent listens there, or it refuses this process.
    """

    def __init__(self, path: Path, timeout_s: float = _TIMEOUT_S) -> None:
        self.path = Path(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(self.path))
        except OSError as err:
            self._sock.close()
            raise BackendUnavailableError(
                f"no powerlib agent at {show_path(self.path)} ({err.strerror or err}); start "
                "`powerlib agent` (as root, under systemd) or set POWERLIB_AGENT_SOCKET"
            ) from None
        self._file = self._sock.makefile("rb")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.lost = False

    def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result.

        Raises:
            PowerlibError: What the agent raised (the same class, e.g. ``PermissionDeniedError``;
                :class:`~powerlib.errors.ProtocolError` for a request it could not take).
            DeviceLostError: The connection is gone (the agent stopped or was restarted).
        """
        with self._lock:
            if self.lost:
                raise DeviceLostError("the connection to the powerlib agent was lost")
            rid = next(self._ids)
            try:
                self._sock.sendall(
                    protocol.encode({"v": protocol.VERSION, "id": rid, "op": op, **args})
                )
                line = self._file.readline(protocol.MAX_LINE_BYTES * 64)
            except OSError as err:
                self._lose()
                raise DeviceLostError(
                    f"the connection to the powerlib agent was lost: {err}"
                ) from None
            except BaseException:
                # interrupted between the request and its reply (Ctrl-C, a signal handler's
                # exception): the next reply would answer this request, so the stream is
                # unusable; the agent restores this connection's leases when it closes
                self._lose()
                raise
            if not line:
                self._lose()
                raise DeviceLostError("the powerlib agent closed the connection")
            try:
                reply = json.loads(line)
            except ValueError:
                reply = None
            if not isinstance(reply, dict) or reply.get("id") not in (rid, None):
                self._lose()  # out of step with the agent: nothing after this can be trusted
                raise DeviceLostError("the powerlib agent's reply does not match the request")
        if not reply.get("ok"):
            raise protocol.error_from_wire(reply.get("error"))
        return reply.get("result")

    def _lose(self) -> None:
        self.lost = True
        self._file.close()
        self._sock.close()

    def close(self) -> None:
        """Disconnect: the agent restores every device this connection leased."""
        with self._lock:
            if not self.lost:
                self._lose()

    def __enter__(self) -> AgentConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
