"""Clients do not control the agent's logs (issue 31, point 9), and the grant cache (point 4).

Each attack runs against a real agent (``Node``, as root) from a forked client under another uid
(``nobody``, granted GPU 0 by the allow list, or 65533, whom no rule names). The agent's log is
its stdout, read after it stops. A log sink that stalls is the agent's stdout pipe left unread.
"""

from __future__ import annotations

import array
import fcntl
import json
import logging
import os
import re
import signal
import socket
import termios
import threading
from pathlib import Path

import pytest
from test_agent import (
    DEFAULT,
    NOBODY,
    STRANGER,
    Node,
    _raw,
    _read_all_line,
    _reply,
    _try,
    _wait,
    as_uid,
    spawn_as,
)
from test_agent import node as node  # the fixtures, shared
from test_agent import root_dir as root_dir

from powerlib.agent import authz
from powerlib.agent.authz import Rules, remove_grant, write_grant
from powerlib.agent.client import AgentConnection

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _lines_about(out: str, uid: int) -> list[str]:
    return [line for line in out.splitlines() if f"uid {uid} pid" in line]


def _send_raw(node: Node, line: bytes, closes: bool) -> tuple[dict, bool]:
    """Send one raw line, read the reply: (reply, whether the agent closed the connection)."""
    s = _raw(node)
    try:
        s.sendall(line)
        reply = _reply(s)
        return reply, closes and s.recv(1) == b""
    finally:
        s.close()


def _raw_as(uid: int, node: Node, line: bytes, closes: bool = True) -> tuple[dict, bool]:
    """:func:`_send_raw` from a child running as ``uid``."""
    res = as_uid(uid, lambda: _send_raw(node, line, closes))
    assert res["ok"], res
    reply, closed = res["value"]
    return reply, closed


# -- (a) a flood of refusals ------------------------------------------------------------------------


def test_a_flood_of_refused_requests_logs_a_few_lines_not_one_each(node: Node) -> None:
    """2,000 refused changes from one connection: 2,000 one-line refusals to the client, and a
    handful of agent log lines (the first 5, then one per 10 s), not 2,000."""

    def flood() -> list[str]:
        conn = AgentConnection(node.sock)
        seen = set()
        for _ in range(2000):
            seen.add(_try(lambda: conn.call("lock_sm_clocks", device=0, min_mhz=1005)))
        conn.close()
        return sorted(seen)

    res = as_uid(STRANGER, flood)
    assert res["ok"], res
    (refusal,) = res["value"]  # every one refused, the same way
    assert refusal.startswith("PermissionDeniedError: uid 65533 may not control device 0")
    assert "\n" not in refusal
    assert node.truth() == DEFAULT
    out = node.stop()
    about = _lines_about(out, STRANGER)
    assert 1 <= len(about) <= 10, f"{len(about)} log lines for one connection's refusals"
    node.start()  # the fixture stops it again


def test_reconnecting_gets_no_fresh_log_budget(node: Node) -> None:
    """300 connections of one uid, each one bad line then gone: the log budget is the uid's,
    so reconnecting in a loop cannot turn the agent's log into a firehose (~390 KB/s before)."""

    def churn() -> int:
        for _ in range(300):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(node.sock))
                s.sendall(b"not json\n")
                s.recv(4096)
        return 300

    assert as_uid(STRANGER, churn)["value"] == 300
    out = node.stop()
    about = _lines_about(out, STRANGER)
    assert 1 <= len(about) <= 10, f"{len(about)} log lines for 300 connections of one uid"
    node.start()  # the fixture stops it again


# -- (b) client text in the log -----------------------------------------------------------------


def test_client_text_cannot_forge_a_log_line(node: Node) -> None:
    """An unknown key holding a newline, and a device selector wrapped in newlines (it still
    names GPU 0): the refusals are one line each, and every line the agent logs is a record of
    its own (a level first), none starting with the client's "FORGED"."""
    reply, closed = _raw_as(
        STRANGER, node, b'{"v": 1, "id": 1, "op": "ping", "x\\nFORGED ERROR line": 1}\n'
    )
    assert reply["ok"] is False and closed
    assert "unexpected argument" in reply["error"]["message"]
    assert "\n" not in reply["error"]["message"]
    reply, closed = _raw_as(
        STRANGER,
        node,
        b'{"v": 1, "id": 2, "op": "lock_sm_clocks", "device": "\\n0\\n", "min_mhz": 1005}\n',
        closes=False,
    )
    assert reply["ok"] is False and reply["error"]["type"] == "PermissionDeniedError"
    assert "\n" not in reply["error"]["message"]
    assert node.truth() == DEFAULT
    out = node.stop()
    lines = [line for line in out.splitlines() if line.strip()]
    assert not [line for line in lines if line.startswith("FORGED")], out
    assert all(line.split(" ", 1)[0] in LEVELS for line in lines), out
    assert "'x\\nFORGED ERROR line'" in out  # quoted, escaped, on the refusal's own line
    node.start()  # the fixture stops it again


# -- (c) a 400-digit number -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_line",
    [
        b'{"v":1,"id":1,"op":"lock_sm_clocks","device":0,"min_mhz":' + b"9" * 400 + b"}\n",
        b'{"v":1,"id":1,"op":"lock_sm_clocks","device":0,"min_mhz":1005,"max_mhz":-'
        + b"9" * 400
        + b"}\n",
        b'{"v":1,"id":1,"op":"set_power_limit","device":0,"power_limit_w":' + b"9" * 400 + b"}\n",
    ],
    ids=["min_mhz", "max_mhz", "power_limit_w"],
)
def test_a_400_digit_number_is_a_protocol_error_not_a_traceback(
    node: Node, request_line: bytes
) -> None:
    """nobody may control GPU 0; a number no float can hold gets one error line, the connection
    closes, no driver call is made and nothing is logged as a traceback."""
    reply, closed = _raw_as(NOBODY, node, request_line)
    assert reply["ok"] is False and closed
    assert "must be a finite number" in reply["error"]["message"]
    assert "\n" not in reply["error"]["message"]
    assert node.truth() == DEFAULT
    with AgentConnection(node.sock) as conn:
        assert conn.call("ping") is None  # the agent serves on
    out = node.stop()
    assert "Traceback" not in out and "OverflowError" not in out, out
    node.start()  # the fixture stops it again


# -- (d) deeply nested JSON ------------------------------------------------------------------------


@pytest.mark.parametrize("opening", [b"[", b'{"a":'], ids=["arrays", "objects"])
def test_deeply_nested_json_gets_an_error_and_the_agent_serves_on(
    node: Node, opening: bytes
) -> None:
    depth = 60_000 // len(opening)  # one line, within the 64 KiB cap
    reply, closed = _raw_as(STRANGER, node, opening * depth + b"\n")
    assert reply["ok"] is False and closed
    assert reply["error"]["message"] == "the request is nested too deeply"
    res = as_uid(STRANGER, lambda: AgentConnection(node.sock).call("ping"))
    assert res == {"ok": True, "value": None}  # the agent serves on
    assert node.truth() == DEFAULT
    out = node.stop()
    assert "Traceback" not in out and "RecursionError" not in out, out
    node.start()  # the fixture stops it again


# -- (e) a stalled log sink -------------------------------------------------------------------------


class _Stalled(logging.Handler):
    """A sink that takes one record and then waits (a full pipe, a journald that hangs)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.gate.wait()
        self.lines.append(record.getMessage())


def test_a_stalled_log_sink_never_blocks_whoever_logs() -> None:
    """100,000 records into a queue of 100 whose writer is stuck: every call returns, the
    records past the queue are dropped and counted, and the sink is told how many."""
    from powerlib.agent.logs import QueueLogging

    target = logging.getLogger("powerlib.tests.stalled")
    target.propagate = False
    target.setLevel(logging.INFO)
    release = threading.Event()
    sink = _Stalled(release)
    target.addHandler(sink)
    logs = QueueLogging(capacity=100, target=target).start()
    done = threading.Event()

    def flood() -> None:
        for i in range(100_000):
            target.warning("agent: refused read uid 65533 pid %d: default deny", i)
        done.set()

    try:
        assert target.handlers == [logs.handler]
        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(120), "logging waited for the stalled sink"
        assert logs.dropped >= 100_000 - 101  # the queue, and the record the sink holds
    finally:
        release.set()
        logs.stop()
        handlers = list(target.handlers)
        target.removeHandler(sink)
    assert handlers == [sink]  # put back
    notices = [line for line in sink.lines if "log records dropped" in line]
    assert notices and sum(int(n.split()[1]) for n in notices) == logs.dropped
    assert len(sink.lines) - len(notices) == 100_000 - logs.dropped


def test_a_stalled_log_sink_does_not_delay_a_killed_clients_restore(node: Node) -> None:
    """The agent's stdout pipe (4 KiB) is left unread and filled by protocol errors from 200
    connections; then nobody, who holds GPU 0, is killed: GPU 0 is restored all the same."""
    assert node.proc is not None and node.proc.stdout is not None
    pipe = node.proc.stdout.fileno()
    capacity = fcntl.fcntl(pipe, fcntl.F_SETPIPE_SZ, 4096)

    def lease(w: int) -> None:
        conn = AgentConnection(node.sock)
        conn.call("set_power_limit", device=0, power_limit_w=222.0)
        os.write(w, b"leased\n")
        signal.pause()

    def garbage(w: int) -> None:  # never reads a reply: the agent's log is what it is after
        for _ in range(200):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(node.sock))
                s.sendall(b"not json\n")
        os.write(w, b"sent\n")
        signal.pause()  # alive: the agent serves a live peer's lines

    pid, r = spawn_as(NOBODY, lease)
    flooder = None
    try:
        assert _read_all_line(r) == b"leased\n"
        assert node.truth()[0] == (None, 222.0)
        # root's connections each get their own log budget (a uid's share one): the quickest
        # way to fill the pipe; who fills it does not matter, only that the sink stalls
        flooder, r = spawn_as(0, garbage)
        assert _read_all_line(r) == b"sent\n"
        assert _wait(lambda: _unread(pipe) > capacity - 512), _unread(pipe)  # the sink stalls
    finally:
        for child in (pid, flooder):
            if child is not None:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
    assert _wait(lambda: node.truth() == DEFAULT), node.truth()
    assert _unread(pipe) > capacity - 512  # restored while the sink was still stalled
    out = node.stop()
    assert "agent: restore" in out  # written once the sink moved again
    node.start()  # the fixture stops it again


def _unread(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


def test_a_connection_logs_its_first_lines_then_one_per_period() -> None:
    from powerlib.agent.logs import LogLimiter

    now = [0.0]
    records: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    target = logging.getLogger("powerlib.tests.limited")
    target.propagate = False
    target.setLevel(logging.INFO)
    target.addHandler(Sink())
    limit = LogLimiter(burst=5, every_s=10.0, clock=lambda: now[0])
    passed = [limit.log(target, logging.WARNING, "refused %d", i) for i in range(2000)]
    assert sum(passed) == 5 and records == [f"refused {i}" for i in range(5)]
    now[0] = 10.0
    assert limit.log(target, logging.WARNING, "refused %d", 2000)
    assert records[-1] == "refused 2000 (1995 more like it from this connection were not logged)"
    now[0] = 15.0
    assert not limit.log(target, logging.WARNING, "refused %d", 2001)


# -- (f) the grant cache, and a grant file that breaks the reader -----------------------------------


def test_a_revoked_grant_admits_nothing_once_revoke_returns(node: Node) -> None:
    """One connection of the job's uid is admitted, the epilog revokes, and that connection's
    very next change is refused (no wait for a cache to expire)."""
    write_grant(node.grants, "77", STRANGER, ["2"])
    to_child_r, to_child_w = os.pipe()

    def job(w: int) -> None:
        conn = AgentConnection(node.sock)
        first = _try(lambda: conn.call("lock_sm_clocks", device=2, min_mhz=1005))
        conn.call("release", device=2)
        os.write(w, json.dumps(first).encode() + b"\n")
        assert os.read(to_child_r, 1) == b"r"  # revoked
        second = _try(lambda: conn.call("lock_sm_clocks", device=2, min_mhz=1005))
        os.write(w, json.dumps(second).encode() + b"\n")

    pid, r = spawn_as(STRANGER, job)
    os.close(to_child_r)
    with os.fdopen(r, "rb") as replies:
        assert json.loads(replies.readline()) == "ok"
        assert remove_grant(node.grants, "77")
        os.write(to_child_w, b"r")
        second = json.loads(replies.readline())
    os.close(to_child_w)
    os.waitpid(pid, 0)
    assert second.startswith("PermissionDeniedError: uid 65533 may not control device 2")
    assert _wait(lambda: node.truth() == DEFAULT)


def test_the_grant_cache_follows_the_folder_not_a_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rules alone, with every folder counted as settled (its times older than a tick): a
    grant written, then removed, is seen at the next check each time; invalidate() forgets."""
    monkeypatch.setattr(authz, "_SETTLE_NS", 0, raising=False)
    folder = tmp_path / "grants"
    rules = Rules(grants_dir=folder, resolve=lambda s: {"0": "GPU-a", "1": "GPU-b"}.get(s))
    check = lambda: rules.check(STRANGER, (), "GPU-a", "0")[0]  # noqa: E731
    assert not check()
    write_grant(folder, "5", STRANGER, ["0"])
    assert check()
    remove_grant(folder, "5")
    assert not check()
    write_grant(folder, "6", STRANGER, ["0"])
    assert check()
    (folder / "job-6.json").chmod(0o666)  # in place: the folder's times do not move
    rules.invalidate()
    assert not check()


def test_a_deeply_nested_grant_file_does_not_stop_another_jobs_grant(node: Node) -> None:
    write_grant(node.grants, "88", STRANGER, ["2"])
    bad = node.grants / "job-bad.json"
    bad.write_text("[" * 100_000 + "]" * 100_000)
    bad.chmod(0o644)

    def lock() -> str:
        return _try(
            lambda: AgentConnection(node.sock).call("lock_sm_clocks", device=2, min_mhz=1005)
        )

    assert as_uid(STRANGER, lock)["value"] == "ok"
    assert _wait(lambda: node.truth() == DEFAULT)
    refused = as_uid(NOBODY, lambda: _try(lambda: AgentConnection(node.sock).call(
        "lock_sm_clocks", device=2, min_mhz=1005
    )))["value"]  # fmt: skip
    assert refused.startswith("PermissionDeniedError") and "job-bad" not in refused
    out = node.stop()
    assert len(re.findall(r"job-bad\.json is nested too deeply", out)) == 1, out
    assert "Traceback" not in out
    node.start()  # the fixture stops it again
