"""Import hygiene and layering: powerlib works with every vendor library and framework blocked."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "pynvml", "amdsmi", "megatron", "deepspeed")

_BLOCKER = f"""
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked for the boundary test: ' + name)
        return None
sys.meta_path.insert(0, _Block())
"""


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", _BLOCKER + code],
        capture_output=True,
        text=True,
        cwd=ROOT.parent,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_powerlib_works_with_vendor_libraries_and_frameworks_blocked(tmp_path: Path) -> None:
    code = f"""
import json, sys
import powerlib, powerlib.cli, powerlib.registry
import powerlib.backends.simulated, powerlib.backends.sysfs, powerlib.backends.nvidia, powerlib.backends.amd
import powerlib.integrations
from powerlib import Settings, open_backend, probe_backends
s = Settings(backend="simulated", state_dir=__import__("pathlib").Path({str(tmp_path)!r}))
with open_backend(settings=s) as b:
    states = [d.read_state() for d in b.devices()]
probes = {{p.backend: p.reason for p in probe_backends(s)}}
print(json.dumps({{"n": len(states), "probes": probes,
                   "loaded": sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r})}}))
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    data = json.loads(proc.stdout)
    assert data["n"] == 4 and data["loaded"] == []
    assert "not installed" in data["probes"]["nvidia"] and "not installed" in data["probes"]["amd"]


def test_cli_json_stays_clean_with_everything_blocked(tmp_path: Path) -> None:
    code = "import sys\nfrom powerlib.cli import main\nmain(['devices', '--json'])"
    proc = _run(code, {"POWERLIB_BACKEND": "simulated", "POWERLIB_STATE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["backend"] == "simulated"
    proc = _run(code, {"POWERLIB_BACKEND": "nvidia", "POWERLIB_STATE_DIR": str(tmp_path)})
    assert proc.returncode == 3 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body:  # module level only: lazy imports inside functions are the point
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_a_vendor_library_or_framework_at_module_level() -> None:
    for folder in ("powerlib", "backends", "integrations"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = _top_level_imports(path) & set(BLOCKED)
            assert not bad, f"{path.relative_to(ROOT)} imports {bad} at module level"


def _module_of(path: Path, root: Path = ROOT) -> list[str]:
    """The dotted name of ``path`` as installed (backends/ and integrations/ under powerlib)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in ("backends", "integrations"):
        parts.insert(0, "powerlib")
    return parts[:-1] if parts[-1] == "__init__" else parts


def _all_imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module (and ``module.name``) ``path`` imports, anywhere in it.

    Relative imports are resolved; ``from pkg import name`` counts as ``pkg`` and ``pkg.name``,
    so ``from powerlib import runtime`` is seen as importing ``powerlib.runtime``.
    """
    names: set[str] = set()
    package = _module_of(path, root)
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_backends_and_core_keep_their_layers() -> None:
    """Backends never import each other or integrations; core never imports a backend."""
    public = {"nvidia", "amd", "sysfs", "simulated"}
    for path in (ROOT / "backends").glob("*.py"):
        for name in _all_imports(path):
            assert not name.startswith("powerlib.integrations"), f"{path.name} imports {name}"
            if name.startswith("powerlib.backends."):
                other = name.split(".")[2]
                assert other not in public or other == path.stem, f"{path.name} imports {name}"
    for path in (ROOT / "powerlib").rglob("*.py"):
        if path.parent.name == "testing":
            continue  # the shipped test kit builds on the sysfs backend's I/O seam
        for name in _all_imports(path):
            assert not name.startswith(("powerlib.backends", "powerlib.integrations")), (
                f"{path} imports {name}"
            )


# The design's layering (docs/architecture.md §1) as allow-lists: every module belongs to one
# part, and each part names the parts it MAY import (its own always). A package nobody placed
# belongs to no part and fails, so a new package is constrained from its first commit. Lazy
# imports inside functions and imports under TYPE_CHECKING count: a cycle of types is still a
# cycle. A part is files or folders (``/``); the most specific entry places a module.
PARTS: dict[str, tuple[str, ...]] = {
    "foundation": (
        "powerlib/errors.py", "powerlib/units.py", "powerlib/inputs.py", "powerlib/progress.py",
        "powerlib/gpu_specs.py", "powerlib/_version.py",
    ),
    "config": ("powerlib/config.py",),  # foundation too, but never imported by pure planning
    "hal": (
        "powerlib/device.py", "powerlib/backend.py", "powerlib/registry.py",
        "powerlib/inspection.py", "powerlib/privilege.py",
    ),
    "backends": ("backends/",),
    "control": ("powerlib/control/",),
    "planning": ("powerlib/planning/",),
    "measurement": ("powerlib/measurement/",),  # the counter-to-energy engine
    "measure_api": ("powerlib/measure_api/",),  # powerlib.measure, powerlib measure -- CMD
    "exporter": ("powerlib/exporter/",),
    "node_check": ("powerlib/node_check/",),
    "runtime": ("powerlib/runtime/",),
    "agent_wire": ("powerlib/agent/client.py", "powerlib/agent/protocol.py"),
    "agent": ("powerlib/agent/",),  # the daemon
    "emulator": ("powerlib/emulator/",),
    "kareus": ("powerlib/kareus/",),
    "cli": ("powerlib/cli/", "powerlib/__main__.py"),
    "integrations": ("integrations/",),
    "testing": ("powerlib/testing/",),
    "api": ("powerlib/__init__.py",),  # the public surface: optimize, Session, measure, ...
}  # fmt: skip
_FOUNDATION = {"foundation", "config"}
_CORE = {*_FOUNDATION, "hal", "control", "planning", "measurement"}
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": {"config"},
    "config": {"foundation"},
    "hal": _FOUNDATION,
    # The agent backend is the agent's client: its connection and wire protocol, not the daemon.
    "backends": {*_FOUNDATION, "hal", "agent_wire"},
    "agent_wire": {*_FOUNDATION, "hal"},
    "control": {*_FOUNDATION, "hal"},
    "planning": {"foundation"},  # pure: no device, no environment (config), no runtime
    "measurement": {*_FOUNDATION, "hal"},
    "measure_api": {*_FOUNDATION, "hal", "measurement", "planning"},
    "node_check": {*_FOUNDATION, "hal", "control", "measurement"},  # it changes clocks
    "runtime": _CORE,
    "exporter": {*_FOUNDATION, "hal", "measurement", "measure_api", "runtime"},
    "agent": {*_FOUNDATION, "hal", "control", "agent_wire"},  # never runtime, planning, measurement
    "emulator": {*_CORE, "runtime"},  # it drives the runtime, never the reverse
    "kareus": {*_CORE, "runtime"},  # registers itself with the session; the core never imports it
    "integrations": {*_FOUNDATION, "api", "runtime", "measure_api"},  # thin: the public API
    "cli": set(PARTS) - {"backends", "integrations", "testing"},  # a shell over the library
    "testing": {*_FOUNDATION, "hal", "backends"},  # the sysfs fake builds on the backend's I/O seam
    "api": {*_CORE, "measure_api", "runtime"},
}  # fmt: skip

# The folders that install under another name (pyproject.toml package-dir).
_INSTALLED_AS = {"backends": "powerlib.backends", "integrations": "powerlib.integrations"}


def _part_prefix(entry: str) -> str:
    """The module name (or package prefix) a :data:`PARTS` entry stands for."""
    top, _, rest = entry.partition("/")
    dotted = ".".join(p for p in rest.removesuffix(".py").split("/") if p)
    base = _INSTALLED_AS.get(top, top)
    if dotted == "__init__":
        return base
    return f"{base}.{dotted}" if dotted else base


def part_of_file(rel: str) -> str | None:
    """The part a file (``powerlib/x/y.py``) belongs to, or None: no part names it."""
    found = [
        (len(entry), part)
        for part, entries in PARTS.items()
        for entry in entries
        if rel == entry or (entry.endswith("/") and rel.startswith(entry))
    ]
    return max(found)[1] if found else None


def part_of_module(name: str, root: Path = ROOT) -> str | None:
    """The part an imported ``powerlib`` module belongs to, or None: no part holds it.

    ``powerlib`` itself, and a name under it that is no module on disk (``from powerlib import
    Session``), is the public surface (``api``).
    """
    found = [
        (len(prefix), part)
        for part, entries in PARTS.items()
        if part != "api"
        for prefix in map(_part_prefix, entries)
        if name == prefix or name.startswith(prefix + ".")
    ]
    if found:
        return max(found)[1]
    head = name.split(".")
    if len(head) > 1 and (
        (root / "powerlib" / head[1]).is_dir() or (root / "powerlib" / f"{head[1]}.py").exists()
    ):
        return None  # a module or package no part places
    return "api"


def _is_module(name: str, root: Path) -> bool:
    top, _, rest = name.partition(".")
    parts = rest.split(".") if rest else []
    if top == "powerlib" and parts and f"powerlib.{parts[0]}" in _INSTALLED_AS.values():
        base, parts = root / parts[0], parts[1:]
    else:
        base = root / top
    path = base.joinpath(*parts)
    return path.is_dir() or path.with_suffix(".py").exists()


def _imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The ``powerlib`` modules ``path`` imports, anywhere in it (lazy and TYPE_CHECKING too).

    ``from pkg import sub`` imports the submodule ``pkg.sub`` when it is one, else ``pkg``; the
    implicit import of parent packages is not counted (a package's ``__init__`` is its surface).
    """
    found: set[str] = set()
    package = _module_of(path, root)
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if _is_module(sub, root) or module == "powerlib" else module)
    return {n for n in found if n == "powerlib" or n.startswith("powerlib.")}


def _library_files(root: Path) -> list[Path]:
    return [
        p
        for folder in ("powerlib", "backends", "integrations")
        if (root / folder).exists()
        for p in sorted((root / folder).rglob("*.py"))
        if "__pycache__" not in p.parts
    ]


def layer_violations(root: Path = ROOT) -> list[str]:
    """Every module no part places, and every import a part's :data:`MAY_IMPORT` leaves out."""
    found = []
    for path in _library_files(root):
        rel = path.relative_to(root).as_posix()
        part = part_of_file(rel)
        if part is None:
            found.append(f"{rel} belongs to no part")
            continue
        for name in sorted(_imported_modules(path, root)):
            target = part_of_module(name, root)
            if target is None:
                found.append(f"{rel} imports {name}, which belongs to no part")
            elif target != part and target not in MAY_IMPORT[part]:
                found.append(f"{rel} ({part}) imports {name} ({target})")
    return found


def test_every_part_has_its_rule_and_a_place_on_disk() -> None:
    """A renamed module or folder must not silently drop its rule."""
    assert set(MAY_IMPORT) == set(PARTS)
    assert {p for allowed in MAY_IMPORT.values() for p in allowed} <= set(PARTS)
    missing = [e for entries in PARTS.values() for e in entries if not (ROOT / e).exists()]
    assert missing == []


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Every set of modules that import each other (strongly connected, Tarjan), any import.

    Lazy imports and those under ``TYPE_CHECKING`` count. ``from pkg import sub`` is an edge to
    the submodule ``sub``; the implicit import of a module's parent packages is not an edge (a
    package's ``__init__`` is its surface: it may name its submodules).
    """
    files = {
        ".".join(_module_of(p, root)): p
        for folder in ("powerlib", "backends", "integrations")
        if (root / folder).exists()
        for p in (root / folder).rglob("*.py")
    }
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in _all_imports(path, root):
            if name in files and name != module:
                targets.add(name)
        # `from pkg import sub`: the edge goes to pkg.sub, not to pkg's __init__
        subs = {t for t in targets if t.rsplit(".", 1)[0] in targets}
        graph[module] = {t for t in targets if not any(s.startswith(t + ".") for s in subs)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_in_a_circle() -> None:
    """No import cycles, lazy and type-level ones included (journal <-> ownership and
    frontier <-> replay were; issue 35)."""
    assert import_cycles() == []


def test_the_cycle_check_sees_type_level_and_lazy_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / "powerlib" / "control"
    pkg.mkdir(parents=True)
    (tmp_path / "powerlib" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from powerlib.control.journal import Entry\n")
    (pkg / "journal.py").write_text("from powerlib.control import locks\n")
    (pkg / "locks.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .journal import Entry\n"
    )
    (pkg / "state.py").write_text("def f():\n    from powerlib.control import trust\n")
    (pkg / "trust.py").write_text("from powerlib.control.journal import Entry\n")
    assert import_cycles(tmp_path) == [
        ["powerlib.control.journal", "powerlib.control.locks"],
    ]
    (pkg / "journal.py").write_text("def g():\n    from powerlib.control.state import f\n")
    assert import_cycles(tmp_path) == [
        ["powerlib.control.journal", "powerlib.control.state", "powerlib.control.trust"],
    ]


def test_every_part_keeps_the_design_layers() -> None:
    """Foundation < HAL < control < planning/measurement < runtime < products and apps
    (docs/architecture.md §1), as allow-lists: the control plane imports no runtime, planning or
    measurement; planning is pure; nothing imports the CLI or an integration; the core never
    imports Kareus; every module belongs to a part."""
    assert layer_violations() == []


def _importers_of(prefix: str, *, allowed: tuple[str, ...]) -> list[str]:
    found = []
    for folder in ("powerlib", "backends", "integrations"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(allowed):
                continue
            found += [
                f"{rel} imports {n}"
                for n in _all_imports(path)
                if n == prefix or n.startswith(prefix + ".")
            ]
    return found


def test_nobody_imports_the_cli() -> None:
    assert _importers_of("powerlib.cli", allowed=("powerlib/cli/", "powerlib/__main__.py")) == []


def test_the_core_never_imports_kareus() -> None:
    """Kareus is one optional package that registers itself with the session (docs/kareus.md);
    only it and the CLI's `kareus` command import it."""
    assert (
        _importers_of("powerlib.kareus", allowed=("powerlib/kareus/", "powerlib/cli/kareus.py"))
        == []
    )


def test_the_layer_check_sees_lazy_imports_and_unplaced_modules(tmp_path: Path) -> None:
    files = {
        "powerlib/planning/bad.py": "def f():\n    from powerlib.runtime.session import Session\n",
        "powerlib/planning/facade.py": "from powerlib import runtime\n",
        "powerlib/planning/relative.py": "from ..control import x\n",
        "powerlib/planning/env.py": "from powerlib.config import Settings\n",
        "powerlib/planning/public.py": "from powerlib import optimize\n",
        "powerlib/planning/pure.py": "from powerlib.errors import PlanError\nimport numpy\n",
        "powerlib/control/ok.py": "from powerlib import device\nimport powerlib.config\n",
        "powerlib/control/typed.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from powerlib.measurement import measure\n"
        ),
        "powerlib/control/uses_new.py": "from powerlib.newpkg.thing import y\n",
        "powerlib/errors.py": "from powerlib.device import Device\n",
        "powerlib/newpkg/thing.py": "from powerlib.errors import PlanError\n",
        "powerlib/agent/protocol.py": "",
        "powerlib/agent/leases.py": "",
        "backends/bad.py": "import powerlib.planning.plan\n",
        "backends/agentish.py": (
            "from powerlib.agent import protocol\nfrom powerlib.agent.leases import Leases\n"
        ),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(layer_violations(tmp_path)) == sorted([
        "backends/agentish.py (backends) imports powerlib.agent.leases (agent)",
        "backends/bad.py (backends) imports powerlib.planning.plan (planning)",
        "powerlib/control/typed.py (control) imports powerlib.measurement (measurement)",
        "powerlib/control/uses_new.py imports powerlib.newpkg.thing, which belongs to no part",
        "powerlib/errors.py (foundation) imports powerlib.device (hal)",
        "powerlib/newpkg/thing.py belongs to no part",
        "powerlib/planning/bad.py (planning) imports powerlib.runtime.session (runtime)",
        "powerlib/planning/env.py (planning) imports powerlib.config (config)",
        "powerlib/planning/facade.py (planning) imports powerlib.runtime (runtime)",
        "powerlib/planning/public.py (planning) imports powerlib.optimize (api)",
        "powerlib/planning/relative.py (planning) imports powerlib.control (control)",
    ])  # fmt: skip


_LAYOUT_DOC = ROOT / "docs" / "architecture.md"


def layout_listing(text: str) -> set[str]:
    """The module paths the ``## Layout`` tree of docs/architecture.md names.

    One entry per line: two spaces of indent per level, then a name (``folder/``, ``module.py``
    or several modules separated by ``, ``), then two or more spaces and what it holds.
    """
    block = re.split(r"^## (?:\d+ )?Layout\b.*$", text, maxsplit=1, flags=re.M)[1].split("```", 2)[
        1
    ]
    listed: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        head = line.strip().split("  ", 1)[0]
        del stack[depth:]
        for name in (n.strip() for n in head.split(",")):
            if name.endswith("/"):
                stack.append(name)
            elif name.endswith((".py", ".cpp")):
                listed.add("".join(stack) + name)
    return listed


def test_the_layout_names_every_module() -> None:
    """docs/architecture.md's layout (the README links it) is the map: every module under
    powerlib/, backends/ and integrations/ is named there, and nothing that is gone."""
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for folder in ("powerlib", "backends", "integrations")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts
    }
    listed = layout_listing(_LAYOUT_DOC.read_text())
    assert sorted(on_disk - listed) == [], "modules the layout does not name"
    assert sorted(listed - on_disk) == [], "the layout names modules that do not exist"
    readme = (ROOT / "README.md").read_text()
    assert "docs/architecture.md" in readme


def test_the_layout_parser_reads_nesting() -> None:
    text = "## 8 Layout\n```\npowerlib/   core\n  a.py, b.py   two\n  sub/   x\n    c.py  y\n  d.py  z\nbackends/\n  e.py  w\n```\n"
    assert layout_listing(text) == {
        "powerlib/a.py", "powerlib/b.py", "powerlib/sub/c.py", "powerlib/d.py", "backends/e.py",
    }  # fmt: skip


def test_version_has_one_source() -> None:
    import powerlib

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert (
        'dynamic = ["version"]' in pyproject
        and 'attr = "powerlib._version.__version__"' in pyproject
    )
    assert f'version = "{powerlib.__version__}"' not in pyproject
    assert (ROOT / "powerlib" / "py.typed").exists()


def test_the_wheel_lists_every_package() -> None:
    """setuptools installs only the packages pyproject.toml lists: a folder left out is missing
    from a non-editable install (powerlib.cli was, so the `powerlib` command failed there)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    names = {"backends": "powerlib.backends", "integrations": "powerlib.integrations"}
    found = set()
    for init in sorted((*ROOT.glob("powerlib/**/__init__.py"), *ROOT.glob("*/__init__.py"))):
        rel = init.parent.relative_to(ROOT).parts
        if rel[0] in names:
            found.add(".".join((names[rel[0]], *rel[1:])))
        elif rel[0] == "powerlib":
            found.add(".".join(rel))
    assert found - listed == set()


def test_powerlib_plan_loads_no_control_plane_and_no_scipy(tmp_path: Path) -> None:
    """The planner's whole-process time (issue 34): `powerlib plan` imports only what it uses."""
    from powerlib.planning.perseus import mincost

    if not mincost.available():
        pytest.skip("the compiled flow solver is not built (the walk's max flow uses scipy)")
    profile = Path(__file__).parent / "data" / "lowtime_frontiers" / "profiles"
    profile = profile / "profile_gpt3-175b_a100_sxm.csv"
    code = f"""
import json, sys
from powerlib.cli import main
try:
    main(['plan', {str(profile)!r}, '--stages', '8', '--microbatches', '4', '--p-block-w',
          '83.64', '--unit-time-s', '0.001', '--json'])
except SystemExit:
    pass
loaded = sorted(m for m in sys.modules if m.startswith(('powerlib.control',
                'powerlib.agent', 'powerlib.exporter', 'powerlib.cli.devices',
                'scipy')))
print(json.dumps(loaded), file=sys.stderr)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["solver"] == "direct"
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
