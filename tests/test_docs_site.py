"""The documentation site (mkdocs.yml, docs/) builds with no warning: ``mkdocs build --strict``.

Runs where the ``docs`` extra is installed (``.ci/run`` installs it) and skips elsewhere. The
build is a subprocess: MkDocs imports the CLI (mkdocs-click) and reads the docstrings (mkdocstrings)
itself, so a broken reference, a link to a missing page or anchor, a page left out of the
navigation or a docstring griffe cannot parse fails here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="needs the docs extra: pip install -c constraints/tested.txt -e '.[docs]'",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    problems = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.startswith(("WARNING", "ERROR"))
    ]
    assert problems == []
    return out


def test_the_site_builds_strict_with_every_page(site: Path) -> None:
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    built = {p.stem if p.name != "index.html" else p.parent.name for p in site.rglob("*.html")}
    assert "index" in pages and (site / "index.html").is_file()
    assert [p for p in pages if p != "index" and p not in built] == []


def test_the_cli_reference_is_generated_from_every_command(site: Path) -> None:
    import click

    from powerlib.cli import cli

    html = (site / "cli" / "index.html").read_text(encoding="utf-8")
    ctx = click.Context(cli, info_name="powerlib")
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None
        if command.hidden:
            continue
        assert f'id="powerlib-{name}"' in html, f"the CLI reference lacks powerlib {name}"
        for option in command.params:
            if isinstance(option, click.Option) and not option.hidden:
                assert option.opts[0] in html, f"the CLI reference lacks {name} {option.opts[0]}"
    assert "\\b" not in html  # click's no-rewrap marker is shown as a code block, not as text


def test_the_api_reference_renders_the_docstrings(site: Path) -> None:
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in (
        "powerlib.open_backend",
        "powerlib.control.ControlSession",
        "powerlib.runtime.session.Session",
        "powerlib.measure_api.measure.measure",
        "powerlib.planning.workflow.plan_profile",
        # backends/ and integrations/ install as powerlib.*: docs/site_plugins.py maps them
        "powerlib.integrations.torch_distributed.attach_pipeline",
        "powerlib.integrations.megatron.patch_training",
    ):
        assert f'id="{name}"' in html, f"the API page lacks {name}"
    # a docstring's Args section became a parameter table
    assert "num_stages" in html and "Parameters:" in html
