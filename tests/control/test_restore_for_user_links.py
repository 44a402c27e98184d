"""`powerlib restore --for-user` walks the user's folder from / and follows no link (issue 46).

The attack (hole 6): an admin's epilog restores from `--user-state-dir /scratch/U/powerlib`
(a sticky root-owned /scratch, the user's own /scratch/U, docs/cluster.md); the user swaps
/scratch/U for a symlink to the folder holding root's state folder. Before, root opened
/scratch/U/powerlib through the link (``O_NOFOLLOW`` covers the last component only), took its
own root-owned folder for the user's (root was an acceptable owner), reset the job's GPU to the
driver default instead of what root journaled and unlinked root's journal. Now every component
is opened from / with ``openat(O_NOFOLLOW)``, the components above the user's part must be
root's (not writable by others unless sticky), and the user's folder and files must be owned by
exactly that uid; anything else is one skipped line and nothing changes.

Also here: `--slurm-gpus` on the restore (Slurm's minor numbers, not indexes), and a state
folder on a FUSE mount (the user's own daemon could hang the epilog) refused before it is opened.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner, Result

from powerlib.backends.simulated import SimulatedBackend
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import Change, JournalEntry, Owner, StateDir, restore_for_user
from powerlib.control.journal import write_journal
from tests.uid_helpers import as_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attacks as other uids need root")

USER = 12345  # the job's user
DEFAULT = (None, 400.0)  # (SM clock lock, power limit W) of a fresh simulated A100
LEFT = ((900.0, 900.0), 175.0)  # what the job left, and root journaled


@dataclass
class Node:
    top: Path
    state: Path  # root's state folder, <top>/run/powerlib (like /run/powerlib)
    scratch_user: Path  # <top>/scratch/U, the user's (the admin made it for them)
    folder: Path  # <top>/scratch/U/powerlib, the admin's --user-state-dir

    def settings(self) -> Settings:
        return Settings(backend="simulated", state_dir=self.state, sim_gpus=2)

    def uuids(self) -> list[str]:
        with SimulatedBackend(self.settings()) as backend:
            return [d.device_id for d in backend.devices()]

    def truth(self) -> list[tuple[Any, Any]]:
        with SimulatedBackend(self.settings()) as backend:
            return [
                (s.locked_sm_freqs_mhz, s.power_limit_w)
                for s in (d.read_state() for d in backend.devices())
            ]


@pytest.fixture
def node() -> Iterator[Node]:
    top = Path(tempfile.mkdtemp(prefix="powerlib-scratch-"))
    top.chmod(0o755)
    run = top / "run"
    run.mkdir(mode=0o755)
    state = run / "powerlib"
    state.mkdir(mode=0o755)
    scratch = top / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)  # like /scratch or /tmp: anyone may create, only owners rename
    scratch_user = scratch / str(USER)
    scratch_user.mkdir(mode=0o755)
    os.chown(scratch_user, USER, USER)
    made = Node(top, state, scratch_user, scratch_user / "powerlib")
    with SimulatedBackend(made.settings()) as backend:
        backend.devices()
    yield made
    shutil.rmtree(top, ignore_errors=True)


def _dead_owner() -> Owner:
    me = Owner.current()
    return Owner(pid=me.pid, start_time_s=me.start_time_s - 3600, hostname=me.hostname)


def _entry(device_id: str, original_w: float) -> JournalEntry:
    return JournalEntry(
        device_id=device_id,
        device_name="Simulated",
        backend="simulated",
        backend_settings={"sim_model": "a100", "sim_gpus": 2},
        owner=_dead_owner(),
        created_s=1.0,
        changes=(
            Change(item="sm_clocks", original=None, target=[900.0, 900.0]),
            Change(item="power_limit", original=original_w, target=175.0),
        ),
    )


def _leave(node: Node, index: int) -> None:
    """What the killed job left on a GPU (900 MHz locked, 175 W)."""
    with SimulatedBackend(node.settings()) as backend:
        dev = backend.device(index)
        dev.lock_sm_clocks(900.0)
        dev.set_power_limit(175.0)


def _roots_journal(node: Node, device_id: str) -> Path:
    """Root's own journal of the job's GPU (a root session killed with the job), 300 W before."""
    return write_journal(StateDir(node.state).prepare(), _entry(device_id, 300.0))


def _users_journal(node: Node, device_id: str) -> Path:
    """As the user: their session's journal in their scratch state folder."""

    def write() -> str:
        return str(write_journal(StateDir(node.folder).prepare(), _entry(device_id, 100.0)))

    out = as_uid(USER, write)
    assert out["ok"], out
    return Path(out["value"])


def _restore(node: Node, *args: str) -> Result:
    return CliRunner().invoke(
        cli,
        ["restore", "--for-user", str(USER), *args, "--json"],
        env={
            "POWERLIB_STATE_DIR": str(node.state),
            "POWERLIB_BACKEND": "simulated",
            "POWERLIB_SIM_GPUS": "2",
        },
        catch_exceptions=False,
    )


def _one_skipped_line(result: Result) -> str:
    assert result.exit_code == 0, result.output  # a user's folder never fails the epilog
    data = json.loads(result.stdout)
    [said] = data["outcomes"]
    assert said["skipped"] is True and said["ok"] is True, said
    assert "\n" not in said["action"]
    return str(said["action"])


# -- hole 6: the attack -------------------------------------------------------------------------


def test_a_user_swapping_their_scratch_folder_for_a_link_never_reaches_roots_state(
    node: Node,
) -> None:
    job_gpu, _ = node.uuids()
    _leave(node, 0)
    _users_journal(node, job_gpu)  # a session of the job's, in the admin's --user-state-dir
    journal = _roots_journal(node, job_gpu)
    before = journal.read_bytes()

    def swap() -> None:  # /scratch is sticky, /scratch/U is the user's: theirs to rename
        os.rename(node.scratch_user, node.scratch_user.with_name(f"{USER}.real"))
        os.symlink(node.state.parent, node.scratch_user)

    assert as_uid(USER, swap)["ok"]
    assert node.folder.resolve() == node.state  # by name, the "user's folder" is root's
    result = _restore(node, "--devices", job_gpu, "--user-state-dir", str(node.folder))
    line = _one_skipped_line(result)
    assert f"{node.scratch_user} is a symbolic link" in line, line
    assert f"skipped the state folder of uid {USER}" in line
    assert journal.read_bytes() == before  # root's journal untouched
    assert node.truth()[0] == LEFT  # as root journaled it, for root's own restore to put back


def test_the_admins_scratch_layout_still_restores(node: Node) -> None:
    job_gpu, _ = node.uuids()
    _leave(node, 0)
    journal = _users_journal(node, job_gpu)
    result = _restore(node, "--devices", job_gpu, "--user-state-dir", str(node.folder))
    assert result.exit_code == 0, result.output
    outcomes = json.loads(result.stdout)["outcomes"]
    assert {o["item"] for o in outcomes} == {"sm_clocks", "power_limit"}, outcomes
    assert node.truth()[0] == DEFAULT and not journal.exists()


# -- the rules of the walk, one refusal line each ------------------------------------------------


def test_roots_folder_inside_the_users_is_not_the_users(node: Node) -> None:
    """Root is no longer an acceptable owner of a user's folders and files: a `journal/` of
    root's in the user's folder (a root session once pointed there) holds root's journal."""
    job_gpu, _ = node.uuids()
    _leave(node, 0)
    _users_journal(node, job_gpu)
    shutil.rmtree(node.folder / "journal")
    (node.folder / "journal").mkdir(mode=0o700)  # root's
    roots = write_journal(StateDir(node.folder, trusted_uids=(USER,)), _entry(job_gpu, 300.0))
    line = _one_skipped_line(
        _restore(node, "--devices", job_gpu, "--user-state-dir", str(node.folder))
    )
    assert f"{node.folder / 'journal'} (owner uid 0 (root)" in line, line
    assert f"it is not owned by uid {USER}" in line
    assert node.truth()[0] == LEFT and roots.exists()


@pytest.mark.parametrize("case", ["group-writable", "stranger-owned", "root-folder"])
def test_a_folder_above_the_users_that_others_control_is_refused(node: Node, case: str) -> None:
    job_gpu, _ = node.uuids()
    _leave(node, 0)
    journal = _users_journal(node, job_gpu)
    scratch = node.scratch_user.parent
    if case == "group-writable":
        scratch.chmod(0o775)  # not sticky: a group member could rename /scratch/U away
        want = f"{scratch} (owner uid 0"
    elif case == "stranger-owned":
        os.chown(scratch, 4242, 4242)
        want = f"{scratch} (owner uid 4242"
    else:  # the admin names a folder that is not the user's at all
        want = f"it is not owned by uid {USER}"
    target = node.state if case == "root-folder" else node.folder
    line = _one_skipped_line(_restore(node, "--devices", job_gpu, "--user-state-dir", str(target)))
    assert want in line, line
    assert node.truth()[0] == LEFT and journal.exists()


@pytest.mark.parametrize("where", ["above", "inside"])
def test_a_state_folder_on_a_fuse_mount_is_refused_before_it_is_opened(
    node: Node, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The user's own FUSE daemon could block any open, stat or read below its mount for ever
    (with user_allow_other): a fake mount table says /scratch/U, or the folder's journal/, is
    `fuse.sshfs` (no FUSE mount can be made here)."""
    import powerlib.control.trust as trust

    job_gpu, _ = node.uuids()
    _leave(node, 0)
    journal = _users_journal(node, job_gpu)
    point = node.scratch_user if where == "above" else node.folder / "journal"
    real = getattr(trust, "read_mounts", list)  # (raising=False: the code before had none)
    fake = SimpleNamespace(mount_id=-1, point=str(point), fs_type="fuse.sshfs")
    monkeypatch.setattr(trust, "read_mounts", lambda: [*real(), fake], raising=False)
    opened: list[str] = []
    spy = _spy(getattr(trust, "_open_component", None), opened)
    monkeypatch.setattr(trust, "_open_component", spy, raising=False)
    outcomes = restore_for_user(node.settings(), USER, [job_gpu], user_dirs=[node.folder])
    assert len(outcomes) == 1, outcomes
    [said] = outcomes
    assert said.skipped and "\n" not in said.action
    assert f"{point} is a fuse.sshfs mount" in said.action, said.action
    assert str(USER) not in opened or where == "inside"  # never opened: no daemon is asked
    assert node.truth()[0] == LEFT and journal.exists()


def test_the_mount_table_is_read_with_its_escapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import powerlib.control.trust as trust

    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "61 22 0:52 / /scratch/a\\040b rw,nosuid - fuse.sshfs me@host: rw,user_id=1000\n"
        "garbage\n"
    )
    monkeypatch.setattr(trust, "_MOUNTINFO", str(table))
    assert trust.read_mounts() == [
        trust.Mount(22, "/", "ext4"),
        trust.Mount(61, "/scratch/a b", "fuse.sshfs"),
    ]


def _spy(fn: Any, opened: list[str]) -> Any:
    def spy(parent_fd: int, name: str) -> int:
        opened.append(name)
        return int(fn(parent_fd, name))

    return spy


# -- Slurm's GPU numbers are minor numbers, not indexes -------------------------------------------


def test_restore_for_user_takes_slurms_minor_numbers(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pynvml")
    from powerlib.testing.fake_nvml import A100_SXM4_40GB, FakeNvml

    fake = FakeNvml([A100_SXM4_40GB] * 3)
    for gpu, minor in zip(fake.gpus, (2, 0, 1)):
        gpu.minor = minor
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    folder = node.top / "empty"  # no journal: the devices resolved are what is checked
    args = ["--backend", "nvidia", "restore", "--for-user", str(USER), "--dry-run", "--json"]
    env = {"POWERLIB_STATE_DIR": str(node.state)}
    runner = CliRunner()
    result = runner.invoke(
        cli, [*args, "--slurm-gpus", "0,2", "--user-state-dir", str(folder)], env=env
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["devices"] == [fake.gpus[1].uuid, fake.gpus[0].uuid]
    bad = runner.invoke(cli, [*args, "--slurm-gpus", "5", "--user-state-dir", str(folder)], env=env)
    assert bad.exit_code != 0 and "no nvidia device has minor number 5" in bad.output
    both = runner.invoke(cli, [*args, "--slurm-gpus", "0", "--devices", "0"], env=env)
    assert both.exit_code == 7 and both.stderr.count("\n") == 1, both.output
    assert "give the job's devices once" in both.stderr
