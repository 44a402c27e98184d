"""The built-in pipeline schedules: per stage, its computations in execution order.

Three orders (a :data:`~powerlib.planning.pipeline.Schedule` each, for
:func:`~powerlib.planning.pipeline.build_dag`):

- :func:`schedule_1f1b`: synchronous 1F1B, the order of DeepSpeed's ``TrainSchedule``,
  Megatron-core's non-interleaved schedule, torch's ``Schedule1F1B`` and the Perseus artifact.
- :func:`schedule_gpipe`: all forwards, then all backwards (torch's ``ScheduleGPipe``).
- :func:`schedule_interleaved_1f1b`: Megatron-core's interleaved 1F1B with virtual stages
  (model chunks placed ``looped``, see :mod:`powerlib.planning.pipeline`).

:func:`build_schedule` picks one by name. Other orders come in as recorded per-stage lists.

Pure: no I/O, and nothing beyond the pipeline types and the error tree.
"""

from __future__ import annotations

from powerlib.errors import PlanError
from powerlib.planning.pipeline import BACKWARD, FORWARD, Instruction, Schedule

__all__ = [
    "SCHEDULE_NAMES",
    "build_schedule",
    "schedule_1f1b",
    "schedule_gpipe",
    "schedule_interleaved_1f1b",
]

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved")
"""The names :func:`build_schedule` accepts."""


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def schedule_1f1b(num_stages: int, num_microbatches: int) -> Schedule:
    """Synchronous 1F1B: warm-up forwards, then one forward and one backward in turn.

    Stage ``s`` of ``N`` with ``M`` microbatches runs ``w = min(N - s - 1, M)`` warm-up forwards
    ``F0 .. F(w-1)``, then the pairs ``F(w+i), B(i)`` for ``i = 0 .. M-w-1``, then the cool-down
    backwards ``B(M-w) .. B(M-1)``. For ``N = 4, M = 6``, stage 0 runs
    ``F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5`` and stage 3 runs ``F0 B0 F1 B1 ... F5 B5``. This is the
    order of DeepSpeed's ``TrainSchedule``, Megatron-core's non-interleaved schedule and the Perseus
    artifact (lowtime's ``Synchronous1F1B``).

    Args:
        num_stages: Number of pipeline stages ``N`` (>= 1).
        num_microbatches: Number of microbatches ``M`` per iteration (>= 1); ``M < N`` is allowed.

    Returns:
        The per-stage instruction lists.

    Raises:
        PlanError: ``N`` or ``M`` is not an integer >= 1.
    """
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    schedule: Schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        order = [Instruction(stage=stage, microbatch=m, kind=FORWARD) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            order.append(Instruction(stage=stage, microbatch=warmup + i, kind=FORWARD))
            order.append(Instruction(stage=stage, microbatch=i, kind=BACKWARD))
        order.extend(
            Instruction(stage=stage, microbatch=m, kind=BACKWARD)
            for m in range(num_microbatches - warmup, num_microbatches)
        )
        schedule.append(order)
    return schedule


def schedule_gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards in microbatch order, then all backwards in order.

    Args:
        num_stages: Number of pipeline stages ``N`` (>= 1).
        num_microbatches: Number of microbatches ``M`` per iteration (>= 1).

    Returns:
        The per-stage instruction lists.

    Raises:
        PlanError: ``N`` or ``M`` is not an integer >= 1.
    """
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    return [
        [
            Instruction(stage=stage, microbatch=m, kind=kind)
            for kind in (FORWARD, BACKWARD)
            for m in range(num_microbatches)
        ]
        for stage in range(num_stages)
    ]


def schedule_interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Interleaved 1F1B with virtual stages, in Megatron-core's order.

    Stage ``s`` holds chunks ``c = 0..V-1`` (model chunk ``c*N + s``). Each stage works through
    ``M*V`` forward "slots" and ``M*V`` backward slots. Slot ``j`` names a (microbatch, chunk)
    pair: slots are taken in groups of ``N`` microbatches; within a group, chunk 0 runs for the
    group's ``N`` microbatches, then chunk 1 for the same microbatches, and so on (the chunk
    rotates every ``N`` microbatches). Writing ``g = j // (N*V)`` and ``r = j % (N*V)``, forward
    slot ``j`` is microbatch ``g*N + r % N`` on chunk ``r // N``; backward slot ``j`` is the same
    microbatch on chunk ``V - 1 - r // N`` (backwards walk the chunks in reverse).

    Stage ``s`` runs ``w = min(2*(N - s - 1) + (V - 1)*N, M*V)`` warm-up forward slots, then
    forward slot ``w + i`` followed by backward slot ``i`` for ``i = 0 .. M*V - w - 1``, then the
    remaining backward slots. This is the order of Megatron-core's
    ``forward_backward_pipelining_with_interleaving`` with its default
    ``microbatch_group_size_per_vp_stage = N``; torch's
    ``ScheduleInterleaved1F1B`` gives the same sequence in the cases checked (reference notes).
    Older Megatron releases special-cased ``M == N`` by running every forward first; this
    function does not (current Megatron-core no longer does either).

    Example, ``N = 2, M = 4, V = 2`` (``w = 4`` on stage 0 and ``w = 2`` on stage 1)::

        stage 0: F0c0 F1c0 F0c1 F1c1 | F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 | B2c1 B3c1 B2c0 B3c0
        stage 1: F0c0 F1c0 | F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 | B2c0 B3c0

    (``F2c1`` is the forward of microbatch 2 on chunk 1; bars separate warm-up, steady state
    and cool-down.)

    Args:
        num_stages: Number of pipeline stages ``N`` (>= 1).
        num_microbatches: Number of microbatches ``M``; must be a multiple of ``N``.
        num_chunks: Number of model chunks per stage ``V`` (>= 2).

    Returns:
        The per-stage instruction lists, each with ``2*M*V`` instructions.

    Raises:
        PlanError: A count is not an integer in range, or ``M`` is not a multiple of ``N``.
    """
    n = _check_count("num_stages", num_stages)
    m_total = _check_count("num_microbatches", num_microbatches)
    v = _check_count("num_chunks", num_chunks, minimum=2)
    if m_total % n:
        raise PlanError(
            f"interleaved 1F1B needs num_microbatches ({m_total}) to be a multiple of "
            f"num_stages ({n})"
        )
    slots = m_total * v

    def slot(j: int) -> tuple[int, int]:
        group, rest = divmod(j, n * v)
        return group * n + rest % n, rest // n

    schedule: Schedule = []
    for stage in range(n):

        def forward(j: int, stage: int = stage) -> Instruction:
            microbatch, chunk = slot(j)
            return Instruction(stage=stage, microbatch=microbatch, kind=FORWARD, chunk=chunk)

        def backward(j: int, stage: int = stage) -> Instruction:
            microbatch, chunk = slot(j)
            return Instruction(
                stage=stage, microbatch=microbatch, kind=BACKWARD, chunk=v - 1 - chunk
            )

        warmup = min(2 * (n - stage - 1) + (v - 1) * n, slots)
        order = [forward(j) for j in range(warmup)]
        for i in range(slots - warmup):
            order.append(forward(warmup + i))
            order.append(backward(i))
        order.extend(backward(j) for j in range(slots - warmup, slots))
        schedule.append(order)
    return schedule


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> Schedule:
    """Build a schedule by name.

    Args:
        name: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
        num_stages: Number of pipeline stages ``N`` (>= 1).
        num_microbatches: Number of microbatches ``M`` (>= 1).
        num_chunks: Model chunks per stage: >= 2 for ``"interleaved"``, 1 otherwise.

    Returns:
        The per-stage instruction lists.

    Raises:
        PlanError: An unknown name, or counts out of range for that schedule.
    """
    if name not in SCHEDULE_NAMES:
        raise PlanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if name == "interleaved":
        return schedule_interleaved_1f1b(num_stages, num_microbatches, num_chunks)
    if isinstance(num_chunks, bool) or num_chunks != 1:
        raise PlanError(f"schedule {name!r} has one chunk per stage; got num_chunks={num_chunks!r}")
    if name == "1f1b":
        return schedule_1f1b(num_stages, num_microbatches)
    return schedule_gpipe(num_stages, num_microbatches)
