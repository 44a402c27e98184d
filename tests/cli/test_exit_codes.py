"""Every exit code in the documented table, triggered through the real CLI.

The table is parsed from docs/json-and-exit-codes.md (the README links there): a row without a
trigger here fails, and so does a trigger for a code the table does not document. Each failure must be one ``powerlib: error: …`` line on
stderr with no traceback (usage errors, code 2, are click's: a usage line and one ``Error:``
line). Device-specific codes come from powerlib's fake vendor modules (``fake_nvml`` raising
nvidia-ml-py's real error types), on which the CLI runs unchanged.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import powerlib.errors
from powerlib.backends.simulated import SimulatedBackend, SimulatedDevice
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import Change, ControlSession, JournalEntry, Owner, StateDir
from powerlib.control.journal import write_journal

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "json-and-exit-codes.md"


def documented_exit_codes() -> dict[int, str]:
    """The ``## Exit codes`` table of docs/json-and-exit-codes.md: code -> meaning."""
    text = TABLE.read_text(encoding="utf-8")
    section = text.split("## Exit codes", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| *(\d+) *\| *(.+?) *\|$", section, flags=re.MULTILINE)
    assert rows, f"no exit-code table found in {TABLE}"
    return {int(code): meaning for code, meaning in rows}


@dataclass
class Run:
    exit_code: int
    stdout: str
    stderr: str


@dataclass
class Env:
    """What a trigger may use: a state folder, the simulated env, and monkeypatch."""

    state_dir: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def sim(self) -> dict[str, str]:
        return {
            "POWERLIB_BACKEND": "simulated",
            "POWERLIB_SIM_GPUS": "2",
            "POWERLIB_STATE_DIR": str(self.state_dir),
        }

    def cli(self, *args: str, env: dict[str, str] | None = None) -> Run:
        result = CliRunner().invoke(
            cli, list(args), env={**self.sim, **(env or {})}, catch_exceptions=False
        )
        return Run(result.exit_code, result.stdout, result.stderr)

    def fake_nvml(self, pattern: str | None = None, code_name: str | None = None) -> None:
        """Put powerlib's fake pynvml in place, failing ``pattern`` calls with an NVML error."""
        pytest.importorskip("pynvml")
        from powerlib.testing.fake_nvml import A100_SXM4_40GB, FakeNvml

        fake = FakeNvml([A100_SXM4_40GB])
        if pattern is not None and code_name is not None:
            fake.fail(pattern, getattr(fake, code_name))
        self.monkeypatch.setitem(sys.modules, "pynvml", fake)

    def crashed_session(self) -> Path:
        """Simulated device 0 modified by a killed session; its journal names a dead owner."""
        me = Owner.current()
        dead = Owner(pid=me.pid, start_time_s=me.start_time_s - 3600.0, hostname=me.hostname)
        settings = Settings(backend="simulated", state_dir=self.state_dir, sim_gpus=2)
        with SimulatedBackend(settings) as backend:
            dev = backend.device(0)
            path = write_journal(
                StateDir(self.state_dir).prepare(),
                JournalEntry(
                    device_id=dev.device_id,
                    device_name=dev.info.name,
                    backend="simulated",
                    backend_settings={"sim_model": "a100", "sim_gpus": 2},
                    owner=dead,
                    created_s=1.0,
                    changes=(Change(item="power_limit", original=400.0, target=175.0),),
                ),
            )
            dev.set_power_limit(175.0)
        return path


def _success(env: Env) -> Run:
    return env.cli("devices", "--json")


def _still_modified_after_restore(env: Env) -> Run:
    env.crashed_session()
    # A driver that reports success but applies nothing: only the read-back can tell.
    env.monkeypatch.setattr(SimulatedDevice, "_set_power_limit", lambda self, watts: watts)
    return env.cli("restore")


def _usage_error(env: Env) -> Run:
    return env.cli("set", "--device", "0")


def _backend_unavailable(env: Env) -> Run:
    env.monkeypatch.setitem(sys.modules, "pynvml", None)
    return env.cli("--backend", "nvidia", "devices")


def _nvml_set_fails(code_name: str) -> Callable[[Env], Run]:
    def trigger(env: Env) -> Run:
        env.fake_nvml("nvmlDeviceSetPowerManagementLimit", code_name)
        return env.cli("--backend", "nvidia", "set", "--device", "0", "--power-limit-w", "300")

    return trigger


def _device_not_found(env: Env) -> Run:
    return env.cli("status", "--device", "7")


def _invalid_argument(env: Env) -> Run:
    return env.cli("set", "--device", "0", "--freq-mhz", "5000")


def _device_busy(env: Env) -> Run:
    settings = Settings(backend="simulated", state_dir=env.state_dir, sim_gpus=2)
    with SimulatedBackend(settings) as backend, ControlSession(backend) as session:
        session.lock_sm_clocks(0, 900)  # a running session controls device 0
        return env.cli("set", "--device", "0", "--freq-mhz", "1200")


def _unreadable_journal(env: Env) -> Run:
    env.crashed_session().write_bytes(b'{"schema": "powerlib.journal.v1", "trunc')
    return env.cli("restore")


def _untrusted_journal(env: Env) -> Run:
    env.crashed_session().chmod(0o666)
    return env.cli("restore")


def _interrupted(env: Env) -> Run:
    """``powerlib check`` (60 s of counter reads) until SIGINT, delivered even if it was ignored.

    The child says ``checking`` on stdout once the command runs. ``watch`` and ``exporter`` are
    not the trigger: Ctrl-C is how they are stopped, and they end with 0.
    """
    code = (
        "import runpy, signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import powerlib.node_check.check as node_check\n"
        "real = node_check.check_settings\n"
        "def started(*args, **kwargs):\n"
        "    print('checking', flush=True)\n"
        "    return real(*args, **kwargs)\n"
        "node_check.check_settings = started\n"
        "runpy.run_module('powerlib.cli', run_name='__main__')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "check", "--device", "0", "--duration-s", "60"],
        env={**os.environ, **env.sim},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # it is checking
        assert first == "checking\n", first
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Run(proc.returncode, first + stdout, stderr)


TRIGGERS: dict[int, tuple[Callable[[Env], Run], str]] = {
    0: (_success, ""),
    1: (_still_modified_after_restore, "still modified"),
    2: (_usage_error, "nothing to set"),
    3: (_backend_unavailable, "pynvml"),
    4: (_nvml_set_fails("NVML_ERROR_NO_PERMISSION"), "Insufficient Permissions"),
    5: (_nvml_set_fails("NVML_ERROR_NOT_SUPPORTED"), "not supported"),
    6: (_device_not_found, "7"),
    7: (_invalid_argument, "5000"),
    8: (_device_busy, "controls this device"),
    9: (_nvml_set_fails("NVML_ERROR_GPU_IS_LOST"), "fell off the bus"),
    10: (_nvml_set_fails("NVML_ERROR_UNKNOWN"), "NVML reported an error"),
    11: (_unreadable_journal, "invalid JSON"),
    12: (_untrusted_journal, "writable by group and others"),
    130: (_interrupted, "interrupted"),
}


def test_every_documented_code_has_a_trigger_and_every_trigger_is_documented() -> None:
    assert sorted(documented_exit_codes()) == sorted(TRIGGERS)


def test_every_error_class_exit_code_is_documented() -> None:
    documented = documented_exit_codes()
    classes = [
        cls
        for _, cls in inspect.getmembers(powerlib.errors, inspect.isclass)
        if issubclass(cls, powerlib.errors.PowerlibError)
    ]
    assert len(classes) >= 12
    for cls in classes:
        assert cls.exit_code in documented, cls


@pytest.mark.parametrize("code", sorted(documented_exit_codes()))
def test_the_cli_exits_with_each_documented_code(
    code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if code not in TRIGGERS:
        pytest.fail(f"{TABLE.name} documents exit code {code} but no test triggers it")
    trigger, expected = TRIGGERS[code]
    run = trigger(Env(state_dir=tmp_path / "state", monkeypatch=monkeypatch))
    assert run.exit_code == code, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    if code == 0:
        assert lines == [] and run.stdout
    elif code == 2:  # click's usage error: usage line, hint, then one "Error:" line
        assert lines[0].startswith("Usage: ") and lines[-1].startswith("Error: ")
        assert expected in lines[-1]
    else:
        assert len(lines) == 1, lines
        assert lines[0].startswith("powerlib: error: ") and expected in lines[0], lines[0]
