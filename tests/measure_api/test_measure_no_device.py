"""``powerlib.measure`` on a node without a device, and its marks before CUDA is up.

Measuring never breaks training (docs/real-gpu.md §7): without a device it warns once and
records time only; a backend or devices named explicitly still fail. ``auto`` alignment is
decided at each boundary (docs/real-gpu.md §4): a measurement entered before the model moves to
the GPU follows the stream once CUDA is initialised.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from types import SimpleNamespace

import pytest

import powerlib
from powerlib.errors import BackendUnavailableError, DeviceNotFoundError
from powerlib.measurement.markers import Stamps, cuda_marker

READER = importlib.import_module("powerlib.measurement.reader")
"""Where the once-per-process no-device warning keeps its flag."""


def _fake_torch(*, initialised: bool) -> SimpleNamespace:
    """``torch.cuda`` as the markers read it; ``calls`` records each event's record and wait."""
    calls: list[str] = []
    state = SimpleNamespace(initialised=initialised)

    class Event:
        def record(self) -> None:
            calls.append("record")

        def synchronize(self) -> None:
            calls.append("wait")

    cuda = SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: state.initialised, Event=Event
    )
    return SimpleNamespace(cuda=cuda, state=state, calls=calls)


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No GPU library, an empty sysfs, ``POWERLIB_BACKEND`` unset: ``auto`` finds nothing."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    (tmp_path / "empty-sys").mkdir()
    monkeypatch.setenv("POWERLIB_SYSFS_ROOT", str(tmp_path / "empty-sys"))
    monkeypatch.setattr(READER, "_NO_DEVICE_WARNED", False)


def test_without_a_device_measure_warns_once_and_times_but_a_named_backend_fails(
    no_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(RuntimeWarning, match="measuring time only, no energy") as caught:
        with powerlib.measure(sampler="manual") as m:
            for _ in range(3):
                with m.step(tokens=10):
                    pass
            with m.window("eval"):
                pass
    assert len(caught) == 1
    assert "no power backend available" in str(caught[0].message)
    assert m.devices == []
    res = m.result()
    assert res.num_steps == 3 and res.tokens == 30 and len(res.window("eval")) == 1
    assert all(t >= 0 and math.isfinite(t) for t in res.step_time_s)
    assert res.devices == ()
    # once per process: the next measurement says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with powerlib.measure(sampler="manual") as again, again.step():
            pass
    assert again.result().num_steps == 1
    # a backend named explicitly that cannot open is an error, as an argument or in the env
    with pytest.raises(BackendUnavailableError, match="powercap"):
        powerlib.measure(backend="sysfs").__enter__()
    monkeypatch.setenv("POWERLIB_BACKEND", "sysfs")
    with pytest.raises(BackendUnavailableError, match="powercap"):
        powerlib.measure().__enter__()


def test_devices_local_is_this_process_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # a launcher gave this rank (LOCAL_RANK=1) one GPU: the one device the backend sees
    monkeypatch.setenv("POWERLIB_BACKEND", "simulated")
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with powerlib.measure("local", sampler="manual") as m:
        pass
    assert [d.index for d in m.devices] == [0]
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "3")
    with powerlib.measure("local", sampler="manual") as m:
        pass
    assert [d.index for d in m.devices] == [1]
    # devices listed explicitly are the caller's: a missing one is an error
    with pytest.raises(DeviceNotFoundError):
        powerlib.measure([5], sampler="manual").__enter__()


def test_auto_alignment_follows_the_stream_once_cuda_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POWERLIB_BACKEND", "simulated")
    monkeypatch.setenv("POWERLIB_SIM_GPUS", "1")
    torch = _fake_torch(initialised=False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    with powerlib.measure(sampler="manual", align="auto") as m:
        with m.step():  # before the model moves to the GPU: host times
            pass
        assert torch.calls == []
        torch.state.initialised = True
        with m.step():  # then the GPU's: an event at each boundary
            pass
    # the second step's two boundaries and the end, each recorded and waited for
    assert torch.calls.count("record") == 3
    assert torch.calls.count("wait") == 3
    assert m.result().num_steps == 2


def test_stamps_take_the_host_clock_until_cuda_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    marker = cuda_marker("auto")
    assert marker is not None and marker.record() is None
    assert "torch" not in sys.modules  # never imported for auto
    torch = _fake_torch(initialised=False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    now = [1.0]
    stamps = Stamps(lambda: now[0], marker)
    try:
        assert stamps.stamp() == [1.0]  # at once, on the host clock
        torch.state.initialised = True
        now[0] = 2.0
        cell = stamps.stamp()  # filled by the waiter when the event completes
        stamps.close()
        assert cell == [2.0]
        assert torch.calls == ["record", "wait"]
    finally:
        stamps.close()
