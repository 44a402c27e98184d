"""ControlSession on a real node's terms (issue 33): what it finds at claim time, how it verifies
a restore, how it reacts to driver errors, what it journals, and its guardian.

NVIDIA cases run through ``NvidiaBackend`` on ``FakeNvml``, which reports a lock only through the
"applications clocks setting" clock-event reason, as NVML does (docs/real-gpu.md §1).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from powerlib import DeviceBusyError, PermissionDeniedError, Settings
from powerlib.backends.simulated import SimulatedBackend, VirtualClock
from powerlib.control import (
    UNKNOWN_LOCK,
    ControlSession,
    DeviceLock,
    JournalEntry,
    Owner,
    StateDir,
    device_key,
)
from powerlib.control.guardian import CLEAN_CLOSE, wait_for_owner_exit
from powerlib.control.journal import list_journals

pynvml = pytest.importorskip("pynvml")

from powerlib.backends.nvidia import NvidiaBackend  # noqa: E402 - needs pynvml's constants
from powerlib.testing.fake_nvml import FakeNvml  # noqa: E402


@pytest.fixture(autouse=True)
def _no_retry_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("powerlib.device.TRANSIENT_RETRY_DELAYS_S", (0.0, 0.0, 0.0))


@pytest.fixture
def sim(settings: Settings) -> SimulatedBackend:
    """One simulated GPU whose state persists in the state dir (journals, device locks)."""
    return SimulatedBackend(settings.replace(sim_gpus=1), clock=VirtualClock(), persist=True)


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def nvidia(settings: Settings, fake: FakeNvml) -> NvidiaBackend:
    return NvidiaBackend(settings, nvml=fake)


def _journals(settings: Settings) -> list[Path]:
    return list_journals(StateDir(settings.state_dir))


def _is_free(backend: object, settings: Settings, index: int = 0) -> bool:
    dev = backend.device(index)  # type: ignore[attr-defined]
    return DeviceLock.is_free(
        StateDir(settings.state_dir), device_key(dev.info.backend, dev.device_id)
    )


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


# -- 1. claim time: what someone else left ---------------------------------------------------------


def test_a_lock_with_a_known_range_is_kept_as_the_original_with_one_warning(
    sim: SimulatedBackend, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    sim.device(0).lock_sm_clocks(1005, 1305)  # an administrator's lock, before the job
    with ControlSession(sim, guardian=False) as session:
        session.lock_sm_clocks(0, 900)
        session.reset_sm_clocks(0)
        session.lock_sm_clocks(0, 1200)
        [journal] = _journals(settings)
        [change] = json.loads(journal.read_text())["changes"]
        assert change["original"] == [1005.0, 1305.0]
    [warning] = _warnings(caplog, "already locked to 1005-1305 MHz")
    assert "kept as the original" in warning
    assert sim.device(0).read_state().locked_sm_freqs_mhz == (1005.0, 1305.0)


def test_a_non_default_power_limit_is_kept_as_the_original_with_one_warning(
    sim: SimulatedBackend, caplog: pytest.LogCaptureFixture
) -> None:
    sim.device(0).set_power_limit(330)
    with ControlSession(sim, guardian=False) as session:
        session.set_power_limit(0, 200)
        session.set_power_limit(0, 250)
    [warning] = _warnings(caplog, "not the default 400 W")
    assert "330 W" in warning
    assert sim.device(0).read_state().power_limit_w == 330.0


def test_an_nvml_lock_of_unknown_range_is_refused_and_left_alone(
    nvidia: NvidiaBackend, fake: FakeNvml, settings: Settings
) -> None:
    fake.gpus[0].locked_mhz = (1005, 1005)  # `nvidia-smi -lgc 1005` by an administrator
    with ControlSession(nvidia, guardian=False) as session:
        with pytest.raises(DeviceBusyError, match=r"nvidia-smi -rgc.*force=True"):
            session.lock_sm_clocks(0, 1410)
        assert fake.gpus[0].locked_mhz == (1005, 1005)
        assert _journals(settings) == [] and _is_free(nvidia, settings)  # not claimed
        with pytest.warns(RuntimeWarning, match="leaves .* alone"):
            assert session.apply_sm_clocks(0, 1410) is False  # training goes on
        assert "nvidia-smi -rgc" in session.degraded[nvidia.device(0).device_id]
        assert session.apply_sm_clocks(1, 1410)  # the other GPU is free
    assert fake.gpus[0].locked_mhz == (1005, 1005)  # no reset on the way out either
    assert fake.gpus[1].locked_mhz is None


def test_force_takes_an_unknown_lock_journals_it_as_such_and_unlocks_at_the_end(
    nvidia: NvidiaBackend, fake: FakeNvml, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    fake.gpus[0].locked_mhz = (1005, 1005)
    session = ControlSession(nvidia, guardian=False, force=True).start()
    session.lock_sm_clocks(0, 1410)
    assert fake.gpus[0].locked_mhz == (1410, 1410)
    [journal] = _journals(settings)
    entry = JournalEntry.from_json(json.loads(journal.read_text()), str(journal))
    assert [(c.item, c.original) for c in entry.changes] == [("sm_clocks", UNKNOWN_LOCK)]
    [warning] = _warnings(caplog, "force=True")
    assert "unlocks its clocks when the session ends" in warning
    [outcome] = session.close()
    assert outcome.ok and "someone else had locked them" in outcome.action
    assert fake.gpus[0].locked_mhz is None and _journals(settings) == []


# -- 2. a restore is verified by reading the device ------------------------------------------------


def test_a_restore_is_checked_against_the_driver_not_this_process_s_record(
    nvidia: NvidiaBackend, fake: FakeNvml, settings: Settings
) -> None:
    session = ControlSession(nvidia, guardian=False).start()
    session.lock_sm_clocks(0, 1005)
    fake.gpus[0].ignores_lock = True  # the reset will be accepted and do nothing
    # ...and the read-back right after the reset times out (1 try + 3 retries): only the
    # restore's own read of the driver can tell
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", fake.NVML_ERROR_TIMEOUT, times=4)
    [outcome] = session.close()
    assert not outcome.ok and outcome.error_code == 1 and outcome.verified is None
    assert "still reads locked: still modified" in outcome.action
    assert fake.gpus[0].locked_mhz == (1005, 1005) and len(_journals(settings)) == 1


def test_a_reset_that_silently_does_nothing_fails_the_restore_and_keeps_the_journal(
    sim: SimulatedBackend, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = ControlSession(sim, guardian=False).start()
    session.lock_sm_clocks(0, 900)
    monkeypatch.setattr(sim.device(0), "_reset_sm_clocks", lambda: None)
    [outcome] = session.close()
    assert not outcome.ok and outcome.error_code == 10 and not outcome.verified
    assert "still in force after a reset (900-900 MHz)" in outcome.action
    assert sim.device(0).read_state().locked_sm_freqs_mhz == (900.0, 900.0)
    assert len(_journals(settings)) == 1


def test_a_restore_says_whether_the_driver_could_confirm_it(
    sim: SimulatedBackend, nvidia: NvidiaBackend, fake: FakeNvml
) -> None:
    with ControlSession(sim, guardian=False) as session:
        session.lock_sm_clocks(0, 900)
        session.set_power_limit(0, 200)
        outcomes = session.close()
    assert [(o.item, o.ok, o.verified) for o in outcomes] == [
        ("power_limit", True, True),
        ("sm_clocks", True, True),
    ]
    with ControlSession(nvidia, guardian=False) as session:
        session.lock_sm_clocks(0, 900)
        [outcome] = session.close()
    # NVML never states "no lock": a good reset is reported, but not as verified
    assert outcome.ok and outcome.verified is None and "not verified" in outcome.action
    assert fake.gpus[0].locked_mhz is None


# -- 3. a driver error during training: baseline, and the reason -----------------------------------


def test_a_timeout_that_outlasts_the_retries_resets_the_gpu_and_says_why(
    nvidia: NvidiaBackend, fake: FakeNvml
) -> None:
    with ControlSession(nvidia, guardian=False) as session:
        assert session.apply_sm_clocks(0, 1005)
        assert fake.gpus[0].locked_mhz == (1005, 1005)
        fake.fail("nvmlDeviceSetGpuLockedClocks", fake.NVML_ERROR_TIMEOUT, device=0)
        with pytest.warns(RuntimeWarning, match="training continues"):
            assert session.apply_sm_clocks(0, 1410) is False
        assert fake.gpus[0].locked_mhz is None  # at the baseline, not stuck at 1005 MHz
        reason = session.degraded[nvidia.device(0).device_id]
        assert reason.startswith("TransientDeviceError: ") and "did not answer in time" in reason
        assert reason.endswith("its clocks were reset to the baseline")
        assert session.apply_sm_clocks(0, 1410) is False  # dropped, silently
        assert fake.gpus[0].locked_mhz is None
        assert session.apply_sm_clocks(1, 1410)  # the other GPU carries on
        assert list(session.degraded) == [nvidia.device(0).device_id]


def test_another_sessions_device_is_left_alone_and_the_reason_kept(
    sim: SimulatedBackend, settings: Settings
) -> None:
    with ControlSession(sim, guardian=False) as first:
        first.lock_sm_clocks(0, 900)
        other = SimulatedBackend(settings.replace(sim_gpus=1), clock=VirtualClock(), persist=True)
        with ControlSession(other, guardian=False) as second:
            with pytest.warns(RuntimeWarning, match="alone"):
                assert second.apply_sm_clocks(0, 1200) is False
            why = second.degraded[other.device(0).device_id]
            assert why.startswith("left alone, its clocks untouched") and str(os.getpid()) in why
        assert sim.device(0).read_state().locked_sm_freqs_mhz == (900.0, 900.0)


# -- 5. a refused change is never journaled --------------------------------------------------------


def test_a_change_the_driver_refuses_leaves_no_journal_and_no_restore_error(
    nvidia: NvidiaBackend, fake: FakeNvml, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("nvmlDeviceSetGpuLockedClocks", fake.NVML_ERROR_NO_PERMISSION)
    fake.fail("nvmlDeviceResetGpuLockedClocks", fake.NVML_ERROR_NO_PERMISSION)
    session = ControlSession(nvidia, guardian=False).start()
    with pytest.raises(PermissionDeniedError):
        session.lock_sm_clocks(0, 1200)
    assert _journals(settings) == [] and _is_free(nvidia, settings)
    assert session.controlled_devices == []
    with pytest.warns(RuntimeWarning, match="training continues"):
        assert session.apply_sm_clocks(0, 1200) is False
    assert "nothing had been changed" in session.degraded[nvidia.device(0).device_id]
    assert "nvmlDeviceResetGpuLockedClocks" not in fake.calls  # nothing to reset
    assert _journals(settings) == []
    assert session.close() == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert _journals(settings) == []  # nothing for a later run to replay


def test_a_refused_item_leaves_the_items_that_were_changed_journaled(
    nvidia: NvidiaBackend, fake: FakeNvml, settings: Settings
) -> None:
    session = ControlSession(nvidia, guardian=False).start()
    session.lock_sm_clocks(0, 1200)
    fake.fail("nvmlDeviceSetPowerManagementLimit", fake.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(PermissionDeniedError):
        session.set_power_limit(0, 250)
    [journal] = _journals(settings)
    assert [c["item"] for c in json.loads(journal.read_text())["changes"]] == ["sm_clocks"]
    assert [(o.item, o.ok) for o in session.close()] == [("sm_clocks", True)]
    assert fake.gpus[0].locked_mhz is None and _journals(settings) == []


# -- 6. the guardian is on where changes outlive the process ---------------------------------------


def _guardians() -> dict[int, psutil.Process]:
    """This process's running guardians, by pid (earlier tests' may still be exiting)."""
    found = {}
    for p in psutil.Process().children():
        try:
            if "powerlib.control.guardian" in " ".join(p.cmdline()) and p.status() != "zombie":
                found[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return found


def test_the_guardian_is_on_by_default_only_where_changes_outlive_the_process(
    sim: SimulatedBackend, settings: Settings
) -> None:
    before = _guardians()
    with ControlSession(sim, handle_signals=False) as session:
        session.lock_sm_clocks(0, 900)
        [guardian] = [p for pid, p in _guardians().items() if pid not in before]
    guardian.wait(timeout=10)  # told of the clean close, it exits without restoring anything
    assert not (settings.state_dir / "guardian.log").exists()
    in_memory = SimulatedBackend(settings.replace(sim_gpus=1, sim_clock="virtual"))
    assert not in_memory.persistent
    through_agent = SimulatedBackend(
        settings.replace(sim_gpus=1), clock=VirtualClock(), persist=True
    )
    through_agent.remote = True  # changes made, journaled and leased by another process
    for backend, guardian_arg in [(in_memory, None), (through_agent, None), (sim, False)]:
        before = _guardians()
        with ControlSession(backend, guardian=guardian_arg, handle_signals=False) as session:
            session.lock_sm_clocks(0, 900)
            assert _guardians().keys() <= before.keys()


def test_a_guardian_told_of_a_clean_close_exits_without_restoring() -> None:
    owner = Owner.current()
    read_fd, write_fd = os.pipe()
    os.write(write_fd, CLEAN_CLOSE)
    os.close(write_fd)
    assert wait_for_owner_exit(owner, read_fd) is True
    os.close(read_fd)
    read_fd, write_fd = os.pipe()
    os.close(write_fd)  # the owner died: the pipe just closes
    assert wait_for_owner_exit(owner, read_fd) is False
    os.close(read_fd)


def test_a_sigkilled_session_with_default_arguments_is_restored_by_its_guardian(
    settings: Settings,
) -> None:
    env = {
        **os.environ,
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "1",
        "POWERLIB_STATE_DIR": str(settings.state_dir),
    }
    code = (
        "import sys, time\nfrom powerlib import open_backend\n"
        "from powerlib.control import ControlSession\n"
        "s = ControlSession(open_backend()).start()\ns.lock_sm_clocks(0, 600)\n"
        "print('locked', flush=True)\ntime.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        device = SimulatedBackend(settings.replace(sim_gpus=1)).device(0)
        assert device.read_state().locked_sm_freqs_mhz == (600.0, 600.0)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 20.0  # a bound on the wait, not a timing assertion
        while device.read_state().locked_sm_freqs_mhz is not None or _journals(settings):
            assert time.monotonic() < deadline, "the guardian did not restore the device"
            time.sleep(0.02)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()
    assert _journals(settings) == []
