"""How the ranks of one job agree: profile gather, plan broadcast, and the sweep's stop vote.

No extra server: the job's own ``torch.distributed`` process group carries everything
(docs/architecture.md §2 steps 3-5). Two operations are needed:

- :meth:`Coordinator.all_agree`: every rank votes; the result is True only if every vote is True
  (the profile sweep stops for everyone or for no one);
- :meth:`Coordinator.exchange`: every rank sends a :data:`~powerlib.runtime.records.Payload`;
  rank 0 turns the list of payloads into an :data:`~powerlib.runtime.records.Outcome` with
  ``plan_fn`` (called exactly once, on rank 0); every rank receives that outcome.

Both return a *future*: a callable that returns ``None`` until the result is known. With
``torch.distributed`` (and alone) results are known at once, because the collectives block. The
in-process :class:`LocalGroup` lets the emulator drive several ranks from one thread: a result
is known once every member has called in, which the emulator guarantees before the next
iteration starts.

Every rank must make the same calls in the same order, or the others wait for it in a
collective until the job's timeout. A rank that fails therefore never leaves them: the profile
sweep's vote ends with a *healthy* element (element-wise ``all`` stops every rank at the same
vote), and an exchange payload says it stopped, with the failure's reason, so rank 0 answers
every rank with one job-wide verdict (docs/real-gpu.md §3).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from powerlib.errors import PlanError, PowerlibError
from powerlib.runtime.records import Outcome, Payload, PlanFailed

__all__ = [
    "Coordinator",
    "Future",
    "LocalGroup",
    "SingleProcess",
    "TorchDistributed",
    "default_coordinator",
]

T = TypeVar("T")

Future = Callable[[], T | None]
"""A result that is ``None`` until every rank has called in (at once with blocking collectives)."""
Vote = bool | tuple[bool, ...]
"""One yes/no, or several decided together in one collective (the profile sweep's)."""
PlanFn = Callable[[list[Payload]], Outcome]
"""Rank 0's turn: every rank's payload in, the outcome every rank gets out."""


class Coordinator(Protocol):
    """What a session needs from the job's process group."""

    rank: int
    world_size: int

    def all_agree(self, vote: Vote) -> Future[Vote]:
        """Future of ``all(votes)`` (element-wise for a tuple of votes)."""
        ...

    def exchange(self, payload: Payload, plan_fn: PlanFn) -> Future[Outcome]:
        """Future of the outcome rank 0 made from every rank's payload."""
        ...


def _resolved(value: T) -> Future[T]:
    return lambda: value


def _normal(vote: Vote) -> Vote:
    return tuple(bool(v) for v in vote) if isinstance(vote, tuple) else bool(vote)


def _all(votes: list[Vote]) -> Vote:
    """``all`` over the ranks' votes, element-wise for tuples."""
    if votes and isinstance(votes[0], tuple):
        return tuple(all(v[i] for v in votes) for i in range(len(votes[0])))  # type: ignore[index]
    return all(votes)


def _raise_or_return(result: Outcome) -> Outcome:
    if isinstance(result, PlanFailed):
        raise PlanError(result.error)
    return result


def _plan_safely(plan_fn: PlanFn, payloads: list[Payload]) -> Outcome:
    """Rank 0 plans; an error is shipped to every rank instead of leaving them waiting."""
    try:
        return plan_fn(payloads)
    except PowerlibError as err:
        return PlanFailed(error=str(err))
    except Exception as err:  # noqa: BLE001 - a bug on rank 0 must not leave the other ranks waiting forever
        return PlanFailed(error=f"planning failed on rank 0: {type(err).__name__}: {err}")


class SingleProcess:
    """No process group: this process is the whole job."""

    rank = 0
    world_size = 1

    def all_agree(self, vote: Vote) -> Future[Vote]:
        """Resolved at once."""
        return _resolved(_normal(vote))

    def exchange(self, payload: Payload, plan_fn: PlanFn) -> Future[Outcome]:
        """Plans at once."""
        result = _plan_safely(plan_fn, [payload])
        return lambda: _raise_or_return(result)


class LocalGroup:
    """Several ranks in one process (the emulator). ``member(rank)`` is each rank's coordinator."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self._votes: dict[int, list[Vote]] = {}
        self._payloads: dict[int, dict[int, Payload]] = {}
        self._plans: dict[int, Outcome] = {}
        self._vote_round = [0] * world_size
        self._exchange_round = [0] * world_size
        self._plan_fn: PlanFn | None = None

    def member(self, rank: int) -> _Member:
        """The coordinator of one rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for {self.world_size} ranks")
        return _Member(self, rank)

    def _vote(self, rank: int, vote: Vote) -> Future[Vote]:
        rnd = self._vote_round[rank]
        self._vote_round[rank] += 1
        votes = self._votes.setdefault(rnd, [])
        votes.append(_normal(vote))

        def result() -> Vote | None:
            got = self._votes.get(rnd, [])
            return _all(got) if len(got) == self.world_size else None

        return result

    def _exchange(self, rank: int, payload: Payload, plan_fn: PlanFn) -> Future[Outcome]:
        rnd = self._exchange_round[rank]
        self._exchange_round[rank] += 1
        payloads = self._payloads.setdefault(rnd, {})
        payloads[rank] = payload
        if rank == 0:
            self._plan_fn = plan_fn
        if len(payloads) == self.world_size:
            assert self._plan_fn is not None
            self._plans[rnd] = _plan_safely(self._plan_fn, [payloads[r] for r in sorted(payloads)])

        def result() -> Outcome | None:
            plan = self._plans.get(rnd)
            return None if plan is None else _raise_or_return(plan)

        return result


class _Member:
    def __init__(self, group: LocalGroup, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_agree(self, vote: Vote) -> Future[Vote]:
        return self._group._vote(self.rank, vote)

    def exchange(self, payload: Payload, plan_fn: PlanFn) -> Future[Outcome]:
        return self._group._exchange(self.rank, payload, plan_fn)


class TorchDistributed:
    """The job's ``torch.distributed`` group.

    Uses object collectives: gloo, or NCCL with the current CUDA device set, as torch requires.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist  # noqa: PLC0415 - torch is an optional extra

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._root = 0 if group is None else dist.get_global_rank(group, 0)

    def all_agree(self, vote: Vote) -> Future[Vote]:
        """``all_gather_object`` of the votes."""
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, _normal(vote), group=self._group)
        return _resolved(_all(out))

    def exchange(self, payload: Payload, plan_fn: PlanFn) -> Future[Outcome]:
        """``gather_object`` to rank 0, plan there, ``broadcast_object_list`` back."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(payload, gathered, dst=self._root, group=self._group)
        box: list[Any] = [None]
        if self.rank == 0:
            assert gathered is not None
            box[0] = _plan_safely(plan_fn, gathered)
        self._dist.broadcast_object_list(box, src=self._root, group=self._group)
        result = box[0]
        return lambda: _raise_or_return(result)


def default_coordinator(group: Any = None) -> Coordinator:
    """``torch.distributed`` when initialised (or ``group`` is given), else this process alone.

    Never imports torch itself.
    """
    dist = sys.modules.get("torch.distributed")
    if group is not None or (dist is not None and dist.is_available() and dist.is_initialized()):
        return TorchDistributed(group)
    return SingleProcess()
