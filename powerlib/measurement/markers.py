"""Markers on an accelerator stream: where the device really is, without a synchronize.

A hook on the training thread runs ahead of the GPU. Recording a CUDA event on the current
stream costs a few microseconds and never blocks; another thread waits for it and so learns
when the device reached that point: :mod:`powerlib.measurement.measure` stamps step boundaries
this way, and the frequency controller holds a clock change until the stream reaches the
instruction it is for (docs/measurement.md).
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
        """Enqueue a marker on the current stream; must not block."""
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


def cuda_marker(align: str) -> StreamMarker | None:
    """CUDA events for ``align`` (``cuda``, ``host``, ``auto``: when CUDA is initialised).

    Never imports torch for ``auto``: a CPU job does not have it.

    Raises:
        InvalidArgumentError: ``align="cuda"`` and torch sees no GPU.
    """
    if align == "host":
        return None
    torch = sys.modules.get("torch")  # never import torch for this: a CPU job does not have it
    if align == "cuda":
        if torch is None:
            import torch  # noqa: PLC0415
        if not torch.cuda.is_available():
            raise InvalidArgumentError("align='cuda' needs CUDA, and torch sees no GPU")
        return _CudaMarker(torch)
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return _CudaMarker(torch)
    return None


class Stamps:
    """Times of points in the training loop: the host clock now, or when the stream got there.

    :meth:`stamp` returns a one-element list (a cell) that holds the time: at once with no
    marker; with one, a waiter thread fills it when the device reaches the marker recorded at
    the call (``nan`` until then). The training thread only records the marker.

    Args:
        clock: Time source in seconds.
        marker: Stream markers (:func:`cuda_marker`), or ``None`` for the host clock.
    """

    def __init__(self, clock: Any, marker: StreamMarker | None = None) -> None:
        self._clock = clock
        self._marker = marker
        self._queue: queue.SimpleQueue[tuple[list[float], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if marker is not None:
            self._thread = threading.Thread(target=self._wait, name="powerlib-stamps", daemon=True)
            self._thread.start()

    def stamp(self) -> list[float]:
        """A cell with the time of this point (``nan`` until the device reaches it)."""
        if self._marker is None:
            return [self._clock()]
        cell = [math.nan]
        self._queue.put((cell, self._marker.record()))
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
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
