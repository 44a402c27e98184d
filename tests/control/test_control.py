"""ControlSession in one process: journal before write, exact restore, degrade, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib import DeviceBusyError, PermissionDeniedError, PowerlibError, Settings
from powerlib.backends.simulated import SimulatedBackend, VirtualClock
from powerlib.cli import cli
from powerlib.control import (
    Change,
    ControlSession,
    JournalEntry,
    JournalError,
    Owner,
    StateDir,
    device_key,
    restore_failure,
    restore_journals,
)
from powerlib.control.journal import journal_path, list_journals, write_journal


@pytest.fixture
def backend(settings: Settings) -> SimulatedBackend:
    """Two simulated GPUs whose state persists in the state dir (so journals are written)."""
    return SimulatedBackend(
        settings.replace(sim_gpus=2), clock=VirtualClock(start_s=10.0), persist=True
    )


def _state(backend: SimulatedBackend, index: int) -> tuple[object, object]:
    st = backend.device(index).read_state()
    return st.locked_sm_freqs_mhz, st.power_limit_w


def _journals(settings: Settings) -> list[Path]:
    return list_journals(StateDir(settings.state_dir))


def test_restores_the_captured_originals_not_defaults(
    backend: SimulatedBackend, settings: Settings
) -> None:
    backend.device(0).lock_sm_clocks(1005, 1305)  # what an operator left before the job
    backend.device(0).set_power_limit(330)
    before = _state(backend, 0)
    with ControlSession(backend) as session:
        session.lock_sm_clocks(0, 900)
        session.set_power_limit(0, 200)
        session.set_power_limit(0, 250)
        session.lock_sm_clocks(0, 1200)
        assert _state(backend, 0) == ((1200.0, 1200.0), 250.0)
        [journal] = _journals(settings)
        data = json.loads(journal.read_text())
        assert data["owner"]["pid"] == os.getpid()
        assert {c["item"]: c["original"] for c in data["changes"]} == {
            "sm_clocks": [1005.0, 1305.0],
            "power_limit": 330.0,
        }
    assert _state(backend, 0) == before
    assert _journals(settings) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_exceptions_restore_and_propagate(
    backend: SimulatedBackend, settings: Settings, error: BaseException
) -> None:
    before = [_state(backend, i) for i in (0, 1)]
    with pytest.raises(type(error)), ControlSession(backend) as session:
        session.lock_sm_clocks(1, 1410)
        session.set_power_limit(0, 150)
        raise error
    assert [_state(backend, i) for i in (0, 1)] == before and _journals(settings) == []


def test_bad_input_changes_nothing_not_even_a_journal(
    backend: SimulatedBackend, settings: Settings
) -> None:
    with ControlSession(backend) as session:
        with pytest.raises(PowerlibError):
            session.lock_sm_clocks(0, 5000)
        with pytest.raises(PowerlibError):
            session.set_power_limit(0, 10)
        assert session.controlled_devices == [] and _journals(settings) == []


def test_an_unusable_state_dir_refuses_before_any_change(
    settings: Settings, tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the state directory should be")
    backend = SimulatedBackend(settings.replace(sim_gpus=1), clock=VirtualClock(), persist=True)
    before = _state(backend, 0)
    broken = SimulatedBackend(
        settings.replace(sim_gpus=1, state_dir=blocker / "state"),
        clock=VirtualClock(),
        persist=False,
    )
    broken.persistent = (
        True  # devices that outlive the process, a state dir that cannot hold journals
    )
    with (
        ControlSession(broken) as session,
        pytest.raises(PermissionDeniedError, match="will not change"),
    ):
        session.lock_sm_clocks(0, 900)
    assert broken.device(0).read_state().locked_sm_freqs_mhz is None
    assert _state(backend, 0) == before


def test_someone_elses_later_change_is_left_alone(backend: SimulatedBackend) -> None:
    with ControlSession(backend) as session:
        session.set_power_limit(0, 200)
        backend.device(0).set_power_limit(380)  # an admin (or DCGM) changes it meanwhile
        outcomes = session.close()
    assert _state(backend, 0)[1] == 380.0
    [outcome] = [o for o in outcomes if o.item == "power_limit"]
    assert outcome.ok and "changed by someone else" in outcome.action


def test_restores_continue_past_failures_and_keep_the_journal(
    backend: SimulatedBackend, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = ControlSession(backend).start()
    session.lock_sm_clocks(0, 900)
    session.lock_sm_clocks(1, 1200)

    def broken_reset() -> None:
        raise PowerlibError("driver said no")

    monkeypatch.setattr(backend.device(0), "_reset_sm_clocks", broken_reset)
    outcomes = session.close()
    assert [o.ok for o in outcomes if o.device_id == backend.device(1).device_id] == [True]
    assert [o.ok for o in outcomes if o.device_id == backend.device(0).device_id] == [False]
    assert _state(backend, 1)[0] is None
    [kept] = _journals(settings)
    assert kept.name == device_key("simulated", backend.device(0).device_id) + ".json"
    monkeypatch.undo()
    assert all(o.ok for o in restore_journals(settings, include_live=True))
    assert _state(backend, 0)[0] is None and _journals(settings) == []


def test_a_second_session_on_a_busy_device_fails_fast(
    backend: SimulatedBackend, settings: Settings
) -> None:
    with ControlSession(backend) as first:
        first.lock_sm_clocks(0, 900)
        other = SimulatedBackend(settings.replace(sim_gpus=2), clock=VirtualClock(), persist=True)
        with ControlSession(other) as second:
            with pytest.raises(DeviceBusyError, match=f"pid {os.getpid()}"):
                second.lock_sm_clocks(0, 1200)
            second.lock_sm_clocks(1, 1200)  # a different device proceeds
        assert _state(backend, 0)[0] == (900.0, 900.0)


def test_a_training_clock_on_a_busy_device_leaves_the_owners_lock_alone(
    backend: SimulatedBackend, settings: Settings
) -> None:
    with ControlSession(backend) as first:
        first.lock_sm_clocks(0, 900)
        other = SimulatedBackend(settings.replace(sim_gpus=2), clock=VirtualClock(), persist=True)
        with ControlSession(other) as second:
            with pytest.warns(
                RuntimeWarning, match="leaves .* alone .* already held by this process"
            ):
                assert second.apply_sm_clocks(0, 1200) is False
            assert second.apply_sm_clocks(0, 1200) is False  # degraded: no second warning
            # Not "a driver error", and no reset: the first session's lock still stands.
            assert _state(backend, 0)[0] == (900.0, 900.0)
        assert _state(backend, 0)[0] == (900.0, 900.0)
    assert _state(backend, 0)[0] is None


def test_cli_set_and_reset_refuse_a_controlled_device(
    backend: SimulatedBackend, settings: Settings
) -> None:
    env = {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(settings.state_dir),
    }
    wall = SimulatedBackend(settings.replace(sim_gpus=2))
    with ControlSession(wall) as session:
        session.lock_sm_clocks(0, 900)
        result = CliRunner().invoke(cli, ["set", "--device", "0", "--freq-mhz", "1200"], env=env)
        assert result.exit_code == 8 and f"pid {os.getpid()}" in result.stderr
        result = CliRunner().invoke(cli, ["reset", "--all"], env=env)
        assert result.exit_code == 8
        assert wall.device(0).read_state().locked_sm_freqs_mhz == (900.0, 900.0)
        assert wall.device(1).read_state().locked_sm_freqs_mhz is None
    assert (
        CliRunner().invoke(cli, ["set", "--device", "0", "--freq-mhz", "1200"], env=env).exit_code
        == 0
    )


def _dead_owner() -> Owner:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return Owner(
        pid=int(out.stdout), start_time_s=1.0, hostname=Owner.current().hostname, argv="killed job"
    )


def _leave_journal(backend: SimulatedBackend, settings: Settings, index: int) -> Path:
    """What a SIGKILLed session leaves: a modified device and its journal."""
    dev = backend.device(index)
    entry = JournalEntry(
        device_id=dev.device_id,
        device_name=dev.info.name,
        backend="simulated",
        backend_settings={
            "sim_model": "a100",
            "sim_gpus": 2,
            "sysfs_root": str(settings.sysfs_root),
        },
        owner=_dead_owner(),
        created_s=1.0,
        changes=(
            Change(item="sm_clocks", original=None),
            Change(item="power_limit", original=400.0, target=175.0),
        ),
    )
    path = write_journal(StateDir(settings.state_dir).prepare(), entry)
    dev.lock_sm_clocks(600)
    dev.set_power_limit(175)
    return path


def test_the_next_session_restores_a_dead_owners_leftovers_first(
    backend: SimulatedBackend, settings: Settings
) -> None:
    path = _leave_journal(backend, settings, 0)
    with ControlSession(backend) as session:
        session.set_power_limit(0, 300)
        assert _state(backend, 0) == (None, 300.0)  # clocks: the dead owner's lock is gone
        assert json.loads(path.read_text())["owner"]["pid"] == os.getpid()  # our journal now
    assert _state(backend, 0) == (None, 400.0)


def test_a_corrupted_journal_is_never_guessed_at(
    backend: SimulatedBackend, settings: Settings
) -> None:
    state = StateDir(settings.state_dir).prepare()
    path = journal_path(state, device_key("simulated", backend.device(0).device_id))
    path.write_text('{"schema": "powerlib.journal.v1", "trunc')
    with ControlSession(backend) as session:
        with pytest.raises(JournalError, match="left in place"):
            session.lock_sm_clocks(0, 900)
        session.lock_sm_clocks(1, 900)  # other devices are unaffected
    assert _state(backend, 0)[0] is None and path.exists()
    result = CliRunner().invoke(
        cli, ["restore", "--json"], env={"POWERLIB_STATE_DIR": str(settings.state_dir)}
    )
    assert result.exit_code == 11  # unreadable journal, as docs/json-and-exit-codes.md's table says
    data = json.loads(result.stdout)
    [outcome] = data["outcomes"]
    assert outcome["item"] == "journal" and not outcome["ok"] and outcome["journal"] == str(path)
    assert outcome["error_code"] == 11 and data["ok"] is False
    assert data["still_modified"] == [
        {
            "device_id": "?",
            "item": "unknown",
            "journal": str(path),
            "reason": outcome["action"],
            "error_code": 11,
        }
    ]
    [line] = result.stderr.splitlines()
    assert line.startswith("powerlib: error: restore incomplete: ") and "left in place" in line
    assert path.exists()


def test_restore_cli_dry_run_then_real(backend: SimulatedBackend, settings: Settings) -> None:
    path = _leave_journal(backend, settings, 1)
    env = {"POWERLIB_STATE_DIR": str(settings.state_dir)}
    dry = CliRunner().invoke(cli, ["restore", "--dry-run", "--json"], env=env)
    assert dry.exit_code == 0, dry.output
    data = json.loads(dry.stdout)
    assert data["dry_run"] is True and {o["item"] for o in data["outcomes"]} == {
        "sm_clocks",
        "power_limit",
    }
    assert all(
        o["journal"] == str(path) and o["owner_pid"] == json.loads(path.read_text())["owner"]["pid"]
        for o in data["outcomes"]
    )
    assert _state(backend, 1) == ((600.0, 600.0), 175.0) and path.exists()
    real = CliRunner().invoke(cli, ["restore"], env=env)
    assert real.exit_code == 0 and "journal of pid" in real.stdout
    assert _state(backend, 1) == (None, 400.0) and not path.exists()
    assert "nothing to restore" in CliRunner().invoke(cli, ["restore"], env=env).stdout


def test_live_owners_are_skipped_unless_all(backend: SimulatedBackend, settings: Settings) -> None:
    session = ControlSession(backend).start()
    session.lock_sm_clocks(0, 900)
    [outcome] = restore_journals(settings)
    assert outcome.ok and "still running" in outcome.action
    assert _state(backend, 0)[0] == (900.0, 900.0)
    session.close()


def test_in_memory_devices_need_no_journal(settings: Settings) -> None:
    backend = SimulatedBackend(settings.replace(sim_gpus=1, sim_clock="virtual"))
    assert not backend.persistent
    with ControlSession(backend) as session:
        session.lock_sm_clocks(0, 900)
        assert _journals(settings) == []
    assert backend.device(0).read_state().locked_sm_freqs_mhz is None


def test_driver_errors_during_training_degrade_to_reset_clocks(settings: Settings) -> None:
    pynvml = pytest.importorskip("pynvml")
    from powerlib.backends.nvidia import NvidiaBackend
    from powerlib.testing.fake_nvml import FakeNvml

    fake = FakeNvml()
    backend = NvidiaBackend(settings, nvml=fake)
    with ControlSession(backend) as session:
        assert session.apply_sm_clocks(0, 1200)
        fake.fail("nvmlDeviceSetGpuLockedClocks", pynvml.NVML_ERROR_GPU_IS_LOST, times=1)
        with pytest.warns(RuntimeWarning, match="training continues"):
            assert not session.apply_sm_clocks(0, 1005)
        assert fake.gpus[0].locked_mhz is None  # left at the safe state
        assert not session.apply_sm_clocks(0, 1110)  # later requests are skipped, silently
        assert fake.gpus[0].locked_mhz is None
        assert session.apply_sm_clocks(1, 1110)  # other devices carry on
    assert fake.gpus[1].locked_mhz is None


def test_sigterm_restores_then_chains_to_the_hosts_handler(backend: SimulatedBackend) -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        session = ControlSession(backend).start()
        session.lock_sm_clocks(0, 1410)
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert _state(backend, 0)[0] is None
        assert (
            signal.getsignal(signal.SIGTERM) is not None
            and signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"
        )
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_ignored_signal_stays_ignored(backend: SimulatedBackend) -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with ControlSession(backend) as session:
            session.lock_sm_clocks(0, 1410)
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_atexit_restores_a_session_left_open(settings: Settings) -> None:
    env = {
        **os.environ,
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "1",
        "POWERLIB_STATE_DIR": str(settings.state_dir),
    }
    code = (
        "from powerlib import open_backend\nfrom powerlib.control import ControlSession\n"
        "s = ControlSession(open_backend()).start()\ns.lock_sm_clocks(0, 600)\ns.set_power_limit(0, 150)\n"
        "print('changed')\n"  # no close(), no with: the interpreter's exit must restore
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "changed", proc.stderr
    after = SimulatedBackend(settings.replace(sim_gpus=1)).device(0).read_state()
    assert (after.locked_sm_freqs_mhz, after.power_limit_w) == (None, 400.0)
    assert _journals(settings) == []


def test_a_restore_that_does_not_read_back_keeps_the_journal(
    backend: SimulatedBackend, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = ControlSession(backend).start()
    session.set_power_limit(0, 200)
    dev = backend.device(0)
    monkeypatch.setattr(dev, "_set_power_limit", lambda watts: watts)  # says yes, does nothing
    [outcome] = session.close()
    assert not outcome.ok and outcome.error_code == 1
    assert "still reads at 200 W: still modified" in outcome.action
    assert _state(backend, 0)[1] == 200.0 and len(_journals(settings)) == 1
    monkeypatch.undo()
    [outcome] = restore_journals(settings, include_live=True)
    assert outcome.ok and outcome.error_code is None and _state(backend, 0)[1] == 400.0
    assert _journals(settings) == []


def test_restore_failures_carry_the_drivers_exit_code(
    backend: SimulatedBackend, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = ControlSession(backend).start()
    session.lock_sm_clocks(0, 900)

    def refuse() -> None:
        raise PermissionDeniedError("needs root")

    monkeypatch.setattr(backend.device(0), "_reset_sm_clocks", refuse)
    outcomes = session.close()
    assert [(o.ok, o.error_code) for o in outcomes] == [(False, 4)]
    failure = restore_failure(outcomes)
    assert failure is not None and failure.exit_code == 4 and "needs root" in str(failure)
    assert restore_failure([]) is None
