"""The device evaluator: Kareus's thermally stable protocol on simulated GPUs, in virtual time."""

from __future__ import annotations

import pytest

from powerlib.backends.simulated import SimulatedBackend, VirtualClock
from powerlib.backends.simulated_model import WorkUnit
from powerlib.config import Settings
from powerlib.control import StateDir
from powerlib.control.journal import list_journals
from powerlib.errors import InvalidArgumentError, NotSupportedError
from powerlib.kareus.evaluator import Evaluator, MeasureProtocol
from powerlib.kareus.meter import DeviceEvaluator
from powerlib.kareus.partition import build_workload
from powerlib.kareus.partition_types import Config, PartitionType
from powerlib.kareus.shapes import MODEL_SHAPES, Parallelism

WORK = WorkUnit(time_at_max_s=0.04, compute_fraction=0.8, sm_activity=0.9, memory_activity=0.2)
PROTOCOL = MeasureProtocol(settle_s=2.0, warmup_s=1.0, window_s=5.0, cooldown_s=5.0)


@pytest.fixture
def backend(tmp_path) -> SimulatedBackend:
    settings = Settings(
        backend="simulated", sim_gpus=2, state_dir=tmp_path / "state", sim_energy_period_s=0.001
    )
    return SimulatedBackend(settings, clock=VirtualClock(1000.0))


@pytest.fixture(scope="module")
def ptype() -> PartitionType:
    workload = build_workload(
        MODEL_SHAPES["llama3.2-3b"], Parallelism(tp=8, micro_batch=8, seq_len=4096), [15, 13]
    )
    return workload.partition("fwd_attn")


class Runner:
    """Runs ``WORK`` on every device at once (one partition execution) and notes the clocks."""

    def __init__(self, backend: SimulatedBackend, fail_after: int | None = None) -> None:
        self.backend = backend
        self.locks: set[object] = set()
        self.calls = 0
        self.fail_after = fail_after

    def __call__(self, ptype: PartitionType, config: Config) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("CUDA error: an illegal memory access")
        devices = self.backend.devices()
        self.locks.update(d.read_state().locked_sm_freqs_mhz for d in devices)
        duration = max(d.begin_work(WORK) for d in devices)
        self.backend.clock.advance(duration)
        for d in devices:
            d.end_work()


def _evaluator(backend: SimulatedBackend, run, **kwargs) -> DeviceEvaluator:
    clock = backend.clock
    return DeviceEvaluator(
        backend,
        run,
        p_static_w=85.0,
        protocol=PROTOCOL,
        clock=clock.now,
        sleep=clock.advance,
        **kwargs,
    )


def test_the_protocol_measures_one_execution_at_the_locked_clock(backend, ptype) -> None:
    run = Runner(backend)
    config = Config(freq_mhz=1050.0, sm_count=12, slot="rope_0")
    with _evaluator(backend, run) as ev:
        assert isinstance(ev, Evaluator)
        assert ev.freqs_mhz[0] == 210.0 and ev.freqs_mhz[-1] == 1410.0
        start = backend.clock.now()
        m = ev.evaluate(ptype, config)
    model = backend.model
    t = model.duration_s(WORK, 1050.0)
    assert m.time_s == pytest.approx(t, rel=1e-9)
    assert m.energy_j == pytest.approx(model.power_w(1050.0, WORK) * t, rel=2e-3)
    assert m.p_static_w == 85.0
    assert m.dynamic_energy_j == pytest.approx(m.energy_j - 85.0 * m.time_s)
    assert run.locks == {(1050.0, 1050.0)}  # every execution ran locked, on both devices
    # warm-up, an execution before the window's first counter update (1 ms counter), the window,
    # and one after it
    expected_runs = int(1.0 / t) + 1 + 1 + int(5.0 / t) + 1 + 1
    assert abs(run.calls - expected_runs) <= 2
    assert m.energy_rel_error is not None and 0 < m.energy_rel_error < 0.02
    assert m.wall_s == pytest.approx(backend.clock.now() - start)
    assert m.wall_s >= PROTOCOL.per_candidate_s
    assert m.start_temp_c is not None and m.start_temp_c > model.ambient_c
    assert all(d.read_state().locked_sm_freqs_mhz is None for d in backend.devices())


def test_lower_clocks_take_longer_and_cost_less(backend, ptype) -> None:
    with _evaluator(backend, Runner(backend)) as ev:
        fast = ev.evaluate(ptype, Config(freq_mhz=1410.0, sm_count=6, slot=None))
        slow = ev.evaluate(ptype, Config(freq_mhz=990.0, sm_count=6, slot=None))
    assert slow.time_s > fast.time_s and slow.dynamic_energy_j < fast.dynamic_energy_j
    assert ev.evaluations == 2


def test_clocks_are_restored_when_the_run_fails(backend, ptype) -> None:
    devices = backend.devices()
    devices[1].lock_sm_clocks(1200.0, 1410.0)  # someone's setting before the evaluator
    run = Runner(backend, fail_after=3)
    ev = _evaluator(backend, run)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ev.evaluate(ptype, Config(freq_mhz=900.0, sm_count=3, slot="norm_0"))
    assert run.locks == {(900.0, 900.0)}
    assert devices[0].read_state().locked_sm_freqs_mhz is None
    assert devices[1].read_state().locked_sm_freqs_mhz == (1200.0, 1410.0)
    ev.close()
    ev.close()  # idempotent


def test_a_journaled_device_is_journaled_while_measured_and_clean_afterwards(
    tmp_path, ptype
) -> None:
    settings = Settings(
        backend="simulated", sim_gpus=1, state_dir=tmp_path / "state", sim_energy_period_s=0.001
    )
    backend = SimulatedBackend(settings, clock=VirtualClock(10.0), persist=True)
    state = StateDir(settings.state_dir)
    journals = []

    class Journaling(Runner):
        def __call__(self, ptype, config) -> None:
            journals.append(len(list_journals(state)))
            super().__call__(ptype, config)

    run = Journaling(backend, fail_after=2)
    with pytest.raises(RuntimeError), _evaluator(backend, run) as ev:
        ev.evaluate(ptype, Config(freq_mhz=900.0, sm_count=3, slot=None))
    assert journals and set(journals) == {1}  # the original was on disk before the change
    assert list_journals(state) == []
    assert backend.devices()[0].read_state().locked_sm_freqs_mhz is None


def test_bad_arguments_are_one_line_errors(backend, ptype) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot all lock 1000 MHz"):
        _evaluator(backend, Runner(backend), freqs_mhz=[1000.0])
    with pytest.raises(InvalidArgumentError, match="p_static_w"):
        DeviceEvaluator(backend, Runner(backend), p_static_w=-1.0)
    ev = _evaluator(backend, Runner(backend), freqs_mhz=[990.0, 1410.0])
    assert ev.freqs_mhz == (990.0, 1410.0)
    with pytest.raises(InvalidArgumentError, match="1200 MHz is not one of"):
        ev.evaluate(ptype, Config(freq_mhz=1200.0, sm_count=3, slot=None))
    with pytest.raises(NotSupportedError, match="no run_sequential"):
        ev.evaluate_sequential((), 990.0, 3)
    with pytest.raises(NotSupportedError, match="no run_compute"):
        ev.evaluate_compute(ptype.ops, 990.0)
    lazy = _evaluator(backend, lambda p, c: None)
    with pytest.raises(InvalidArgumentError, match="took no time"):
        lazy.evaluate(ptype, Config(freq_mhz=990.0, sm_count=3, slot=None))
    assert all(d.read_state().locked_sm_freqs_mhz is None for d in backend.devices())


def test_sequential_and_compute_runs_use_the_same_protocol(backend, ptype) -> None:
    runner = Runner(backend)
    seen = []

    def sequential(segments, freq_mhz, sm_count) -> None:
        seen.append(("seq", freq_mhz, sm_count))
        runner(ptype, Config(freq_mhz=freq_mhz, sm_count=sm_count, slot=None))

    def compute(ops, freq_mhz) -> None:
        seen.append(("compute", freq_mhz, len(ops)))
        runner(ptype, Config(freq_mhz=freq_mhz, sm_count=1, slot=None))

    with _evaluator(backend, runner, run_sequential=sequential, run_compute=compute) as ev:
        a = ev.evaluate_sequential((), 1200.0, 20)
        b = ev.evaluate_compute(ptype.ops, 1200.0)
    assert a.time_s == pytest.approx(b.time_s)
    assert {s[0] for s in seen} == {"seq", "compute"} and ("seq", 1200.0, 20) in seen
    assert runner.locks == {(1200.0, 1200.0)}


def test_a_group_runs_as_many_executions_as_its_slowest_rank(backend, ptype) -> None:
    # A partition that issues collectives must run the same number of times on every rank of
    # its group, or a rank blocks in a collective the others never start. ``agree`` is the
    # group's decision; here it holds every phase open for 3 more executions after this rank is
    # done (a slower peer), as an all-reduce MIN of "done" would: the warm-up, the window and
    # the two counter updates time-stamped on either side of it.
    late = {"left": 3}
    asked: list[bool] = []

    def agree(done: bool) -> bool:
        asked.append(done)
        if not done:
            return False
        late["left"] -= 1
        if late["left"] < 0:
            late["left"] = 3
            return True
        return False

    alone, together = Runner(backend), Runner(backend)
    config = Config(freq_mhz=1410.0, sm_count=6, slot="rope_0")
    with _evaluator(backend, alone) as ev:
        m_alone = ev.evaluate(ptype, config)
    with _evaluator(backend, together, agree=agree) as ev:
        m_together = ev.evaluate(ptype, config)
    assert together.calls == alone.calls + 4 * 3  # each phase ran 3 more
    assert asked.count(True) == 4 * 4
    assert m_together.time_s == pytest.approx(m_alone.time_s, rel=1e-9)  # per execution


def test_combine_gives_every_measurement_the_groups_figures(backend, ptype) -> None:
    import dataclasses

    seen = []

    def combine(m):  # a peer twice as slow: the group's time is the slowest rank's
        seen.append(m)
        return dataclasses.replace(m, time_s=2 * m.time_s)

    with _evaluator(backend, Runner(backend), combine=combine) as ev:
        m = ev.evaluate(ptype, Config(freq_mhz=1410.0, sm_count=6, slot=None))
    assert len(seen) == 1 and m.time_s == 2 * seen[0].time_s
    assert m.energy_j == seen[0].energy_j


# -- an NVML-like counter: publishes every 100 ms, a read returns the last published value --------

SHORT = WorkUnit(time_at_max_s=0.005, compute_fraction=0.8, sm_activity=0.9, memory_activity=0.2)
"""A partition of a few ms (Kareus's are), far shorter than the counter's period."""
NVML_PERIOD_S = 0.1
PHASES = [1000.0 + 0.0137 * k for k in range(8)]  # where the window falls in the counter's period


def _nvml_backend(tmp_path, start_s: float, period_s: float = NVML_PERIOD_S) -> SimulatedBackend:
    settings = Settings(
        backend="simulated", sim_gpus=2, state_dir=tmp_path / "state", sim_energy_period_s=period_s
    )
    return SimulatedBackend(settings, clock=VirtualClock(start_s))


class ExactRunner(Runner):
    """Runs ``work`` on every device and notes each execution's exact energy (the ground truth)."""

    def __init__(self, backend: SimulatedBackend, work: WorkUnit = SHORT) -> None:
        super().__init__(backend)
        self.work = work
        self.exact_j: list[float] = []

    def __call__(self, ptype: PartitionType, config: Config) -> None:
        self.calls += 1
        devices = self.backend.devices()
        before = [d.exact_energy_j() for d in devices]
        duration = max(d.begin_work(self.work) for d in devices)
        self.backend.clock.advance(duration)
        for d in devices:
            d.end_work()
        spent = [d.exact_energy_j() - b for d, b in zip(devices, before)]
        self.exact_j.append(sum(spent) / len(spent))


def _measure_nvml(backend, ptype, window_s: float, work: WorkUnit = SHORT):
    """One measurement at 1050 MHz with a ``window_s`` window, and one execution's true energy."""
    run = ExactRunner(backend, work)
    protocol = MeasureProtocol(settle_s=0.5, warmup_s=0.2, window_s=window_s, cooldown_s=0.0)
    clock = backend.clock
    with DeviceEvaluator(
        backend, run, p_static_w=85.0, protocol=protocol, clock=clock.now, sleep=clock.advance
    ) as ev:
        m = ev.evaluate(ptype, Config(freq_mhz=1050.0, sm_count=12, slot=None))
    return m, run.exact_j[-1]  # steady state: every execution costs the same


def test_a_short_window_under_a_100ms_counter_is_within_its_stated_interval(
    tmp_path, ptype
) -> None:
    # Two counter reads around a 0.25 s window (what the evaluator did) are off by up to one
    # 100 ms update, i.e. tens of percent, depending on where the window falls in the period:
    naive = []
    for k, start_s in enumerate(PHASES):
        backend = _nvml_backend(tmp_path / f"naive{k}", start_s)
        dev, run = backend.devices()[0], ExactRunner(backend)
        dev.lock_sm_clocks(1050.0, 1050.0)
        e0, t0 = dev.read_state().energy_j, backend.clock.now()
        while backend.clock.now() - t0 < 0.25:
            run(None, None)  # type: ignore[arg-type]
        e1 = dev.read_state().energy_j
        naive.append((e1 - e0) / len(run.exact_j) / run.exact_j[-1] - 1.0)
    assert max(abs(e) for e in naive) > 0.15, naive
    # Energy attributed between two time-stamped updates, on the same windows, is within the
    # interval it states, and that interval is a few percent, not an update:
    for k, start_s in enumerate(PHASES):
        m, exact_j = _measure_nvml(_nvml_backend(tmp_path / f"new{k}", start_s), ptype, 0.25)
        assert abs(m.energy_j / exact_j - 1.0) < 0.03, (start_s, m, exact_j)
        assert m.energy_rel_error is not None and 0 < m.energy_rel_error < 0.03, m
        assert abs(m.energy_j - exact_j) <= m.energy_rel_error * exact_j, (start_s, m, exact_j)
        lo_j, hi_j = m.energy_interval_j
        assert lo_j <= exact_j <= hi_j
        assert m.to_json()["energy_rel_error"] == m.energy_rel_error


@pytest.mark.parametrize("work", [SHORT, WORK], ids=["5ms", "40ms"])
def test_the_interval_shrinks_with_a_longer_window(tmp_path, ptype, work) -> None:
    errors, bounds = [], []
    for window_s in (0.25, 1.0, 4.0):
        m, exact_j = _measure_nvml(
            _nvml_backend(tmp_path / str(window_s), 1000.03), ptype, window_s
        )
        errors.append(abs(m.energy_j / exact_j - 1.0))
        bounds.append(m.energy_rel_error)
    assert all(e <= b for e, b in zip(errors, bounds)), (errors, bounds)
    assert bounds[0] > bounds[1] > bounds[2]
    assert bounds[2] < bounds[0] / 8  # about one bracket over the window: 16x the window


def test_reads_that_cost_time_count_in_the_interval(tmp_path, ptype) -> None:
    # An NVML read costs ~3 ms, during which the GPU idles: the reads next to the second update
    # fall inside the span and lower its mean power; the interval says how much that can be.
    bounds = []
    for cost_s in (0.0, 0.003):
        backend = _nvml_backend(tmp_path / str(cost_s), 1000.03)
        for dev in backend.devices():

            def slow_read(read=dev._read_state, clock=backend.clock, cost_s=cost_s):
                clock.advance(cost_s)
                return read()

            dev._read_state = slow_read  # type: ignore[method-assign]
        m, exact_j = _measure_nvml(backend, ptype, 0.5)
        assert abs(m.energy_j - exact_j) <= m.energy_rel_error * exact_j, (cost_s, m, exact_j)
        bounds.append(m.energy_rel_error)
    assert bounds[1] > bounds[0]


def test_a_counter_that_does_not_move_is_one_error_and_the_clocks_are_restored(
    tmp_path, ptype
) -> None:
    from powerlib.errors import DeviceError

    backend = _nvml_backend(tmp_path, 1000.0, period_s=10.0)  # publishes every 10 s
    with pytest.raises(DeviceError, match=r"energy counter of .* did not move in 2 s"):
        _measure_nvml(backend, ptype, 0.25)
    assert all(d.read_state().locked_sm_freqs_mhz is None for d in backend.devices())
