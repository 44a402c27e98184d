"""Process-wide safety nets of the control sessions: atexit and SIGTERM/SIGHUP restore.

Every open :class:`~powerlib.control.session.ControlSession` is registered here
(:func:`register`); at interpreter exit, and on SIGTERM or SIGHUP, each is closed (its devices
restored) newest first. The signal handlers chain to those the host program installed and are
removed again once no session is open (docs/real-gpu.md §6).
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from types import FrameType
from typing import Any, Protocol

__all__ = ["register", "unregister"]

logger = logging.getLogger(__name__)

_HANDLED_SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None
)


class _Closable(Protocol):
    def close(self) -> Any: ...


_ACTIVE: list[_Closable] = []
_ACTIVE_GUARD = threading.RLock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_ATEXIT_REGISTERED = False


def _restore_all(reason: str) -> None:
    with _ACTIVE_GUARD:
        sessions = list(_ACTIVE)
    for session in reversed(sessions):
        logger.info("restoring devices: %s", reason)
        session.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)  # read first: closing unregisters
    _restore_all(f"signal {signal.Signals(signum).name}")
    if callable(previous):
        previous(signum, frame)  # the host program's handler decides what happens next
        return
    raise SystemExit(128 + signum)  # the default action terminates; let finally blocks run


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_restore_all, "interpreter exit")
        _ATEXIT_REGISTERED = True


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not in the main thread: signal handlers not installed (atexit still is)")
        return
    for signum in _HANDLED_SIGNALS:
        current = signal.getsignal(signum)
        if current is _on_signal or current is signal.SIG_IGN:
            continue  # already ours, or the host ignores it: then so do we
        _PREVIOUS_HANDLERS[signum] = current
        signal.signal(signum, _on_signal)


def _remove_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_PREVIOUS_HANDLERS.items()):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _PREVIOUS_HANDLERS[signum]


def register(session: _Closable, *, handle_signals: bool) -> None:
    """Close ``session`` at interpreter exit (and on SIGTERM/SIGHUP with ``handle_signals``)."""
    with _ACTIVE_GUARD:
        _ACTIVE.append(session)
        _register_atexit()
        if handle_signals:
            _install_signal_handlers()


def unregister(session: _Closable) -> None:
    """Forget ``session``; the signal handlers go when the last session does."""
    with _ACTIVE_GUARD:
        if session in _ACTIVE:
            _ACTIVE.remove(session)
        if not _ACTIVE:
            _remove_signal_handlers()
