"""Root's memory, root's log and the job grants stay bounded against a granted user (issue 46).

A job's user (``nobody``, granted GPU 0 by a job grant) loops change-and-release through a real
agent (in this process, so its structures can be measured), or spends its log budget on
refusals first; root's job record, the revoke answer and the log lines of its privileged actions
are checked. The grants' own findings (one job's grant per device; a failed read of the grants
folder) run against the agent's rules and leases directly.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_agent import (
    DEFAULT,
    NOBODY,
    NOGROUP,
    STRANGER,
    Node,
    _try,
    _wait,
    as_uid,
    spawn_as,
)
from test_agent import root_dir as root_dir  # noqa: F401 - the fixture, shared

from powerlib.agent import authz, protocol
from powerlib.agent.authz import Rules, write_grant
from powerlib.agent.client import AgentConnection
from powerlib.agent.leases import Client, Leases
from powerlib.agent.peer import Peer
from powerlib.agent.transport import Agent
from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings
from powerlib.errors import PowerlibError

JOB = "4646"


def _deep_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """What ``obj`` and everything it holds take (``sys.getsizeof``, each object once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(_deep_bytes(k, seen) + _deep_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return size + sum(_deep_bytes(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        held = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        if hasattr(obj, "__dict__"):
            held.append(obj.__dict__)
        return size + sum(_deep_bytes(v, seen) for v in held)
    return size


def _job_record(leases: Leases) -> Any:
    return leases._job_events.get(JOB)


@pytest.fixture
def served(root_dir: Path) -> Iterator[tuple[Agent, Path]]:  # noqa: F811 - the fixture above
    """An agent in this process on one simulated GPU; job JOB grants nobody GPU 0."""
    backend = SimulatedBackend(
        Settings(backend="simulated", sim_gpus=2, state_dir=root_dir / "state")
    )
    grants = root_dir / "grants"
    write_grant(grants, JOB, NOBODY, ["0"])
    sock = root_dir / "run" / "agent.sock"
    agent = Agent(backend, socket_path=sock, rules=Rules(grants_dir=grants), group=NOGROUP)
    try:
        with agent.in_thread():
            yield agent, sock
    finally:
        backend.close()


def _loops(sock: Path, count: int) -> int:
    """``count`` change-and-release loops on GPU 0 through one connection (as the child's uid)."""
    conn = AgentConnection(sock)
    for i in range(count):
        conn.call("set_power_limit", device=0, power_limit_w=200.0 + i % 100)
        conn.call("release", device=0)
    conn.close()
    return count


# -- hole 2: a job's events are bounded ------------------------------------------------------------


def test_ten_thousand_leases_of_a_job_keep_roots_record_of_it_flat() -> None:
    """10,000 leases of one job started and ended through the agent's lease table (in process:
    through the socket they take ~35 s): root's record of that job is the same size after 1,000
    and after 10,000 (13 KB), and the revoke answer stays under 16 KiB (before: every lease
    kept, 274 KB after 1,000 and 2.7 MB after 10,000; the answer 99 B a lease, past the
    client's 4 MiB line cap after ~42,000)."""
    import tempfile

    state = Path(tempfile.mkdtemp(prefix="powerlib-bounds-"))
    backend = SimulatedBackend(Settings(backend="simulated", sim_gpus=1, state_dir=state))
    leases = Leases(backend, Rules(), workers=2, inline_below_s=0.002)
    leases.prepare()
    dev = backend.devices()[0]
    peer = Peer(pid=os.getpid(), uid=NOBODY, gid=NOGROUP, groups=(), start_ticks=None)
    client = Client(id=1, peer=peer, writer=None, pool=f"uid:{NOBODY}")  # type: ignore[arg-type]
    sizes: dict[int, int] = {}

    async def loop() -> Any:
        for i in range(1, 10_001):
            lease = leases._lease(client, dev, f"job:{JOB}")
            await leases.restore(lease, "released")
            if i in (1_000, 10_000):
                sizes[i] = _deep_bytes(_job_record(leases))
        return await leases._revoke(JOB)

    try:
        answer = asyncio.run(loop())
    finally:
        leases.close()
        backend.close()
        subprocess.run(["rm", "-rf", str(state)], check=False)
    assert sizes[10_000] <= sizes[1_000] * 1.05 + 256, sizes  # flat, not 10x
    assert sizes[10_000] < 64 * 1024, sizes
    encoded = protocol.encode(protocol.reply(1, answer))
    assert len(encoded) < 16 * 1024, len(encoded)
    assert answer["left_out"] == 10_000 - len(answer["ended"]) and answer["left_out_failed"] == 0
    assert not leases._job_events  # the revoke took the record


def test_a_granted_uid_looping_through_the_socket_leaves_a_bounded_record_and_answer(
    served: tuple[Agent, Path], root_dir: Path
) -> None:
    """nobody loops change-and-release through the socket (100, then 200 more): root's record of
    the job stays flat and the epilog's revoke answer lists the latest leases and counts the
    rest (before: 3x the record, every lease in the answer)."""
    agent, sock = served
    assert as_uid(NOBODY, lambda: _loops(sock, 100)) == {"ok": True, "value": 100}
    first = _deep_bytes(_job_record(agent.leases))
    assert as_uid(NOBODY, lambda: _loops(sock, 200)) == {"ok": True, "value": 200}
    second = _deep_bytes(_job_record(agent.leases))
    assert second <= first * 1.05 + 256, (first, second)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")},
        "POWERLIB_AGENT_SOCKET": str(sock),
        "POWERLIB_STATE_DIR": str(root_dir / "state"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "powerlib", "agent", "revoke", "--job", JOB, "--grants-dir",
         str(root_dir / "grants"), "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["removed"]
    assert 0 < len(report["leases_ended"]) <= 64
    assert report["leases_left_out"] == 300 - len(report["leases_ended"])
    assert len(done.stdout) < 16 * 1024


# -- hole 4: privileged actions are always logged -------------------------------------------------


def test_privileged_actions_are_logged_after_the_refusal_budget_is_spent(
    served: tuple[Agent, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """nobody spends its log budget on 8 refused changes of GPU 1, then leases GPU 0, changes its
    power limit and its clocks (three times) and releases it, then leases it again and exits:
    each lease, first change of an item and restore has its line (the restore's counting every
    change), and the refusals stay capped (before: none of the nine privileged lines)."""
    caplog.set_level(logging.INFO, logger="powerlib.agent")
    agent, sock = served

    def job() -> int:
        conn = AgentConnection(sock)
        refused = [_try(lambda: conn.call("set_power_limit", device=1, power_limit_w=250.0))
                   for _ in range(8)]  # fmt: skip
        assert all(r.startswith("PermissionDeniedError") for r in refused), refused
        conn.call("set_power_limit", device=0, power_limit_w=250.0)
        for mhz in (1005, 1200, 1005):  # a plan's per-instruction switching
            conn.call("lock_sm_clocks", device=0, min_mhz=mhz)
        conn.call("release", device=0)
        again = AgentConnection(sock)
        again.call("set_power_limit", device=0, power_limit_w=260.0)
        return os.getpid()  # exits holding the lease: its end restores

    res = as_uid(NOBODY, job)
    assert res["ok"], res
    pid = res["value"]
    assert _wait(lambda: not agent.leases._leases)
    with AgentConnection(sock) as root:
        root.call("revoke", job=JOB)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("powerlib.agent")]
    about = [line for line in lines if f"uid {NOBODY} pid {pid}" in line]
    refusals = [line for line in about if "refused" in line]
    assert 1 <= len(refusals) <= 5, refusals  # still capped
    assert len([line for line in about if " leases " in line]) == 2, about
    changes = [line for line in about if re.search(r": (set_power_limit|lock_sm_clocks) ", line)]
    assert len(changes) == 3, about
    assert any("set_power_limit" in c and "250 W" in c for c in changes), changes
    assert any("lock_sm_clocks" in c and "1005-1005 MHz" in c for c in changes), changes
    restores = [line for line in about if line.startswith("agent: restore ")]
    assert len(restores) == 2, about
    # the later clock changes of a lease log at DEBUG; its restore's line counts every change
    assert any("released" in line and "after 4 change(s)" in line for line in restores), restores
    assert any("after 1 change(s)" in line for line in restores), restores
    assert any(f"revoke job {JOB}" in line for line in lines), lines
    assert all("\n" not in line for line in lines)


# -- finding (c): a device is one job's at a time --------------------------------------------------


def _line_within(fd: int, timeout_s: float) -> bytes:
    out = b""
    while not out.endswith(b"\n"):
        if not select.select([fd], [], [], timeout_s)[0]:
            raise AssertionError(f"the client said nothing in {timeout_s} s (got {out!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            break
        out += chunk
    return out


def test_a_new_jobs_grant_clears_a_stale_grant_of_its_device(root_dir: Path) -> None:
    """A failed epilog left job 41's grant (nobody, GPUs 0 and 1), and nobody still holds GPU 0.
    The prolog of job 42 (uid 65533, GPU 0) takes GPU 0 out of job 41's grant: nobody's lease
    ends and is restored, its next change is refused, and the new job's user gets the device
    (before: nobody kept GPU 0 and the new job got DeviceBusyError)."""
    node = Node(root_dir, None).start()
    try:
        write_grant(node.grants, "41", NOBODY, ["0", "1"])

        def hold(w: int) -> None:
            conn = AgentConnection(node.sock)
            conn.call("set_power_limit", device=0, power_limit_w=250.0)
            os.write(w, b"leased\n")
            while True:
                try:
                    conn.call("set_power_limit", device=0, power_limit_w=250.0)
                except PowerlibError as err:
                    os.write(w, f"{type(err).__name__}\n".encode())
                    return
                time.sleep(0.05)

        pid, r = spawn_as(NOBODY, hold)
        try:
            assert _line_within(r, 30) == b"leased\n"
            env = {**node.env, "POWERLIB_AGENT_SOCKET": str(node.sock)}
            done = subprocess.run(
                [sys.executable, "-m", "powerlib", "agent", "grant", "--job", "42", "--uid",
                 str(STRANGER), "--devices", "0", "--grants-dir", str(node.grants),
                 "--no-user-state", "--json"],
                env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert json.loads((node.grants / "job-41.json").read_text())["devices"] == ["1"]
            assert json.loads(done.stdout)["cleared"] == [{"job": "41", "devices": ["0"]}]
            assert _line_within(r, 10) in (b"PermissionDeniedError\n", b"DeviceLostError\n")
            assert _wait(lambda: node.truth() == DEFAULT, 10), node.truth()
            got = as_uid(STRANGER, lambda: _try(lambda: AgentConnection(node.sock).call(
                "set_power_limit", device=0, power_limit_w=300.0)))  # fmt: skip
            assert got == {"ok": True, "value": "ok"}
            still = as_uid(NOBODY, lambda: _try(lambda: AgentConnection(node.sock).call(
                "set_power_limit", device=1, power_limit_w=300.0)))  # fmt: skip
            assert still == {"ok": True, "value": "ok"}  # its other device stays granted
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
    finally:
        node.stop()


# -- finding (d): a failed read of the grants folder keeps the last good grants ----------------


def test_a_failed_read_of_the_grants_folder_ends_no_lease(
    root_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The grants folder cannot be listed (EMFILE, as when the agent's descriptors run out): the
    last good grants stand, the job's lease lives on, and the failure is logged once (before:
    no grants at all, and the housekeeping ended every job's lease); the job's revoke still
    ends its grant."""
    monkeypatch.setattr(authz, "_SETTLE_NS", 0, raising=False)
    grants = root_dir / "grants"
    write_grant(grants, JOB, NOBODY, ["0"])
    backend = SimulatedBackend(
        Settings(backend="simulated", sim_gpus=1, state_dir=root_dir / "state")
    )
    rules = Rules(grants_dir=grants)
    leases = Leases(backend, rules, workers=2, inline_below_s=0.002)
    leases.prepare()
    peer = Peer(pid=os.getpid(), uid=NOBODY, gid=NOGROUP, groups=(), start_ticks=None)
    client = Client(id=1, peer=peer, writer=None, pool=f"uid:{NOBODY}")  # type: ignore[arg-type]
    real_scandir = os.scandir

    def failing_scandir(path: Any = ".") -> Any:
        if str(path) == str(grants):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_scandir(path)

    async def run() -> tuple[bool, bool, bool]:
        await leases.dispatch(
            client, {"op": "set_power_limit", "device": 0, "power_limit_w": 250.0}
        )
        monkeypatch.setattr(os, "scandir", failing_scandir)
        for _ in range(3):
            rules.invalidate()
            await leases.end_gone_jobs()
        held = bool(leases._leases)
        gpu0 = backend.devices()[0].device_id
        allowed, _ = rules.check(NOBODY, (NOGROUP,), gpu0, "0")
        # the epilog's revoke still ends the job, though the folder cannot be read
        root_peer = dataclasses.replace(peer, uid=0, gid=0)
        root = Client(id=2, peer=root_peer, writer=None, pool="root")  # type: ignore[arg-type]
        await leases.dispatch(root, {"op": "revoke", "job": JOB})
        after_revoke, _ = rules.check(NOBODY, (NOGROUP,), gpu0, "0")
        monkeypatch.setattr(os, "scandir", real_scandir)
        await leases.end_all("test over")
        return held, allowed, after_revoke

    caplog.set_level(logging.WARNING, logger="powerlib.agent")
    try:
        held, allowed, after_revoke = asyncio.run(run())
    finally:
        leases.close()
        backend.close()
    assert held and allowed and not after_revoke
    failures = [r.getMessage() for r in caplog.records if "grants" in r.getMessage()]
    assert len(failures) == 1, failures
    assert "Too many open files" in failures[0] and "last good" in failures[0]
