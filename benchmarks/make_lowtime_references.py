"""Write lowtime 0.3.0's frontiers for the SOSP'24 emulation profiles as test references.

lowtime (the Perseus paper's solver) is used only as a black box, through its public API, from
an environment of its own; powerlib does not depend on it. The driver follows the paper
artifact's pipeline (reference docs/perseus.md §5.3, §5.6):

1. per (stage, kind): ``ExecutionOption`` per measured frequency, Pareto-filtered by
   ``CandidateExecutionOptions`` (refiltered with ``noise_factor=0.95`` when three or fewer
   survive), then ``P_block · quant_time · τ`` subtracted from each survivor's cost (the
   artifact's filter-then-subtract order) and ``ExponentialModel(search_strategy="best")`` fit;
2. a ``Synchronous1F1B`` per stage, program-order edges plus the edges of
   ``DependencyResolver([forward_dep, backward_dep])``, a dummy source (0) and sink (1);
3. ``PhillipsDessouky(dag).run()``; each step gives one CSV row
   ``iteration,quant_time,time_s,energy_j`` with ``energy_j = cost + N · P_block · time_s``.

Each output is ``tests/data/lowtime_frontiers/<case>.csv``; the profiles are copied to its
``profiles/`` folder so that ``tests/planning/perseus/test_lowtime_references.py`` runs without
``/work/shared``.

Run (lowtime needs its own venv; ``pip install lowtime==0.3.0 pandas``)::

    /tmp/scivenv/bin/python benchmarks/make_lowtime_references.py --check-artifact
    /tmp/scivenv/bin/python benchmarks/make_lowtime_references.py gpt3_a100_mb12 bloom_a100_mb12
    /tmp/scivenv/bin/python benchmarks/make_lowtime_references.py --list

With no case names it writes every case (the two A40 cases take about 5 min each).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import logging
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "tests" / "data" / "lowtime_frontiers"
PROFILE_DIR = OUT_DIR / "profiles"
EMULATION = Path("/work/shared/perseus_validation/sosp24_emulation")
ARTIFACT_FRONTIER = EMULATION / "frontier_gpt3-175b_a100_sxm_mb12.csv"
NUM_STAGES = 8
NOISE_FACTOR = 0.95


@dataclass(frozen=True)
class Case:
    """One reference frontier."""

    name: str
    profile: str  # file name in EMULATION (and, copied, in PROFILE_DIR)
    num_microbatches: int
    p_block_w: float
    unit_time_s: float


A100 = {"p_block_w": 83.64, "unit_time_s": 0.001}
A40 = {"p_block_w": 70.38, "unit_time_s": 0.0001}
CASES = {
    c.name: c
    for c in (
        Case("gpt3_a100_mb12", "profile_gpt3-175b_a100_sxm.csv", 12, **A100),
        Case("gpt3_a100_mb24", "profile_gpt3-175b_a100_sxm.csv", 24, **A100),
        Case("gpt3_a100_mb48", "profile_gpt3-175b_a100_sxm.csv", 48, **A100),
        Case("bloom_a100_mb12", "profile_bloom_a100_sxm.csv", 12, **A100),
        Case("bloom_a100_mb24", "profile_bloom_a100_sxm.csv", 24, **A100),
        Case("gpt3_a40_mb12", "profile_gpt3-175b_a40.csv", 12, **A40),
        Case("bloom_a40_mb12", "profile_bloom_a40.csv", 12, **A40),
    )
}


def read_profile(path: Path) -> dict[tuple[int, str], list[tuple[float, float, float]]]:
    """``(stage, kind) -> [(frequency MHz, time s, energy J), ...]`` from a profile CSV."""
    rows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            key = (int(row["stage"]), row["instruction"].strip())
            rows.setdefault(key, []).append(
                (float(row["frequency"]), float(row["time"]), float(row["energy"]))
            )
    return rows


def build_dag(
    profile_path: Path,
    num_stages: int,
    num_microbatches: int,
    p_block_w: float,
    unit_time_s: float,
):
    """The lowtime DAG (networkx, operations on attribute ``op``) for synchronous 1F1B."""
    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import DependencyResolver, add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import (
        Backward,
        Forward,
        Instruction,
        backward_dep,
        forward_dep,
    )
    from lowtime.perseus.schedule import Synchronous1F1B

    profile = read_profile(profile_path)
    specs: list[dict[type, OperationSpec]] = []
    for stage in range(num_stages):
        spec_map = {}
        for kind, cls in (("forward", Forward), ("backward", Backward)):
            measured = profile[(stage, kind)]

            def make_options(rows=measured):
                return [
                    ExecutionOption(real_time=t, unit_time=unit_time_s, cost=e, knob=int(freq))
                    for freq, t, e in rows
                ]

            cands = CandidateExecutionOptions(options=make_options())
            if len(cands.options) <= 3:
                cands = CandidateExecutionOptions(options=make_options(), noise_factor=NOISE_FACTOR)
            for option in cands.options:  # artifact order: filter on raw energy, then subtract
                option.cost -= p_block_w * option.quant_time * unit_time_s
            model = ExponentialModel(cands, search_strategy="best")
            spec_map[cls] = OperationSpec(options=cands, cost_model=model)
        specs.append(spec_map)

    dag = nx.DiGraph()
    node_id = itertools.count(2)  # 0 and 1 are the source and the sink
    nodes: list[int] = []
    for stage in range(num_stages):
        prev = None
        for inst in Synchronous1F1B(num_stages, num_microbatches, stage, specs[stage]):
            node = next(node_id)
            dag.add_node(node, op=inst)
            nodes.append(node)
            if prev is not None:
                dag.add_edge(prev, node)
            prev = node
    resolver = DependencyResolver([forward_dep, backward_dep], Instruction)
    for u, v in itertools.permutations(nodes, 2):
        if resolver.is_dependent(dag.nodes[u]["op"], dag.nodes[v]["op"]):
            dag.add_edge(u, v)
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    return dag


def solve(case: Case, profile_dir: Path = EMULATION) -> list[tuple[int, int, float, float]]:
    """lowtime's frontier: ``[(iteration, quant_time, time_s, energy_j), ...]``."""
    from lowtime.solver import PhillipsDessouky

    dag = build_dag(
        profile_dir / case.profile,
        NUM_STAGES,
        case.num_microbatches,
        case.p_block_w,
        case.unit_time_s,
    )
    rows = []
    for result in PhillipsDessouky(dag).run():
        energy = result.cost + NUM_STAGES * case.p_block_w * result.real_time
        rows.append(
            (int(result.iteration), int(result.quant_time), float(result.real_time), float(energy))
        )
    return rows


def write(case: Case, rows: list[tuple[int, int, float, float]]) -> Path:
    """Write the case's CSV (full float precision) and copy its profile next to it."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{case.name}.csv"
    with path.open("w", newline="") as f:
        f.write("iteration,quant_time,time_s,energy_j\n")
        for iteration, quant, t, e in rows:
            f.write(f"{iteration},{quant},{t!r},{e!r}\n")
    PROFILE_DIR.mkdir(exist_ok=True)
    if not (PROFILE_DIR / case.profile).exists():
        shutil.copyfile(EMULATION / case.profile, PROFILE_DIR / case.profile)
    return path


def check_artifact() -> None:
    """Compare the GPT-3 A100 M=12 frontier with the paper artifact's; exit 1 on a mismatch."""
    rows = solve(CASES["gpt3_a100_mb12"])
    with ARTIFACT_FRONTIER.open(newline="") as f:
        artifact = [(float(r["time"]), float(r["energy"])) for r in csv.DictReader(f)]
    ok = len(rows) == len(artifact)
    max_dt = max_rel = 0.0
    for (_, _, t, e), (ta, ea) in zip(rows, artifact):
        max_dt = max(max_dt, abs(t - ta))
        max_rel = max(max_rel, abs(e - ea) / abs(ea))
    ok = ok and max_dt < 1e-9 and max_rel < 1e-8
    print(
        f"artifact: {len(artifact)} points, lowtime: {len(rows)}; max |dT| {max_dt:.3g} s, "
        f"max rel dE {max_rel:.3g}; first {rows[0][2:]}, last {rows[-1][2:]} -> "
        f"{'OK' if ok else 'MISMATCH'}"
    )
    if not ok:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "--check-artifact",
        action="store_true",
        help="only compare GPT-3 A100 M=12 with the paper artifact's frontier",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # The fit's grid search overflows exp() and fails to estimate covariances on some starts.
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message="Covariance of the parameters could not be estimated")
    if args.list:
        for c in CASES.values():
            print(c)
        return
    if args.check_artifact:
        check_artifact()
        return
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    for name in args.cases or list(CASES):
        case = CASES[name]
        start = time.perf_counter()
        rows = solve(case)
        path = write(case, rows)
        elapsed = time.perf_counter() - start
        print(f"{name}: {len(rows)} points in {elapsed:.1f} s -> {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
