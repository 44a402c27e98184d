"""Markers on an accelerator stream: where the device really is, without a synchronize.

A hook on the training thread runs ahead of the GPU. Recording a CUDA event on the current
stream costs a few microseconds and never blocks; another thread waits for it and so learns
when the device reached that point: :mod:`powerlib.measure_api.measure` stamps step boundaries
this way, and the frequency controller holds a clock change until the stream reaches the
instruction it is for (docs/measurement.md).

``auto`` is decided at each mark, not once: before CUDA is initialised a mark is ``None`` (the
host clock stands in), and from the first mark after it the marks are CUDA events, so a session
or measurement entered before the model moves to the GPU still follows the kernels
(docs/real-gpu.md §4).
"""

from __future__ import annotations

import collections
import math
import queue
import sys
import threading
from typing import Any, Protocol

from powerlib.errors import InvalidArgumentError

__all__ = ["Stamps", "StreamMarker", "cuda_marker"]


class StreamMarker(Protocol):
    """Marks points on an accelerator stream and waits for them (the CUDA one: events)."""

    def record(self) -> object:
        """Enqueue a marker on the current stream; must not block.

        ``None``: no marker now (no stream yet); the host clock stands in for this point.
        """
        ...

    def wait(self, token: object) -> None:
        """Block (on the waiter thread) until the marker has been reached."""
        ...


class _CudaMarker:
    """CUDA events on the current stream; completed events are reused (no create per step)."""

    def __init__(self, torch: Any) -> None:
        self._event = torch.cuda.Event
        self._free: collections.deque[Any] = collections.deque()

    def record(self) -> object:
        try:
            event = self._free.pop()
        except IndexError:
            event = self._event()
        event.record()
        return event

    def wait(self, token: object) -> None:
        token.synchronize()  # type: ignore[attr-defined]
        self._free.append(token)


class _LazyCudaMarker:
    """``auto``: no marker (``None``) until CUDA is initialised, CUDA events from then on.

    Each mark before that costs a dictionary look-up and one ``is_initialized()``; the event
    marker is kept once CUDA is up. Never imports torch.
    """

    def __init__(self) -> None:
        self._cuda: _CudaMarker | None = None

    def record(self) -> object:
        cuda = self._cuda
        if cuda is None:
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_initialized():
                return None
            cuda = self._cuda = _CudaMarker(torch)
        return cuda.record()

    def wait(self, token: object) -> None:
        if token is not None and self._cuda is not None:
            self._cuda.wait(token)


def cuda_marker(align: str) -> StreamMarker | None:
    """CUDA events for ``align`` (``cuda``, ``host``, ``auto``: once CUDA is initialised).

    ``auto`` returns a marker whose marks are ``None`` until CUDA is initialised (decided at
    each mark); it never imports torch: a CPU job does not have it.

    Raises:
        InvalidArgumentError: ``align="cuda"`` and torch sees no GPU.
    """
    if align == "host":
        return None
    torch = sys.modules.get("torch")  # never import torch for this: a CPU job does not have it
    if align == "cuda":
        if torch is None:
            import torch  # noqa: PLC0415 - optional dependency, imported where used
        assert torch is not None  # for the type checker: the import bound it
        if not torch.cuda.is_available():
            raise InvalidArgumentError("align='cuda' needs CUDA, and torch sees no GPU")
        return _CudaMarker(torch)
    if align != "auto":
        raise InvalidArgumentError(f"align must be auto, cuda or host, got {align!r}")
    return _LazyCudaMarker()


class Stamps:
    """Times of points in the training loop: the host clock now, or when the stream got there.

    :meth:`stamp` returns a one-element list (a cell) that holds the time: at once with no
    marker (or a ``None`` mark: no stream yet); with one, a waiter thread (started at the first
    mark) fills it when the device reaches the marker recorded at the call (``nan`` until
    then). The training thread only records the marker.

    Args:
        clock: Time source in seconds.
        marker: Stream markers (:func:`cuda_marker`), or ``None`` for the host clock.
    """

    def __init__(self, clock: Any, marker: StreamMarker | None = None) -> None:
        self._clock = clock
        self._marker = marker
        self._queue: queue.SimpleQueue[tuple[list[float], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def stamp(self) -> list[float]:
        """A cell with the time of this point (``nan`` until the device reaches it)."""
        token = None if self._marker is None or self._closed else self._marker.record()
        if token is None:
            return [self._clock()]
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait, name="powerlib-stamps", daemon=True)
            self._thread.start()
        cell = [math.nan]
        self._queue.put((cell, token))
        return cell

    def _wait(self) -> None:
        assert self._marker is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            cell, token = item
            try:
                self._marker.wait(token)
            except Exception:  # noqa: BLE001 - a stream error must not kill the waiter
                continue
            cell[0] = self._clock()

    def close(self) -> None:
        """Stop the waiter. Idempotent."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
