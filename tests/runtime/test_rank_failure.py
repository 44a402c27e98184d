"""Issue 33, point 3 (and the runtime half of point 2): one rank's failure never hangs the job.

Several ranks on one in-process group (the emulator drives them from one thread). The group
bounds every wait: on ``torch.distributed`` a collective blocks until every rank joins it, so a
result that is still unknown after a few asks here is a rank the job would wait for until the
timeout; every rank must also make the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import EXACT_SWEEP, FREQS, make_emulator, toy_profile

from powerlib.errors import DeviceError, InvalidArgumentError
from powerlib.runtime.coordination import Future, LocalGroup
from powerlib.runtime.phases import RankFailure
from powerlib.runtime.session import Session, optimize

WORLD = 4
MAX_ASKS = 8
"""A result every rank has called in for is known at the next iteration start: 2-3 asks."""


class BoundedGroup:
    """A :class:`LocalGroup` whose members log their collectives and bound every wait."""

    def __init__(self, world_size: int) -> None:
        self.group = LocalGroup(world_size)
        self.calls: list[list[str]] = [[] for _ in range(world_size)]

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)

    def bounded(self, rank: int, future: Future) -> Future:
        asks = 0

        def result() -> Any:
            nonlocal asks
            value = future()
            if value is None:
                asks += 1
                if asks > MAX_ASKS:
                    raise AssertionError(
                        f"rank {rank} waits in a collective another rank skipped "
                        f"(calls per rank: {[len(c) for c in self.calls]})"
                    )
            return value

        return result


class _Member:
    def __init__(self, owner: BoundedGroup, rank: int) -> None:
        self._owner = owner
        self._inner = owner.group.member(rank)
        self.rank = rank
        self.world_size = owner.group.world_size

    def all_agree(self, vote: Any) -> Future:
        self._owner.calls[self.rank].append("vote")
        return self._owner.bounded(self.rank, self._inner.all_agree(vote))

    def exchange(self, payload: dict[str, Any], plan_fn: Any) -> Future:
        self._owner.calls[self.rank].append("exchange")
        return self._owner.bounded(self.rank, self._inner.exchange(payload, plan_fn))


def _sessions(emulator, group: BoundedGroup, **kwargs: Any) -> list[Session]:
    """One session per stage, as ``runtime_helpers.emulated_sessions``, on ``group``."""
    options: dict[str, Any] = {
        "num_stages": WORLD,
        "num_microbatches": 4,
        "backend": emulator.backend,
        "clock": emulator.clock,
        "threaded": False,
        "out_dir": None,
        "progress": False,
        "warmup_iterations": 1,
        "settle_iterations": 1,
        "iterations_per_freq": 1,
        **EXACT_SWEEP,
        "check_rounds": 0,
    } | kwargs
    return [
        optimize(stage=s, device=s, coordinator=group.member(s), **options) for s in range(WORLD)
    ]


def _run(emulator, sessions, iterations: int, arm=None) -> tuple[list, list[str]]:
    """Run the loop (``arm(i)`` before iteration ``i``); the phases seen and the warnings."""
    phases = []
    with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as stack:
        warnings.simplefilter("always")
        for s in sessions:
            stack.enter_context(s)
        for i in range(iterations):
            if arm is not None:
                arm(i)
            phases.append(emulator.run_iteration(sessions).phases)
        # once every rank is done, each GPU runs at its baseline (unlocked: the top clock)
        locked = [d.read_state().locked_sm_freqs_mhz for d in emulator.devices]
        running = [d.freq_at(emulator.clock()) for d in emulator.devices]
        phases.append((tuple(s.phase for s in sessions), locked, running))
    return phases, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _stopped_together(phases: list, group: BoundedGroup) -> int:
    """Every rank in the same phase at every iteration, all done at the end; when they stopped."""
    for i, seen in enumerate(phases[:-1]):
        assert len(set(seen)) == 1, f"iteration {i}: the ranks diverged: {seen}"
    final, locked, running = phases[-1]
    assert final == ("done",) * WORLD
    assert locked == [None] * WORLD and running == [max(FREQS)] * WORLD
    assert all(calls == group.calls[0] for calls in group.calls), group.calls
    return next(i for i, seen in enumerate(phases) if seen[0] == "done")


def test_a_refused_clock_change_on_one_rank_stops_every_rank_at_the_same_vote() -> None:
    """Rank 1's driver refuses a clock once the sweep's first block ended: rank 1 used to go
    idle and stop voting, leaving the others in the sweep's stop vote for good. Now it keeps
    voting, unhealthy, and at that vote every rank stops, resets and warns once (rank 0)."""
    emulator = make_emulator(toy_profile(), 4)
    group = BoundedGroup(WORLD)
    sessions = _sessions(emulator, group)
    device = emulator.devices[1]
    lock = device._lock_sm_clocks

    def refusing(min_mhz: float, max_mhz: float) -> None:
        sweep = sessions[1].profiling.sweep
        if sweep.visited:  # the first block ended: the device starts refusing
            raise DeviceError("the driver refused the lock (injected)", device=device.device_id)
        lock(min_mhz, max_mhz)

    device._lock_sm_clocks = refusing  # type: ignore[method-assign]
    phases, warned = _run(emulator, sessions, 30)
    stopped = _stopped_together(phases, group)
    assert 3 <= stopped < 30
    assert group.calls[0].count("exchange") == 1  # the gather, with every rank's stop
    job_wide = [m for m in warned if "stopped profiling on every rank" in m]
    assert len(job_wide) == 1, warned
    assert "stage 1: could not set" in job_wide[0] and "baseline clocks" in job_wide[0]
    assert all(s.plan is None for s in sessions)


@pytest.mark.parametrize(
    ("where", "rank", "hook"),
    [("energy", 1, "step"), ("clock", 0, "begin"), ("clock", 2, "end")],
)
def test_a_read_that_raises_on_one_rank_stays_out_of_the_hooks(
    where: str, rank: int, hook: str
) -> None:
    """An energy read (the sampler's counter timeline, solved in ``step``) or a clock read (the
    stamp of ``begin``/``end``) raises on one rank while profiling: it used to propagate out
    of that hook into the training loop. Now no exception leaves any hook, every rank stops
    at the same vote, and rank 0 warns once with the error."""
    emulator = make_emulator(toy_profile(), 4)
    group = BoundedGroup(WORLD)
    sessions = _sessions(emulator, group)
    failing = sessions[rank]

    def arm(i: int) -> None:
        if i != 4:  # after the warm-up and the first block
            return
        error = DeviceError(f"{where} read failed (injected)", device=f"EMU-{rank:04d}")
        if where == "energy":

            def raising(*args: Any, **kwargs: Any) -> Any:
                raise error

            failing.sampler.timeline = raising  # type: ignore[method-assign]
        else:
            stamps = failing.profiling._stamps
            stamp = stamps.stamp
            ends = 0

            def stamping() -> list[float]:
                nonlocal ends
                ends += 1
                # begin's is the first stamp of the iteration, end's the second
                if (hook == "begin" and ends == 1) or (hook == "end" and ends == 2):
                    raise error
                return stamp()

            stamps.stamp = stamping  # type: ignore[method-assign]

    phases, warned = _run(emulator, sessions, 30, arm)
    assert _stopped_together(phases, group) > 4
    job_wide = [m for m in warned if "stopped profiling on every rank" in m]
    assert len(job_wide) == 1, warned
    assert f"{where} read failed (injected)" in job_wide[0]
    assert f"stage {rank}: " in job_wide[0]


def test_usage_errors_still_raise_on_every_rank_after_a_failure() -> None:
    """A bug in the calling code is the same on every rank, so it still raises: after the job
    stopped on a failure, an unknown kind raises (before, an idle session ignored it)."""
    emulator = make_emulator(toy_profile(), 4)
    group = BoundedGroup(WORLD)
    sessions = _sessions(emulator, group)
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in sessions:
            stack.enter_context(s)
        emulator.run_iteration(sessions)
        sessions[3]._flow.fail(RankFailure("stage 3: injected failure"))
        for _ in range(8):
            emulator.run_iteration(sessions)
        assert [s.phase for s in sessions] == ["done"] * WORLD
        for s in sessions:
            with pytest.raises(InvalidArgumentError, match="instruction kind"):
                s.begin("sideways")


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan for the toy pipeline, made by the sessions themselves."""
    out = tmp_path_factory.mktemp("plan")
    emulator = make_emulator(toy_profile(), 4)
    sessions = _sessions(emulator, BoundedGroup(WORLD), out_dir=out, settle_iterations=0)
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        for _ in range(60):
            emulator.run_iteration(sessions)
            if all(s.phase == "apply" for s in sessions):
                break
        assert all(s.phase == "apply" for s in sessions)
    data = json.loads((out / "plan.json").read_text())
    assert len({i["freq_mhz"] for i in data["stages"][2]["instructions"]}) > 1
    return out / "plan.json"


def _transient_failure(session: Session) -> Any:
    """From the next change on, ``apply_sm_clocks`` does what the control session does when a
    transient driver error outlasts its retries: reset the device, record why, return False."""
    control = session.control
    assert control is not None
    reason = "TransientDeviceError: NVML_ERROR_TIMEOUT after 3 retries (injected)"

    def failing(device: Any, freq_mhz: float) -> bool:
        control.reset_sm_clocks(device)
        degraded = getattr(control, "degraded", None)
        if isinstance(degraded, dict):
            degraded[device.device_id] = reason
        else:  # before ControlSession.degraded exists
            control.degraded = {device.device_id: reason}  # type: ignore[attr-defined]
        return False

    control.apply_sm_clocks = failing  # type: ignore[method-assign]
    return reason


def test_a_failed_change_while_the_plan_is_checked_reverts_it_on_every_rank(
    plan_path: Path,
) -> None:
    """A clock change of rank 2 fails during the closed loop's check: its phase used to stay
    ``apply`` for good. Now it stops, resets, and sends its windows as stopped with the
    reason: the verdict reverts the plan on every rank, with one warning naming the reason."""
    emulator = make_emulator(toy_profile(), 4)
    group = BoundedGroup(WORLD)
    sessions = _sessions(emulator, group, mode="apply", plan_path=plan_path, check_rounds=3)
    reason: list[str] = []

    def arm(i: int) -> None:
        if i == 4:  # a plan window of the first round
            reason.append(_transient_failure(sessions[2]))

    phases, warned = _run(emulator, sessions, 45, arm)
    assert phases[3] == ("check",) * WORLD
    assert phases[-1][0] == ("done",) * WORLD
    assert phases[-1][1] == [None] * WORLD and phases[-1][2] == [max(FREQS)] * WORLD
    assert all(calls == ["exchange", "exchange"] for calls in group.calls)  # plan, verdict
    assert len(warned) == 1, warned
    assert reason[0] in warned[0] and "stage 2: could not set" in warned[0]
    assert "plan reverted, running at the baseline clocks" in warned[0]
    assert all(s.realized is not None and s.realized.verdict == "reverted" for s in sessions)


def test_a_failed_change_after_the_check_stops_that_rank_with_one_warning(
    plan_path: Path,
) -> None:
    """With no collective left in the apply phase (no check), the rank whose change failed
    leaves ``apply`` at once: phase ``done``, its GPU at the baseline, one warning naming the
    reason; the other ranks keep their plan (a stage at its top clock only gets faster)."""
    emulator = make_emulator(toy_profile(), 4)
    group = BoundedGroup(WORLD)
    sessions = _sessions(emulator, group, mode="apply", plan_path=plan_path, check_rounds=0)
    reason: list[str] = []

    def arm(i: int) -> None:
        if i == 3:
            reason.append(_transient_failure(sessions[2]))

    phases, warned = _run(emulator, sessions, 8, arm)
    assert phases[3] == ("apply",) * WORLD
    assert phases[5] == ("apply", "apply", "done", "apply")
    assert len(warned) == 1, warned
    assert reason[0] in warned[0] and warned[0].startswith("powerlib: stage 2: could not set")
    assert "GPU was reset to its baseline clocks" in warned[0]
    assert phases[-1][1][2] is None and phases[-1][2][2] == max(FREQS)
    assert sessions[2].controller is not None and sessions[2].controller.stopped


def test_a_failed_rank_keeps_voting_on_a_replan_and_stays_at_its_baseline(
    tmp_path: Path,
) -> None:
    """Rank 1's change fails while a plan runs; then every rank re-plans: rank 1 still makes
    the re-plan's collectives with the others (they would wait for it), but does not switch:
    its GPU stays at the baseline."""
    profile = toy_profile()
    profile.write_csv(tmp_path / "profile.csv")
    emulator = make_emulator(profile, 4)
    group = BoundedGroup(WORLD)
    sessions = _sessions(
        emulator,
        group,
        mode="plan",
        profile_path=tmp_path / "profile.csv",
        p_block_w=80.0,
        switch_latency_s=0.0,
    )
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in sessions:
            stack.enter_context(s)
        fastest_s = [emulator.run_iteration(sessions) for _ in range(2)][-1].time_s
        _transient_failure(sessions[1])
        emulator.run_iteration(sessions)
        assert [s.phase for s in sessions] == ["apply", "done", "apply", "apply"]
        for s in sessions:
            s.replan(fastest_s * 1.25)
        sessions[0]._flow.pending_replan.solve.result(
            timeout=60
        )  # rank 0's planning thread is done
        for _ in range(3):
            emulator.run_iteration(sessions)
        assert [len(s.replans) for s in sessions] == [1, 0, 1, 1]
        assert [s.phase for s in sessions] == ["apply", "done", "apply", "apply"]
        assert emulator.devices[1].read_state().locked_sm_freqs_mhz is None
    assert all(calls == group.calls[0] for calls in group.calls), group.calls
    assert group.calls[0].count("vote") >= 1
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
