"""Pipeline-parallel schedules and the computation DAG the frequency planner works on.

A *schedule* lists, for every pipeline stage (one GPU, or one group of TP/CP ranks that act
as one), the forward and backward computations it runs in one training iteration, in execution
order. Three orders are built in:

- :func:`schedule_1f1b`: synchronous 1F1B, the order of DeepSpeed's ``TrainSchedule``,
  Megatron-core's non-interleaved schedule, torch's ``Schedule1F1B`` and the Perseus artifact.
- :func:`schedule_gpipe`: all forwards, then all backwards (torch's ``ScheduleGPipe``).
- :func:`schedule_interleaved_1f1b`: Megatron-core's interleaved 1F1B with virtual stages.

Other orders (zero-bubble, V schedules, whatever a framework really runs) come in as recorded
per-stage lists; :func:`check_deadlock_free` and :func:`build_dag` accept any complete order.

Kinds: a forward (``F``) and either a full backward (``B``) or a backward split into its input
part (``I``, the gradient the previous model chunk waits for) and its weight part (``W``, which
only needs this chunk's ``I`` and can fill bubbles), as zero-bubble schedules run them.

:func:`build_dag` turns a schedule into an activity-on-node DAG (:class:`PipelineDAG`): one node
per computation; edges for program order on each stage, activations flowing forward and gradients
flowing backward. Communication is not modelled (a transfer takes no time), as in Perseus.
:func:`check_deadlock_free` dry-runs a schedule and names the blocked computations when a
hand-written or recorded schedule cannot finish.

Model chunks:
    With ``N`` stages and ``V`` chunks per stage, stage ``s`` holds chunks ``c = 0..V-1``. In the
    ``looped`` placement (the default; Megatron interleaved, torch looped schedules) chunk ``c``
    of stage ``s`` is model chunk ``k = c*N + s`` (the model is cut into ``N*V`` consecutive
    pieces, dealt round-robin over the stages). In the ``v`` placement (``V = 2``: torch
    ZBVZeroBubble and DualPipeV, DeepSpeed DualPipeV) chunk 0 of stage ``s`` is ``k = s`` and
    chunk 1 is ``k = 2N-1-s``, so stage 0 holds the first and the last piece. Non-interleaved
    schedules have ``V = 1`` and ``k = s``. The forward of a microbatch visits
    ``k = 0, 1, ..., N*V-1``; its backward visits them in reverse.

This module is pure: it imports only the standard library.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from powerlib.errors import PlanError

__all__ = [
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "KINDS",
    "KIND_LETTERS",
    "PLACEMENTS",
    "SCHEDULE_NAMES",
    "Instruction",
    "InstructionKey",
    "PipelineDAG",
    "Schedule",
    "build_dag",
    "build_schedule",
    "check_deadlock_free",
    "schedule_1f1b",
    "schedule_gpipe",
    "schedule_interleaved_1f1b",
]

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"
BACKWARD_WEIGHT = "backward_weight"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
"""The computation kinds, in the order profiles and plans list them."""

PLACEMENTS = ("looped", "v")
"""How a stage's model chunks map onto the model (see the module docstring)."""

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved")
"""The names :func:`build_schedule` accepts."""

KIND_LETTERS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}
"""The one-letter form of each kind, as schedules are usually written."""


class InstructionKey(NamedTuple):
    """``(stage, chunk, microbatch, kind)``: how hooks, plans and schedules name an instruction.

    The one key type of the project (a tuple, so a plain 4-tuple compares equal to it).
    """

    stage: int
    chunk: int
    microbatch: int
    kind: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruction:
    """One computation of a pipeline stage: a forward or (part of) a backward of one microbatch.

    The string form is compact, e.g. ``"S1 F mb3"`` for the forward of microbatch 3 on stage 1;
    a chunk other than 0 is appended, as in ``"S1 B mb3 c1"``.

    Attributes:
        stage: The pipeline stage (pp rank) that runs it, from 0.
        microbatch: The microbatch index, from 0.
        kind: One of :data:`KINDS`: forward, backward, backward_input or backward_weight.
        chunk: The virtual-stage (model chunk) index on this stage; 0 unless interleaved.

    Raises:
        PlanError: A negative index or an unknown kind.
    """

    stage: int
    microbatch: int
    kind: str
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(
                f"unknown instruction kind {self.kind!r}; expected one of {', '.join(KINDS)}"
            )
        for name in ("stage", "microbatch", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"instruction {name} must be an integer >= 0, got {value!r}")

    @property
    def key(self) -> InstructionKey:
        """``(stage, chunk, microbatch, kind)``."""
        return InstructionKey(self.stage, self.chunk, self.microbatch, self.kind)

    def __str__(self) -> str:
        return f"S{self.stage} {_short(self)}"


Schedule = list[list[Instruction]]
"""One list per stage (index = stage), each in execution order."""


def _short(instruction: Instruction) -> str:
    """The string form of an instruction without its stage, e.g. ``"F mb3"`` or ``"B mb3 c1"``."""
    text = f"{KIND_LETTERS[instruction.kind]} mb{instruction.microbatch}"
    return f"{text} c{instruction.chunk}" if instruction.chunk else text


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


@dataclass(frozen=True, slots=True)
class PipelineDAG:
    """The activity-on-node DAG of one training iteration.

    There are no dummy source or sink nodes: node ``F(stage 0, chunk 0, mb 0)`` is the only node
    without predecessors and ``B(stage 0, chunk 0, mb M-1)`` the only one without successors for
    the built-in schedules.

    Attributes:
        instructions: Node ``i`` is ``instructions[i]``; stage 0's instructions come first, in
            execution order, then stage 1's, and so on.
        edges: Precedence edges ``(u, v)``: node ``u`` must finish before node ``v`` starts.
            Sorted, without duplicates.
        num_stages: Number of pipeline stages.
    """

    instructions: tuple[Instruction, ...]
    edges: tuple[tuple[int, int], ...]
    num_stages: int

    def stage_order(self, stage: int) -> list[int]:
        """The node indices of one stage, in execution order.

        Args:
            stage: The stage, ``0 <= stage < num_stages``.

        Returns:
            Node indices into :attr:`instructions`.

        Raises:
            PlanError: The stage is out of range.
        """
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or not 0 <= stage < self.num_stages
        ):
            raise PlanError(f"stage {stage!r} is out of range for {self.num_stages} stages")
        return [i for i, ins in enumerate(self.instructions) if ins.stage == stage]

    def topological_order(self) -> list[int]:
        """Every node index once, each after all of its predecessors."""
        succs: list[list[int]] = [[] for _ in self.instructions]
        indegree = [0] * len(self.instructions)
        for u, v in self.edges:
            succs[u].append(v)
            indegree[v] += 1
        ready = [i for i, d in enumerate(indegree) if d == 0]
        out = []
        while ready:
            v = ready.pop()
            out.append(v)
            for w in succs[v]:
                indegree[w] -= 1
                if indegree[w] == 0:
                    ready.append(w)
        return out

    def start_times(self, durations: Sequence[float]) -> list[float]:
        """Each node's earliest start: when its last predecessor ends (the first nodes at 0).

        Args:
            durations: How long node ``i`` runs, in any unit.
        """
        starts = [0.0] * len(self.instructions)
        preds: list[list[int]] = [[] for _ in self.instructions]
        for u, v in self.edges:
            preds[v].append(u)
        for v in self.topological_order():
            starts[v] = max((starts[u] + durations[u] for u in preds[v]), default=0.0)
        return starts


def _key(instruction: Instruction) -> InstructionKey:
    return instruction.key


def _check_placement(placement: str, num_chunks: int) -> None:
    if placement not in PLACEMENTS:
        raise PlanError(f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
    if placement == "v" and num_chunks != 2:
        raise PlanError(f"the v placement needs 2 chunks per stage, the schedule has {num_chunks}")


class _Shape:
    """The stage/chunk layout of a validated schedule and the cross-stage dependency rule."""

    __slots__ = ("num_chunks", "num_microbatches", "num_stages", "placement", "split")

    def __init__(
        self,
        num_stages: int,
        num_chunks: int,
        num_microbatches: int,
        placement: str = "looped",
        split: frozenset[tuple[int, int, int]] = frozenset(),
    ) -> None:
        _check_placement(placement, num_chunks)
        self.num_stages = num_stages
        self.num_chunks = num_chunks
        self.num_microbatches = num_microbatches
        self.placement = placement
        self.split = split  # (stage, chunk, microbatch) whose backward runs as I + W

    def model_chunk(self, stage: int, chunk: int) -> int:
        """The model piece ``k`` that ``chunk`` of ``stage`` holds."""
        n = self.num_stages
        if self.placement == "v" and chunk == 1:
            return 2 * n - 1 - stage
        return chunk * n + stage

    def locate(self, k: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding model piece ``k``."""
        n = self.num_stages
        if self.placement == "v" and k >= n:
            return 2 * n - 1 - k, 1
        chunk, stage = divmod(k, n)
        return stage, chunk

    def dependency(self, ins: Instruction) -> Instruction | None:
        """The one computation on which ``ins`` depends besides its stage predecessor.

        A forward of model chunk ``k > 0`` needs the forward of chunk ``k - 1`` (activations); a
        backward (or its input part) of chunk ``k`` below the last needs the backward (or input
        part) of chunk ``k + 1`` (gradients); the backward of the last chunk needs its own
        forward; a weight part needs its own input part.
        """
        mb = ins.microbatch
        if ins.kind == BACKWARD_WEIGHT:
            return Instruction(stage=ins.stage, microbatch=mb, kind=BACKWARD_INPUT, chunk=ins.chunk)
        last = self.num_stages * self.num_chunks - 1
        k = self.model_chunk(ins.stage, ins.chunk)
        if ins.kind == FORWARD:
            if k == 0:
                return None
            stage, chunk = self.locate(k - 1)
            return Instruction(stage=stage, microbatch=mb, kind=FORWARD, chunk=chunk)
        if k == last:
            return Instruction(stage=ins.stage, microbatch=mb, kind=FORWARD, chunk=ins.chunk)
        stage, chunk = self.locate(k + 1)
        kind = BACKWARD_INPUT if (stage, chunk, mb) in self.split else BACKWARD
        return Instruction(stage=stage, microbatch=mb, kind=kind, chunk=chunk)


def _validate(schedule: Schedule, placement: str = "looped") -> _Shape:
    """Check a schedule's structure: one list per stage, every computation exactly once.

    Every (stage, chunk, microbatch) needs its forward and either a full backward or both
    backward parts (input and weight), never both forms.
    """
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise PlanError("a schedule needs at least one stage (a non-empty list of lists)")
    seen: set[InstructionKey] = set()
    num_chunks = num_microbatches = 0
    for stage, order in enumerate(schedule):
        if not isinstance(order, (list, tuple)):
            raise PlanError(f"stage {stage}'s schedule must be a list of Instructions")
        for position, ins in enumerate(order):
            if not isinstance(ins, Instruction):
                raise PlanError(
                    f"stage {stage}, position {position}: expected an Instruction, got {ins!r}"
                )
            if ins.stage != stage:
                raise PlanError(
                    f"stage {stage}, position {position}: {ins} belongs to stage {ins.stage}"
                )
            key = _key(ins)
            if key in seen:
                raise PlanError(f"stage {stage}, position {position}: {ins} appears twice")
            seen.add(key)
            num_chunks = max(num_chunks, ins.chunk + 1)
            num_microbatches = max(num_microbatches, ins.microbatch + 1)
    split: set[tuple[int, int, int]] = set()
    missing: list[Instruction] = []
    for s in range(len(schedule)):
        for c in range(num_chunks):
            for m in range(num_microbatches):
                kinds = [kind for kind in KINDS if (s, c, m, kind) in seen]
                if BACKWARD in kinds and len(kinds) > 2:
                    raise PlanError(
                        f"stage {s} runs both a full backward and a split one (I/W) of "
                        f"mb{m}" + (f" c{c}" if c else "")
                    )
                need = [FORWARD]
                if BACKWARD_INPUT in kinds or BACKWARD_WEIGHT in kinds:
                    need += [BACKWARD_INPUT, BACKWARD_WEIGHT]
                    split.add((s, c, m))
                else:
                    need.append(BACKWARD)
                missing += [
                    Instruction(stage=s, microbatch=m, kind=kind, chunk=c)
                    for kind in need
                    if kind not in kinds
                ]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise PlanError(
            f"schedule misses {missing[0]}{more} (expected {len(schedule)} stages x "
            f"{num_chunks} chunk(s) x {num_microbatches} microbatches x forward/backward)"
        )
    return _Shape(len(schedule), num_chunks, num_microbatches, placement, frozenset(split))


def check_deadlock_free(schedule: Schedule, placement: str = "looped") -> None:
    """Check that a schedule is complete and can run to the end.

    Each stage executes its list in order; a computation starts once its stage predecessor and
    its cross-stage dependency (see :class:`PipelineDAG`) have finished. The dry run is
    event-driven and linear in the number of computations.

    Args:
        schedule: One instruction list per stage.
        placement: ``looped`` or ``v`` (see the module docstring).

    Raises:
        PlanError: The schedule misses or repeats a computation, lists one under the wrong stage,
            or stalls; a stall names where every unfinished stage waits, e.g.
            ``"deadlock: S0 waits at B mb0 (needs S1 B mb0), S1 waits at F mb1 (needs S0 F mb1)"``.
    """
    shape = _validate(schedule, placement)
    done: set[InstructionKey] = set()
    position = [0] * shape.num_stages
    waiting: dict[InstructionKey, list[int]] = {}
    ready = deque(range(shape.num_stages))
    while ready:
        stage = ready.popleft()
        order = schedule[stage]
        while position[stage] < len(order):
            ins = order[position[stage]]
            dep = shape.dependency(ins)
            if dep is not None and _key(dep) not in done:
                waiting.setdefault(_key(dep), []).append(stage)
                break
            key = _key(ins)
            done.add(key)
            position[stage] += 1
            ready.extend(waiting.pop(key, ()))
    blocked = []
    for stage, order in enumerate(schedule):
        if position[stage] < len(order):
            ins = order[position[stage]]
            blocked.append(f"S{stage} waits at {_short(ins)} (needs {shape.dependency(ins)})")
    if blocked:
        raise PlanError("deadlock: " + ", ".join(blocked))


def build_dag(schedule: Schedule, placement: str = "looped") -> PipelineDAG:
    """Turn a schedule into its activity-on-node precedence DAG.

    Edges, deduplicated and sorted:

    - program order: each instruction to the next one on the same stage;
    - activations: forward of model chunk ``k`` to forward of chunk ``k + 1``, same microbatch
      (``F(s, m) -> F(s+1, m)`` without interleaving);
    - gradients: backward of chunk ``k + 1`` to backward of chunk ``k``, same microbatch (the
      input part ``I`` where the backward is split; ``W`` follows its own ``I``).

    The backward of the last model chunk also depends on its own forward. Both run on the last
    stage, and :func:`check_deadlock_free` (called first) guarantees the forward comes earlier
    in that stage's list, so program order already implies that edge and none is added. The
    same holds for any dependency between two instructions of one stage (with one stage and
    several chunks, the activation and gradient edges too). A 1F1B
    DAG thus has ``2*N*M`` nodes and ``N*(2*M - 1) + 2*M*(N - 1)`` edges (48 and 80 for
    ``N = 4, M = 6``); add a source, a sink and their two edges for lowtime's counts.

    Args:
        schedule: One instruction list per stage.
        placement: ``looped`` or ``v`` (see the module docstring).

    Returns:
        The DAG.

    Raises:
        PlanError: The schedule is incomplete, repeats a computation or deadlocks.
    """
    check_deadlock_free(schedule, placement)
    instructions = [ins for order in schedule for ins in order]
    shape = _validate(schedule, placement)
    index = {_key(ins): node for node, ins in enumerate(instructions)}
    edges: set[tuple[int, int]] = set()
    start = 0  # node index of each stage's first instruction
    for order in schedule:
        edges.update((start + i, start + i + 1) for i in range(len(order) - 1))
        start += len(order)
    for node, ins in enumerate(instructions):
        dep = shape.dependency(ins)
        if dep is None:
            continue
        source = index[_key(dep)]
        if dep.stage == ins.stage and source < node:
            continue  # implied by program order on this stage
        edges.add((source, node))
    return PipelineDAG(
        instructions=tuple(instructions), edges=tuple(sorted(edges)), num_stages=len(schedule)
    )
