"""Record the amdsmi Python API snapshot that ``test_amd.py`` checks the backend and fake against.

The real ``amdsmi`` module cannot be imported without ``libamd_smi.so``, so the API is read from the
wrapper's source with :mod:`ast` instead: every top-level ``def amdsmi_*`` in
``amdsmi_interface.py`` (parameter names, in order), the exception classes of
``amdsmi_exception.py`` (their ``__init__`` parameters), the members of the enums the backend uses
(values resolved from ``amdsmi_wrapper.py``), the ``AMDSMI_STATUS_*`` codes, and the wrapper version.

Refresh it when bumping the supported ROCm release::

    pip download --no-deps amdsmi==<version> -d /tmp/amdsmi_whl
    cd /tmp/amdsmi_whl && mkdir -p x && unzip -o -q amdsmi-*.whl -d x
    python tests/backends/record_amdsmi_snapshot.py /tmp/amdsmi_whl/x/amdsmi

(or point it at ``/opt/rocm/share/amd_smi/amdsmi`` on a ROCm node), then run
``pytest tests/backends/test_amd.py`` and review the diff of ``amdsmi_api_snapshot.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("amdsmi_api_snapshot.json")
ENUMS = (
    "AmdSmiInitFlags",
    "AmdSmiClkType",
    "AmdSmiDevPerfLevel",
    "AmdSmiTemperatureType",
    "AmdSmiTemperatureMetric",
)


def _params(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg is not None:
        names.append("*" + args.vararg.arg)
    names.extend(a.arg for a in args.kwonlyargs)
    if args.kwarg is not None:
        names.append("**" + args.kwarg.arg)
    return names


def _wrapper_constants(tree: ast.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int)
        ):
            out[node.targets[0].id] = node.value.value
    return out


def _enum_members(cls: ast.ClassDef, constants: dict[str, int]) -> dict[str, int]:
    members: dict[str, int] = {}
    for node in cls.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        value = node.value
        if isinstance(value, ast.Attribute) and value.attr in constants:
            members[node.targets[0].id] = constants[value.attr]
        elif isinstance(value, ast.Constant) and isinstance(value.value, int):
            members[node.targets[0].id] = value.value
    return members


def record(package: Path) -> dict[str, object]:
    """Build the snapshot from an unpacked ``amdsmi`` package directory."""
    interface = ast.parse((package / "amdsmi_interface.py").read_text())
    exceptions = ast.parse((package / "amdsmi_exception.py").read_text())
    wrapper = ast.parse((package / "amdsmi_wrapper.py").read_text())
    constants = _wrapper_constants(wrapper)
    version_text = (package / "_version.py").read_text()
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", version_text)
    functions = {
        node.name: _params(node)
        for node in interface.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("amdsmi_")
    }
    classes = {node.name: node for node in interface.body if isinstance(node, ast.ClassDef)}
    exception_inits: dict[str, list[str] | None] = {}
    for node in exceptions.body:
        if isinstance(node, ast.ClassDef):
            init = next(
                (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"),
                None,
            )
            exception_inits[node.name] = None if init is None else _params(init)[1:]
    return {
        "wrapper_version": match[1] if match else None,
        "source": "amdsmi wheel: amdsmi_interface.py, amdsmi_exception.py, amdsmi_wrapper.py",
        "functions": dict(sorted(functions.items())),
        "exceptions": exception_inits,
        "enums": {name: _enum_members(classes[name], constants) for name in ENUMS},
        "status_codes": {
            name.removeprefix("AMDSMI_STATUS_"): value
            for name, value in sorted(constants.items(), key=lambda kv: kv[1])
            if name.startswith("AMDSMI_STATUS_")
        },
    }


def main() -> None:
    """Write the snapshot next to this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path, help="directory of the unpacked amdsmi package")
    args = parser.parse_args()
    SNAPSHOT.write_text(json.dumps(record(args.package), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    main()
