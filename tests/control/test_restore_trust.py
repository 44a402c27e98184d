"""`powerlib restore` as root on a shared node: it acts only on state it can trust.

The tests run as root (as the epilog does). A state folder or journal owned by another uid
(12345), writable by group or others, or not a real folder / regular file (symlink, fifo) is
refused with one line naming path, owner and mode, exit 12, and the device is left as it was.
Garbage journals exit 11, a journal never redirects where a restore writes, and a restore that
could not act (read-only or unlistable state folder, a driver that refused, a device still
modified afterwards) exits non-zero with ``"ok": false`` and a ``still_modified`` list.

Two conditions cannot be made for root with modes alone: a read-only folder is made with
``chattr +i`` (an immutable folder: even root cannot create or remove entries, and
``os.access`` reports it; skipped where the file system has no such attribute), and an
unlistable folder is exercised in a forked child that drops to uid 12345 (modes then apply).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from powerlib.backends.simulated import SimulatedBackend, SimulatedDevice
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import Change, DeviceLock, JournalEntry, Owner, StateDir, device_key
from powerlib.control.journal import write_journal
from powerlib.errors import PermissionDeniedError, UntrustedStateError
from powerlib.registry import open_backend

OTHER_UID = 12345
ORIGINAL = (None, 400.0)  # (SM clock lock, power limit W) of a fresh simulated A100
MODIFIED = ((900.0, 900.0), 175.0)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _dead_owner() -> Owner:
    """This pid with another start time: a process that no longer runs."""
    me = Owner.current()
    return Owner(pid=me.pid, start_time_s=me.start_time_s - 3600.0, hostname=me.hostname)


def _backend(state_dir: Path) -> SimulatedBackend:
    return SimulatedBackend(Settings(backend="simulated", state_dir=state_dir, sim_gpus=2))


def _device_state(state_dir: Path) -> tuple[Any, Any]:
    with _backend(state_dir) as backend:
        st = backend.device(0).read_state()
    return st.locked_sm_freqs_mhz, st.power_limit_w


def _entry(device_id: str, backend: str = "simulated", **settings: Any) -> JournalEntry:
    return JournalEntry(
        device_id=device_id,
        device_name="Simulated",
        backend=backend,
        backend_settings={"sim_model": "a100", "sim_gpus": 2, **settings},
        owner=_dead_owner(),
        created_s=1.0,
        changes=(
            Change(item="sm_clocks", original=None),
            Change(item="power_limit", original=400.0, target=175.0),
        ),
    )


def _crashed_session(state_dir: Path) -> Path:
    """What a SIGKILLed session leaves: device 0 modified, its journal naming a dead owner."""
    with _backend(state_dir) as backend:
        dev = backend.device(0)
        path = write_journal(StateDir(state_dir).prepare(), _entry(dev.device_id))
        dev.lock_sm_clocks(900)
        dev.set_power_limit(175)
    assert _device_state(state_dir) == MODIFIED
    return path


def _restore(state_dir: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(
        cli,
        ["restore", *args],
        env={"POWERLIB_STATE_DIR": str(state_dir), **(env or {})},
        catch_exceptions=False,
    )


def _one_error_line(result: Result) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("powerlib: error: ") and "Traceback" not in result.output
    return lines[0]


def _assert_names_owner_and_mode(line: str, path: Path, uid: int, mode: int) -> None:
    assert str(path) in line, line
    assert f"owner uid {uid}" in line, line
    assert re.search(rf"mode {mode:04o} ", line), line


# -- the state folder itself --------------------------------------------------------------------


def _chown_tree(root: Path, uid: int) -> None:
    for folder, dirs, files in os.walk(root):
        os.chown(folder, uid, uid)
        for name in dirs + files:
            os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)


def _owned_by_another_user(state: Path) -> Path:
    _chown_tree(state, OTHER_UID)
    return state


def _world_writable(state: Path) -> Path:
    state.chmod(0o777)
    return state


def _group_writable(state: Path) -> Path:
    state.chmod(0o770)
    return state


def _journal_folder_world_writable(state: Path) -> Path:
    (state / "journal").chmod(0o707)
    return state / "journal"


def _locks_folder_owned_by_another_user(state: Path) -> Path:
    os.chown(state / "locks", OTHER_UID, OTHER_UID)
    return state / "locks"


@pytest.mark.parametrize(
    "plant",
    [
        _owned_by_another_user,
        _world_writable,
        _group_writable,
        _journal_folder_world_writable,
        _locks_folder_owned_by_another_user,
    ],
)
def test_an_untrusted_state_folder_is_refused_and_the_device_left_alone(
    tmp_path: Path, plant: Callable[[Path], Path]
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    refused = plant(state)
    st = refused.lstat()
    result = _restore(state, "--json")
    assert result.exit_code == 12
    line = _one_error_line(result)
    _assert_names_owner_and_mode(line, refused, st.st_uid, stat.S_IMODE(st.st_mode))
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["exit_code"] == 12 and data["still_modified"]
    assert _device_state(state) == MODIFIED and journal.exists()


def test_another_users_folder_is_never_restored_with_that_users_values(tmp_path: Path) -> None:
    """The epilog line before 0.31 (`--trust-owner UID` over the user's folder) applied the
    user's journal values as root; it is now refused in one line and changes nothing."""
    state = tmp_path / "state"
    journal = _crashed_session(state)
    _chown_tree(state, OTHER_UID)
    assert _restore(state).exit_code == 12 and _device_state(state) == MODIFIED
    result = _restore(state, "--trust-owner", str(OTHER_UID), "--json")
    assert result.exit_code == 7, result.output
    assert "acts only on that user's job's devices" in _one_error_line(result)
    assert _device_state(state) == MODIFIED and journal.exists()


def test_a_symlinked_state_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    _crashed_session(real)
    link = tmp_path / "state"
    link.symlink_to(real)
    result = _restore(link)
    assert result.exit_code == 12
    line = _one_error_line(result)
    _assert_names_owner_and_mode(line, link, 0, 0o777)
    assert "symlink" in line and _device_state(real) == MODIFIED


def test_a_symlinked_journal_folder_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _crashed_session(state)
    elsewhere = tmp_path / "elsewhere"
    (state / "journal").rename(elsewhere)
    (state / "journal").symlink_to(elsewhere)
    result = _restore(state)
    assert result.exit_code == 12 and "symlink" in _one_error_line(result)
    assert _device_state(state) == MODIFIED


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_state_path_that_is_not_a_folder_is_refused_not_nothing_to_restore(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "state"
    if kind == "file":
        path.write_text("not a folder")
    else:
        os.mkfifo(path, 0o600)
    result = _restore(path)
    assert result.exit_code == 12 and "nothing to restore" not in result.stdout
    line = _one_error_line(result)
    _assert_names_owner_and_mode(line, path, 0, stat.S_IMODE(path.lstat().st_mode))
    assert f"a {'regular file' if kind == 'file' else 'fifo'}, not a folder" in line


def test_a_state_path_under_a_file_is_an_invalid_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = _restore(blocker / "state")
    assert result.exit_code == 7 and "a part of its path is a file" in _one_error_line(result)


def test_a_state_folder_others_can_swap_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    _crashed_session(parent / "state")
    parent.chmod(0o777)  # anyone could rename the state folder away and plant their own
    with pytest.raises(UntrustedStateError, match="lets others replace it"):
        StateDir(parent / "state").prepare()  # a session refuses to journal there, too
    result = _restore(parent / "state")
    assert result.exit_code == 12
    line = _one_error_line(result)
    _assert_names_owner_and_mode(line, parent, 0, 0o777)
    parent.chmod(0o1777)  # sticky, like /tmp: only the owner may rename it
    assert _restore(parent / "state").exit_code == 0
    assert _device_state(parent / "state") == ORIGINAL


def test_nothing_to_restore_only_when_missing_or_trusted_and_empty(tmp_path: Path) -> None:
    missing = _restore(tmp_path / "missing")
    assert missing.exit_code == 0 and "nothing to restore" in missing.stdout
    assert not (tmp_path / "missing").exists()  # a restore creates nothing
    empty = tmp_path / "empty"
    StateDir(empty).prepare()
    result = _restore(empty, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True
    assert json.loads(result.stdout)["outcomes"] == []


# -- journal files ------------------------------------------------------------------------------


def _journal_owned_by_another_user(path: Path) -> None:
    os.chown(path, OTHER_UID, OTHER_UID)


def _journal_world_writable(path: Path) -> None:
    path.chmod(0o666)


def _journal_group_writable(path: Path) -> None:
    path.chmod(0o620)


def _journal_symlink(path: Path) -> None:
    target = path.parent.parent / "planted.json"
    path.rename(target)
    path.symlink_to(target)


def _journal_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def _journal_folder(path: Path) -> None:
    path.unlink()
    path.mkdir(mode=0o700)


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (_journal_owned_by_another_user, "it is not owned by uid 0"),
        (_journal_world_writable, "writable by group and others"),
        (_journal_group_writable, "writable by group"),
        (_journal_symlink, "it is a symlink, not a regular file"),
        (_journal_fifo, "it is a fifo, not a regular file"),
        (_journal_folder, "it is a folder, not a regular file"),
    ],
)
def test_an_untrusted_journal_is_refused_with_one_line_and_left(
    tmp_path: Path, plant: Callable[[Path], None], reason: str
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    plant(journal)
    st = journal.lstat()
    result = _restore(state, "--json")
    assert result.exit_code == 12, result.output
    line = _one_error_line(result)
    _assert_names_owner_and_mode(line, journal, st.st_uid, stat.S_IMODE(st.st_mode))
    assert reason in line
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert [(m["journal"], m["item"], m["error_code"]) for m in data["still_modified"]] == [
        (str(journal), "unknown", 12)
    ]
    assert _device_state(state) == MODIFIED and os.path.lexists(journal)


def _deep(path: Path) -> None:
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


def _deep_objects(path: Path) -> None:
    path.write_bytes(b'{"a":' * 100_000 + b"0" + b"}" * 100_000)


def _binary(path: Path) -> None:
    path.write_bytes(b"\x00\x01powerlib\xff")


def _not_utf8(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b'"Simulated"', b'"Simul\xe9"'))


def _huge(path: Path) -> None:
    path.write_bytes(b" " * (2 * 1024 * 1024) + path.read_bytes())


def _rewrite(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return plant


def _set_original_w(value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data["changes"][1]["original"] = value

    return change


def _misfiled(path: Path) -> None:
    path.rename(path.with_name("simulated--GPU-other.json"))


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (_deep, "nested more than 16 levels deep"),
        (_deep_objects, "nested more than 16 levels deep"),
        (_binary, "binary"),
        (_not_utf8, "not UTF-8 text (invalid byte 0xe9"),
        (_huge, "over the 1.0 MiB input limit"),
        (_rewrite(_set_original_w(float("nan"))), "power_limit original is not finite"),
        (_rewrite(_set_original_w("400")), "power_limit original is not a number"),
        (_rewrite(_set_original_w(None)), "the original power limit is missing"),
        (_rewrite(lambda d: d["owner"].update(pid=True)), "owner pid True is not a process id"),
        (_rewrite(lambda d: d.update(changes={"a": 1})), "changes is not a list"),
        (_rewrite(lambda d: d.update(backend="../evil")), "is not a backend name"),
        (
            _rewrite(lambda d: d["backend_settings"].update(sim_model="../../etc")),
            "sim_model '../../etc' is not a model name",
        ),
        (
            _rewrite(lambda d: d["changes"].append(d["changes"][1])),
            "item 'power_limit' appears twice",
        ),
        (_rewrite(lambda d: d["changes"][0].update(original=[1300, 900])), "not a clock range"),
    ],
)
def test_a_garbage_journal_exits_11_with_one_line_and_is_left(
    tmp_path: Path, plant: Callable[[Path], None], reason: str
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    plant(journal)
    for path in state.joinpath("journal").iterdir():
        journal, content = path, path.read_bytes()
    result = _restore(state, "--json")
    assert result.exit_code == 11, result.output
    line = _one_error_line(result)
    assert reason in line and str(journal) in line
    assert json.loads(result.stdout)["ok"] is False
    assert _device_state(state) == MODIFIED and journal.read_bytes() == content


def test_a_misfiled_journal_is_not_restored(tmp_path: Path) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    _misfiled(journal)
    result = _restore(state)
    assert result.exit_code == 11 and "whose journal is simulated--GPU-" in _one_error_line(result)
    assert _device_state(state) == MODIFIED


def test_a_device_id_in_a_journal_must_match_exactly(tmp_path: Path) -> None:
    """A journal naming device "0" (an index) must not restore device 0."""
    state = tmp_path / "state"
    journal = _crashed_session(state)
    data = json.loads(journal.read_text())
    journal.unlink()
    data["device_id"] = "0"
    (state / "journal" / f"{device_key('simulated', '0')}.json").write_text(json.dumps(data))
    result = _restore(state)
    assert result.exit_code == 6 and "no simulated device has the id 0" in _one_error_line(result)
    assert _device_state(state) == MODIFIED


# -- a journal never redirects where a restore writes --------------------------------------------


def test_a_recorded_sysfs_root_never_redirects_the_restore(tmp_path: Path) -> None:
    from powerlib.testing.sysfs import make_cpufreq_tree, make_powercap_tree

    trees = {}
    for name in ("invoking", "planted"):
        root = tmp_path / name
        make_powercap_tree(root, packages=1)
        make_cpufreq_tree(root, packages=1)
        trees[name] = root

    def limits() -> dict[str, str]:
        return {
            name: "".join(
                p.read_text() for p in sorted(root.glob("**/constraint_*_power_limit_uw"))
            )
            for name, root in trees.items()
        }

    state = tmp_path / "state"
    with open_backend(
        settings=Settings(backend="sysfs", sysfs_root=trees["planted"], state_dir=state)
    ) as backend:
        backend.device(0).set_power_limit(90.0)  # what the journal says the killed job set
    before = limits()
    entry = JournalEntry(
        device_id="intel-rapl:0",
        device_name="package-0",
        backend="sysfs",
        backend_settings={"sysfs_root": str(trees["planted"])},
        owner=_dead_owner(),
        created_s=1.0,
        changes=(Change(item="power_limit", original=100.0, target=90.0),),
    )
    journal = write_journal(StateDir(state).prepare(), entry)
    result = _restore(state, env={"POWERLIB_SYSFS_ROOT": str(trees["invoking"])})
    assert result.exit_code == 12
    line = _one_error_line(result)
    assert str(trees["planted"]) in line and "never chooses where a restore writes" in line
    assert limits() == before and journal.exists()
    # The operator who does mean that tree says so with the invoking settings.
    result = _restore(state, env={"POWERLIB_SYSFS_ROOT": str(trees["planted"])})
    assert result.exit_code == 0, result.output
    after = limits()
    assert after["invoking"] == before["invoking"] and after["planted"] != before["planted"]
    assert "100000000" in after["planted"] and not journal.exists()


def test_a_simulated_journal_writes_only_under_the_invoking_state_folder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    data = json.loads(journal.read_text())
    data["backend_settings"]["sysfs_root"] = str(tmp_path / "elsewhere")
    journal.write_text(json.dumps(data))
    assert _restore(state).exit_code == 0
    assert _device_state(state) == ORIGINAL and not (tmp_path / "elsewhere").exists()


# -- restores that could not act ----------------------------------------------------------------


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """``chattr +i`` a folder (undone afterwards); skips where the file system cannot."""
    done: list[Path] = []

    def make(path: Path) -> None:
        chattr = shutil.which("chattr")
        if chattr is None:
            pytest.skip("chattr is not installed")
        proc = subprocess.run([chattr, "+i", str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot make a folder immutable here: {proc.stderr.strip()}")
        done.append(path)

    yield make
    for path in done:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_state_folder_restores_nothing_and_says_so(
    tmp_path: Path, immutable: Callable[[Path], None]
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    immutable(state / "journal")
    assert not os.access(state / "journal", os.W_OK)  # even for root
    result = _restore(state, "--json")
    assert result.exit_code == 4
    line = _one_error_line(result)
    assert "read-only" in line and str(state / "journal") in line
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert sorted(m["item"] for m in data["still_modified"]) == ["power_limit", "sm_clocks"]
    assert _device_state(state) == MODIFIED and journal.exists()


def _as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child whose uid and gid are ``uid``; return its JSON result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
        except BaseException as err:
            out = {"crash": repr(err)}
        try:
            os.write(write_fd, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    return json.loads(raw)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder another uid can reach (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="powerlib-trust-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize(
    ("journal_mode", "code", "message"),
    [(0o300, 4, "cannot list the journals"), (0o500, 4, "read-only for uid 12345")],
)
def test_an_unlistable_or_read_only_folder_of_a_user_restores_nothing(
    shared_tmp: Path, journal_mode: int, code: int, message: str
) -> None:
    state = shared_tmp / "state"
    journal = _crashed_session(state)
    _chown_tree(state, OTHER_UID)
    (state / "journal").chmod(journal_mode)
    _restore(shared_tmp / "missing")  # lazy imports happen before the child drops root

    def restore_as_user() -> Any:
        result = _restore(state, "--json")
        return {"code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}

    out = _as_user(OTHER_UID, restore_as_user)
    assert "crash" not in out, out
    assert out["code"] == code, out
    [line] = out["stderr"].splitlines()
    assert line.startswith("powerlib: error: ") and message in line
    data = json.loads(out["stdout"])
    assert data["ok"] is False and data["still_modified"]
    (state / "journal").chmod(0o700)
    assert _device_state(state) == MODIFIED and journal.exists()


def test_a_driver_that_refuses_exits_with_its_code_and_lists_what_is_still_modified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pynvml")
    from powerlib.testing.fake_nvml import A100_SXM4_40GB, FakeNvml

    fake = FakeNvml([A100_SXM4_40GB])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    uuid = fake.gpus[0].uuid
    fake.gpus[0].power_limit_mw = 250_000  # what the killed job left
    state = tmp_path / "state"
    entry = JournalEntry(
        device_id=uuid,
        device_name="A100",
        backend="nvidia",
        backend_settings={},
        owner=_dead_owner(),
        created_s=1.0,
        changes=(Change(item="power_limit", original=400.0, target=250.0),),
    )
    journal = write_journal(StateDir(state).prepare(), entry)
    fake.fail("nvmlDeviceSetPowerManagementLimit", fake.NVML_ERROR_NO_PERMISSION)
    result = _restore(state, "--json")
    assert result.exit_code == 4, result.output
    line = _one_error_line(result)
    assert "power_limit" in line and "Insufficient Permissions" in line
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert [(m["device_id"], m["item"], m["error_code"]) for m in data["still_modified"]] == [
        (uuid, "power_limit", 4)
    ]
    assert fake.gpus[0].power_limit_mw == 250_000 and journal.exists()


def test_a_driver_that_accepts_but_does_not_apply_is_caught_by_the_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    monkeypatch.setattr(SimulatedDevice, "_set_power_limit", lambda self, w: w)  # a lying driver
    result = _restore(state, "--json")
    assert result.exit_code == 1, result.output
    line = _one_error_line(result)
    assert "still reads at 175 W: still modified" in line
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert [m["item"] for m in data["still_modified"]] == ["power_limit"]
    monkeypatch.undo()
    assert _device_state(state) == (None, 175.0)  # clocks restored, the limit truly not
    assert journal.exists()
    assert _restore(state).exit_code == 0 and _device_state(state) == ORIGINAL


def test_a_lock_that_cannot_be_taken_is_a_failure_not_a_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)

    def refuse(self: object, owner: Owner) -> None:
        raise PermissionDeniedError("cannot open the lock file (Read-only file system)")

    monkeypatch.setattr("powerlib.control.locks.DeviceLock.acquire", refuse)
    result = _restore(state, "--json")
    assert result.exit_code == 4 and "lock cannot be taken" in _one_error_line(result)
    assert json.loads(result.stdout)["ok"] is False
    assert _device_state(state) == MODIFIED and journal.exists()


def test_a_device_locked_by_a_live_process_is_a_busy_failure(tmp_path: Path) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    lock = DeviceLock(StateDir(state), journal.stem)
    lock.acquire(Owner.current())  # another controller holds the device
    try:
        result = _restore(state, "--json")
    finally:
        lock.release()
    assert result.exit_code == 8 and "lock cannot be taken" in _one_error_line(result)
    assert json.loads(result.stdout)["ok"] is False
    assert _device_state(state) == MODIFIED and journal.exists()


# -- the legitimate case ------------------------------------------------------------------------


def test_a_private_folder_with_a_stale_journal_is_restored_to_the_original(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    journal = _crashed_session(state)
    for folder in (state / "journal", state / "locks"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not state.stat().st_mode & 0o022  # (the simulated backend made it, with the umask)
    assert stat.S_IMODE(journal.stat().st_mode) == 0o600
    result = _restore(state, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["still_modified"] == [] and data["exit_code"] == 0
    assert {o["item"] for o in data["outcomes"]} == {"sm_clocks", "power_limit"}
    assert all(o["action"].endswith("done") for o in data["outcomes"])
    assert _device_state(state) == ORIGINAL and not journal.exists()
    again = _restore(state)
    assert again.exit_code == 0 and "nothing to restore" in again.stdout


# -- where the state lives ----------------------------------------------------------------------


def test_a_users_default_state_is_their_own_runtime_dir_or_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from powerlib.config import default_state_dir

    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)  # a user, not root
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, OTHER_UID, OTHER_UID)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    assert default_state_dir(env) == runtime / "powerlib"
    tmp_default = Path(tempfile.gettempdir()) / f"powerlib-{OTHER_UID}"
    runtime.chmod(0o777)  # writable by others: not a private runtime dir
    assert default_state_dir(env) == tmp_default
    runtime.chmod(0o700)
    os.chown(runtime, 0, 0)  # someone else's (sudo keeps the caller's XDG_RUNTIME_DIR)
    assert default_state_dir(env) == tmp_default
    assert default_state_dir({}) == tmp_default
