"""powerlib's version: one source, read by the package metadata and by every report.

A leaf of its own so that what reports the version (``powerlib env``, ``powerlib check``, the
CLI's ``--version``) does not import the package's public surface, which loads the runtime.
"""

__version__ = "0.1.0"
