"""The partition types of Kareus's overlap model: operations, collectives and configurations.

Consecutive short memory-bound operations share one *launch slot* (``norm``, ``rope``,
``activation``); compute-bound ones have a slot each (``linear``, ``attn``), numbered per name in
order (``linear_0``, ``linear_1``). A configuration (:class:`Config`) is a clock, an SM (CTA) count
for the communication kernel and a launch slot, or ``None`` for no overlap: the collective runs
after the compute with the whole GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from powerlib.errors import PlanError

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "BLOCK_SIZE",
    "REDUCE_SCATTER",
    "Collective",
    "Config",
    "Op",
    "PartitionType",
    "Segment",
]

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
_ABBREV = {ALL_REDUCE: "ar", ALL_GATHER: "ag", REDUCE_SCATTER: "rs"}

BLOCK_SIZE = 1024
"""Threads per CTA of the communication kernel (fixed, as in the artifact)."""

_MEMORY_BOUND_SLOTS = ("norm", "rope", "activation")


# --------------------------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One compute kernel (or a merged group of short memory-bound kernels) on one GPU.

    Attributes:
        name: What it is (``qkv``, ``flash_attn_bwd``, ...).
        slot: Its launch slot (``norm_0``, ``linear_1``, ...).
        flops: Floating-point operations on this GPU.
        hbm_bytes: Bytes moved to and from HBM on this GPU.
        ctas: Thread blocks the kernel launches (bounds how many SMs it can use).
    """

    name: str
    slot: str
    flops: float
    hbm_bytes: float
    ctas: int

    @property
    def memory_bound(self) -> bool:
        """Whether its slot is one of the merged memory-bound groups."""
        return self.slot.rsplit("_", 1)[0] in _MEMORY_BOUND_SLOTS


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """One collective of one nanobatch (consecutive collectives already fused).

    Attributes:
        kind: :data:`ALL_REDUCE`, :data:`ALL_GATHER` or :data:`REDUCE_SCATTER`.
        payload_bytes: The full buffer ``M`` (all-reduce: the tensor; all-gather: the gathered
            result; reduce-scatter: the input).
        group_size: Ranks in the group ``g``.
        wire_bytes: Bytes each GPU sends: ring all-reduce ``2(g−1)/g·M``, the others
            ``(g−1)/g·M`` (docs/kareus.md §5.1).
    """

    kind: str
    payload_bytes: float
    group_size: int

    @property
    def wire_bytes(self) -> float:
        """Bytes on the wire per GPU."""
        g = self.group_size
        factor = 2.0 * (g - 1) / g if self.kind == ALL_REDUCE else (g - 1) / g
        return factor * self.payload_bytes

    @property
    def abbrev(self) -> str:
        """``ar``, ``ag`` or ``rs``."""
        return _ABBREV[self.kind]


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A run of compute ending in a collective (the unit partitions are formed from)."""

    name: str
    ops: tuple[Op, ...]
    comm: Collective


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionType:
    """One partition type: the compute of one nanobatch with another's collective in flight.

    Attributes:
        key: Stable type key (``fwd_attn``, ``bwd_qkv_rs``, ...).
        phase: ``fwd`` or ``bwd``.
        ops: The compute (nanobatch-sized), in stream order.
        comm: The overlapped collective (nanobatch-sized).
        slots: Candidate launch slots: every slot but the last (launching with the last kernel
            leaves the collective exposed), and the only one when there is one.
        per_layer: Occurrences per layer and instruction (both nanobatches counted).
    """

    key: str
    phase: str
    ops: tuple[Op, ...]
    comm: Collective
    slots: tuple[str, ...]
    per_layer: int

    @property
    def size_class(self) -> str:
        """Search-budget class by compute kernels (docs/kareus.md §1.4): small, medium or large."""
        n = len(self.ops)
        return "small" if n <= 1 else "medium" if n <= 3 else "large"

    @property
    def slot_ops(self) -> dict[str, int]:
        """Each slot's first op index (where a collective launched "with" it starts)."""
        first: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            first.setdefault(op.slot, i)
        return first


@dataclass(frozen=True, slots=True)
class Config:
    """One partition configuration.

    Attributes:
        freq_mhz: Locked SM clock.
        sm_count: CTAs (one per SM) of the communication kernel.
        slot: Launch slot, or ``None``: no overlap, the collective runs after the compute.
    """

    freq_mhz: float
    sm_count: int
    slot: str | None

    def __str__(self) -> str:
        """The artifact's ``<start>-<end>-<sm>-<block>`` string (``none`` start: no overlap)."""
        return f"{self.slot or 'none'}-none-{self.sm_count}-{BLOCK_SIZE}"

    def to_json(self) -> dict[str, object]:
        """``{"freq_mhz", "sm_count", "slot"}``."""
        return {"freq_mhz": self.freq_mhz, "sm_count": self.sm_count, "slot": self.slot}

    @classmethod
    def parse(cls, text: str, freq_mhz: float) -> Config:
        """Parse a configuration string (:meth:`__str__`) at ``freq_mhz``.

        Raises:
            PlanError: If the string is malformed.
        """
        parts = str(text).split("-")
        if len(parts) != 4 or not parts[2].isdigit() or int(parts[2]) < 1:
            raise PlanError(
                f"partition configuration {text!r} is not <slot>-<end>-<sm_count>-<block>"
            )
        slot = None if parts[0] in ("none", "-1") else parts[0]
        return cls(freq_mhz=float(freq_mhz), sm_count=int(parts[2]), slot=slot)
