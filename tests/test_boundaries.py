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


# The design's layering (docs/architecture.md §1): what each part may not import. Lazy imports
# inside functions and imports under TYPE_CHECKING count: a cycle of types is still a cycle.
_APPS = ("powerlib.cli", "powerlib.integrations", "powerlib.kareus")
_FOUNDATION = (
    "powerlib/errors.py", "powerlib/config.py", "powerlib/units.py", "powerlib/inputs.py",
    "powerlib/progress.py", "powerlib/gpu_specs.py", "powerlib/_version.py",
)  # fmt: skip
_HAL = (
    "powerlib/device.py",
    "powerlib/backend.py",
    "powerlib/registry.py",
    "powerlib/inspection.py",
    "powerlib/privilege.py",
)
_ABOVE_HAL = (
    "powerlib.control", "powerlib.runtime", "powerlib.planning", "powerlib.measurement",
    "powerlib.profiling", "powerlib.emulator", "powerlib.agent", *_APPS,
)  # fmt: skip
LAYER_RULES: dict[str, tuple[str, ...]] = {
    **{
        leaf: (
            "powerlib.device", "powerlib.backend", "powerlib.registry", "powerlib.inspection",
            "powerlib.privilege", *_ABOVE_HAL,
        )
        for leaf in _FOUNDATION
    },
    **{hal: _ABOVE_HAL for hal in _HAL},
    "powerlib/control": (
        "powerlib.runtime", "powerlib.planning", "powerlib.measurement", "powerlib.profiling",
        "powerlib.emulator", "powerlib.agent", *_APPS,
    ),
    "powerlib/planning": (  # pure: no device, no environment (config), no runtime
        "powerlib.runtime", "powerlib.profiling", "powerlib.control", "powerlib.measurement",
        "powerlib.emulator", "powerlib.agent", "powerlib.registry", "powerlib.device",
        "powerlib.backend", "powerlib.inspection", "powerlib.privilege", "powerlib.config",
        *_APPS,
    ),
    "powerlib/measurement": (
        "powerlib.runtime", "powerlib.profiling", "powerlib.emulator", "powerlib.agent", *_APPS,
    ),
    "powerlib/profiling": ("powerlib.runtime", "powerlib.emulator", "powerlib.agent", *_APPS),
    "powerlib/runtime": ("powerlib.emulator", "powerlib.agent", *_APPS),
    "powerlib/emulator": ("powerlib.agent", *_APPS),
    "powerlib/agent": (
        "powerlib.runtime", "powerlib.planning", "powerlib.measurement", "powerlib.profiling",
        "powerlib.emulator", *_APPS,
    ),
    "powerlib/testing": ("powerlib.runtime", "powerlib.planning", *_APPS),
    "powerlib/kareus": ("powerlib.cli", "powerlib.agent"),
    # The agent backend is the agent's client: it may use the client and the wire protocol,
    # never the daemon's modules.
    "backends": (
        "powerlib.planning", "powerlib.runtime", "powerlib.measurement", "powerlib.control",
        "powerlib.profiling", "powerlib.emulator", *_APPS,
        *(f"powerlib.agent.{m}" for m in (
            "transport", "leases", "listener", "authz", "kubernetes", "node", "peer", "logs",
        )),
    ),
    "integrations": ("powerlib.cli", "powerlib.kareus", "powerlib.emulator"),
}  # fmt: skip


def layer_violations(root: Path = ROOT) -> list[str]:
    """Every ``file imports name`` that breaks :data:`LAYER_RULES`."""
    found = []
    for part, forbidden in LAYER_RULES.items():
        where = root / part
        if not where.exists():
            continue  # test_every_layer_rule_names_a_real_part keeps the rules honest
        paths = [where] if where.suffix == ".py" else sorted(where.rglob("*.py"))
        for path in paths:
            for name in sorted(_all_imports(path, root)):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_every_layer_rule_names_a_real_part() -> None:
    """A renamed module or folder must not silently drop its rule."""
    assert [part for part in LAYER_RULES if not (ROOT / part).exists()] == []


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
    """Foundation < HAL < control < planning/measurement < runtime < apps (docs/architecture.md
    §1): the control plane imports no runtime, planning or measurement; planning is pure;
    nothing imports the CLI or an integration; the core never imports Kareus."""
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


def test_the_layer_check_sees_lazy_imports(tmp_path: Path) -> None:
    (tmp_path / "powerlib" / "planning").mkdir(parents=True)
    (tmp_path / "powerlib" / "control").mkdir(parents=True)
    (tmp_path / "backends").mkdir()
    (tmp_path / "powerlib" / "planning" / "bad.py").write_text(
        "def f():\n    from powerlib.runtime.session import Session\n"
    )
    (tmp_path / "powerlib" / "control" / "ok.py").write_text("import powerlib.runtimex\n")
    (tmp_path / "powerlib" / "control" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from powerlib.measurement import measure\n"
    )
    (tmp_path / "powerlib" / "errors.py").write_text("from powerlib.device import Device\n")
    (tmp_path / "powerlib" / "planning" / "facade.py").write_text("from powerlib import runtime\n")
    (tmp_path / "powerlib" / "planning" / "relative.py").write_text("from ..control import x\n")
    (tmp_path / "backends" / "bad.py").write_text("import powerlib.planning.plan\n")
    (tmp_path / "backends" / "agentish.py").write_text(
        "from powerlib.agent import protocol\nfrom powerlib.agent.leases import Leases\n"
    )
    assert layer_violations(tmp_path) == [
        "powerlib/errors.py imports powerlib.device",
        "powerlib/errors.py imports powerlib.device.Device",
        "powerlib/control/typed.py imports powerlib.measurement",
        "powerlib/control/typed.py imports powerlib.measurement.measure",
        "powerlib/planning/bad.py imports powerlib.runtime.session",
        "powerlib/planning/bad.py imports powerlib.runtime.session.Session",
        "powerlib/planning/facade.py imports powerlib.runtime",
        "powerlib/planning/relative.py imports powerlib.control",
        "powerlib/planning/relative.py imports powerlib.control.x",
        "backends/agentish.py imports powerlib.agent.leases",
        "backends/agentish.py imports powerlib.agent.leases.Leases",
        "backends/bad.py imports powerlib.planning.plan",
    ]


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
                'powerlib.agent', 'powerlib.measurement.exporter', 'powerlib.cli.devices',
                'scipy')))
print(json.dumps(loaded), file=sys.stderr)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["solver"] == "direct"
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
