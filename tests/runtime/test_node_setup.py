"""A session on a real node's set-up (docs/real-gpu.md §4, §5, §7), on fake NVML and a fake torch.

Which GPU a session takes when none is named (the CUDA device's UUID, else ``LOCAL_RANK``,
else the only visible one), the refusals at the ``with`` line before any lock or journal (a CPU
backend, MIG, no privilege), the waits resolved when first needed rather than at the ``with``
line, and a measure-only session without a device.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from uid_helpers import NOBODY, as_uid

from powerlib.backends.nvidia import NvidiaBackend
from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.errors import (
    BackendUnavailableError,
    DeviceNotFoundError,
    NotSupportedError,
    PermissionDeniedError,
)
from powerlib.privilege import WAYS_OUT
from powerlib.runtime.claim import select_device
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.session import Session, optimize
from powerlib.runtime.session_config import RunConfig
from powerlib.testing.fake_nvml import H100_SXM5_80GB, FakeNvml

# -- fakes -----------------------------------------------------------------------------------------


class _CUuuid:
    """What ``torch.cuda.get_device_properties(i).uuid`` is: its ``str`` has no ``GPU-``."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


def fake_torch(
    uuid: str | None = None, *, initialised: bool = True, hip: str | None = None
) -> SimpleNamespace:
    """The slice of ``torch`` powerlib reads: ``torch.cuda`` and ``torch.version.hip``.

    ``calls`` records ``sync`` (``torch.cuda.synchronize``) and ``record`` (an event recorded).
    """
    calls: list[str] = []
    state = SimpleNamespace(initialised=initialised, device=0)

    class Event:
        def record(self) -> None:
            calls.append("record")

        def synchronize(self) -> None:
            calls.append("event-sync")

    cuda = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: state.initialised,
        current_device=lambda: state.device,
        get_device_properties=lambda index: SimpleNamespace(uuid=_CUuuid(uuid or "")),
        synchronize=lambda: calls.append("sync"),
        Event=Event,
    )
    return SimpleNamespace(cuda=cuda, version=SimpleNamespace(hip=hip), state=state, calls=calls)


@pytest.fixture
def no_vendor_libs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make pynvml and amdsmi unimportable, whatever is installed: ``auto`` finds no GPU."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)


@pytest.fixture
def warn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The no-device warning is once per process: let this test see it."""
    module = importlib.import_module("powerlib.measurement.reader")
    monkeypatch.setattr(module, "_NO_DEVICE_WARNED", False)


def _nvidia(settings: Settings, gpus: int = 2, **overrides: Any) -> tuple[FakeNvml, NvidiaBackend]:
    fake = FakeNvml([H100_SXM5_80GB] * gpus)
    return fake, NvidiaBackend(settings.replace(**overrides), nvml=fake)


def _session(backend: Any, settings: Settings, **options: Any) -> Session:
    return optimize(
        num_stages=1,
        num_microbatches=1,
        mode="profile",
        backend=backend,
        settings=settings,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
        guardian=False,
        **options,
    )


def _journals(settings: Settings) -> list[Path]:
    return sorted((settings.state_dir / "journal").glob("*.json"))


# -- §4 which GPU ----------------------------------------------------------------------------------


def test_a_rank_given_one_gpu_by_cuda_visible_devices_gets_that_gpu(settings: Settings) -> None:
    # torchrun-style launcher, rank 1 of a node: LOCAL_RANK=1, CUDA_VISIBLE_DEVICES=1
    rank1 = settings.replace(cuda_visible_devices="1", local_rank=1)
    fake, backend = _nvidia(rank1)
    with backend:
        assert [d.device_id for d in backend.devices()] == [fake.gpus[1].uuid]
        with _session(backend, rank1) as session:
            assert session.device is not None
            assert session.device.device_id == fake.gpus[1].uuid


def test_the_cuda_device_is_found_by_uuid_before_local_rank(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, backend = _nvidia(settings, gpus=4)
    uuid = fake.gpus[2].uuid
    assert uuid.startswith("GPU-")  # NVML's form; torch's has no prefix
    torch = fake_torch(uuid.removeprefix("GPU-"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    with backend:
        # CUDA's order differs from NVML's, or LOCAL_RANK is not the CUDA device: the UUID wins
        with _session(backend, settings.replace(local_rank=1)) as session:
            assert session.device is not None and session.device.device_id == uuid
        run = RunConfig()
        assert select_device(run, backend, settings.replace(local_rank=0)).device_id == uuid
        # a named device is taken as named
        assert select_device(RunConfig(device=3), backend, settings).device_id == fake.gpus[3].uuid
        # before CUDA is up, and on ROCm (HIP UUIDs are not the vendor ids), the index decides
        torch.state.initialised = False
        assert select_device(run, backend, settings.replace(local_rank=1)).index == 1
        monkeypatch.setitem(sys.modules, "torch", fake_torch(uuid[4:], hip="6.2"))
        assert select_device(run, backend, settings.replace(local_rank=1)).index == 1


def test_no_device_for_local_rank_names_what_was_looked_at(settings: Settings) -> None:
    rank2 = settings.replace(cuda_visible_devices="0,1", local_rank=2)
    fake, backend = _nvidia(rank2, gpus=3)
    with backend, pytest.raises(DeviceNotFoundError) as info:
        with _session(backend, rank2):
            pytest.fail("the with block must not run")
    message = str(info.value)
    assert "LOCAL_RANK=2" in message
    assert "CUDA_VISIBLE_DEVICES '0,1'" in message
    assert "2 device(s)" in message
    assert "\n" not in message


def test_a_gpu_in_mig_mode_is_refused_at_the_with_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, backend = _nvidia(settings, gpus=1)
    with backend:
        device = backend.device(0)
        monkeypatch.setattr(device, "mig_enabled", lambda: True)
        with pytest.raises(NotSupportedError, match="MIG mode") as info:
            with _session(backend, settings, device=device):
                pytest.fail("the with block must not run")
        assert "\n" not in str(info.value)
        assert "reset" not in " ".join(fake.calls).lower()  # nothing was changed or journaled
        assert _journals(settings) == []
        # measuring only changes nothing: MIG is no reason to refuse it
        with _session(backend, settings, device=device, enabled=False) as session:
            session.step()


def test_a_training_session_on_the_cpu_sysfs_backend_is_refused(
    settings: Settings, no_vendor_libs: None
) -> None:
    from powerlib.testing.sysfs import make_cpufreq_tree, make_powercap_tree

    make_powercap_tree(settings.sysfs_root, packages=1)
    make_cpufreq_tree(settings.sysfs_root, packages=1)
    with pytest.raises(BackendUnavailableError) as info:
        with _session(None, settings):  # POWERLIB_BACKEND unset: auto falls back to sysfs
            pytest.fail("the with block must not run")
    message = str(info.value)
    assert "sysfs backend was picked" in message and "POWERLIB_BACKEND" in message
    assert "\n" not in message
    assert _journals(settings) == []


# -- §5 no root, no agent ----------------------------------------------------------------------


def test_without_privilege_the_with_line_fails_with_one_line_before_any_journal(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = f"powerlib cannot change simulated GPU clocks: this process is not root; {WAYS_OUT}"
    monkeypatch.setattr(SimulatedBackend, "control_refusal", lambda self: line)
    started: list[ControlSession] = []
    start = ControlSession.start

    def recording_start(self: ControlSession) -> ControlSession:
        started.append(self)
        return start(self)

    monkeypatch.setattr(ControlSession, "start", recording_start)
    sim = settings.replace(backend="simulated", sim_gpus=1)
    with pytest.raises(PermissionDeniedError) as info:
        with _session(None, sim):
            pytest.fail("the with block must not run")
    assert str(info.value) == line  # the backend's one line, as it is
    assert started == []  # no control session: no lock taken, nothing journaled
    assert _journals(sim) == []
    # a measure-only session changes nothing: it needs no privilege
    with _session(None, sim, enabled=False) as session:
        session.step()
    assert session.report().to_json()["disabled"]["iterations"] == 1


def test_a_non_root_process_is_refused_by_the_nvidia_backend_at_the_with_line(
    settings: Settings, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("forks a child that drops root")
    _, backend = _nvidia(settings, gpus=1)  # NVML opens as root; the child only enters

    def enter() -> str:
        try:
            with _session(backend, settings):
                return "entered"
        except PermissionDeniedError as err:
            return str(err)

    try:
        result = as_uid(NOBODY, enter)
    finally:
        backend.close()
    assert result["ok"], result
    out = result["value"]
    assert "is not root" in out and "POWERLIB_BACKEND=agent" in out and "\n" not in out
    assert _journals(settings) == []


# -- §4 waits resolved when first needed -------------------------------------------------------


def test_the_default_sync_waits_for_cuda_once_it_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = fake_torch(initialised=False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    sync = RunConfig().resolve_sync()  # at the with line, before the model moves to the GPU
    sync()
    assert torch.calls == []
    torch.state.initialised = True
    sync()
    sync()
    assert torch.calls == ["sync", "sync"]
    mine = []
    assert RunConfig(sync=lambda: mine.append(1)).resolve_sync()() is None and mine == [1]


def test_a_session_entered_before_cuda_follows_the_stream_once_cuda_is_up(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = fake_torch(initialised=False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    sim = settings.replace(backend="simulated", sim_gpus=1)
    with _session(None, sim) as session:
        assert session.controller is not None
        marker = session.controller.marker
        assert marker.record() is None  # no stream yet: the host clock stands in
        torch.state.initialised = True  # the model moved to the GPU
        token = marker.record()
        assert token is not None and torch.calls == ["record"]
        marker.wait(token)
        assert torch.calls == ["record", "event-sync"]


# -- §7 measuring without a device -------------------------------------------------------------


def test_a_measure_only_session_without_a_device_warns_once_and_times(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, no_vendor_libs: None, warn_again: None
) -> None:
    # no GPU, no POWERLIB_BACKEND, and sysfs finds nothing (settings.sysfs_root is empty)
    with pytest.warns(RuntimeWarning, match="measuring time only") as caught:
        with _session(None, settings, enabled=False) as session:
            session.step()
            session.step()
    assert len(caught) == 1
    measured = session.report().disabled
    assert measured is not None and measured.iterations == 2 and measured.energy_j is None
    # a training session is an explicit control request: it fails at its with line
    with pytest.raises(BackendUnavailableError, match="no power backend available"):
        with _session(None, settings):
            pytest.fail("the with block must not run")
    # and so does a backend named explicitly that cannot open, even measuring only
    with pytest.raises(BackendUnavailableError):
        with _session(None, settings.replace(backend="sysfs"), enabled=False):
            pytest.fail("the with block must not run")
