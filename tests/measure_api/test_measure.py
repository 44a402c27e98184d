"""powerlib.measure against the simulated backend's ground truth (virtual clock, manual sampling)."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from pathlib import Path

import jsonschema
import pytest

import powerlib
from powerlib.backends.simulated import SimulatedBackend, VirtualClock
from powerlib.backends.simulated_model import WorkUnit
from powerlib.config import Settings
from powerlib.device import Capabilities, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import DeviceNotFoundError, InvalidArgumentError
from powerlib.measure_api import SCHEMA, Measurement, MeasurementResult, read_events

SCHEMA_PATH = Path(powerlib.__file__).parent / "measure_api" / "result.schema.json"


class Rig:
    """Simulated GPUs on a virtual clock, sampled every ~10 ms with jitter, like the thread does."""

    def __init__(self, settings: Settings, gpus: int = 2, seed: int = 0) -> None:
        self.clock = VirtualClock(1000.0)
        self.backend = SimulatedBackend(
            Settings(state_dir=settings.state_dir, sim_gpus=gpus, sim_clock="virtual"),
            clock=self.clock,
        )
        self.rng = random.Random(seed)
        self.m: Measurement | None = None
        self.next_poll = 0.0

    def measure(self, **kw) -> Measurement:
        self.m = powerlib.measure(
            backend=self.backend, clock=self.clock.now, sampler="manual", **kw
        )
        return self.m

    def truth(self) -> float:
        return math.fsum(d.exact_energy_j() for d in self.backend.devices())

    def advance(self, duration_s: float) -> None:
        end = self.clock.now() + duration_s
        while True:
            polling = self.m is not None and self.m.running
            if polling and self.next_poll <= self.clock.now():
                self.m.poll()
                self.next_poll = self.clock.now() + self.rng.uniform(0.007, 0.013)
            target = min(end, self.next_poll) if polling else end
            if target > self.clock.now():
                self.clock.advance(target - self.clock.now())
            if self.clock.now() >= end and not (polling and self.next_poll <= self.clock.now()):
                return

    def stall(self, duration_s: float) -> None:
        """The sampler thread gets no GIL for ``duration_s`` (the trainer's setup, a GC pause)."""
        self.clock.advance(duration_s)
        self.next_poll = self.clock.now()

    def step(self, busy_s: float, idle_s: float, activity: float = 0.9) -> None:
        """A training step: every GPU computes (staggered), then waits for data."""
        for i, dev in enumerate(self.backend.devices()):
            dev.begin_work(
                WorkUnit(time_at_max_s=busy_s, compute_fraction=0.8, sm_activity=activity - 0.1 * i)
            )
        self.advance(busy_s)
        for dev in self.backend.devices():
            dev.end_work()
        self.advance(idle_s)


def _realistic_run(rig: Rig, m: Measurement, steps: int) -> list[tuple[float, float, float]]:
    """Steps of 0.2-0.45 s with idle gaps; returns (start, end, true energy) of 1 s+ blocks."""
    truths = []
    block_start, block_truth, block = rig.clock.now(), rig.truth(), m.window("block")
    block.__enter__()
    for k in range(steps):
        busy = rig.rng.uniform(0.15, 0.4)
        idle = rig.rng.uniform(0.01, 0.06)
        with m.step(tokens=4096):
            rig.step(busy, idle)
        if rig.clock.now() - block_start >= 1.0 + 0.7 * (k % 3):
            block.__exit__(None, None, None)
            truths.append((block_start, rig.clock.now(), rig.truth() - block_truth))
            block_start, block_truth, block = rig.clock.now(), rig.truth(), m.window("block")
            block.__enter__()
    block.__exit__(None, None, None)
    return truths


def test_windows_of_a_second_or_more_are_within_half_a_percent(settings: Settings) -> None:
    rig = Rig(settings, gpus=2, seed=1)
    m = rig.measure()
    with m:
        rig.advance(0.3)  # the job starts a moment after the measurement
        start_truth = rig.truth()
        _realistic_run(rig, m, steps=150)
        rig.advance(0.25)  # the counter's next update after the last step
        end_truth = rig.truth()
    res = m.result()
    blocks = res.window("block")
    assert len(blocks) >= 20
    # Re-run the same seeded job to get each block's ground truth at its boundaries.
    rig2 = Rig(settings, gpus=2, seed=1)
    m2 = rig2.measure()
    with m2:
        rig2.advance(0.3)
        truths = _realistic_run(rig2, m2, steps=150)
    assert len(truths) == len([b for b in blocks if b.time_s >= 1.0])
    worst = 0.0
    for b, (_, _, true_j) in zip([b for b in blocks if b.time_s >= 1.0], truths):
        worst = max(worst, abs(b.energy_j - true_j) / true_j)
    assert worst < 0.005, worst
    # The whole measurement includes the idle lead-in and tail.
    total_truth = end_truth - start_truth
    steps_energy = math.fsum(res.step_energy_j)
    assert res.num_steps == 150
    assert res.tokens == 150 * 4096
    assert res.energy_per_token_j == pytest.approx(steps_energy / (150 * 4096))
    assert steps_energy == pytest.approx(total_truth, rel=0.01)  # steps cover all but a tail
    assert not res.estimated
    assert all(d.source == "counter" for d in res.devices)


def test_steps_are_accurate_on_average_even_though_shorter_than_a_counter_update(
    settings: Settings,
) -> None:
    """A 60 ms step spans part of an update: each is shaped by power, their sum by the counter."""
    rig = Rig(settings, gpus=1, seed=3)
    m = rig.measure()
    truth = []
    with m:
        for _ in range(200):
            before = rig.truth()
            with m.step():
                rig.step(0.045, 0.015)
            truth.append(rig.truth() - before)
        rig.advance(0.3)
    got = m.result().step_energy_j
    assert math.fsum(got) == pytest.approx(math.fsum(truth), rel=0.005)
    errors = sorted(abs(g - t) / t for g, t in zip(got, truth))
    assert errors[len(errors) // 2] < 0.06  # power sampled every 10 ms shapes each step


def test_a_starved_sampler_costs_no_accuracy(settings: Settings) -> None:
    """Reads that miss several counter updates (the sampler waited for the GIL) bracket the last
    of them, not their middle: the lead-in and the windows around the gap stay within 0.5 %.

    The device idles through each gap (the trainer's setup, a checkpoint save): a power change
    inside a gap is shaped by the two reads around it, and only its counter delta is exact.
    """
    rig = Rig(settings, gpus=1, seed=5)
    m = rig.measure()
    with m:
        start_truth = rig.truth()
        rig.stall(0.37)  # Lightning's setup: no read for 3-4 updates after the first one
        rig.advance(0.02)
        with m.window("a"):
            a_truth = rig.truth()
            for _ in range(6):
                rig.step(0.2, 0.02)
            rig.stall(0.45)  # and again mid-run
            rig.advance(0.02)
            for _ in range(6):
                rig.step(0.2, 0.02)
            a_truth = rig.truth() - a_truth
        rig.advance(0.3)
        end_truth = rig.truth()
    res = m.result()
    (a,) = res.window("a")
    assert a.energy_j == pytest.approx(a_truth, rel=0.005)
    assert res.energy_j == pytest.approx(end_truth - start_truth, rel=0.005)


def test_integrated_power_is_marked_estimated(settings: Settings) -> None:
    clock = VirtualClock()

    class PowerOnly(Device):
        def __init__(self) -> None:
            super().__init__(
                DeviceInfo(
                    device_id="GPU-power-only",
                    index=0,
                    name="Old GPU",
                    vendor="nvidia",
                    kind=DeviceKind.GPU,
                    backend="test",
                    supported_sm_freqs_mhz=(),
                    power_limit_range_w=None,
                    default_power_limit_w=None,
                    capabilities=Capabilities(
                        can_lock_sm_clocks=False,
                        can_set_power_limit=False,
                        can_reset_power_limit=False,
                        has_energy_counter=False,
                        has_power_reading=True,
                        has_temperature=False,
                    ),
                )
            )

        def _read_state(self) -> PowerState:
            return PowerState(
                device_id=self.device_id,
                timestamp_s=clock.now(),
                power_w=100.0 + 50.0 * (int(clock.now()) % 2),
                energy_j=None,
                sm_freq_mhz=None,
                power_limit_w=None,
                temperature_c=None,
            )

        _lock_sm_clocks = _reset_sm_clocks = _set_power_limit = _reset_power_limit = None  # type: ignore[assignment]

    dev = PowerOnly()
    m = Measurement([dev], clock=clock.now, sampler="manual")
    with m:
        for _ in range(400):
            clock.advance(0.01)
            m.poll()
    res = m.result()
    (d,) = res.devices
    assert d.source == "integrated" and d.estimated and res.estimated
    assert d.energy_j == pytest.approx(4 * 125.0, rel=0.01)  # 100 W and 150 W seconds alternate


class Scripted(Device):
    """A device whose counter follows a script: wraps and resets on demand."""

    def __init__(self, clock: VirtualClock, power_w: float, wrap_j: float | None = None) -> None:
        super().__init__(
            DeviceInfo(
                device_id="GPU-scripted",
                index=0,
                name="Scripted",
                vendor="nvidia",
                kind=DeviceKind.GPU,
                backend="test",
                supported_sm_freqs_mhz=(),
                power_limit_range_w=None,
                default_power_limit_w=None,
                capabilities=Capabilities(
                    can_lock_sm_clocks=False,
                    can_set_power_limit=False,
                    can_reset_power_limit=False,
                    has_energy_counter=True,
                    has_power_reading=True,
                    has_temperature=False,
                ),
            )
        )
        self.clock = clock
        self.power = power_w
        self.offset = 0.0
        self.energy_counter_wrap_j = wrap_j
        self.exact = 0.0
        self.last = clock.now()

    def _read_state(self) -> PowerState:
        now = self.clock.now()
        self.exact += self.power * (now - self.last)
        self.last = now
        raw = float(math.floor(self.exact - self.offset))  # whole joules
        if self.energy_counter_wrap_j is not None:
            raw %= self.energy_counter_wrap_j
        return PowerState(
            device_id=self.device_id,
            timestamp_s=now,
            power_w=self.power,
            energy_j=raw,
            sm_freq_mhz=None,
            power_limit_w=None,
            temperature_c=None,
        )

    _lock_sm_clocks = _reset_sm_clocks = _set_power_limit = _reset_power_limit = None  # type: ignore[assignment]


def test_counter_wrap_is_unwrapped_exactly() -> None:
    clock = VirtualClock()
    dev = Scripted(clock, power_w=200.0, wrap_j=300.0)  # wraps every 1.5 s
    m = Measurement([dev], clock=clock.now, sampler="manual")
    with m:
        for _ in range(1000):  # 10 s: six wraps
            clock.advance(0.01)
            m.poll()
    (d,) = m.result().devices
    assert d.counter_wraps == 6
    assert d.counter_resets == 0 and not d.estimated
    assert d.energy_j == pytest.approx(2000.0, rel=0.001)


def test_counter_reset_is_detected_and_bridged_with_power() -> None:
    clock = VirtualClock()
    dev = Scripted(clock, power_w=200.0)
    m = Measurement([dev], clock=clock.now, sampler="manual")
    with m:
        for i in range(1000):
            clock.advance(0.01)
            if i == 500:
                dev.offset = dev.exact  # the driver reset the counter to 0
            m.poll()
    (d,) = m.result().devices
    assert d.counter_resets == 1 and d.estimated
    assert d.energy_j == pytest.approx(2000.0, rel=0.002)


def test_result_json_matches_the_schema_and_round_trips(settings: Settings) -> None:
    rig = Rig(settings, gpus=2)
    m = rig.measure()
    with m:
        for _ in range(5):
            with m.step(tokens=10):
                rig.step(0.2, 0.02)
        with m.window("eval"):
            rig.step(0.3, 0.0)
        rig.advance(0.2)
    doc = m.result().to_json()
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.validate(doc, schema)
    assert doc["schema"] == SCHEMA and doc["steps"] == 5 and doc["tokens"] == 50
    again = MeasurementResult.from_json(json.loads(json.dumps(doc)))
    _same(again.to_json(), doc)
    bad = dict(doc, energy_j="12 kJ")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    with pytest.raises(ValueError, match="powerlib.measurement/1"):
        MeasurementResult.from_json({"schema": "other"})


def _same(a: object, b: object) -> None:
    """Equal, numbers to 1e-6 (the JSON form rounds; totals are recomputed from rounded parts)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-9)
    else:
        assert a == b


def test_bad_arguments_get_one_clear_error(settings: Settings) -> None:
    rig = Rig(settings)
    with pytest.raises(InvalidArgumentError, match="sample_period_s"):
        powerlib.measure(backend=rig.backend, sample_period_s=0)
    with pytest.raises(InvalidArgumentError, match="align"):
        powerlib.measure(backend=rig.backend, align="gpu")
    with pytest.raises(DeviceNotFoundError, match="no device with index 9"):
        with powerlib.measure([9], backend=rig.backend):
            pass
    m = rig.measure()
    with pytest.raises(InvalidArgumentError, match="not running"):
        with m.step():
            pass
    with m:
        with pytest.raises(InvalidArgumentError, match="reduce"):
            m.result(reduce="global")
        with pytest.raises(InvalidArgumentError, match="torch.distributed"):
            m.result(reduce="world")
    with pytest.raises(InvalidArgumentError, match="entered once"):
        m.__enter__()


def test_devices_listed_twice_are_measured_once(settings: Settings) -> None:
    rig = Rig(settings, gpus=2)
    dev = rig.backend.devices()[0]
    m = powerlib.measure(
        [0, dev, dev.device_id], backend=rig.backend, sampler="manual", clock=rig.clock.now
    )
    with m:
        rig.advance(0.5)
    assert [d.device_id for d in m.result().devices] == [dev.device_id]


def test_begin_end_step_and_open_steps_closed_at_exit(settings: Settings) -> None:
    rig = Rig(settings, gpus=1)
    m = rig.measure()
    with m:
        m.begin_step(tokens=3)
        rig.step(0.2, 0.0)
        w = m.end_step(tokens=5)
        assert w is not None and w.tokens == 5
        assert m.end_step() is None
        m.begin_step()
        rig.step(0.1, 0.0)
    res = m.result()
    assert res.num_steps == 2 and res.tokens == 5
    assert res.steps[1].time_s == pytest.approx(0.1, abs=1e-9)


class DelayedMarker:
    """A stream whose markers complete 50 ms (of the test's fake clock) after they are recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()
        self.drained = False  # the device finished everything queued

    def clock(self) -> float:
        with self.lock:
            return self.now

    def record(self) -> object:
        return self.clock() + 0.05

    def wait(self, token: object) -> None:
        assert isinstance(token, float)
        while self.clock() < token and not self.drained:
            time.sleep(0.0005)


def test_stream_aligned_boundaries_are_when_the_device_got_there() -> None:
    """The host runs ahead; a step's window is the stream's, with no blocking call on the host."""
    marker = DelayedMarker()
    clock = VirtualClock()

    class Flat(Scripted):
        pass

    dev = Flat(clock, power_w=100.0)
    m = Measurement([dev], clock=marker.clock, sampler="manual", stream_marker=marker)

    def tick(dt: float) -> None:
        with marker.lock:
            marker.now += dt

    with m:
        t0 = time.perf_counter()
        with m.step():
            pass  # the host enqueues the step's kernels and returns at once
        host_cost = time.perf_counter() - t0
        (w,) = m.windows
        assert w.end_s == pytest.approx(0.0)  # provisional: the host's time
        tick(0.2)  # the device catches up; the waiter stamps the markers
        deadline = time.monotonic() + 5
        while (w.end_s or 0.0) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.001)
        marker.drained = True  # lets the exit's own marker complete
    assert host_cost < 0.05  # did not wait for the stream (which needed the fake clock to move)
    assert w.start_s == pytest.approx(0.2) and w.end_s == pytest.approx(0.2)


def test_events_file_gets_the_windows(settings: Settings, tmp_path: Path) -> None:
    rig = Rig(settings, gpus=1)
    path = tmp_path / "events.jsonl"
    m = rig.measure(events_path=path)
    with m:
        for _ in range(3):
            with m.step(tokens=7):
                rig.step(0.1, 0.0)
    events = read_events(path)
    assert [e["index"] for e in events] == [0, 1, 2]
    assert all(e["kind"] == "step" and e["tokens"] == 7 for e in events)
    assert events[0]["end_s"] - events[0]["start_s"] == pytest.approx(0.1)


def test_a_bad_events_line_is_skipped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = {"kind": "step", "name": "step", "rank": 0, "start_s": 1.0, "end_s": 2.0}
    path = tmp_path / "events.jsonl"
    with path.open("wb") as f:
        f.write(json.dumps(good).encode() + b"\n")
        f.write(b"[" * 100_000 + b"]" * 100_000 + b"\n")  # the decoder's RecursionError
        f.write(b'{"a": ' * 50 + b"1" + b"}" * 50 + b"\n")  # deep, but within the recursion limit
        f.write(b'{"start_s": 1' + b"0" * 5000 + b"}\n")  # an integer past Python's digit limit
        f.write(b'{"start_s": 5.0, "end_s": 6.0, "name": "\xff"}\n')  # not UTF-8: kept, replaced
        f.write(json.dumps(good | {"start_s": 3.0, "end_s": 4.0}).encode() + b"\n")
        f.write(b"\n")  # a blank line is no problem
    with caplog.at_level(logging.WARNING, logger="powerlib"):
        events = read_events(path)
    warnings = [r.getMessage() for r in caplog.records]
    assert [e["start_s"] for e in events] == [1.0, 5.0, 3.0]
    assert events[1]["name"] == "\ufffd"
    assert len(warnings) == 1
    assert "skipped 3 malformed line(s)" in warnings[0]
    assert "line 2: JSON nested more than 8 levels deep" in warnings[0]


def test_thread_sampler_on_wall_clock_matches_ground_truth(settings: Settings) -> None:
    """The real thread on the persisted wall-clock simulator: what a user's job runs."""
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=1))
    dev = backend.devices()[0]
    with powerlib.measure(backend=backend, sample_period_s=0.005) as m:
        start = dev.exact_energy_j()
        with m.window("work"):
            dev.begin_work(WorkUnit(time_at_max_s=10.0, sm_activity=0.8))
            time.sleep(0.6)
            dev.end_work()
            time.sleep(0.6)
        truth = dev.exact_energy_j() - start
    (w,) = m.result().window("work")
    assert 1.2 <= w.time_s < 2.0
    # The ground truth is read microseconds from the boundaries, on a loaded 2-core VM too.
    assert w.energy_j == pytest.approx(truth, rel=0.02)
    assert m.result().devices[0].samples > 50  # 5 ms asked; fewer on a loaded machine


def test_a_loop_that_holds_the_gil_keeps_half_a_percent(settings: Settings) -> None:
    """A pure-Python training loop holds the GIL: the sampler's reads wait for it, each read
    spans several ms and lands 20-70 ms after the last. The sampler must not count that wait as
    its own cost (which stretched its period to ~0.5 s), and the knots must come from the
    intersection of the reads' brackets, not their midpoints (errors up to 14 % before)."""
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=2))
    idle_w = math.fsum(d.model.power_w(d.model.min_freq_mhz) for d in backend.devices())
    with powerlib.measure(backend=backend) as m:
        with m.window("w"):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1.2:
                with m.step():
                    sum(i * i for i in range(20000))  # ~1-2 ms of bytecode, GIL held
    res = m.result()
    (w,) = res.window("w")
    assert w.energy_j == pytest.approx(idle_w * w.time_s, rel=0.005)
    assert res.energy_j == pytest.approx(idle_w * res.time_s, rel=0.005)
    # reads kept coming while the loop ran (a stretched sampler read ~2 times a second)
    assert all(d.samples >= 10 for d in res.devices)


def test_knots_from_wide_starved_brackets_are_exact() -> None:
    """Reads 5-60 ms apart, each taking 0-20 ms with the device read at an unknown instant of it:
    every bracket alone is up to 80 ms wide; together they place an update within ~1 ms."""
    from powerlib.measurement.timeline import build_timeline

    rng = random.Random(3)
    power_w, period = 250.0, 0.1
    times, read_s, counter = [], [], []
    now = 0.013
    while now < 20.0:
        dur = rng.uniform(0.0, 0.02)
        instant = now + rng.uniform(0.0, dur)  # when the device was really read
        times.append(now + dur / 2)
        read_s.append(dur)
        counter.append(math.floor(instant / period) * period * power_w)
        now += dur + rng.uniform(0.005, 0.06)
    tl = build_timeline(times, counter, [power_w] * len(times), read_s=read_s)
    err = sorted(abs(k - round(k / period) * period) for k in tl.knot_times_s)
    assert len(err) > 190  # every update seen
    assert err[len(err) // 2] < 0.002 and err[-1] < 0.006
    e = tl.energy_at([1.234, 17.89])
    assert e[1] - e[0] == pytest.approx(power_w * (17.89 - 1.234), rel=5e-4)


def test_the_flush_waits_for_an_update_after_the_end() -> None:
    """A read in flight at the end may show an update from before it: the flush needs two reads
    that both began after the end, with different values."""
    from powerlib.measurement.reader import _Track, _updated_after

    class Dev:
        def read_state(self):
            return PowerState(
                device_id="d", timestamp_s=0.0, power_w=1.0, energy_j=0.0, sm_freq_mhz=None,
                power_limit_w=None, temperature_c=None,
            )  # fmt: skip

    t = _Track(Dev())  # type: ignore[arg-type]
    end = 1.0
    # began at 0.99 (before the end), finished at 1.01 showing a new value
    t.times, t.read_s, t.counter = [0.95, 1.0], [0.0, 0.02], [5.0, 6.0]
    assert not _updated_after(t, end)
    t.times.append(1.02), t.read_s.append(0.0), t.counter.append(6.0)
    assert not _updated_after(t, end)  # after the end, no change yet
    t.times.append(1.05), t.read_s.append(0.0), t.counter.append(7.0)
    assert _updated_after(t, end)


def test_sliding_max_matches_the_naive_windows() -> None:
    import numpy as np

    from powerlib.measurement.timeline import _sliding_max

    x = np.random.default_rng(0).normal(size=997)
    for size in (1, 2, 7, 41, 997):
        naive = np.lib.stride_tricks.sliding_window_view(x, size).max(axis=1)
        assert np.array_equal(_sliding_max(x, size), naive)
