"""Devices go back to their captured state however a controlling process ends.

A child process (``child.py``) opens a ``ControlSession`` and changes SM clocks and power limits on
two devices; it is then left normally, raises, gets SIGTERM or SIGINT (the session restores), gets
SIGKILL at a random point (``powerlib restore`` restores), or gets SIGKILL with the guardian on
(the guardian restores, no command). Every case runs on the simulated backend (wall clock, state
shared through the state directory) and on the sysfs backend over a fake tree of plain files.

Before each child starts, the parent moves the devices to a non-default baseline and captures it
(raw sysfs files; simulated lock and power limit), so a restore to defaults would fail the test.

Set ``CRASH_RESTORE_SEED`` to replay the kill times of a failed run, ``CRASH_RESTORE_TRIALS`` to
change the number of SIGKILL trials per backend (default 50). Run with ``-s`` to see the summary.
"""

from __future__ import annotations

import collections
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner, Result

from powerlib.backends.simulated import SimulatedBackend
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import ControlSession, DeviceLock, StateDir, device_key
from powerlib.control.journal import list_journals
from powerlib.errors import DeviceBusyError
from powerlib.registry import open_backend
from powerlib.testing.sysfs import make_cpufreq_tree, make_powercap_tree

CHILD = Path(__file__).with_name("child.py")
REPO = Path(__file__).resolve().parents[2]
BACKENDS = ["simulated", "sysfs"]
KILL_TRIALS = int(os.environ.get("CRASH_RESTORE_TRIALS", "50"))
KILL_WINDOW_S = 0.12  # ~1.5 passes of the child's 14-change sequence on a quiet machine
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")}
_CLI_LOCK = threading.Lock()  # CliRunner swaps os.environ and sys.stdout: one at a time


# -- one backend, in its own directories --------------------------------------------------------


@dataclass
class Rig:
    """A backend under test: its state directory (and fake sysfs tree), env and snapshots."""

    kind: str
    root: Path
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state_dir = self.root / "state"
        self.sysfs_root = self.root / "sys"
        if self.kind == "sysfs":
            make_powercap_tree(self.sysfs_root, packages=2)
            make_cpufreq_tree(self.sysfs_root, packages=2, cpus_per_package=4)
        self.settings = Settings(
            backend=self.kind, state_dir=self.state_dir, sysfs_root=self.sysfs_root, sim_gpus=2
        )
        self.cli_env = {
            "POWERLIB_BACKEND": self.kind,
            "POWERLIB_STATE_DIR": str(self.state_dir),
            "POWERLIB_SIM_GPUS": "2",
        }
        if self.kind == "sysfs":
            self.cli_env["POWERLIB_SYSFS_ROOT"] = str(self.sysfs_root)
        self.env = {**BASE_ENV, **self.cli_env}

    def set_baseline(self) -> dict[str, Any]:
        """Move both devices off their defaults; return what the backend reads back, by id."""
        with open_backend(settings=self.settings) as backend:
            dev0, dev1 = backend.devices()
            freqs = dev0.info.supported_sm_freqs_mhz
            dev0.lock_sm_clocks(freqs[1], freqs[-2])
            dev0.set_power_limit(_fraction_w(dev0, 0.8))
            dev1.set_power_limit(_fraction_w(dev1, 0.9))
            states = {d.device_id: d.read_state() for d in (dev0, dev1)}
        return {
            dev_id: {
                "sm_clocks": None
                if st.locked_sm_freqs_mhz is None
                else list(st.locked_sm_freqs_mhz),
                "power_limit": st.power_limit_w,
            }
            for dev_id, st in states.items()
        }

    def snapshot(self) -> dict[str, Any]:
        """Every device's full controllable state: raw sysfs files, or the simulated state."""
        if self.kind == "sysfs":
            patterns = (
                "devices/system/cpu/cpufreq/policy*/scaling_m*_freq",
                "devices/virtual/powercap/intel-rapl/**/constraint_*_power_limit_uw",
                "devices/virtual/powercap/intel-rapl/**/enabled",
            )
            return {
                str(path.relative_to(self.sysfs_root)): path.read_text().strip()
                for pattern in patterns
                for path in sorted(self.sysfs_root.glob(pattern))
            }
        snap: dict[str, Any] = {}
        with SimulatedBackend(self.settings) as backend:
            for dev in backend.devices():
                st = dev.read_state()
                snap[f"{dev.index}/locked_sm_freqs_mhz"] = st.locked_sm_freqs_mhz
                snap[f"{dev.index}/power_limit_w"] = st.power_limit_w
        return snap

    def journals(self) -> list[Path]:
        return list_journals(StateDir(self.state_dir))

    def locks_free(self) -> bool:
        state = StateDir(self.state_dir)
        with open_backend(settings=self.settings) as backend:
            keys = [device_key(d.info.backend, d.device_id) for d in backend.devices()]
        return all(DeviceLock.is_free(state, key) for key in keys)

    def cli(self, *args: str) -> Result:
        with _CLI_LOCK:
            return CliRunner().invoke(cli, list(args), env=self.cli_env)

    def start(self, mode: str, *args: str) -> Child:
        child = Child(self, mode, *args)
        self.children.append(child)
        return child


def _fraction_w(dev: Any, fraction: float) -> float:
    lo, hi = dev.info.power_limit_range_w
    return float(round(lo + fraction * (hi - lo)))


def _diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    keys = sorted(set(before) | set(after))
    return "; ".join(
        f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)
    )


class Child:
    """``child.py`` running under a rig's environment, its stdout read line by line."""

    def __init__(self, rig: Rig, mode: str, *args: str) -> None:
        self.err_path = rig.root / f"child-{mode}-{len(rig.children)}.stderr"
        self.err_path.parent.mkdir(parents=True, exist_ok=True)
        gated = "--gate" in args
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), mode, *args],
                env=rig.env,
                cwd=REPO,
                stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._partial = b""
        self._eof = False

    def go(self) -> None:
        """Let a ``--gate`` child open the backend."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died already; expect() reports its stderr

    def _read(self, timeout_s: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], max(timeout_s, 0))[0]:
            return
        chunk = os.read(fd, 65536)
        if not chunk:
            self._eof = True
            return
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        self.lines.extend(line.decode() for line in complete)

    def expect(self, line: str, timeout_s: float = 30.0) -> None:
        """Wait until the child prints ``line``; fail with its stderr if it exits first."""
        deadline = time.monotonic() + timeout_s
        while line not in self.lines:
            if self._eof:
                self.proc.wait(timeout=10)
                raise AssertionError(
                    f"child exited ({self.proc.returncode}) before printing {line!r}:\n"
                    + self.stderr()
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"child printed no {line!r} in {timeout_s} s:\n{self.stderr()}"
                )
            self._read(deadline - time.monotonic())

    def finish(self, timeout_s: float = 30.0) -> int:
        """Wait for the child to exit and read the rest of its output; its exit code."""
        self.proc.wait(timeout=timeout_s)
        while not self._eof:
            self._read(5.0)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode

    def kill(self, signum: int = signal.SIGKILL) -> int:
        os.kill(self.pid, signum)
        return self.finish()

    @property
    def steps(self) -> int:
        """How many changes the child reported as done."""
        return sum(1 for line in self.lines if line.startswith("step "))

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")[-4000:]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture(params=BACKENDS)
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    made = Rig(request.param, tmp_path / request.param)
    yield made
    for child in made.children:
        child.cleanup()


def _guardian_of(child: Child) -> psutil.Process:
    found = [
        p
        for p in psutil.Process(child.pid).children()
        if "powerlib.control.guardian" in " ".join(p.cmdline())
    ]
    assert len(found) == 1, f"expected one guardian under pid {child.pid}, found {found}"
    return found[0]


def _wait_exited(proc: psutil.Process, timeout_s: float = 10.0) -> None:
    """Wait for an orphan to exit; a zombie counts (init may take a while to reap it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {proc.pid} still runs {timeout_s} s later")


# -- (a)-(d): the session restores on its own ---------------------------------------------------


@pytest.mark.parametrize("ending", ["normal", "raise", "sigterm", "sigint"])
def test_session_end_restores_the_captured_state(rig: Rig, ending: str) -> None:
    rig.set_baseline()
    before = rig.snapshot()
    if ending in ("normal", "raise"):
        child = rig.start(ending)
        code = child.finish()
        assert child.steps == 14, child.lines
        if ending == "normal":
            assert code == 0, child.stderr()
        else:
            assert code == 1 and "RuntimeError: the job failed" in child.stderr()
    else:
        child = rig.start("wait")
        child.expect("done")
        during = rig.snapshot()
        assert during != before, "the child changed nothing"
        assert len(rig.journals()) == 2
        signum = signal.SIGTERM if ending == "sigterm" else signal.SIGINT
        code = child.kill(signum)
        # SIGTERM: the session's handler restores, then exits 128 + 15; SIGINT: KeyboardInterrupt
        # leaves the with block, and Python dies by the signal once the block has restored.
        assert code == (143 if ending == "sigterm" else -signal.SIGINT), child.stderr()
    after = rig.snapshot()
    assert after == before, f"{rig.kind}/{ending}: not restored: {_diff(before, after)}"
    assert rig.journals() == []
    assert rig.locks_free()


# -- (e): SIGKILL at a random point, then `powerlib restore` ------------------------------------


@dataclass
class _Trial:
    number: int
    delay_s: float
    steps: int = 0
    restored_items: int = 0
    problems: list[str] = field(default_factory=list)


def _kill_trial(kind: str, root: Path, trial: _Trial) -> _Trial:
    rig = Rig(kind, root)
    child = rig.start("sequence", "--gate")  # its imports overlap the baseline set-up
    try:
        rig.set_baseline()
        before = rig.snapshot()
        child.go()
        child.expect("ready")
        time.sleep(trial.delay_s)
        code = child.kill()
    finally:
        child.cleanup()
    trial.steps = child.steps
    if code != -signal.SIGKILL:
        trial.problems.append(f"the child exited {code} before the kill: {child.stderr()}")
    result = rig.cli("restore", "--json")
    if result.exit_code != 0:
        trial.problems.append(f"restore exited {result.exit_code}: {result.output}")
    else:
        outcomes = json.loads(result.stdout)["outcomes"]
        trial.restored_items = sum(o["item"] != "journal" for o in outcomes)
        trial.problems += [f"outcome not ok: {o}" for o in outcomes if not o["ok"]]
        trial.problems += [f"not restored: {o}" for o in outcomes if o["action"].startswith("left")]
    after = rig.snapshot()
    if after != before:
        trial.problems.append(f"state differs: {_diff(before, after)}")
    if rig.journals():
        trial.problems.append(f"journals left: {rig.journals()}")
    return trial


@pytest.mark.parametrize("kind", BACKENDS)
def test_sigkill_at_random_points_then_restore_puts_everything_back(
    kind: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CRASH_RESTORE_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    trials = [_Trial(i, rng.uniform(0.0, KILL_WINDOW_S)) for i in range(KILL_TRIALS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda t: _kill_trial(kind, tmp_path / f"t{t.number}", t), trials))
    failed = [t for t in done if t.problems]
    kill_points = collections.Counter(t.steps for t in done)
    summary = (
        f"crash-restore[{kind}]: {len(done) - len(failed)}/{len(done)} SIGKILL trials restored "
        f"(seed {seed}; {sum(t.restored_items for t in done)} items restored; trials killed after "
        f"K changes: {dict(sorted(kill_points.items()))})"
    )
    print(summary)
    assert not failed, (
        f"{summary} - failures (replay with CRASH_RESTORE_SEED={seed}):\n"
        + "\n".join(
            f"trial {t.number} (kill {t.delay_s * 1e3:.1f} ms after ready, after {t.steps} "
            f"changes): {'; '.join(t.problems)}"
            for t in failed
        )
    )
    assert len(kill_points) >= min(5, KILL_TRIALS // 5), f"kill points not spread: {summary}"


def test_sigkill_between_journal_and_power_limit_write_is_restored(rig: Rig) -> None:
    """Regression: the journal holds the new target before the device does; a crash in between
    leaves the previous target, which restore once mistook for someone else's change."""
    baseline = rig.set_baseline()
    before = rig.snapshot()
    child = rig.start("die-in-write")
    assert child.finish() == -signal.SIGKILL, child.stderr()
    assert child.steps == 5, child.lines  # died in step 6, its second power limit on device 0
    result = rig.cli("restore", "--json")
    assert result.exit_code == 0, result.output
    dev0 = next(iter(baseline))
    power = [
        o
        for o in json.loads(result.stdout)["outcomes"]
        if (o["device_id"], o["item"]) == (dev0, "power_limit")
    ]
    assert len(power) == 1 and not power[0]["action"].startswith("left"), power
    assert rig.snapshot() == before, _diff(before, rig.snapshot())


# -- concurrency: one controller per device -----------------------------------------------------


def test_second_session_on_a_held_device_fails_fast_naming_the_owner(rig: Rig) -> None:
    rig.set_baseline()
    before = rig.snapshot()
    holder = rig.start("hold", "--hold-device", "0")
    holder.expect("holding")
    held = rig.snapshot()
    with open_backend(settings=rig.settings) as backend, ControlSession(backend) as session:
        freq = backend.device(0).info.supported_sm_freqs_mhz[0]
        start = time.monotonic()
        with pytest.raises(DeviceBusyError) as busy:
            session.lock_sm_clocks(0, freq)
        elapsed = time.monotonic() - start
        assert f"pid {holder.pid}" in str(busy.value)
        assert elapsed < 1.0, f"took {elapsed:.3f} s: a busy device must fail fast"
        assert rig.snapshot() == held, "the refused request changed something"
        session.lock_sm_clocks(1, freq)  # a different device proceeds
        assert rig.snapshot() != held
    assert rig.snapshot() == held  # the parent's session put device 1 back

    result = rig.cli("set", "--device", "0", "--freq-mhz", str(freq))
    assert result.exit_code == 8, result.output
    assert f"pid {holder.pid}" in result.output

    other = rig.start("hold", "--hold-device", "1")  # two processes, two devices: both proceed
    other.expect("holding")
    assert rig.snapshot() != held
    for child in (holder, other):
        assert child.kill(signal.SIGTERM) == 143, child.stderr()
    assert rig.snapshot() == before
    assert rig.journals() == []


# -- the guardian ---------------------------------------------------------------------------------


def test_guardian_restores_a_sigkilled_session_without_any_command(rig: Rig) -> None:
    rig.set_baseline()
    before = rig.snapshot()
    child = rig.start("wait", "--guardian")
    child.expect("done")
    guardian = _guardian_of(child)
    assert rig.snapshot() != before
    killed_at = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    latency_s = None
    while time.monotonic() - killed_at < 10.0:
        if rig.snapshot() == before:
            latency_s = time.monotonic() - killed_at
            break
        time.sleep(0.005)
    assert latency_s is not None, (
        f"not restored 10 s after SIGKILL: {_diff(before, rig.snapshot())}"
    )
    assert latency_s < 10.0, f"restored {latency_s:.3f} s after SIGKILL"
    print(f"guardian[{rig.kind}]: restored {latency_s:.3f} s after SIGKILL")
    assert child.finish() == -signal.SIGKILL
    _wait_exited(guardian)
    assert rig.journals() == []
    records = [
        json.loads(line)
        for line in (rig.state_dir / "guardian.log").read_text().splitlines()
        if line.strip()
    ]
    mine = [r for r in records if r["owner_pid"] == child.pid]
    assert len(mine) == 1, records
    assert mine[0]["guardian_pid"] == guardian.pid
    items = sorted((o["device_id"], o["item"]) for o in mine[0]["outcomes"])
    assert len(items) == 4 and {i for _, i in items} == {"sm_clocks", "power_limit"}
    assert all(o["ok"] for o in mine[0]["outcomes"]), mine[0]


def test_guardian_does_nothing_after_a_clean_exit(rig: Rig) -> None:
    rig.set_baseline()
    before = rig.snapshot()
    child = rig.start("normal", "--guardian")
    assert child.finish() == 0, child.stderr()  # the session stopped and reaped its guardian
    assert rig.snapshot() == before
    assert not (rig.state_dir / "guardian.log").exists()


# -- restore --dry-run ------------------------------------------------------------------------


def test_restore_dry_run_lists_journals_and_changes_nothing(rig: Rig) -> None:
    baseline = rig.set_baseline()
    before = rig.snapshot()
    child = rig.start("wait")
    child.expect("done")
    assert child.kill() == -signal.SIGKILL
    during = rig.snapshot()
    assert during != before
    journals = rig.journals()
    assert len(journals) == 2

    result = rig.cli("restore", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dry_run"] is True and data["ok"] is True and data["mode"] == "stale"
    listed = {(o["device_id"], o["item"]): o for o in data["outcomes"]}
    assert len(listed) == len(data["outcomes"]) == 4
    for (dev_id, item), outcome in listed.items():
        assert Path(outcome["journal"]).exists()
        assert Path(outcome["journal"]) in journals
        assert Path(outcome["journal"]).name == f"{device_key(rig.kind, dev_id)}.json"
        assert outcome["owner_pid"] == child.pid
        assert outcome["target"] == baseline[dev_id][item], outcome
        assert not outcome["action"].endswith("done"), outcome
    assert rig.snapshot() == during, "the dry run changed a device"
    assert rig.journals() == journals, "the dry run removed a journal"

    result = rig.cli("restore", "--json")
    assert result.exit_code == 0, result.output
    assert rig.snapshot() == before
    assert rig.journals() == []
