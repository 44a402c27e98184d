"""SM-limited communicators for Kareus plans: one NCCL process group per SM count.

**SM shares.** On NCCL a collective's SM share is a property of its communicator
(``ncclConfig_t`` ``minCTAs``/``maxCTAs``, docs/kareus.md §3.3): :class:`SMGroups` creates one process
group per (ranks, SM count) with ``ProcessGroupNCCL.Options().config.min_ctas = max_ctas =
sm_count``. ``new_group`` is collective over the *whole* job and every rank must create groups in
the same order, so they are all created when the plan is loaded
(:meth:`powerlib.kareus.launch.LaunchControl.load`), from the
distinct SM counts of *every* stage of the plan (sorted) and every group in ``group_ranks``
(default: the whole world), on every rank, before any training instruction: never lazily inside
a partition, where a rank of another pipeline stage would never join. The block size cannot be
set per communicator on NCCL (``NCCL_NTHREADS`` is process-wide): it is recorded only. On gloo
(and any backend other than NCCL), and without an initialised process group, SM counts cannot be
enforced: the collective runs on the group the integration passed, the requested count is
recorded (:attr:`powerlib.kareus.launch.LaunchControl.records`), and one warning says so.

torch is not imported by this module (only :func:`nccl_options` called without ``dist`` does): the
process group comes from ``sys.modules``, so nothing is enforced unless the job itself initialised
``torch.distributed``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from powerlib.errors import InvalidArgumentError, NotSupportedError

__all__ = ["SMGroups", "nccl_options"]

logger = logging.getLogger(__name__)


def _warn(message: str) -> None:
    """Log and warn (``RuntimeWarning``), as the session does for a degraded feature."""
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------
# SM shares: one NCCL communicator per (ranks, SM count)
# --------------------------------------------------------------------------------------------


def nccl_options(sm_count: int, dist: Any = None) -> Any:
    """``ProcessGroupNCCL.Options`` whose communicator uses exactly ``sm_count`` CTAs.

    Sets ``config.min_ctas = config.max_ctas = sm_count`` (NCCL >= 2.17's ``ncclConfig_t``
    ``minCTAs``/``maxCTAs``; torch passes it through since PR #97394; checked against torch 2.13).

    Args:
        sm_count: CTAs (one per SM) of every collective on the communicator.
        dist: The ``torch.distributed`` module (default: imported).

    Raises:
        InvalidArgumentError: ``sm_count`` is not a positive integer.
        NotSupportedError: This torch build has no NCCL (CPU wheels), or its options lack the
            CTA fields.
    """
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise InvalidArgumentError(f"sm_count must be a positive integer, got {sm_count!r}")
    if dist is None:
        import torch.distributed as dist  # noqa: PLC0415 - torch is an optional extra
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None:
        raise NotSupportedError(
            "this torch build has no ProcessGroupNCCL (a CPU wheel?): SM counts cannot be enforced"
        )
    options = pg_nccl.Options()
    config = getattr(options, "config", None)
    if config is None or not hasattr(config, "max_ctas"):
        raise NotSupportedError(
            "ProcessGroupNCCL.Options has no config.min_ctas/max_ctas (needs torch >= 2.1 built "
            "with NCCL >= 2.17): SM counts cannot be enforced"
        )
    config.min_ctas = sm_count
    config.max_ctas = sm_count
    return options


def _dist_module() -> Any:
    """``torch.distributed`` if the job imported it and initialised a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


class SMGroups:
    """Process groups that carry collectives with a bounded SM share (NCCL only).

    Args:
        dist: The ``torch.distributed`` module; default: the job's, when it initialised one (this
            class never imports torch). Tests pass a fake.
        warn: How a degraded feature is reported (default: log and ``RuntimeWarning``).

    Attributes:
        groups: ``{(ranks, sm_count): process group}`` for this rank's groups.
    """

    def __init__(self, *, dist: Any = None, warn: Callable[[str], None] = _warn) -> None:
        self._dist_arg = dist
        self._warn = warn
        self.groups: dict[tuple[tuple[int, ...], int], Any] = {}
        self._warned: set[str] = set()
        # id(group) -> (group, backend, ranks): launches ask for the same few groups every time
        self._seen: dict[int, tuple[Any, str, tuple[int, ...]]] = {}

    @property
    def dist(self) -> Any:
        """The ``torch.distributed`` module in use, or ``None`` (no process group)."""
        return self._dist_arg if self._dist_arg is not None else _dist_module()

    def _backend(self, group: Any) -> str:
        dist = self.dist
        if dist is None:
            return ""
        try:
            return str(dist.get_backend(group)).lower()
        except Exception:  # noqa: BLE001 - an odd group never stops training
            return ""

    def enforceable(self, group: Any = None) -> bool:
        """Whether ``group`` (``None``: the default group) is NCCL, so SM counts can be enforced."""
        return "nccl" in self._backend(group)

    def _ranks(self, group: Any) -> tuple[int, ...]:
        dist = self.dist
        if group is None:
            return tuple(range(dist.get_world_size()))
        return tuple(sorted(int(r) for r in dist.get_process_group_ranks(group)))

    def prepare(
        self, sm_counts: Iterable[int], group_ranks: Sequence[Sequence[int]] | None = None
    ) -> int:
        """Create the SM-limited communicators: collective over the whole job (see module doc).

        Every rank must call it with the same arguments at the same point (the session does it
        when the plan arrives). Does nothing unless the default group is NCCL.

        Args:
            sm_counts: The plan's SM counts (every stage's).
            group_ranks: The global ranks of every group the collectives run on, the same lists
                on every rank (e.g. every tensor-parallel group); default: the whole world.

        Returns:
            How many groups this rank belongs to (0 when nothing can be enforced).
        """
        dist = self.dist
        if dist is None or not self.enforceable(None):
            return 0
        counts = sorted({int(s) for s in sm_counts})
        if group_ranks is None:
            lists = [tuple(range(dist.get_world_size()))]
        else:
            lists = [tuple(sorted(int(r) for r in ranks)) for ranks in group_ranks]
        me = dist.get_rank()
        try:
            options = {sm: nccl_options(sm, dist) for sm in counts}
        except NotSupportedError as err:
            self._warn_once(
                "options", f"powerlib: {err}; overlapped collectives use the default groups"
            )
            return 0
        created = 0
        try:
            for ranks in lists:
                for sm in counts:
                    pg = dist.new_group(list(ranks), backend="nccl", pg_options=options[sm])
                    if me in ranks:
                        self.groups[(ranks, sm)] = pg
                        created += 1
        except Exception as err:  # noqa: BLE001 - training goes on without SM limits
            self.groups.clear()
            self._warn_once(
                "create",
                f"powerlib: creating the SM-limited NCCL communicators failed ({err}); overlapped "
                "collectives use the default groups",
            )
            return 0
        return created

    def lookup(self, group: Any, sm_count: int) -> tuple[Any, bool]:
        """The group to run a collective of ``group`` with ``sm_count`` SMs on.

        Returns:
            ``(group to use, enforced)``: the SM-limited communicator and True, or ``group``
            itself and False (not NCCL, no process group, or not prepared; one warning each).
        """
        dist = self.dist
        if dist is None:
            self._warn_once(
                "nodist",
                "powerlib: no torch.distributed process group: overlap SM counts are recorded, "
                "not enforced",
            )
            return group, False
        seen = self._seen.get(id(group))
        if seen is None or seen[0] is not group:
            backend = self._backend(group)
            try:
                ranks = self._ranks(group) if "nccl" in backend else ()
            except Exception:  # noqa: BLE001 - an odd group never stops training
                ranks = ()
            seen = (group, backend, ranks)
            self._seen[id(group)] = seen  # holds the group: its id is not reused meanwhile
        _, backend, ranks = seen
        if "nccl" not in backend:
            self._warn_once(
                "backend",
                f"powerlib: the {backend or 'unknown'} backend cannot limit a collective's SMs "
                "(only NCCL can): overlap SM counts are recorded, not enforced",
            )
            return group, False
        pg = self.groups.get((ranks, sm_count))
        if pg is None:
            self._warn_once(
                f"missing{ranks}",
                f"powerlib: no SM-limited communicator for ranks {list(ranks)} with {sm_count} "
                "SMs (pass every tensor/context-parallel group as group_ranks): that collective "
                "uses its default group",
            )
            return group, False
        return pg, True

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._warn(message)
