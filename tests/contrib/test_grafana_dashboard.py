"""contrib/grafana: the dashboard's queries name only metrics the exporter serves, and a real
Prometheus that scrapes ``powerlib exporter`` and a training process answers every one of them."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from powerlib.backends.simulated import SimulatedBackend  # noqa: E402
from powerlib.config import Settings  # noqa: E402
from powerlib.exporter import Exporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "contrib" / "grafana"
DASHBOARD = GRAFANA / "powerlib-dashboard.json"
JOB = Path(__file__).with_name("grafana_job.py")

# -- the dashboard ---------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too; rows themselves left out."""
    out = []
    for p in dash["panels"]:
        out.extend(_panels(p) if p.get("type") == "row" else [p])
    return out


def _targets(dash: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in _panels(dash) for t in p.get("targets", [])]


def _variable_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, query)`` of every query variable (Grafana stores a string or an object)."""
    out = []
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((v["name"], q["query"] if isinstance(q, dict) else q))
    return out


def _walk(node: Any) -> Iterator[Any]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from _walk(child)


# -- PromQL: the metric names an expression selects ------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*\x00(\d+)\x00")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_MODIFIER = re.compile(r"\b(?:offset\s+-?[\w$]+|@\s*(?:[\d.]+|start\(\)|end\(\)))")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
    "group_right", "offset", "inf", "nan",
}  # fmt: skip
_PLAIN = re.compile(r"[A-Za-z_:][\w:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: bare names and ``__name__`` matchers.

    String literals are set aside first (a label value may hold anything), label matchers,
    ranges, groupings (``by (x)``, ``on (x)``) and modifiers removed; what is left is function
    and aggregation names (followed by ``(``), keywords, numbers and metric names.

    Raises:
        ValueError: A ``__name__`` matcher that is not a name or a ``|`` list of names.
    """
    strings: list[str] = []

    def keep(m: re.Match[str]) -> str:
        strings.append(m.group(0)[1:-1])
        return f"\x00{len(strings) - 1}\x00"

    text = _STRING.sub(keep, expr)
    names: set[str] = set()
    for block in _BRACES.findall(text):
        for label, op, idx in _MATCHER.findall(block):
            if label != "__name__":
                continue
            alternatives = strings[int(idx)].split("|") if op == "=~" else [strings[int(idx)]]
            if op not in ("=", "=~") or not all(_PLAIN.fullmatch(a) for a in alternatives):
                raise ValueError(f"cannot tell the metrics of {label}{op}: {expr}")
            names.update(alternatives)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _MODIFIER.sub(" ", text)
    for name, call in _IDENT.findall(text):
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('powerlib_device_power_watts{gpu=~"$gpu"}', {"powerlib_device_power_watts"}),
        (
            'sum by (Hostname, gpu) (rate(a_total{x="}{ b_total [5m]"}[$__rate_interval]))'
            " / on (Hostname) group_left (gpu) b offset 5m",
            {"a_total", "b"},
        ),
        ("max without(verdict)(c:rule) > 0.5 and bool d @ start()", {"c:rule", "d"}),
        ('{__name__=~"e|f_total", Hostname=~".*"} * 1e3', {"e", "f_total"}),
        ("histogram_quantile(0.9, sum(rate(g_bucket[1m])) by (le))", {"g_bucket"}),
    ],
)
def test_the_promql_name_parser(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_a_name_regex_the_parser_cannot_read_is_refused() -> None:
    with pytest.raises(ValueError, match="__name__=~"):
        promql_metric_names('{__name__=~"powerlib_.*"}')


def _served_metric_names(settings: Settings) -> set[str]:
    """The sample names one scrape of a live Exporter (simulated GPUs, sessions on) can hold.

    Every family is rendered, with or without samples (its HELP and TYPE lines), so a family
    whose samples need a running session or a clock lock is counted too.
    """
    backend = SimulatedBackend(Settings(state_dir=settings.state_dir, sim_gpus=2))
    with Exporter(backend=backend, port=None, interval_s=3600) as exp:
        text = exp.render().decode()
    suffixes = {"gauge": [""], "counter": ["_total"], "summary": ["", "_sum", "_count"]}
    served = set()
    for fam in text_string_to_metric_families(text):
        assert fam.type in suffixes, (fam.name, fam.type)
        served.update(fam.name + s for s in suffixes[fam.type])
    return served


def test_every_query_names_only_metrics_the_exporter_serves(settings: Settings) -> None:
    served = _served_metric_names(settings)
    assert {"powerlib_device_power_watts", "powerlib_session_measured_saving_ratio"} <= served
    dash = _dashboard()
    used: set[str] = set()
    queries = [(title, t["expr"]) for title, t in _targets(dash)]
    queries += [(f"variable {n}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q))
                for n, q in _variable_queries(dash)]  # fmt: skip
    assert len(queries) >= 12
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= served, f"{where}: {sorted(names - served)} not served ({expr!r})"
        used |= names
    # the panels the dashboard promises: power, energy, clocks, per-job energy and steps, saving
    for name in (
        "powerlib_device_power_watts",
        "powerlib_device_energy_joules_total",
        "powerlib_device_sm_clock_hertz",
        "powerlib_device_power_limit_watts",
        "powerlib_session_energy_joules_total",
        "powerlib_session_steps_total",
        "powerlib_session_measured_saving_ratio",
    ):
        assert name in used, name


def test_the_dashboard_picks_its_datasource_through_a_variable() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] >= 38  # Grafana 10
    (ds_var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["query"] == "prometheus"
    refs = [n for n in _walk(dash) if isinstance(n, dict) and n.get("type") == "prometheus"]
    assert refs and all(r.get("uid") == f"${{{ds_var['name']}}}" for r in refs), refs
    panels = _panels(dash)
    assert all(p.get("datasource", {}).get("type") == "prometheus" for p in panels)
    ids = [p["id"] for p in _walk(dash["panels"]) if isinstance(p, dict) and "gridPos" in p]
    assert len(ids) == len(set(ids))
    for title, t in _targets(dash):
        assert t["refId"] and t["expr"].strip(), title


def test_the_provisioning_files_agree_with_the_dashboard_and_the_scrape_config() -> None:
    yaml = pytest.importorskip("yaml")
    scrape = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in scrape["scrape_configs"]}
    targets = [t for c in jobs["powerlib"]["static_configs"] for t in c["targets"]]
    assert targets and all(t.endswith(":9464") for t in targets)  # powerlib exporter --port 9464
    (source,) = yaml.safe_load((GRAFANA / "provisioning/datasources/powerlib.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    # $__rate_interval is built on the datasource's scrape interval: it must be Prometheus's
    assert source["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/powerlib.yaml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"]
    readme = (GRAFANA / "README.md").read_text()
    assert "powerlib exporter --port 9464" in readme and DASHBOARD.name in readme


# -- a real Prometheus -----------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_S = 1
# Grafana's variables, as a 1 s scrape and a test of a few seconds make them: $__rate_interval
# is max($__interval + scrape interval, 4 x scrape interval); every Hostname and GPU selected.
VARIABLES = {
    "Hostname": ".*",
    "gpu": ".*",
    "__rate_interval": f"{4 * SCRAPE_S}s",
    "__interval": f"{SCRAPE_S}s",
    "__range": "1m",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced; an unknown variable fails the test."""

    def value(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        assert name in VARIABLES, f"unknown dashboard variable ${name} in {expr!r}"
        return VARIABLES[name]

    return _VARIABLE.sub(value, expr)


def test_substitute_replaces_every_form_of_a_variable() -> None:
    assert substitute('rate(x{gpu=~"$gpu",h=~"${Hostname}"}[$__rate_interval])') == (
        'rate(x{gpu=~".*",h=~".*"}[4s])'
    )
    with pytest.raises(AssertionError, match="unknown dashboard variable"):
        substitute("x[$__nope]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(
    what: str,
    check: Callable[[], Any],
    deadline: float,
    *logs: Path,
    detail: Callable[[], str] = str,
) -> Any:
    """Poll ``check()`` until it returns something truthy; fail at ``deadline`` with ``detail()``
    and the tails of ``logs``."""
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}:\n{p.read_text()[-2000:]}" for p in logs if p.exists())
            pytest.fail(f"timed out waiting for {what}: {detail()}\n{tails}")
        time.sleep(0.2)


def _port_from(log: Path, pattern: str, proc: subprocess.Popen[bytes]) -> int | None:
    m = re.search(pattern, log.read_text()) if log.exists() else None
    if m:
        return int(m.group(1))
    assert proc.poll() is None, f"{log.name}: exited {proc.returncode}: {log.read_text()[-2000:]}"
    return None


def _api(port: int, path: str, **params: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:  # a query Prometheus refuses: 400 with its reason
        with err:
            pytest.fail(f"Prometheus refused {params}: {err.code} {err.read()[:500]!r}")
    assert body["status"] == "success", body
    return body["data"]  # type: ignore[no-any-return]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_real_prometheus_answers_every_panel_query(tmp_path: Path) -> None:
    """Prometheus scrapes ``powerlib exporter`` (2 simulated GPUs) and a training process's
    Exporter (a ``powerlib.measure`` block stepping, four optimizing sessions with a measured
    verdict) every second; every panel query and every variable's selector is then evaluated
    through the HTTP API to a non-empty, finite result."""
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip(f"no Prometheus server at {PROMETHEUS} (Debian: apt-get install prometheus)")
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "config", str(GRAFANA / "prometheus.yml")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert check.returncode == 0, check.stdout + check.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(tmp_path / "state"),
    }
    logs = {name: tmp_path / f"{name}.log" for name in ("exporter", "job", "prometheus")}
    deadline = time.monotonic() + 30
    with contextlib.ExitStack() as stack:

        def start(name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
            out = stack.enter_context(logs[name].open("wb"))
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kwargs)
            stack.callback(_stop, proc)  # every exit path: the assertion's, a skip's, Ctrl-C's
            return proc

        exporter = start(
            "exporter",
            [sys.executable, "-m", "powerlib.cli", "exporter", "--port", "0",
             "--addr", "127.0.0.1", "--interval-s", "0.25"],
            env=env,
        )  # fmt: skip
        job = start(
            "job", [sys.executable, str(JOB), str(tmp_path / "out")], env=env,
            stdin=subprocess.PIPE,
        )  # fmt: skip
        node_port = _wait_for(
            "powerlib exporter's port",
            lambda: _port_from(logs["exporter"], r"http://127\.0\.0\.1:(\d+)/", exporter),
            deadline,
        )
        job_port = _wait_for(
            "the training process's port",
            lambda: _port_from(logs["job"], r"(?m)^port (\d+)$", job),
            deadline,
        )
        config = tmp_path / "prometheus.yml"  # JSON is YAML
        config.write_text(
            json.dumps({
                "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                           "evaluation_interval": f"{SCRAPE_S}s"},
                "scrape_configs": [
                    {"job_name": "powerlib",
                     "static_configs": [{"targets": [f"127.0.0.1:{node_port}"]}]},
                    {"job_name": "powerlib-training",
                     "static_configs": [{"targets": [f"127.0.0.1:{job_port}"]}]},
                ],
            })
        )  # fmt: skip
        prom_port = _free_port()
        start(
            "prometheus",
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            cwd=tmp_path,
        )  # fmt: skip
        _wait_for("Prometheus to be ready", lambda: _ready(prom_port), deadline, logs["prometheus"])

        dash = _dashboard()
        queries = {f"{title} [{t['refId']}]": substitute(t["expr"]) for title, t in _targets(dash)}
        selectors = {
            name: (re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q) or pytest.fail(q)).groups()
            for name, q in _variable_queries(dash)
        }
        answers: dict[str, list[Any]] = {}

        def pending() -> list[str]:
            for key, expr in queries.items():
                if not answers.get(key):
                    answers[key] = _api(prom_port, "/api/v1/query", query=expr)["result"]
            for name, (selector, label) in selectors.items():
                series = _api(prom_port, "/api/v1/series", **{"match[]": substitute(selector)})
                answers[f"variable {name}"] = [s for s in series if label in s]
            return [k for k, v in answers.items() if not v]

        def why() -> str:
            targets = _api(prom_port, "/api/v1/targets")["activeTargets"]
            health = [(t["scrapePool"], t["health"], t["lastError"]) for t in targets]
            return f"still empty: {pending()}; targets {health}"

        _wait_for(
            "every query to answer", lambda: not pending(), time.monotonic() + 20,
            logs["prometheus"], detail=why,
        )  # fmt: skip
    for key, result in answers.items():
        if key.startswith("variable "):
            continue
        values = [float(r["value"][1]) for r in result]
        assert all(math.isfinite(v) for v in values), (key, result)
    # the values are the exporter's: the job's steps and its measured saving came through
    saving = answers["Measured saving [A]"]
    assert [r["metric"]["verdict"] for r in saving] == ["kept"]
    assert 0.0 < float(saving[0]["value"][1]) < 0.5
    assert all(float(r["value"][1]) > 0 for r in answers["Energy per step [A]"])
