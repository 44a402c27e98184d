"""``python -m powerlib.cli``."""

from __future__ import annotations

from powerlib.cli import main

main()
