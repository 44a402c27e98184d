"""The one progress channel: ``powerlib: ...`` lines on stderr, when enabled.

The session (rank 0 by default), the planning step and the demo report what they do through a
:class:`Progress`; nothing else in the library prints.
"""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """Writes ``powerlib: <message>`` lines to stderr while :attr:`enabled`.

    Args:
        enabled: Whether :meth:`say` prints anything.
    """

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def say(self, message: str) -> None:
        """Print one progress line (flushed at once, so it interleaves with the job's output)."""
        if self.enabled:
            print(f"powerlib: {message}", file=sys.stderr, flush=True)
