"""The frequency controller: latest request wins, no-op changes are skipped, driver errors degrade."""

from __future__ import annotations

import threading
import time

import pytest

from powerlib.control import ControlSession
from powerlib.emulator.device import EmulatedBackend, EmulatedDevice, VirtualTime
from powerlib.errors import PermissionDeniedError
from powerlib.runtime.controller import FrequencyController

TABLE = {"forward": {f: (0.01, 1.0) for f in (900.0, 1000.0, 1100.0, 1200.0)}}


class _Gated(EmulatedDevice):
    """Blocks inside the driver call until released, and can fail on demand."""

    def __init__(self) -> None:
        super().__init__(index=0, table=TABLE, clock=VirtualTime(), p_block_w=50.0)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[float] = []
        self.fail = False

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        if self.fail:
            raise PermissionDeniedError("no permission to lock clocks", device=self.device_id)
        self.calls.append(max_mhz)
        super()._lock_sm_clocks(min_mhz, max_mhz)


@pytest.fixture
def gated():
    dev = _Gated()
    backend = EmulatedBackend([dev])
    control = ControlSession(backend, handle_signals=False).start()
    ctl = FrequencyController(control, dev)
    yield dev, ctl, control
    dev.gate.set()
    ctl.close()
    control.close()


def test_latest_request_wins_while_the_driver_is_busy(gated) -> None:
    dev, ctl, _ = gated
    ctl.request(900.0)
    assert dev.entered.wait(5)  # the worker is inside the driver call for 900
    for f in (1000.0, 1100.0, 1200.0):
        ctl.request(f)  # returns at once although the driver is blocked
    dev.gate.set()
    assert ctl.wait_idle()
    assert dev.calls == [900.0, 1200.0]  # 1000 and 1100 were superseded
    assert [c.freq_mhz for c in ctl.applied] == [900.0, 1200.0]


def test_repeats_and_no_op_changes_cost_no_driver_call(gated) -> None:
    dev, ctl, _ = gated
    dev.gate.set()
    for f in (900.0, 900.0, 900.0, 1000.0, 1000.0):
        ctl.request(f)
        assert ctl.wait_idle()
    ctl.request(900.0)
    assert ctl.wait_idle()
    assert dev.calls == [900.0, 1000.0, 900.0]


def test_a_driver_error_resets_the_device_warns_once_and_keeps_going(gated) -> None:
    dev, ctl, control = gated
    dev.fail = True
    dev.gate.set()
    with pytest.warns(RuntimeWarning, match="training continues"):
        ctl.request(900.0)
        assert ctl.wait_idle()
    assert ctl.applied[-1].ok is False
    ctl.request(1000.0)  # ignored: the device is left alone for the rest of the session
    assert ctl.wait_idle()
    assert dev.calls == []
    assert dev.read_state().locked_sm_freqs_mhz is None


def test_inline_mode_applies_on_the_callers_thread_and_restores() -> None:
    clock = VirtualTime()
    dev = EmulatedDevice(index=0, table=TABLE, clock=clock, p_block_w=50.0, switch_latency_s=0.004)
    backend = EmulatedBackend([dev])
    with ControlSession(backend, handle_signals=False) as control:
        ctl = FrequencyController(control, dev, threaded=False, clock=clock)
        ctl.request(1000.0)
        assert dev.read_state().locked_sm_freqs_mhz == (1000.0, 1000.0)
        assert dev.freq_at(0.0) == 1200.0 and dev.freq_at(0.004) == 1000.0  # lands late
        ctl.reset()
        assert dev.read_state().locked_sm_freqs_mhz is None
        ctl.request(900.0)
    assert dev.read_state().locked_sm_freqs_mhz is None  # the session restored it
    assert [c.freq_mhz for c in ctl.applied] == [1000.0, None, 900.0]


# -- delayed requests, threaded (issue 45, point 5; inline: test_request_ahead.py) ---------------


def test_a_delayed_request_never_drops_a_pending_immediate_one(gated) -> None:
    dev, ctl, _ = gated
    ctl.request(900.0)
    assert dev.entered.wait(5)  # the worker is inside the driver call for 900
    ctl.request(1000.0)  # immediate, pending
    t0 = time.monotonic()
    ctl.request(1100.0, delay_s=0.05)  # delayed: waits beside it
    assert ctl.delayed_mhz == 1100.0
    dev.gate.set()
    assert ctl.wait_idle()
    assert dev.calls == [900.0, 1000.0, 1100.0]
    assert ctl.delayed_mhz is None
    assert time.monotonic() - t0 >= 0.05  # no earlier than its delay after the call


def test_an_immediate_request_supersedes_a_delayed_one(gated) -> None:
    dev, ctl, _ = gated
    dev.gate.set()
    ctl.request(1000.0, delay_s=30.0)
    ctl.request(1000.0)  # the same clock, no marker: now
    assert ctl.wait_idle(5)
    ctl.request(1100.0, delay_s=30.0)
    ctl.request(900.0)  # another clock: the delayed one is dropped
    assert ctl.wait_idle(5)
    ctl.request(1200.0, delay_s=30.0)
    ctl.reset()  # and by a reset
    assert ctl.wait_idle(5)
    assert dev.calls == [1000.0, 900.0]


class _Marker:
    """A stream marker the test releases: ``wait`` blocks until then."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.reached_at = 0.0

    def record(self) -> object:
        return "mark"

    def wait(self, token: object) -> None:
        assert self.reached.wait(10)
        self.reached_at = time.monotonic()


def test_a_delayed_request_counts_its_delay_from_its_marker(gated) -> None:
    dev, ctl, _ = gated
    dev.gate.set()
    ctl.marker = marker = _Marker()
    ctl.request(1100.0, after="mark", delay_s=0.05)
    ctl.request(1100.0, after="mark")  # the same clock with a marker: the delayed one stays
    assert ctl.delayed_mhz == 1100.0
    time.sleep(0.1)
    assert dev.calls == []  # the stream has not reached the marker
    t_reached = time.monotonic()
    marker.reached.set()
    assert ctl.wait_idle()
    assert dev.calls == [1100.0]
    assert time.monotonic() - t_reached >= 0.05  # from the marker, not from the call (0.1 s ago)
    assert ctl.applied[-1].ok


def test_closing_drops_a_delayed_request(gated) -> None:
    dev, ctl, _ = gated
    dev.gate.set()
    ctl.request(1000.0, delay_s=30.0)
    t0 = time.monotonic()
    ctl.close()
    assert time.monotonic() - t0 < 5.0 and dev.calls == []
