"""mypy, as pyproject.toml configures it (strict, powerlib/ and backends/), holds in the suite.

``python3 tests/test_typing.py`` prints the same report (from the repository root or anywhere).

A bare ``python3 -m mypy`` cannot check this tree: setuptools installs ``backends/`` as
``powerlib.backends`` (``package-dir``), so mypy names those files ``backends.*`` and finds
no ``powerlib.backends`` for the imports that use the installed name. This runner takes the
sources and options mypy's command line would (pyproject.toml's ``[tool.mypy]``) and renames
``backends.*`` to ``powerlib.backends.*`` before the build, as the docs site's griffe extension
does for the API reference (docs/site_plugins.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The folders that install under another name (pyproject.toml [tool.setuptools] package-dir).
INSTALLED_AS = {"backends": "powerlib.backends", "integrations": "powerlib.integrations"}


def _installed_name(module: str) -> str:
    top, dot, rest = module.partition(".")
    return INSTALLED_AS[top] + dot + rest if top in INSTALLED_AS else module


def mypy_sources(args: list[str]) -> tuple[list[Any], Any]:
    """The build sources and options of ``mypy ARGS`` run from the root, under installed names."""
    from mypy.fscache import FileSystemCache
    from mypy.main import process_options
    from mypy.modulefinder import BuildSource

    fscache = FileSystemCache()
    sources, options = process_options(args, fscache=fscache)
    renamed = [BuildSource(s.path, _installed_name(s.module), s.text, s.base_dir) for s in sources]
    # A run over some files only still needs backends/ under its installed name: mypy finds
    # no powerlib/backends folder to follow an import into (and would cache that miss).
    named = {s.module for s in renamed}
    for path in sorted((ROOT / "backends").glob("*.py")):
        module = "powerlib.backends" + ("" if path.stem == "__init__" else f".{path.stem}")
        if module not in named:
            renamed.append(BuildSource(str(path.relative_to(ROOT)), module, None, str(ROOT)))
    return renamed, options


def run_mypy(args: list[str]) -> list[str]:
    """mypy's messages for the configured files (errors and notes, one per line)."""
    from mypy import build
    from mypy.errors import CompileError

    os.chdir(ROOT)  # pyproject.toml's `files` are relative to the working directory
    sources, options = mypy_sources(args)
    try:
        return list(build.build(sources, options).errors)
    except CompileError as err:  # a blocking error (a syntax error, a module found twice)
        return list(err.messages)


def main() -> int:
    messages = run_mypy(sys.argv[1:])
    errors = [m for m in messages if ": error:" in m]
    print("\n".join(messages))
    files = {m.split(":", 1)[0] for m in errors}
    print(
        f"Found {len(errors)} errors in {len(files)} files"
        if errors
        else "Success: no issues found (mypy as configured in pyproject.toml)"
    )
    return 1 if errors else 0


# What mypy reports depends on these packages' own annotations: the verdict is held on the
# tested set (constraints/tested.txt); .ci/oldest and .ci/newest install others.
TYPES_FROM = ("mypy", "numpy", "click", "torch")


def untested_versions(names: tuple[str, ...] = TYPES_FROM) -> list[str]:
    """``name installed (tested X)`` for each of ``names`` not at its tested version."""
    from importlib import metadata

    from packaging.markers import Marker
    from packaging.utils import canonicalize_name

    tested = {}
    for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines():
        pin, _, marker = line.split("#", 1)[0].partition(";")
        if "==" in pin and not (marker.strip() and not Marker(marker.strip()).evaluate()):
            name, version = pin.split("==", 1)
            tested[canonicalize_name(name.strip())] = version.strip()
    found = []
    for name in names:
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        want = tested.get(canonicalize_name(name))
        if want not in (installed, installed.split("+")[0]):
            found.append(f"{name} {installed} (tested {want})")
    return found


def test_mypy_passes_as_configured() -> None:
    """``strict = true`` is a rule a test holds, not a sentence (issue 43): every error fails."""
    pytest.importorskip("mypy", reason="mypy is in the test extra")
    if untested := untested_versions():
        pytest.skip(f"types are checked on the tested set; here {', '.join(untested)}")
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]


def _mypy_config() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_mypy_covers_what_the_docs_claim() -> None:
    """Strict over the core and every backend (docs/development.md): no part left out, no
    first-party module relaxed, only untyped third-party modules let through."""
    config = _mypy_config()
    assert config["strict"] is True
    assert sorted(config["files"]) == ["backends", "powerlib"]
    assert "exclude" not in config
    for override in config.get("overrides", []):
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        first_party = [m for m in modules if m.split(".")[0] in ("powerlib", *INSTALLED_AS)]
        assert first_party == [], "an override relaxes powerlib's own modules"
        assert set(override) == {"module", "ignore_missing_imports"}, override


def test_mypy_sees_every_module_under_its_installed_name() -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra")
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        sources, _ = mypy_sources([])
    finally:
        os.chdir(cwd)
    checked = {Path(s.path).resolve().relative_to(ROOT).as_posix(): s.module for s in sources}
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for folder in ("powerlib", "backends")
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sorted(on_disk - set(checked)) == []
    assert checked["backends/sysfs.py"] == "powerlib.backends.sysfs"
    assert checked["powerlib/device.py"] == "powerlib.device"


_IGNORE = re.compile(r"#\s*type:\s*ignore(?!\[)")


def test_every_type_ignore_names_its_error_code() -> None:
    """An ignore says which error it silences (strict's warn_unused_ignores drops stale ones)."""
    bare = [
        f"{p.relative_to(ROOT)}:{n}"
        for folder in ("powerlib", "backends")
        for p in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if _IGNORE.search(line)
    ]
    assert bare == []


if __name__ == "__main__":
    sys.exit(main())
