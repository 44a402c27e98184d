"""``python -m powerlib``: the same as the ``powerlib`` command."""

from powerlib.cli import main

if __name__ == "__main__":
    main()
