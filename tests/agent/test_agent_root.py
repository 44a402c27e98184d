"""The agent's root-side rules (issue 31): the socket's own folder, revoked grants, the connection
table, failed requests and values the agent did not set.

A real agent process as root (the ``Node`` of test_agent.py) on simulated GPUs; the attackers
are forked children under other uids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_agent import (
    DEFAULT,
    GPUS,
    NOBODY,
    STRANGER,
    Node,
    _try,
    _wait,
    as_uid,
    open_connections,
    spawn_as,
)
from test_agent import node as node  # noqa: F401 - the fixtures, shared
from test_agent import root_dir as root_dir  # noqa: F401

from powerlib.agent.client import AgentConnection
from powerlib.backends.agent import AgentBackend
from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings
from powerlib.control.journal import write_journal
from powerlib.errors import ConfigError, PowerlibError


def _cli(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "powerlib", *args],
        env={**node.env, "POWERLIB_AGENT_SOCKET": str(node.sock)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _hold(node: Node, uid: int, device: int, limit_w: float) -> tuple[int, int]:
    """A client of ``uid`` that leases ``device`` (power limit ``limit_w``) and stays; its pid
    and a pipe that says "leased"."""

    def lease(w: int) -> None:
        conn = AgentConnection(node.sock)
        conn.call("set_power_limit", device=device, power_limit_w=limit_w)
        os.write(w, b"leased\n")
        while True:
            time.sleep(0.05)
            try:
                conn.call("set_power_limit", device=device, power_limit_w=limit_w)
            except PowerlibError as err:  # the lease ended: say how, and stay alive
                os.write(w, (type(err).__name__ + ": " + err.message + "\n").encode())
                time.sleep(60)

    return spawn_as(uid, lease)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


# -- point 3: the socket has a folder of its own --------------------------------------------------


@pytest.mark.parametrize("inside", ["state", "grants", "allow"])
def test_an_agent_whose_state_grants_or_allow_list_lie_in_the_socket_folder_does_not_start(
    root_dir: Path, inside: str
) -> None:
    """Pods mount the socket's folder, and a container's root is the host's: a grants folder
    there let a root pod write `{"uid": 0, "devices": ["*"]}` and own every GPU."""
    n = Node(root_dir, {"rules": [{"uid": NOBODY, "devices": ["0"]}]})
    folder = root_dir / "run"
    if inside == "state":  # the layout before: /run/powerlib/agent.sock beside the journals
        n.env["POWERLIB_STATE_DIR"] = str(folder)
    elif inside == "grants":
        n.args[n.args.index("--grants-dir") + 1] = str(folder / "grants")
    else:
        (folder / "allow.json").write_text(n.allow.read_text())
        n.args[n.args.index("--allow") + 1] = str(folder / "allow.json")
    n.start(wait=False)
    code, out = n.exited()
    assert code == ConfigError.exit_code, out
    assert "lies in the socket's folder" in out and str(folder) in out
    assert not n.sock.exists()


def test_the_socket_folder_inside_roots_state_folder_is_reachable_and_holds_only_the_socket(
    root_dir: Path,
) -> None:
    state = root_dir / "powerlib"
    state.mkdir(mode=0o700)  # as a root session leaves /run/powerlib
    n = Node(root_dir, {"rules": [{"uid": NOBODY, "devices": ["0"]}]})
    n.env["POWERLIB_STATE_DIR"] = str(state)
    n.sock = state / "agent" / "agent.sock"
    n.args[n.args.index("--socket") + 1] = str(n.sock)
    n.args[n.args.index("--grants-dir") + 1] = str(state / "grants")
    n.state = state
    n.start()
    try:
        assert os.listdir(state / "agent") == ["agent.sock"]
        res = as_uid(NOBODY, lambda: AgentConnection(n.sock).call("ping"))
        assert res == {"ok": True, "value": None}  # traversable (x), not listable by others
        assert not os.stat(state).st_mode & 0o044 and os.stat(state).st_mode & 0o001
    finally:
        n.stop()


# -- point 4: a lease ends with its job's grant --------------------------------------------------


def test_revoke_ends_and_restores_a_lease_of_a_process_started_outside_the_job(
    node: Node,
) -> None:
    granted = _cli(node, "agent", "grant", "--job", "4242", "--uid", str(STRANGER), "--devices",
                   "2", "--grants-dir", str(node.grants), "--no-user-state")  # fmt: skip
    assert granted.returncode == 0, granted.stderr
    pid, r = _hold(node, STRANGER, 2, 250.0)  # e.g. started over ssh: outlives the job
    try:
        assert _read_all_line_keep(r) == b"leased\n"
        assert node.truth()[2] == (None, 250.0)
        done = _cli(node, "agent", "revoke", "--job", "4242", "--grants-dir", str(node.grants),
                    "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["removed"] and [e["pid"] for e in report["leases_ended"]] == [pid]
        assert node.truth() == DEFAULT  # restored before revoke returned: no wait
        line = _read_all_line_keep(r)  # the client's next change is refused, not admitted
        assert line.startswith(b"DeviceLostError") or line.startswith(b"PermissionDeniedError")
        # the device is free for the next job at once
        nxt = as_uid(NOBODY, lambda: _try(lambda: AgentConnection(node.sock).call(
            "lock_sm_clocks", device=0, min_mhz=1005)))  # fmt: skip
        assert nxt["value"] == "ok"
        with AgentConnection(node.sock) as root:
            assert root.call("lock_sm_clocks", device=2, min_mhz=1005) == [1005.0, 1005.0]
    finally:
        _kill(pid)
        os.close(r)


def test_a_grant_file_removed_by_hand_ends_its_leases_too(node: Node) -> None:
    from powerlib.agent.authz import remove_grant, write_grant

    write_grant(node.grants, "99", STRANGER, ["1"])
    pid, r = _hold(node, STRANGER, 1, 222.0)
    try:
        assert _read_all_line_keep(r) == b"leased\n"
        remove_grant(node.grants, "99")
        # refused from now on: the grant cache never admits past the removal
        assert _wait(lambda: node.truth() == DEFAULT, 10.0), node.truth()
    finally:
        _kill(pid)
        os.close(r)


def _read_all_line_keep(fd: int) -> bytes:
    import select

    assert select.select([fd], [], [], 60)[0], "the client did not answer"
    out = b""
    while not out.endswith(b"\n"):
        out += os.read(fd, 1)
    return out


# -- point 6: the connection table ----------------------------------------------------------------


def test_ungranted_uids_cannot_fill_the_connection_table(root_dir: Path) -> None:
    """Four uids with no grant open all they can; a granted job still connects and leases."""
    n = Node(
        root_dir,
        {"rules": [{"name": "job", "uid": NOBODY, "devices": ["0"]}]},
        ("--max-connections", "64", "--max-per-uid", "16"),
    ).start()
    holders: list[int] = []
    try:
        for uid in (STRANGER, STRANGER - 1, STRANGER - 2, STRANGER - 3):

            def flood(w: int) -> None:
                conns, opened = [], 0
                for _ in range(16):
                    try:
                        c = AgentConnection(n.sock)
                        c.call("ping")
                        conns.append(c)
                        opened += 1
                    except PowerlibError:
                        pass
                os.write(w, f"{opened}\n".encode())
                time.sleep(60)

            pid, r = spawn_as(uid, flood)
            holders.append(pid)
            opened = int(_read_all_line_keep(r))
            os.close(r)
            assert opened <= 16

        def job() -> list[str]:
            conns = []
            for _ in range(8):
                try:
                    conns.append(AgentConnection(n.sock))
                    conns[-1].call("ping")
                except PowerlibError as err:
                    return [type(err).__name__ + ": " + err.message]
            return [_try(lambda: conns[0].call("lock_sm_clocks", device=0, min_mhz=1005))]

        assert as_uid(NOBODY, job)["value"] == ["ok"]
    finally:
        for pid in holders:
            _kill(pid)
        n.stop()
    assert n.truth() == DEFAULT


def test_idle_connections_without_a_lease_are_closed_and_clients_reconnect(
    root_dir: Path,
) -> None:
    n = Node(
        root_dir,
        {"rules": [{"uid": NOBODY, "devices": ["*"]}]},
        ("--idle-timeout-s", "0.3"),
    ).start()
    try:

        def idle_then_work() -> dict[str, object]:
            idle = AgentConnection(n.sock)
            leasing = AgentConnection(n.sock)
            leasing.call("lock_sm_clocks", device=1, min_mhz=1005)
            backend = AgentBackend(n.client_settings())
            chatty = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            chatty.connect(str(n.sock))
            for _ in range(15):  # blank lines are not requests: they keep nothing open
                with contextlib.suppress(OSError):
                    chatty.sendall(b"\n")
                time.sleep(0.1)
            out = {"idle": _try(lambda: idle.call("ping"))}
            chatty.settimeout(5)
            try:
                out["chatty"] = chatty.recv(1) == b""
            except OSError:
                out["chatty"] = True  # reset: closed
            out["leasing"] = _try(lambda: leasing.call("lock_sm_clocks", device=1, min_mhz=1200))
            # the backend's connection was idle too, and it holds no lease: it reconnects
            out["read"] = backend.device(0).read_state().power_limit_w
            out["change"] = backend.device(0).lock_sm_clocks(1005)
            return out

        res = as_uid(NOBODY, idle_then_work)["value"]
        assert res["idle"].startswith("DeviceLostError") and res["chatty"] is True
        assert res["leasing"] == "ok" and res["read"] == 400.0 and res["change"] == [1005.0, 1005.0]
    finally:
        n.stop()
    assert n.truth() == DEFAULT


# -- Low: a failed request takes no lease -------------------------------------------------------


def test_a_failed_first_change_leaves_no_lease(node: Node) -> None:
    def fail_then_stay(w: int) -> None:
        conn = AgentConnection(node.sock)
        out = _try(lambda: conn.call("lock_sm_clocks", device=0, min_mhz=5))
        os.write(w, (out + "\n").encode())
        time.sleep(60)

    pid, r = spawn_as(NOBODY, fail_then_stay)
    try:
        assert _read_all_line_keep(r).startswith(b"InvalidArgumentError")
        with AgentConnection(node.sock) as root:
            assert root.call("leases") == []
            assert root.call("lock_sm_clocks", device=0, min_mhz=1005) == [1005.0, 1005.0]
    finally:
        _kill(pid)
        os.close(r)
    assert _wait(lambda: node.truth() == DEFAULT)


# -- point 1: the agent says when it finds a value it did not set ---------------------------------


def test_a_lease_whose_device_someone_else_changed_ends_not_ok_naming_value_and_owner(
    node: Node,
) -> None:
    pid, r = _hold(node, NOBODY, 0, 250.0)
    try:
        assert _read_all_line_keep(r) == b"leased\n"
        with SimulatedBackend(
            Settings(backend="simulated", sim_gpus=GPUS, state_dir=node.state)
        ) as other:
            other.device(0).set_power_limit(150.0)  # another root process, under the lease
        os.kill(pid, signal.SIGSTOP)  # the client stops re-setting it...
        time.sleep(0.1)
    finally:
        _kill(pid)  # ...and dies: the agent's restore finds 150 W, not its 250 W
        os.close(r)
    time.sleep(0.5)
    out = node.stop()
    node.start()  # the fixture stops it again
    line = next(x for x in out.splitlines() if "not ok" in x)
    assert "power limit reads 150 W, not the 250 W" in line
    assert f"uid {NOBODY} pid {pid} (allow:nobody-gpu0)" in line and "left as found" in line
    assert node.truth()[0] == (None, 150.0)


# -- the prolog: grants by UUID, and the user's own state folder ----------------------------------


def test_slurm_gpus_are_granted_by_uuid_through_their_minor_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM_JOB_GPUS lists /dev/nvidia<N> numbers, which need not follow NVML's PCI order."""
    pytest.importorskip("pynvml")
    from click.testing import CliRunner

    from powerlib.cli import cli
    from powerlib.testing.fake_nvml import A100_SXM4_40GB, FakeNvml

    fake = FakeNvml([A100_SXM4_40GB] * 3)
    for gpu, minor in zip(fake.gpus, (2, 0, 1)):
        gpu.minor = minor
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    grants = tmp_path / "grants"
    result = CliRunner().invoke(
        cli,
        ["--backend", "nvidia", "agent", "grant", "--job", "7", "--uid", str(STRANGER),
         "--slurm-gpus", "0,2", "--grants-dir", str(grants), "--no-user-state", "--json"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["devices"] == [fake.gpus[1].uuid, fake.gpus[0].uuid]
    saved = json.loads((grants / "job-7.json").read_text())
    assert saved["devices"] == [fake.gpus[1].uuid, fake.gpus[0].uuid]
    bad = CliRunner().invoke(
        cli,
        ["--backend", "nvidia", "agent", "grant", "--job", "8", "--uid", str(STRANGER),
         "--slurm-gpus", "5", "--grants-dir", str(grants), "--no-user-state"],
    )  # fmt: skip
    assert bad.exit_code != 0 and "no nvidia device has minor number 5" in bad.output
    assert not (grants / "job-8.json").exists()


def test_the_prolog_makes_the_users_state_folder_and_their_sessions_use_it(
    root_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import powerlib.config as config

    state = root_dir / "node"
    state.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")}
    done = subprocess.run(
        [sys.executable, "-m", "powerlib", "agent", "grant", "--job", "3", "--uid",
         str(NOBODY), "--devices", "0", "--grants-dir", str(state / "grants")],
        env={**env, "POWERLIB_STATE_DIR": str(state)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = state / "users" / str(NOBODY)
    st = folder.lstat()
    assert (st.st_uid, st.st_mode & 0o777) == (NOBODY, 0o700)
    assert (folder.parent.stat().st_uid, folder.parent.stat().st_mode & 0o777) == (0, 0o755)
    monkeypatch.setattr(config, "NODE_STATE_DIR", state)
    assert as_uid(NOBODY, lambda: str(config.default_state_dir({})))["value"] == str(folder)
    # opened up by its user after a job: closed again, not a failed prolog (a drained node)
    assert as_uid(NOBODY, lambda: os.chmod(folder, 0o777))["ok"]
    again = subprocess.run(
        [sys.executable, "-m", "powerlib", "agent", "grant", "--job", "5", "--uid",
         str(NOBODY), "--devices", "0", "--grants-dir", str(state / "grants")],
        env={**env, "POWERLIB_STATE_DIR": str(state)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert folder.lstat().st_mode & 0o777 == 0o700
    # a folder of that name that is someone else's is refused, never taken over
    os.chown(folder, STRANGER, STRANGER)
    again = subprocess.run(
        [sys.executable, "-m", "powerlib", "agent", "grant", "--job", "4", "--uid",
         str(NOBODY), "--devices", "0", "--grants-dir", str(state / "grants")],
        env={**env, "POWERLIB_STATE_DIR": str(state)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 12 and "it must be uid 65534" in again.stderr


def test_the_contrib_slurm_prolog_and_epilog_end_to_end(root_dir: Path) -> None:
    """contrib/slurm/prolog.sh and epilog.sh as written, against a real agent: the job's user
    leases its GPU from a process that outlives the job, leaves a journal for another job's GPU
    in its state folder, and an attacker plants /tmp/powerlib-<uid>; the epilog exits 0 and
    every GPU is back to its default."""
    import shutil
    import tempfile

    from powerlib.control import Change, JournalEntry, Owner, StateDir

    repo = Path(__file__).resolve().parents[2]
    state = root_dir / "node"
    state.mkdir(mode=0o700)
    n = Node(root_dir, None)
    n.env["POWERLIB_STATE_DIR"] = str(state)
    n.state = state
    n.sock = state / "agent" / "agent.sock"
    n.args[n.args.index("--socket") + 1] = str(n.sock)
    n.args[n.args.index("--grants-dir") + 1] = str(state / "grants")
    n.start()
    wrapper = root_dir / "powerlib.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m powerlib "$@"\n')
    wrapper.chmod(0o755)
    env = {
        **n.env,
        "POWERLIB": str(wrapper),
        "POWERLIB_LOG": str(root_dir / "restore.log"),
        "POWERLIB_AGENT_SOCKET": str(n.sock),
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_UID": str(STRANGER),
        "SLURM_JOB_GPUS": "1",
    }
    planted = Path(tempfile.gettempdir()) / f"powerlib-{STRANGER}"
    shutil.rmtree(planted, ignore_errors=True)
    pid = None
    try:
        prolog = subprocess.run(["sh", str(repo / "contrib/slurm/prolog.sh")], env=env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert prolog.returncode == 0, prolog.stderr
        with AgentConnection(n.sock) as conn:
            uuids = [d["device_id"] for d in conn.call("devices")]
        grant = json.loads((state / "grants" / "job-1234.json").read_text())
        assert grant["devices"] == [uuids[1]]
        pid, r = _hold(n, STRANGER, 1, 250.0)  # started over ssh: outlives the job
        assert _read_all_line_keep(r) == b"leased\n"
        folder = state / "users" / str(STRANGER)
        me = Owner.current()
        dead = Owner(pid=me.pid, start_time_s=me.start_time_s - 60, hostname=me.hostname)

        def leave_journal() -> None:
            write_journal(StateDir(folder).prepare(), JournalEntry(
                device_id=uuids[0], device_name="x", backend="simulated", backend_settings={},
                owner=dead, created_s=1.0,
                changes=(Change(item="power_limit", original=100.0, target=100.0),),
            ))  # fmt: skip

        assert as_uid(STRANGER, leave_journal)["ok"]
        assert as_uid(NOBODY, lambda: os.mkdir(planted, 0o777))["ok"]
        epilog = subprocess.run(["sh", str(repo / "contrib/slurm/epilog.sh")], env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        log = (root_dir / "restore.log").read_text()
        assert epilog.returncode == 0, log + epilog.stderr
        assert n.truth() == DEFAULT, log
        assert "not filed under one of the job's devices" in log and str(planted) in log
        assert "1 lease(s) ended and restored" in log, log
        os.close(r)
    finally:
        if pid is not None:
            _kill(pid)
        shutil.rmtree(planted, ignore_errors=True)
        n.stop()


def test_a_full_connection_table_never_turns_away_roots_revoke(root_dir: Path) -> None:
    n = Node(
        root_dir,
        {"rules": [{"name": "job", "uid": NOBODY, "devices": ["*"]}]},
        ("--max-connections", "4", "--max-per-uid", "4"),
    ).start()
    try:

        def fill(w: int) -> None:
            conns = [AgentConnection(n.sock) for _ in range(4)]
            for c in conns:
                c.call("ping")
            os.write(w, b"full\n")
            time.sleep(60)

        pid, r = spawn_as(NOBODY, fill)
        try:
            assert _read_all_line_keep(r) == b"full\n"

            refused = as_uid(STRANGER, lambda: open_connections(n.sock, 1))["value"]
            assert refused[0].startswith("PermissionDeniedError: the agent holds 4"), refused
            done = _cli(n, "agent", "revoke", "--job", "1", "--grants-dir", str(n.grants))
            assert done.returncode == 0 and "0 lease(s) ended" in done.stdout, done.stderr
        finally:
            _kill(pid)
            os.close(r)
    finally:
        n.stop()
