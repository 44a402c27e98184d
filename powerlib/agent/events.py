"""What the agent keeps of the leases that ended: each one's timing, and a job's, bounded.

:class:`AgentEvent` is one lease that ended (what ``benchmarks/agent.py`` reads);
:class:`JobEvents` is a job's ended leases kept for ``powerlib agent revoke``'s answer, the
latest :data:`JOB_EVENTS` and a count of the rest, so a job that leases in a loop for hours
costs root the same memory as one that leased once (issue 46, docs/agent.md §4).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["JOB_EVENTS", "AgentEvent", "JobEvents"]

JOB_EVENTS = 64
"""Ended leases kept per job for ``revoke``'s answer; older ones are counted, not kept."""


@dataclass(slots=True)
class AgentEvent:
    """A lease that ended, with its timing (monotonic seconds): what the benchmark reads."""

    device_id: str
    pid: int
    uid: int
    reason: str
    detected_s: float
    restore_started_s: float = float("nan")
    restore_done_s: float = float("nan")
    ok: bool = False


@dataclass
class JobEvents:
    """The leases one job grant admitted that ended, bounded (docs/agent.md §4).

    A job's user can start and end leases in a loop as long as the job runs: root keeps the
    latest :data:`JOB_EVENTS` for ``revoke``'s answer and counts the rest (``left_out``), those
    that did not restore cleanly too (``left_out_failed``: the epilog still fails), so its memory
    for a job and the answer stay the same size however long the loop runs.
    """

    recent: collections.deque[AgentEvent] = field(
        default_factory=lambda: collections.deque(maxlen=JOB_EVENTS)
    )
    left_out: int = 0
    left_out_failed: int = 0

    def add(self, event: AgentEvent) -> None:
        """Keep ``event`` (its restore done); count the oldest one when it has to go."""
        if len(self.recent) == self.recent.maxlen:
            self.left_out += 1
            self.left_out_failed += not self.recent[0].ok
        self.recent.append(event)

    def to_wire(self) -> dict[str, object]:
        """``revoke``'s answer: the latest ended leases, and how many earlier ones it leaves out."""
        ended = [
            {"device_id": e.device_id, "uid": e.uid, "pid": e.pid, "ok": e.ok} for e in self.recent
        ]
        return {"ended": ended, "left_out": self.left_out, "left_out_failed": self.left_out_failed}
