"""Journals, owners and locks: atomic, private, never fooled by symlinks or reused pids."""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from powerlib import DeviceBusyError, PermissionDeniedError
from powerlib.control import (
    Change,
    DeviceLock,
    JournalEntry,
    JournalError,
    Owner,
    StateDir,
    device_key,
    iter_entries,
)
from powerlib.control.journal import journal_path, read_journal, write_journal
from powerlib.errors import UntrustedStateError


def _entry(owner: Owner | None = None, device_id: str = "GPU-1234") -> JournalEntry:
    return JournalEntry(
        device_id=device_id,
        device_name="Simulated",
        backend="simulated",
        backend_settings={"sim_model": "a100", "sim_gpus": 2, "sysfs_root": "/sys"},
        owner=owner or Owner.current(),
        created_s=1.0,
        changes=(Change(item="power_limit", original=350.0, target=250.0),),
    )


def test_journal_is_written_atomically_and_privately(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state").prepare()
    path = write_journal(state, _entry())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (state.root, state.journal_dir, state.lock_dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [p.name for p in state.journal_dir.iterdir()] == [path.name]  # no temporary left
    again = read_journal(state, path)
    assert again == _entry(owner=again.owner) and again.owner.pid == os.getpid()


def test_original_is_captured_once_and_only_the_target_moves() -> None:
    entry = _entry().with_change(Change(item="sm_clocks", original=None))
    entry = entry.with_change(Change(item="power_limit", original=999.0, target=200.0))
    assert [c.item for c in entry.changes] == ["power_limit", "sm_clocks"]
    assert entry.change("power_limit") == Change(
        item="power_limit", original=350.0, target=200.0, previous_target=250.0
    )


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b'{"schema": "powerlib.journal.v1", "device_id": ',
        b"[1, 2]",
        b'{"schema": "other"}',
        json.dumps(
            {**_entry().to_json(), "changes": [{"item": "fan_speed", "original": 1}]}
        ).encode(),
    ],
)
def test_corrupted_or_truncated_journals_are_reported_and_left(
    tmp_path: Path, content: bytes
) -> None:
    state = StateDir(tmp_path).prepare()
    path = state.journal_dir / "bad.json"
    path.write_bytes(content)
    with pytest.raises(JournalError, match="bad.json"):
        read_journal(state, path)
    [(found, error)] = list(iter_entries(state))
    assert found == path and isinstance(error, JournalError)
    assert path.read_bytes() == content


def test_symlinks_are_not_followed(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state").prepare()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(_entry().to_json()))
    link = state.journal_dir / "link.json"
    link.symlink_to(target)
    with pytest.raises(UntrustedStateError, match="link.json .*mode 0777 lrwx.*it is a symlink"):
        read_journal(state, link)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked-state").symlink_to(real)
    with pytest.raises(UntrustedStateError, match="linked-state .*it is a symlink"):
        StateDir(tmp_path / "linked-state").prepare()


def test_a_state_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionDeniedError, match="will not change a device"):
        StateDir(blocker / "state").prepare()


def test_owner_liveness_uses_pid_and_start_time() -> None:
    me = Owner.current()
    assert me.is_alive()
    reused = Owner(pid=me.pid, start_time_s=me.start_time_s - 3600, hostname=me.hostname)
    assert not reused.is_alive()  # same pid, another process: not the owner
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone = Owner(pid=int(done.stdout), start_time_s=me.start_time_s, hostname=me.hostname)
    assert not gone.is_alive()
    elsewhere = Owner(pid=1, start_time_s=0.0, hostname="another-host")
    assert elsewhere.is_alive()  # cannot tell: never restore another host's devices


def test_device_key_is_file_name_safe() -> None:
    assert device_key("sysfs", "intel-rapl:0") == "sysfs--intel-rapl_0"
    assert "/" not in device_key("x", "../../etc/passwd")


def test_lock_is_exclusive_within_and_across_processes(tmp_path: Path) -> None:
    state = StateDir(tmp_path).prepare()
    lock = DeviceLock(state, "k")
    lock.acquire(Owner.current())
    with pytest.raises(DeviceBusyError, match=str(os.getpid())):
        DeviceLock(state, "k").acquire(Owner.current())
    assert not DeviceLock.is_free(state, "k")
    code = (
        "import sys; from pathlib import Path; from powerlib.control import StateDir, DeviceLock, Owner\n"
        f"s = StateDir(Path({str(tmp_path)!r}))\n"
        "try:\n    DeviceLock(s, 'k').acquire(Owner.current())\nexcept Exception as e:\n    print(e); sys.exit(3)\n"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert other.returncode == 3 and f"pid {os.getpid()}" in other.stdout
    lock.release()
    lock.release()  # idempotent
    assert DeviceLock.is_free(state, "k")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stdout + other.stderr


def test_every_field_survives_the_round_trip(tmp_path: Path) -> None:
    state = StateDir(tmp_path).prepare()
    entry = _entry().with_change(Change(item="power_limit", original=1.0, target=190.0))
    assert entry.change("power_limit") == Change(
        item="power_limit", original=350.0, target=190.0, previous_target=250.0
    )
    assert read_journal(state, write_journal(state, entry)) == entry


def test_a_refusal_names_path_owner_with_user_name_and_mode(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state").prepare()
    path = write_journal(state, _entry())
    os.chown(path, 65534, 65534)  # "nobody" in every passwd this runs on
    user = pwd.getpwuid(65534).pw_name
    with pytest.raises(UntrustedStateError) as info:
        read_journal(state, path)
    line = str(info.value)
    assert "\n" not in line and str(path) in line
    assert f"owner uid 65534 ({user})" in line and "mode 0600 -rw-------" in line
    assert read_journal(StateDir(state.root, trusted_uids=[65534]), path).device_id == "GPU-1234"


def test_the_journal_checked_is_the_journal_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owner and mode come from fstat on the opened descriptor, not from a path lookup."""
    state = StateDir(tmp_path / "state").prepare()
    path = write_journal(state, _entry())
    trusted_looking = os.lstat(path)
    path.chmod(0o666)
    real_lstat = os.lstat
    monkeypatch.setattr(  # a racing swap: the path lookup sees a good file, the open another
        "powerlib.control.journal.os.lstat",
        lambda p, *a, **k: trusted_looking if Path(p) == path else real_lstat(p, *a, **k),
    )
    with pytest.raises(UntrustedStateError, match="mode 0666"):
        read_journal(state, path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested more than 16 levels"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{}\x00", "binary"),
        (b" " * (1024 * 1024 + 1), "over the 1.0 MiB input limit"),
    ],
)
def test_hostile_journals_are_one_line_errors_not_crashes(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    state = StateDir(tmp_path).prepare()
    path = state.journal_dir / "simulated--GPU-1234.json"
    path.write_bytes(content)
    with pytest.raises(JournalError, match=reason) as info:
        read_journal(state, path)
    assert "\n" not in str(info.value) and "left in place" in str(info.value)
    assert "POWERLIB_MAX_INPUT_BYTES" not in str(info.value)  # the journal cap is fixed


def test_a_folder_that_others_own_or_can_write_is_refused_for_sessions_too(
    tmp_path: Path,
) -> None:
    owned = tmp_path / "owned"
    owned.mkdir(mode=0o700)
    os.chown(owned, 12345, 12345)
    with pytest.raises(UntrustedStateError, match="owner uid 12345"):
        StateDir(owned).prepare()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedStateError, match="writable by group and others"):
        StateDir(shared).prepare()
    assert not (shared / "journal").exists()  # refused before anything is created in it


def test_a_lock_owner_file_is_read_bounded(tmp_path: Path) -> None:
    state = StateDir(tmp_path).prepare()
    lock = DeviceLock(state, "k")
    lock.owner_path.write_bytes(b"[" * 100_000)
    assert lock.read_owner() is None
    lock.owner_path.write_text(json.dumps(Owner.current().to_json()))
    assert lock.read_owner() == Owner.current()


def test_a_planted_link_at_a_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state").prepare()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    entry = _entry()
    final = journal_path(state, entry.key)
    os.link(victim, final.with_name(f".{final.name}.{os.getpid()}.tmp"))
    lock = DeviceLock(state, "k")
    os.link(victim, lock.owner_path.with_name(f".{lock.owner_path.name}.{os.getpid()}.tmp"))
    assert read_journal(state, write_journal(state, entry)) == entry
    lock.acquire(Owner.current())
    lock.release()
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("kind", ["hard link", "fifo", "world-writable"])
def test_a_lock_file_that_is_not_a_private_regular_file_is_refused(
    tmp_path: Path, kind: str
) -> None:
    state = StateDir(tmp_path / "state").prepare()
    lock = DeviceLock(state, "k")
    if kind == "hard link":
        other = tmp_path / "other"
        other.write_text("")
        os.link(other, lock.path)
        reason = "2 hard links"
    elif kind == "fifo":
        os.mkfifo(lock.path, 0o600)
        reason = "it is a fifo"
    else:
        lock.path.touch(mode=0o600)
        lock.path.chmod(0o666)
        reason = "writable by group and others"
    with pytest.raises(UntrustedStateError, match=reason):
        lock.acquire(Owner.current())
    assert not lock.is_held
