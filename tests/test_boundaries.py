"""Import hygiene and layering: powerlib works with every vendor library and framework blocked."""

from __future__ import annotations

import ast
import json
import os
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


def _all_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
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


# The design's layering: what each layer may not import (lazy imports inside functions count).
LAYER_RULES = {
    "powerlib/planning": ("powerlib.runtime", "powerlib.profiling", "powerlib.control"),
    "powerlib/runtime": ("powerlib.emulator",),
    "backends": ("powerlib.planning",),
}


def layer_violations(root: Path = ROOT) -> list[str]:
    """Every ``file imports name`` that breaks :data:`LAYER_RULES`."""
    found = []
    for folder, forbidden in LAYER_RULES.items():
        for path in sorted((root / folder).rglob("*.py")):
            for name in sorted(_all_imports(path)):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_planning_runtime_and_backends_keep_the_design_layers() -> None:
    """Planning is pure (no runtime, profiling or control); runtime never imports the emulator
    (the emulator drives the runtime, not the reverse); backends know nothing of planning."""
    assert layer_violations() == []


def test_the_layer_check_sees_lazy_imports(tmp_path: Path) -> None:
    (tmp_path / "powerlib" / "planning").mkdir(parents=True)
    (tmp_path / "powerlib" / "runtime").mkdir(parents=True)
    (tmp_path / "backends").mkdir()
    (tmp_path / "powerlib" / "planning" / "bad.py").write_text(
        "def f():\n    from powerlib.runtime.session import Session\n"
    )
    (tmp_path / "powerlib" / "runtime" / "ok.py").write_text("import powerlib.emulatorx\n")
    (tmp_path / "backends" / "bad.py").write_text("import powerlib.planning.plan\n")
    assert layer_violations(tmp_path) == [
        "powerlib/planning/bad.py imports powerlib.runtime.session",
        "backends/bad.py imports powerlib.planning.plan",
    ]


def test_version_has_one_source() -> None:
    import powerlib

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "powerlib.__version__"' in pyproject
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
                'powerlib.agent', 'powerlib.exporter', 'powerlib.cli.devices', 'scipy')))
print(json.dumps(loaded), file=sys.stderr)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["solver"] == "direct"
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
