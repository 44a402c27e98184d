"""The agent's logging: nothing a client does can block the agent or flood its log.

A refusal, a protocol error or a failed call is a log line that a client causes, as often as it
likes (docs/agent.md §5). Two things keep those lines from turning against the agent:

* **A bounded queue** (:func:`queue_logging`): the agent's records go to a queue, and a thread of
  their own writes them to the real handlers (a file, the journal's stderr pipe). A log sink that
  stalls stalls that thread only: once the queue is full each further record is dropped and
  counted, never waited for, and the next record the sink takes is preceded by ``N log records
  dropped`` (so is a quiet spell of ``notice_every_s``).
* **A limit per connection** (:class:`LogLimiter`): the first few lines a connection causes, then
  at most one every ``every_s`` seconds, each saying how many were left out before it.

What a client does *with* a device is another matter: a lease's start and end, each change made
through it, its restore and a job's revoke change a GPU on someone's behalf, and each has its
line, always (:func:`log_privileged`), outside that limit: refusals spent on purpose must not
hide them (docs/agent.md §5). Their rate is the rate of real device work, which the request
throttle bounds.

Client text in those lines is quoted by :func:`powerlib.agent.protocol.quote` and
:func:`~powerlib.agent.protocol.one_line`: no newline of a client's reaches the log.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["BoundedQueueHandler", "LogLimiter", "QueueLogging", "log_privileged", "queue_logging"]

logger = logging.getLogger(__name__)

QUEUE_RECORDS = 10_000
"""Records the queue holds while the sink is slow; a record past them is dropped and counted."""


class BoundedQueueHandler(logging.handlers.QueueHandler):
    """Puts records on a bounded queue; a full queue drops the record and counts it.

    It never blocks and never raises: a record that cannot be formatted is counted as dropped
    too (the stock handler would print a traceback to stderr, which may be the stalled sink).

    Attributes:
        dropped: Records dropped since the handler was made.
    """

    def __init__(self, records: queue.Queue[Any]) -> None:
        super().__init__(records)
        self._records = records  # typeshed types self.queue as put-only
        self._count_lock = threading.Lock()
        self.dropped = 0
        self._unreported = 0

    def emit(self, record: logging.LogRecord) -> None:
        """Queue the record (formatted here), or count it when the queue is full."""
        if self._records.full():  # don't format what would be dropped anyway
            self._drop()
            return
        super().emit(record)

    def enqueue(self, record: logging.LogRecord) -> None:
        """Put without waiting; a full queue counts the record as dropped."""
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self._drop()

    def handleError(self, record: logging.LogRecord) -> None:  # logging's name
        """A record that could not be prepared: counted, not printed to a stderr that may block."""
        self._drop()

    def take_dropped(self) -> int:
        """Records dropped since the last call (what the next notice reports)."""
        with self._count_lock:
            count, self._unreported = self._unreported, 0
        return count

    def _drop(self) -> None:
        with self._count_lock:
            self.dropped += 1
            self._unreported += 1


class _Listener(logging.handlers.QueueListener):
    """Writes queued records to the real handlers, each after a notice of drops before it."""

    # QueueListener's end-of-queue record (None in CPython), which typeshed leaves undeclared
    _sentinel: ClassVar[None] = None

    def __init__(
        self,
        records: queue.Queue[Any],
        source: BoundedQueueHandler,
        handlers: list[logging.Handler],
        notice_every_s: float,
    ) -> None:
        super().__init__(records, *handlers, respect_handler_level=True)
        self._records = records  # typeshed's QueueListener.queue has no timeout on get
        self.source = source
        self.notice_every_s = notice_every_s

    def dequeue(self, block: bool) -> Any:
        """The next record; while none comes, report drops every ``notice_every_s``."""
        while True:
            try:
                return self._records.get(block, self.notice_every_s)
            except queue.Empty:
                if not block:
                    raise
                self.notice()

    def handle(self, record: logging.LogRecord) -> None:
        """Report drops first (they happened before this record was taken), then the record."""
        self.notice()
        super().handle(record)

    def notice(self) -> None:
        """Write ``N log records dropped`` if any were."""
        count = self.source.take_dropped()
        if count:
            super().handle(
                logger.makeRecord(
                    logger.name, logging.WARNING, __file__, 0,
                    "agent: %d log records dropped (the log was not written fast enough)",
                    (count,), None,
                )
            )  # fmt: skip


class QueueLogging:
    """The root logger's handlers moved behind a bounded queue and a writer thread.

    Args:
        capacity: Records the queue holds (:data:`QUEUE_RECORDS`).
        notice_every_s: How often a quiet writer reports drops.
        target: The logger whose handlers move (the root logger).
    """

    def __init__(
        self,
        capacity: int = QUEUE_RECORDS,
        notice_every_s: float = 10.0,
        target: logging.Logger | None = None,
    ) -> None:
        self.target = target if target is not None else logging.getLogger()
        last = [] if logging.lastResort is None else [logging.lastResort]
        self.handlers: list[logging.Handler] = list(self.target.handlers) or last
        self.queue: queue.Queue[Any] = queue.Queue(capacity)
        self.handler = BoundedQueueHandler(self.queue)
        self.listener = _Listener(self.queue, self.handler, self.handlers, notice_every_s)
        self._started = False

    def start(self) -> QueueLogging:
        """Swap the handlers for the queue and start the writer thread (stopped at exit)."""
        if self._started:
            return self
        self._started = True
        self.listener.start()
        for h in self.handlers:
            self.target.removeHandler(h)
        self.target.addHandler(self.handler)
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, stop the thread and put the handlers back (idempotent).

        A sink stalled for longer than ``timeout_s`` loses what is still queued: the process is
        exiting, and waiting on it is what this module exists to avoid.
        """
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        thread = self.listener._thread  # QueueListener keeps it there
        if thread is not None:
            try:
                self.queue.put(self.listener._sentinel, timeout=timeout_s)
            except queue.Full:
                pass
            thread.join(timeout_s)
            self.listener._thread = None
        self.target.removeHandler(self.handler)
        for h in self.handlers:
            if h is not logging.lastResort:
                self.target.addHandler(h)
        if thread is None or not thread.is_alive():
            self.listener.notice()

    @property
    def dropped(self) -> int:
        """Records dropped so far."""
        return self.handler.dropped


def queue_logging(capacity: int = QUEUE_RECORDS, notice_every_s: float = 10.0) -> QueueLogging:
    """Move the root logger's handlers behind a bounded queue (``powerlib agent serve``).

    Call it once logging is configured; :meth:`QueueLogging.stop` (also run at exit) flushes.
    """
    return QueueLogging(capacity, notice_every_s).start()


class LogLimiter:
    """How many log lines one source (a client's connection) may cause.

    The first ``burst`` lines pass, then at most one every ``every_s`` seconds; a line that
    passes after some were held back says how many.

    Args:
        burst: Lines that pass before the limit starts.
        every_s: The least time between two lines after that.
        clock: Monotonic seconds (tests give their own).
    """

    def __init__(
        self, burst: int = 5, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.every_s = every_s
        self.clock = clock
        self.passed = 0
        self.suppressed = 0
        self._last_s = float("-inf")

    def log(
        self, log: logging.Logger, level: int, msg: str, *args: Any, exc_info: bool = False
    ) -> bool:
        """``log.log(level, msg, *args)`` if the limit allows it; whether it did."""
        if not log.isEnabledFor(level):
            return False
        now = self.clock()
        if self.passed >= self.burst and now - self._last_s < self.every_s:
            self.suppressed += 1
            return False
        self.passed += 1
        self._last_s = now
        if self.suppressed:
            msg += " (%d more like it from this connection were not logged)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        log.log(level, msg, *args, exc_info=exc_info)
        return True


def log_privileged(log: logging.Logger, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log one privileged action: a lease's start or end, a change, a restore, a revoke.

    Always one line, never counted against the :class:`LogLimiter` of the client that caused it
    (six refusals must not silence its next lease). Client text in ``args`` must be quoted
    already (:func:`powerlib.agent.protocol.one_line`); the bounded queue still applies, so a
    stalled sink never stalls the caller.
    """
    log.log(level, msg, *args)
