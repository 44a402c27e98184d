r"""Two small additions for the documentation site (mkdocs.yml); not part of the package.

- :class:`PowerlibLayout`, a griffe extension: pyproject.toml installs the folders ``backends/``
  and ``integrations/`` as ``powerlib.backends`` and ``powerlib.integrations``. griffe reads
  source statically and finds ``powerlib`` in ``powerlib/`` only, so the API page could not name
  an integration; the extension loads the two folders as members of the package.
- :func:`on_page_content`, an MkDocs hook: click's ``\b`` marks a paragraph of a command's help
  that must not be rewrapped (its examples); mkdocs-click passes the marker through as text, and
  the hook shows such a paragraph as a code block, as ``--help`` lays it out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_VERBATIM = re.compile(r"<p>\\b\n(.*?)</p>", re.DOTALL)


class PowerlibLayout(griffe.Extension):
    """Attach ``backends/`` and ``integrations/`` to the ``powerlib`` package griffe loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Load each folder as the submodule of the same name (griffe's own module loader)."""
        if pkg.name != "powerlib" or pkg.filepath is None or isinstance(pkg.filepath, list):
            return
        root = Path(pkg.filepath).parent.parent
        for name in ("backends", "integrations"):
            if name not in pkg.members and (root / name / "__init__.py").is_file():
                module = loader._load_module(name, root / name / "__init__.py", parent=pkg)
                pkg.set_member(name, module)


def on_page_content(html: str, **kwargs: Any) -> str:
    r"""Show click's ``\b`` paragraphs (a command's examples) verbatim, as ``--help`` does."""
    return _VERBATIM.sub(lambda m: f"<pre><code>{m.group(1)}</code></pre>", html)
