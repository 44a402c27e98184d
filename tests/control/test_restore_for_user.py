"""`powerlib restore --for-user`: root in a Slurm epilog, acting for the job's user.

Every attack here is made by another uid (a forked child that drops to it) against root's
restore, on simulated GPUs whose state lives in root's own state folder (the node's devices):

* a user's journal naming another job's GPU, or a CPU-style "original" value: the other GPU is
  never touched, and the job's own GPU is reset to the driver default, never to the journal's
  value (issue 31, point 1);
* a device another process has leased (its lock in root's state folder): left to the lease;
* a folder planted in /tmp under the victim's name, a garbage journal, a 0777 folder: skipped and
  logged, exit 0 (the epilog must not drain the node, point 5);
* `journal/` and `locks/` swapped for symlinks into root-only folders while root restores:
  nothing of root's is unlinked or created (point 7).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from powerlib.agent.node import make_user_state_dir
from powerlib.backends.simulated import SimulatedBackend
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import (
    Change,
    DeviceLock,
    JournalEntry,
    Owner,
    StateDir,
    device_key,
    restore_for_user,
)
from powerlib.control.journal import write_journal

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attacks as other uids need root")

USER = 12345  # the job's user
ATTACKER = 12346  # another user of the node
DEFAULT = (None, 400.0)  # (SM clock lock, power limit W) of a fresh simulated A100


@pytest.fixture
def node() -> Iterator[Path]:
    """Root's state folder (0755, like /run/powerlib) in a folder the users can traverse."""
    top = Path(tempfile.mkdtemp(prefix="powerlib-epilog-"))
    top.chmod(0o755)
    state = top / "run-powerlib"
    state.mkdir(mode=0o755)
    with _backend(state) as backend:  # the node's two GPUs, persisted in root's state folder
        backend.devices()
    yield state
    shutil.rmtree(top, ignore_errors=True)


def _settings(state: Path) -> Settings:
    return Settings(backend="simulated", state_dir=state, sim_gpus=2)


def _backend(state: Path) -> SimulatedBackend:
    return SimulatedBackend(_settings(state))


def _uuids(state: Path) -> list[str]:
    with _backend(state) as backend:
        return [d.device_id for d in backend.devices()]


def _truth(state: Path) -> list[tuple[Any, Any]]:
    with _backend(state) as backend:
        return [
            (s.locked_sm_freqs_mhz, s.power_limit_w)
            for s in (d.read_state() for d in backend.devices())
        ]


def _modify(state: Path, index: int, clock_mhz: float, limit_w: float) -> None:
    with _backend(state) as backend:
        dev = backend.device(index)
        dev.lock_sm_clocks(clock_mhz)
        dev.set_power_limit(limit_w)


def _as(uid: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child that dropped to ``uid``; its JSON result (or the crash)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out: Any = {"value": fn()}
        except BaseException as err:
            out = {"crash": repr(err)}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    out = json.loads(raw)
    assert "crash" not in out, out
    return out["value"]


def _dead_owner() -> dict[str, Any]:
    me = Owner.current()
    return Owner(pid=me.pid, start_time_s=me.start_time_s - 3600, hostname=me.hostname).to_json()


def _plant_journal(folder: Path, device_id: str, original_w: float, clocks: list[float]) -> Path:
    """As the user: a journal in their own state folder saying what to "restore"."""

    def write() -> str:
        entry = JournalEntry(
            device_id=device_id,
            device_name="Simulated",
            backend="simulated",
            backend_settings={"sim_model": "a100", "sim_gpus": 1024},  # never used for a user
            owner=Owner.from_json(_dead_owner()),
            created_s=1.0,
            changes=(
                Change(item="sm_clocks", original=clocks),
                Change(item="power_limit", original=original_w, target=original_w),
            ),
        )
        return str(write_journal(StateDir(folder).prepare(), entry))

    return Path(_as(USER, write))


def _restore(state: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(
        cli,
        ["restore", *args],
        env={
            "POWERLIB_STATE_DIR": str(state),
            "POWERLIB_BACKEND": "simulated",
            "POWERLIB_SIM_GPUS": "2",
            **(env or {}),
        },
        catch_exceptions=False,
    )


def _user_dir(state: Path) -> Path:
    return make_user_state_dir(state, USER)  # the prolog's `powerlib agent grant`


# -- point 1: only the job's devices, and never a value from the user's files ------------------


def test_a_users_journal_never_changes_another_jobs_gpu(node: Path) -> None:
    job_gpu, other_gpu = _uuids(node)
    folder = _user_dir(node)
    journal = _plant_journal(folder, other_gpu, 100.0, [1005.0, 1005.0])
    # the epilog line before this release, run over the user's folder: refused, nothing done
    legacy = _restore(folder, "--trust-owner", str(USER), "--json")
    assert legacy.exit_code == 7, legacy.output
    assert legacy.stderr.count("\n") == 1
    assert "acts only on that user's job's devices" in legacy.stderr
    assert _truth(node) == [DEFAULT, DEFAULT]
    # today's epilog: the other job's GPU is not the user's to touch
    result = _restore(node, "--for-user", str(USER), "--devices", job_gpu, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["devices"] == [job_gpu]
    [skipped] = data["outcomes"]
    assert (
        skipped["skipped"] is True
        and "1 journal file(s) not filed under one of the job's" in skipped["action"]
    )
    assert _truth(node) == [DEFAULT, DEFAULT] and journal.exists()


def test_the_jobs_gpu_is_reset_to_the_driver_default_never_to_the_journals_value(
    node: Path,
) -> None:
    job_gpu, _ = _uuids(node)
    _modify(node, 0, 900.0, 175.0)  # what the killed job left on its GPU
    folder = _user_dir(node)
    journal = _plant_journal(folder, job_gpu, 100.0, [1005.0, 1005.0])  # a lie about "before"
    result = _restore(node, "--for-user", str(USER), "--devices", "0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {o["item"] for o in data["outcomes"]} == {"sm_clocks", "power_limit"}
    assert all("reset to the driver default" in o["action"] for o in data["outcomes"])
    assert _truth(node) == [DEFAULT, DEFAULT]  # 400 W and unlocked, not 100 W and 1005 MHz
    assert not journal.exists()  # removed once the device is back
    assert len(list((node / "simulated").iterdir())) == 4  # 2 GPUs x (state, lock), not 1024


def test_a_restore_for_a_user_reads_the_devices_from_the_jobs_grant(node: Path) -> None:
    from powerlib.agent.authz import write_grant

    job_gpu, other_gpu = _uuids(node)
    _modify(node, 0, 900.0, 175.0)
    _modify(node, 1, 900.0, 175.0)  # another job's, leased through the agent say
    folder = _user_dir(node)
    _plant_journal(folder, job_gpu, 100.0, [1005.0, 1005.0])
    _plant_journal(folder, other_gpu, 100.0, [1005.0, 1005.0])
    grants = node / "grants"
    write_grant(grants, "77", USER, [job_gpu])
    result = _restore(node, "--for-user", str(USER), "--job", "77", "--grants-dir", str(grants))
    assert result.exit_code == 0, result.output
    assert _truth(node) == [DEFAULT, ((900.0, 900.0), 175.0)]
    wrong = _restore(node, "--for-user", str(ATTACKER), "--job", "77", "--grants-dir", str(grants))
    assert wrong.exit_code == 7 and "grant is for uid 12345, not uid 12346" in wrong.stderr


def test_a_device_leased_by_a_live_process_is_left_to_its_lease(node: Path) -> None:
    """The lock is root's (where the agent's leases hold theirs), not the user's folder."""
    job_gpu, _ = _uuids(node)
    _modify(node, 0, 1200.0, 250.0)  # a live lease's settings
    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:  # pragma: no cover - the lease holder (root, like the agent)
        lock = DeviceLock(StateDir(node).prepare(), device_key("simulated", job_gpu))
        lock.acquire(Owner.current())
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        folder = _user_dir(node)
        journal = _plant_journal(folder, job_gpu, 100.0, [1005.0, 1005.0])
        result = _restore(node, "--for-user", str(USER), "--devices", job_gpu, "--json")
        assert result.exit_code == 0, result.output
        [left] = json.loads(result.stdout)["outcomes"]
        assert left["skipped"] and f"the device is controlled by pid {holder}" in left["action"]
        assert _truth(node)[0] == ((1200.0, 1200.0), 250.0) and journal.exists()
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        os.close(r)
        os.close(w)


# -- point 5: nothing a user plants makes the epilog fail ---------------------------------------


@pytest.fixture
def planted_tmp() -> Iterator[Path]:
    path = Path(tempfile.gettempdir()) / f"powerlib-{USER}"
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_folder_planted_in_tmp_under_the_victims_name_does_not_fail_the_epilog(
    node: Path, planted_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_gpu, _ = _uuids(node)
    assert _as(ATTACKER, lambda: os.mkdir(planted_tmp, 0o777)) is None  # before the job runs
    result = _restore(node, "--for-user", str(USER), "--devices", job_gpu, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    [skipped] = data["outcomes"]
    assert skipped["skipped"] and str(planted_tmp) in skipped["journal"]
    assert f"owner uid {ATTACKER}" in skipped["action"]
    # and the victim's sessions never use it: the prolog made them a folder of their own
    import powerlib.config as config

    monkeypatch.setattr(config, "NODE_STATE_DIR", node)
    folder = _user_dir(node)
    assert _as(USER, lambda: str(config.default_state_dir({}))) == str(folder)


@pytest.mark.parametrize("attack", ["garbage", "world-writable", "symlink"])
def test_what_a_user_can_put_in_their_own_folder_never_fails_the_epilog(
    node: Path, attack: str
) -> None:
    job_gpu, other_gpu = _uuids(node)
    _modify(node, 0, 900.0, 175.0)
    folder = _user_dir(node)
    name = f"{device_key('simulated', job_gpu)}.json"

    def plant() -> None:
        StateDir(folder).prepare()
        if attack == "garbage":
            (folder / "journal" / name).write_bytes(b"[" * 100_000)
            (folder / "journal" / "x.json").write_text("{}")
        elif attack == "world-writable":
            os.chmod(folder, 0o777)
        else:
            os.rmdir(folder / "journal")
            os.symlink("/etc", folder / "journal")

    _as(USER, plant)
    result = _restore(node, "--for-user", str(USER), "--devices", job_gpu, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and all(o["ok"] for o in data["outcomes"])
    if attack == "garbage":
        # the journal's values are never needed: a garbage journal filed under the job's GPU
        # still tells root which device to reset, and the other is skipped
        assert _truth(node) == [DEFAULT, DEFAULT]
        assert any(
            o["skipped"] and "skipped 1 journal file(s)" in o["action"] for o in data["outcomes"]
        )
    else:
        assert [o["skipped"] for o in data["outcomes"]] == [True]
        assert _truth(node)[0] == ((900.0, 900.0), 175.0)


# -- point 7: folders swapped between check and use ---------------------------------------------


def test_swapping_the_users_folders_for_symlinks_never_reaches_roots(node: Path) -> None:
    """The user swaps `journal/` and `locks/` for symlinks into root-only folders, as fast as it
    can, while root runs 40 epilogs: root's live journal survives and nothing is created in
    root's folders (every step goes through descriptors opened without following links)."""
    job_gpu, _ = _uuids(node)
    roots = StateDir(node).prepare()
    live = node / "journal" / f"{device_key('simulated', job_gpu)}.json"
    live.write_text("{}")  # the agent's live journal of a lease on the job's GPU
    live.chmod(0o600)
    secret = node / "root-only"
    secret.mkdir(mode=0o700)
    folder = _user_dir(node)
    _plant_journal(folder, job_gpu, 100.0, [1005.0, 1005.0])
    r, w = os.pipe()
    swapper = os.fork()
    if swapper == 0:  # pragma: no cover - the attacker: the folder's owner
        os.setgroups([])
        os.setgid(USER)
        os.setuid(USER)
        os.close(r)
        os.write(w, b"x")
        for sub, target in (("journal", roots.journal_dir), ("locks", secret)):
            os.symlink(target, folder / f".{sub}-link")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            for sub in ("journal", "locks"):
                with contextlib.suppress(OSError):
                    os.rename(folder / sub, folder / f".{sub}-real")
                    os.rename(folder / f".{sub}-link", folder / sub)
                    os.rename(folder / sub, folder / f".{sub}-link")
                    os.rename(folder / f".{sub}-real", folder / sub)
        os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        for _ in range(40):
            restore_for_user(_settings(node), USER, [job_gpu], user_dirs=[folder])
            assert live.exists(), "root unlinked the agent's live journal through a symlink"
            assert list(secret.iterdir()) == [], "root created a file in a root-only folder"
    finally:
        os.kill(swapper, signal.SIGKILL)
        os.waitpid(swapper, 0)
        os.close(r)
        os.close(w)
    assert sorted(p.name for p in (node / "journal").iterdir()) == [live.name]


# -- found by the attack review ----------------------------------------------------------------


def test_an_item_the_device_cannot_reset_is_skipped_never_a_failure(node: Path) -> None:
    """A well-formed journal naming memory clocks on a GPU that cannot lock them made every later
    epilog of that user fail (exit 5) and drain the node."""
    job_gpu, _ = _uuids(node)
    _modify(node, 0, 900.0, 175.0)
    folder = _user_dir(node)

    def write() -> str:
        entry = JournalEntry(
            device_id=job_gpu,
            device_name="Simulated",
            backend="simulated",
            backend_settings={},
            owner=Owner.from_json(_dead_owner()),
            created_s=1.0,
            changes=(
                Change(item="memory_clocks", original=None),
                Change(item="sm_clocks", original=[1005.0, 1005.0]),
            ),
        )
        return str(write_journal(StateDir(folder).prepare(), entry))

    journal = Path(_as(USER, write))
    with _backend(node) as backend:
        assert not backend.device(0).info.capabilities.can_lock_memory_clocks
    result = _restore(node, "--for-user", str(USER), "--devices", job_gpu, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    said = [o for o in data["outcomes"] if o["skipped"]]
    assert len(said) == 1 and "memory_clocks" in said[0]["action"]
    assert _truth(node)[0] == (None, 175.0)  # the clocks it could reset; the limit untouched
    assert not journal.exists()  # all it could tell was acted on: the next epilog is clean
    assert _restore(node, "--for-user", str(USER), "--devices", job_gpu).exit_code == 0


def test_a_folder_of_junk_journals_costs_one_line_and_no_reads(node: Path) -> None:
    job_gpu, _ = _uuids(node)
    folder = _user_dir(node)

    def junk() -> None:
        journal = StateDir(folder).prepare().journal_dir
        for i in range(5000):
            os.mkfifo(journal / f"junk-{i}.json", 0o600)  # a read of any would block

    _as(USER, junk)
    result = _restore(node, "--for-user", str(USER), "--devices", job_gpu, "--json")
    assert result.exit_code == 0, result.output
    [said] = json.loads(result.stdout)["outcomes"]
    assert said["skipped"] and "skipped 5000 journal file(s) not filed under" in said["action"]
