"""Tests of the Perseus cost-curve construction (reference docs/perseus.md §2.1, §5.2)."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest

from powerlib.errors import PlanError
from powerlib.planning.perseus.cost_model import (
    ConvexHullCostModel,
    CostModel,
    ExponentialCostModel,
    TableCostModel,
    build_cost_model,
    fit_exponential,
)
from powerlib.planning.perseus.frequency_options import (
    ORDERS,
    PRUNINGS,
    Option,
    _pareto_keep,
    frequency_for,
    prepare_options,
)

VALIDATION = Path("/work/shared/perseus_validation")
SYNTH = VALIDATION / "synthetic" / "profile_synth4.csv"
GPT3 = VALIDATION / "sosp24_emulation" / "profile_gpt3-175b_a100_sxm.csv"
FTS, STF = ORDERS  # filter-then-subtract, subtract-then-filter
WEAK, ARTIFACT = PRUNINGS  # the default, and the SOSP'24 artifact's (reproduces its figures)
TAU = 1e-3

needs_data = pytest.mark.skipif(
    not (SYNTH.exists() and GPT3.exists()), reason="perseus validation data not available"
)

Points = list[tuple[float, float, float]]


def load_profile(path: Path) -> dict[tuple[int, str], Points]:
    out: dict[tuple[int, str], Points] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            key = (int(row["stage"]), row["instruction"])
            out.setdefault(key, []).append(
                (float(row["frequency"]), float(row["time"]), float(row["energy"]))
            )
    return out


@pytest.fixture(scope="module")
def synth() -> dict[tuple[int, str], Points]:
    return load_profile(SYNTH)


@pytest.fixture(scope="module")
def gpt3() -> dict[tuple[int, str], Points]:
    return load_profile(GPT3)


def close_to_printed(got: float, printed: str, rel: float = 1e-4) -> bool:
    """``got`` agrees with a value printed to limited digits: within ``rel`` or half a last digit."""
    ref = float(printed)
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(got - ref) <= max(rel * abs(ref), 0.5 * 10.0**-decimals)


def second_differences(model: CostModel) -> list[float]:
    c = [model.cost(q) for q in range(model.q_min, model.q_max + 1)]
    return [c[i - 1] - 2.0 * c[i] + c[i + 1] for i in range(1, len(c) - 1)]


def first_differences(model: CostModel) -> list[float]:
    c = [model.cost(q) for q in range(model.q_min, model.q_max + 1)]
    return [c[i + 1] - c[i] for i in range(len(c) - 1)]


# ------------------------------------------------------------------------------------------------
# Option preparation
# ------------------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(
    ("order", "count", "fastest", "slowest"),
    [(FTS, 8, 1410.0, 990.0), (STF, 10, 1410.0, 870.0)],
)
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_synthetic_stage0_option_counts(
    synth: dict[tuple[int, str], Points],
    kind: str,
    order: str,
    count: int,
    fastest: float,
    slowest: float,
) -> None:
    opts = prepare_options(
        synth[(0, kind)], unit_time_s=TAU, p_block_w=80.0, order=order, pruning=ARTIFACT
    )
    assert len(opts) == count
    assert opts[0].freq_mhz == fastest
    assert opts[-1].freq_mhz == slowest
    quants = [o.quant for o in opts]
    assert quants == sorted(set(quants))  # distinct, fastest first
    freqs = [o.freq_mhz for o in opts]
    assert freqs == sorted(freqs, reverse=True)


@needs_data
@pytest.mark.parametrize(
    ("order", "count", "slowest"),
    [(FTS, 13, 1080.0), (STF, 19, 885.0)],
)
def test_gpt3_stage0_forward_option_counts(
    gpt3: dict[tuple[int, str], Points], order: str, count: int, slowest: float
) -> None:
    opts = prepare_options(
        gpt3[(0, "forward")], unit_time_s=TAU, p_block_w=83.64, order=order, pruning=ARTIFACT
    )
    assert len(opts) == count
    assert (opts[0].freq_mhz, opts[-1].freq_mhz) == (1410.0, slowest)


@needs_data
def test_quantization_uses_float_floor_division(synth: dict[tuple[int, str], Points]) -> None:
    assert 0.030 // 0.001 == 29.0  # the IEEE behaviour lowtime relies on
    opts = prepare_options(synth[(0, "forward")], unit_time_s=TAU, p_block_w=80.0)
    fastest = opts[0]
    assert (fastest.freq_mhz, fastest.time_s, fastest.energy_j) == (1410.0, 0.030, 9.0)
    assert fastest.quant == 29  # not 30
    assert fastest.eff_energy_j == 9.0 - 80.0 * 29 * TAU
    for o in opts:
        assert o.quant == int(o.time_s // TAU)
        assert o.eff_energy_j == o.energy_j - 80.0 * o.quant * TAU


def test_quantization_with_other_unit_time() -> None:
    pts = [(1410.0, 0.0300, 9.0), (1200.0, 0.0351, 8.0), (1000.0, 0.0415, 7.5)]
    opts = prepare_options(pts, unit_time_s=1e-4, p_block_w=0.0)
    assert [o.quant for o in opts] == [int(0.0300 // 1e-4), int(0.0351 // 1e-4), 415]
    assert [o.eff_energy_j for o in opts] == [9.0, 8.0, 7.5]  # p_block 0: raw energy


@pytest.mark.parametrize("pruning", PRUNINGS)
def test_strict_pareto_filter_drops_dominated(pruning: str) -> None:
    pts = [
        (1400.0, 0.0105, 10.0),
        (1300.0, 0.0115, 9.0),
        (1250.0, 0.0118, 9.5),  # dominated by 1300
        (1200.0, 0.0125, 8.0),
        (1100.0, 0.0135, 7.0),
        (1000.0, 0.0145, 7.2),  # dominated by 1100
    ]
    opts = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    assert [o.freq_mhz for o in opts] == [1400.0, 1300.0, 1200.0, 1100.0]


@pytest.mark.parametrize("pruning", PRUNINGS)
def test_soft_fallback_when_three_or_fewer_survive(pruning: str) -> None:
    # Strictly, only the fastest point survives (it is also the cheapest); the soft filter keeps
    # the second, which is within 5% of it in time.
    pts = [(1410.0, 0.0105, 5.0), (1300.0, 0.0112, 5.1)]
    opts = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    assert [o.freq_mhz for o in opts] == [1410.0, 1300.0]
    strict = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, noise_factor=1.0, pruning=pruning)
    assert [o.freq_mhz for o in strict] == [1410.0]  # one useful duration is a valid answer


@pytest.mark.parametrize("pruning", PRUNINGS)
def test_a_single_useful_duration_is_a_fixed_activity(pruning: str) -> None:
    # Everything floors to one quant: one option is left, and it is a fixed-duration model.
    pts = [(1410.0, 0.0101, 10.0), (1300.0, 0.0105, 9.0)]
    (only,) = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    # The artifact keeps the costlier one (closest to 10 τ); weak pruning keeps the fastest
    # bucket's fastest point (all-max stays reachable): 1410 MHz either way.
    assert (only.freq_mhz, only.quant) == (1410.0, 10)
    for kind in ("exp", "convex"):
        model = build_cost_model([only], kind=kind, unit_time_s=TAU)
        assert model.q_min == model.q_max == 10
        assert model.cost(10) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("pruning", "kept_11", "kept_12"),
    [(ARTIFACT, (1200.0, 8.0), (1000.0, 6.05)), (WEAK, (1100.0, 7.0), (1050.0, 6.0))],
)
def test_soft_fallback_count_is_taken_after_dedup(
    pruning: str, kept_11: tuple[float, float], kept_12: tuple[float, float]
) -> None:
    # Five strict survivors, but only three distinct quants: the soft filter is applied, and it
    # keeps the strictly dominated 1000 MHz point, which then wins the quant-12 de-duplication
    # under the artifact's rule (highest energy); weak pruning keeps the cheapest, 1050 MHz.
    pts = [
        (1400.0, 0.0101, 10.0),
        (1300.0, 0.0105, 9.0),
        (1200.0, 0.0111, 8.0),
        (1100.0, 0.0115, 7.0),
        (1050.0, 0.0121, 6.0),
        (1000.0, 0.0125, 6.05),
    ]
    opts = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    assert [(o.quant, o.freq_mhz, o.energy_j) for o in opts] == [
        (10, 1400.0, 10.0),
        (11, *kept_11),
        (12, *kept_12),
    ]
    # A strictly dominated 950 MHz point in a quant of its own comes back with the soft filter
    # under both rules: the count (three quants) was taken after the de-duplication.
    late = [*pts, (950.0, 0.0131, 6.1)]
    opts = prepare_options(late, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    assert [o.freq_mhz for o in opts] == [1400.0, kept_11[0], kept_12[0], 950.0]
    strict = prepare_options(late, unit_time_s=TAU, p_block_w=0.0, noise_factor=1.0)
    assert 950.0 not in [o.freq_mhz for o in strict]
    # With more distinct quants the strict result stands.
    pts.append((900.0, 0.0135, 5.0))
    opts = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    assert [o.freq_mhz for o in opts] == [1400.0, kept_11[0], 1050.0, 900.0]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("pruning", "kept_13"), [(ARTIFACT, 1100.0), (WEAK, 1000.0)])
def test_dedupe_rule_per_quant(order: str, pruning: str, kept_13: float) -> None:
    # The artifact keeps the most expensive survivor of a quant (its real time is closest to
    # quant·τ); weak pruning keeps the cheapest, except in the fastest quant, which keeps its
    # fastest point (1400 MHz, not the cheaper 1350) so that all-max stays reachable.
    pts = [
        (1400.0, 0.0101, 10.0),  # quant 10, the fastest and more expensive: kept by both
        (1350.0, 0.0108, 9.0),  # quant 10, cheaper
        (1200.0, 0.0125, 8.0),  # quant 12
        (1100.0, 0.0131, 7.5),  # quant 13, the more expensive: the artifact's
        (1000.0, 0.0139, 7.0),  # quant 13, the cheaper: weak pruning's
    ]
    opts = prepare_options(pts, unit_time_s=TAU, p_block_w=50.0, order=order, pruning=pruning)
    assert [(o.quant, o.freq_mhz) for o in opts] == [(10, 1400.0), (12, 1200.0), (13, kept_13)]


def test_weak_pruning_keeps_a_cheaper_clock_at_the_same_time() -> None:
    # A memory-bound instruction: 1200 MHz takes as long as 1410 MHz for 21 % less energy.
    pts = [
        (1410.0, 0.0205, 10.0),
        (1200.0, 0.0205, 7.9),
        (1000.0, 0.0235, 7.5),
        (900.0, 0.0265, 7.2),
        (800.0, 0.0295, 7.0),
    ]
    times, energies = [t for _, t, _ in pts], [e for _, _, e in pts]
    # The filter alone: weak dominance drops 1410 MHz; the artifact's strict one keeps both.
    assert _pareto_keep(times, energies, 1.0, weak=True) == [1, 2, 3, 4]
    assert _pareto_keep(times, energies, 1.0, weak=False) == [0, 1, 2, 3, 4]
    weak = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0)  # the default
    assert [(o.quant, o.freq_mhz, o.energy_j) for o in weak] == [
        (20, 1200.0, 7.9),
        (23, 1000.0, 7.5),
        (26, 900.0, 7.2),
        (29, 800.0, 7.0),
    ]
    # The artifact then keeps the more expensive of the two in their shared quant: 1410 MHz.
    artifact = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=ARTIFACT)
    assert [o.freq_mhz for o in artifact] == [1410.0, 1000.0, 900.0, 800.0]
    assert weak[0].energy_j == pytest.approx(0.79 * artifact[0].energy_j)  # 21 % less
    assert weak[0].quant == artifact[0].quant  # at the same time


@pytest.mark.parametrize("pruning", PRUNINGS)
def test_exact_duplicates_keep_one(pruning: str) -> None:
    # Two clocks measured at exactly the same (time, energy): one of them survives, the first.
    pts = [
        (1410.0, 0.0105, 10.0),
        (1395.0, 0.0105, 10.0),
        (1200.0, 0.0125, 8.0),
        (1100.0, 0.0135, 7.0),
        (1000.0, 0.0145, 6.5),
    ]
    opts = prepare_options(pts, unit_time_s=TAU, p_block_w=0.0, pruning=pruning)
    assert [o.freq_mhz for o in opts] == [1410.0, 1200.0, 1100.0, 1000.0]
    times, energies = [t for _, t, _ in pts], [e for _, _, e in pts]
    assert len(_pareto_keep(times, energies, 1.0, weak=pruning == WEAK)) == 4 + (
        pruning == ARTIFACT
    )  # weak dominance drops the second copy already; the artifact's dedupe does it


@pytest.mark.parametrize("bad", ["strict", "", "Weak", None])
def test_a_bad_pruning_is_a_one_line_plan_error(bad: object) -> None:
    with pytest.raises(PlanError, match="pruning must be one of") as err:
        prepare_options(GOOD, unit_time_s=TAU, p_block_w=0.0, pruning=bad)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message and "weak" in message and "artifact" in message
    assert repr(bad) in message


@needs_data
def test_subtract_then_filter_keeps_raw_dominated_points(
    synth: dict[tuple[int, str], Points],
) -> None:
    raw = prepare_options(synth[(0, "forward")], unit_time_s=TAU, p_block_w=80.0, order=FTS)
    eff = prepare_options(synth[(0, "forward")], unit_time_s=TAU, p_block_w=80.0, order=STF)
    assert {o.freq_mhz for o in eff} - {o.freq_mhz for o in raw} == {930.0, 870.0}
    # The artifact order filters raw energy: survivors strictly decrease in raw energy.
    assert all(x.energy_j > y.energy_j for x, y in zip(raw, raw[1:]))
    # The Zeus order filters effective energy: survivors strictly decrease in it.
    assert all(x.eff_energy_j > y.eff_energy_j for x, y in zip(eff, eff[1:]))


def test_option_is_frozen_and_keyword_only() -> None:
    o = Option(freq_mhz=1410.0, time_s=0.03, energy_j=9.0, quant=29, eff_energy_j=6.68)
    with pytest.raises(AttributeError):
        o.quant = 30  # type: ignore[misc]
    with pytest.raises(TypeError):
        Option(1410.0, 0.03, 9.0, 29, 6.68)  # type: ignore[misc]


GOOD = [(1410.0, 0.010, 10.0), (1200.0, 0.012, 8.0), (1000.0, 0.015, 7.0)]


@pytest.mark.parametrize(
    ("points", "kwargs", "match"),
    [
        (GOOD, {"unit_time_s": 0.0, "p_block_w": 0.0}, "unit_time_s"),
        (GOOD, {"unit_time_s": -1e-3, "p_block_w": 0.0}, "unit_time_s"),
        (GOOD, {"unit_time_s": math.nan, "p_block_w": 0.0}, "unit_time_s"),
        (GOOD, {"unit_time_s": TAU, "p_block_w": -1.0}, "p_block_w"),
        (GOOD, {"unit_time_s": TAU, "p_block_w": 0.0, "order": "bogus"}, "order"),
        (GOOD, {"unit_time_s": TAU, "p_block_w": 0.0, "noise_factor": 0.0}, "noise_factor"),
        (GOOD, {"unit_time_s": TAU, "p_block_w": 0.0, "noise_factor": 1.5}, "noise_factor"),
        ([], {"unit_time_s": TAU, "p_block_w": 0.0}, "at least two"),
        (GOOD[:1], {"unit_time_s": TAU, "p_block_w": 0.0}, "at least two"),
        ([*GOOD, (1410.0, 0.02, 5.0)], {"unit_time_s": TAU, "p_block_w": 0.0}, "distinct"),
        ([*GOOD, (900.0, math.inf, 5.0)], {"unit_time_s": TAU, "p_block_w": 0.0}, "finite"),
        ([*GOOD, (900.0, 0.02, math.nan)], {"unit_time_s": TAU, "p_block_w": 0.0}, "finite"),
        ([*GOOD, (900.0, -0.02, 5.0)], {"unit_time_s": TAU, "p_block_w": 0.0}, "positive"),
        ([*GOOD, (900.0, 0.02)], {"unit_time_s": TAU, "p_block_w": 0.0}, "triple"),
        ([*GOOD, (900.0, "x", 1.0)], {"unit_time_s": TAU, "p_block_w": 0.0}, "number"),
        (GOOD, {"unit_time_s": 0.011, "p_block_w": 0.0}, "quantum"),  # 1410 MHz -> quant 0
    ],
)
def test_prepare_options_rejects_bad_input(
    points: list[tuple[float, ...]], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        prepare_options(points, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Exponential fit
# ------------------------------------------------------------------------------------------------

# (profile, p_block, order, (stage, kind), printed (a, b, c) from reference §2.1/§5.2)
PRINTED_FITS = [
    ("synth", 80.0, FTS, (0, "forward"), ("158.414", "-0.142291", "4.10511")),
    ("synth", 80.0, FTS, (0, "backward"), ("595.906", "-0.0815732", "8.43171")),
    ("synth", 80.0, FTS, (1, "forward"), ("2192.84", "-0.300175", "3.6225")),
    ("synth", 80.0, STF, (0, "forward"), ("229.153", "-0.156849", "4.24732")),
    ("synth", 80.0, STF, (0, "backward"), ("761.115", "-0.0862007", "8.57998")),
    ("synth", 80.0, STF, (1, "forward"), ("1471.97", "-0.28245", "3.57201")),
    ("gpt3", 83.64, FTS, (0, "forward"), ("15184.2", "-0.1495", "10.94")),
    ("gpt3", 83.64, FTS, (0, "backward"), ("53373.1", "-0.08758", "20.45")),
]

# The same fits from lowtime 0.3.0 (scipy curve_fit, "best" of the 3x6x3 grid), full precision.
LOWTIME_FITS = [
    (
        "synth",
        80.0,
        FTS,
        (0, "forward"),
        (158.41434728548208, -0.14229139382791478, 4.105109670990766),
    ),
    (
        "synth",
        80.0,
        FTS,
        (0, "backward"),
        (595.9055808574752, -0.08157318106404625, 8.431705443415474),
    ),
    (
        "synth",
        80.0,
        FTS,
        (1, "forward"),
        (2192.836503000823, -0.30017503003202395, 3.6224988526016273),
    ),
    (
        "synth",
        80.0,
        STF,
        (0, "forward"),
        (229.15277232890267, -0.15684918381281188, 4.247317034537943),
    ),
    (
        "synth",
        80.0,
        STF,
        (0, "backward"),
        (761.1154506956296, -0.08620068209460215, 8.579980947219392),
    ),
    (
        "synth",
        80.0,
        STF,
        (1, "forward"),
        (1471.9647267914806, -0.28244987218468615, 3.5720124583277393),
    ),
    (
        "gpt3",
        83.64,
        FTS,
        (0, "forward"),
        (15184.201125143514, -0.14950104426905322, 10.939907862521054),
    ),
    (
        "gpt3",
        83.64,
        FTS,
        (0, "backward"),
        (53373.1359057188, -0.08757836074931481, 20.452832844540545),
    ),
    (
        "gpt3",
        83.64,
        STF,
        (0, "forward"),
        (57462.19464903612, -0.1767942048827632, 11.557007146838405),
    ),
    (
        "gpt3",
        83.64,
        STF,
        (0, "backward"),
        (201739.9171604084, -0.10272813456923874, 21.720961618407436),
    ),
]


def _fit(
    request: pytest.FixtureRequest, profile: str, p_block: float, order: str, key: tuple[int, str]
) -> tuple[list[Option], ExponentialCostModel]:
    data = request.getfixturevalue(profile)
    # The printed and lowtime fits are the artifact's: its pruning reproduces them.
    opts = prepare_options(
        data[key], unit_time_s=TAU, p_block_w=p_block, order=order, pruning=ARTIFACT
    )
    return opts, fit_exponential(opts, unit_time_s=TAU)


@needs_data
@pytest.mark.parametrize(("profile", "p_block", "order", "key", "printed"), PRINTED_FITS)
def test_fit_matches_reference_printed_values(
    request: pytest.FixtureRequest,
    profile: str,
    p_block: float,
    order: str,
    key: tuple[int, str],
    printed: tuple[str, str, str],
) -> None:
    _, m = _fit(request, profile, p_block, order, key)
    for got, ref in zip((m.a, m.b, m.c), printed):
        assert close_to_printed(got, ref), (got, ref)


@needs_data
@pytest.mark.parametrize(("profile", "p_block", "order", "key", "coeffs"), LOWTIME_FITS)
def test_fit_matches_lowtime_curve(
    request: pytest.FixtureRequest,
    profile: str,
    p_block: float,
    order: str,
    key: tuple[int, str],
    coeffs: tuple[float, float, float],
) -> None:
    opts, m = _fit(request, profile, p_block, order, key)
    a, b, c = coeffs
    assert m.a == pytest.approx(a, rel=1e-5)
    assert m.b == pytest.approx(b, rel=1e-5)
    assert m.c == pytest.approx(c, rel=1e-5)
    for q in range(m.q_min, m.q_max + 1):
        assert m.cost(q) == pytest.approx(a * math.exp(b * q) + c, rel=1e-7)
    assert (m.q_min, m.q_max) == (opts[0].quant, opts[-1].quant)
    resid = [(m.cost(o.quant) - o.eff_energy_j) ** 2 for o in opts]
    assert m.mse == pytest.approx(sum(resid) / len(resid), rel=1e-12)
    # lowtime's own fit is no better than ours (ours is the least-squares optimum).
    lt_resid = [(a * math.exp(b * o.quant) + c - o.eff_energy_j) ** 2 for o in opts]
    assert m.mse <= sum(lt_resid) / len(lt_resid) * (1 + 1e-9)


@needs_data
@pytest.mark.parametrize("order", ORDERS)
def test_exp_model_convex_and_non_increasing_on_all_stages(
    synth: dict[tuple[int, str], Points], gpt3: dict[tuple[int, str], Points], order: str
) -> None:
    for data, p_block in ((synth, 80.0), (gpt3, 83.64)):
        for points in data.values():
            opts = prepare_options(points, unit_time_s=TAU, p_block_w=p_block, order=order)
            m = fit_exponential(opts, unit_time_s=TAU)
            assert m.a > 0.0 and m.b < 0.0
            scale = max(abs(m.cost(m.q_min)), abs(m.cost(m.q_max)))
            assert all(d <= 0.0 for d in first_differences(m))
            assert all(d >= -1e-12 * scale for d in second_differences(m))


@needs_data
def test_fit_is_fast(gpt3: dict[tuple[int, str], Points]) -> None:
    opts = prepare_options(gpt3[(0, "backward")], unit_time_s=TAU, p_block_w=83.64, order=STF)
    fit_exponential(opts, unit_time_s=TAU)  # warm up numpy
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        fit_exponential(opts, unit_time_s=TAU)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.05


def _options(qs: list[int], ys: list[float]) -> list[Option]:
    return [
        Option(freq_mhz=2000.0 - 10 * q, time_s=q * TAU, energy_j=y, quant=q, eff_energy_j=y)
        for q, y in zip(qs, ys)
    ]


@pytest.mark.parametrize(
    ("a", "b", "c"), [(500.0, -0.1, 3.0), (2.0, -0.5, -1.0), (1e5, -0.02, 7.0)]
)
def test_fit_recovers_exact_exponential(a: float, b: float, c: float) -> None:
    qs = list(range(20, 41, 2))
    m = fit_exponential(_options(qs, [a * math.exp(b * q) + c for q in qs]), unit_time_s=TAU)
    assert (m.a, m.b, m.c) == pytest.approx((a, b, c), rel=1e-7)
    assert m.mse < 1e-20 * max(1.0, a * a)


def test_fit_three_points_interpolates() -> None:
    qs, ys = [10, 12, 15], [9.0, 7.0, 6.0]
    m = fit_exponential(_options(qs, ys), unit_time_s=TAU)
    for q, y in zip(qs, ys):
        assert m.cost(q) == pytest.approx(y, rel=1e-9)


def test_fit_two_points_passes_through_both() -> None:
    m = fit_exponential(_options([10, 14], [9.0, 6.0]), unit_time_s=TAU)
    assert m.b == pytest.approx(-0.01)  # lowtime's first starting rate, at τ = 1 ms
    assert m.cost(10) == pytest.approx(9.0, rel=1e-12)
    assert m.cost(14) == pytest.approx(6.0, rel=1e-12)
    assert m.mse < 1e-20


@pytest.mark.parametrize(
    "ys",
    [
        [10.0, 9.9, 9.6, 9.0, 8.0],  # concave: the least-squares optimum is the linear limit
        [8.0, 8.0, 8.0, 8.0, 8.0],  # flat
        [8.0, 8.5, 9.0, 9.2, 9.9],  # increasing (possible only after the soft filter)
        [10.0, 8.0, 8.0, 8.0, 8.0],  # a single step
    ],
)
def test_fit_degenerate_data_stays_convex_non_increasing(ys: list[float]) -> None:
    qs = [10, 11, 12, 13, 14]
    m = fit_exponential(_options(qs, ys), unit_time_s=TAU)
    assert m.a >= 0.0 and m.b <= 0.0
    assert all(map(math.isfinite, (m.a, m.b, m.c, m.mse)))
    scale = max(1.0, abs(m.a), abs(m.c))
    assert all(d <= 1e-12 * scale for d in first_differences(m))
    assert all(d >= -1e-12 * scale for d in second_differences(m))
    # No worse than the best constant.
    mean = sum(ys) / len(ys)
    assert m.mse <= sum((y - mean) ** 2 for y in ys) / len(ys) + 1e-12


def test_fit_rejects_single_duration() -> None:
    with pytest.raises(PlanError, match="two distinct"):
        fit_exponential(_options([10, 10], [5.0, 4.0]), unit_time_s=TAU)
    with pytest.raises(PlanError, match="unit_time_s"):
        fit_exponential(_options([10, 12], [5.0, 4.0]), unit_time_s=0.0)


def test_exponential_model_validation_and_domain() -> None:
    m = ExponentialCostModel(a=100.0, b=-0.1, c=2.0, q_min=5, q_max=9)
    assert math.isnan(m.mse)
    assert m.cost(5) == 100.0 * math.exp(-0.5) + 2.0
    assert isinstance(m, CostModel)
    for q in (4, 10):
        with pytest.raises(PlanError, match="outside"):
            m.cost(q)
    with pytest.raises(TypeError):
        m.cost(5.5)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="convex"):
        ExponentialCostModel(a=-1.0, b=-0.1, c=0.0, q_min=1, q_max=2)
    with pytest.raises(PlanError, match="convex"):
        ExponentialCostModel(a=1.0, b=0.1, c=0.0, q_min=1, q_max=2)
    with pytest.raises(PlanError, match="finite"):
        ExponentialCostModel(a=math.inf, b=-0.1, c=0.0, q_min=1, q_max=2)
    with pytest.raises(PlanError, match="empty"):
        ExponentialCostModel(a=1.0, b=-0.1, c=0.0, q_min=3, q_max=2)


# ------------------------------------------------------------------------------------------------
# Convex hull and table models
# ------------------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize("order", ORDERS)
def test_convex_hull_properties_on_profiles(
    synth: dict[tuple[int, str], Points], gpt3: dict[tuple[int, str], Points], order: str
) -> None:
    for data, p_block in ((synth, 80.0), (gpt3, 83.64)):
        for points in data.values():
            opts = prepare_options(points, unit_time_s=TAU, p_block_w=p_block, order=order)
            m = ConvexHullCostModel.from_options(opts)
            assert isinstance(m, CostModel)
            assert (m.q_min, m.q_max) == (opts[0].quant, opts[-1].quant)
            by_quant = {o.quant: o.eff_energy_j for o in opts}
            for q, y in m.vertices:
                assert by_quant[q] == y
                assert m.cost(q) == y
            for o in opts:
                assert m.cost(o.quant) <= o.eff_energy_j + 1e-12
            scale = max(abs(y) for _, y in m.vertices)
            assert all(d >= -1e-12 * scale for d in second_differences(m))
            assert all(d <= 1e-12 * scale for d in first_differences(m))


def test_convex_hull_by_hand() -> None:
    m = ConvexHullCostModel([(10, 10.0), (12, 7.0), (11, 9.5), (14, 5.0), (13, 6.5), (16, 4.0)])
    # (11, 9.5) and (13, 6.5) lie above the hull.
    assert m.vertices == ((10, 10.0), (12, 7.0), (14, 5.0), (16, 4.0))
    assert [m.cost(q) for q in range(10, 17)] == [10.0, 8.5, 7.0, 6.0, 5.0, 4.5, 4.0]
    assert m.cost(11) < 9.5 and m.cost(13) < 6.5
    with pytest.raises(PlanError, match="outside"):
        m.cost(17)


def test_convex_hull_is_cut_at_its_minimum() -> None:
    # The slowest point costs more than the one before (soft-filter survivors): dropped.
    m = ConvexHullCostModel([(10, 10.0), (12, 6.0), (14, 5.0), (16, 5.5)])
    assert (m.q_min, m.q_max) == (10, 14)
    assert all(d <= 0.0 for d in first_differences(m))
    # Duplicate durations: the lowest cost counts.
    m = ConvexHullCostModel([(10, 10.0), (10, 9.0), (12, 6.0)])
    assert m.vertices == ((10, 9.0), (12, 6.0))
    with pytest.raises(PlanError):
        ConvexHullCostModel([])


def test_build_cost_model_kinds() -> None:
    opts = _options([10, 11, 12, 14], [9.0, 7.5, 6.6, 6.0])
    exp = build_cost_model(opts, unit_time_s=TAU)
    assert isinstance(exp, ExponentialCostModel)
    hull = build_cost_model(opts, kind="convex", unit_time_s=TAU)
    assert isinstance(hull, ConvexHullCostModel)
    assert hull.cost(11) == 7.5
    with pytest.raises(PlanError, match="kind"):
        build_cost_model(opts, kind="spline", unit_time_s=TAU)


def test_table_model_accepts_hand_cases() -> None:
    m = TableCostModel({3: 1.0, 2: 3.0, 1: 7.0})
    assert (m.q_min, m.q_max) == (1, 3)
    assert [m.cost(q) for q in (1, 2, 3)] == [7.0, 3.0, 1.0]
    assert isinstance(m, CostModel)
    flat = TableCostModel({2: 0.0, 1: 3.0, 3: 0.0})  # flat tail is fine
    assert flat.cost(3) == 0.0
    single = TableCostModel({4: 2.0})
    assert (single.q_min, single.q_max, single.cost(4)) == (4, 4, 2.0)
    tenths = TableCostModel({3: 0.8, 2: 1.8, 1: 3.8})  # float rounding in the slopes
    assert tenths.cost(2) == 1.8
    with pytest.raises(PlanError, match="outside"):
        m.cost(0)


def test_table_model_interpolates_gaps() -> None:
    m = TableCostModel({1: 10.0, 3: 4.0, 4: 2.0})
    assert m.cost(2) == 7.0


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({1: 7.0, 2: 3.0, 3: 2.0, 4: 0.0}, "not convex"),  # slopes -4, -1, -2
        ({1: 5.0, 2: 4.0, 3: 1.0}, "not convex"),
        ({1: 1.0, 2: 2.0}, "increases"),
        ({1: 3.0, 2: 1.0, 3: 2.0}, "increases"),
        ({}, "at least one"),
        ({1.5: 1.0}, "integers"),
        ({-1: 1.0, 0: 0.0}, "non-negative"),
        ({1: math.nan, 2: 0.0}, "finite"),
    ],
)
def test_table_model_rejects_bad_tables(table: dict[int, float], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        TableCostModel(table)


# ------------------------------------------------------------------------------------------------
# Mapping durations back to frequencies
# ------------------------------------------------------------------------------------------------


def test_frequency_for() -> None:
    opts = _options([10, 12, 15, 16], [9.0, 7.0, 6.0, 5.8])
    pick = {d: frequency_for(opts, d).quant for d in range(8, 19)}
    assert pick == {
        8: 10,
        9: 10,
        10: 10,
        11: 10,
        12: 12,
        13: 12,
        14: 12,
        15: 15,
        16: 16,
        17: 16,
        18: 16,
    }
    assert frequency_for(list(reversed(opts)), 13) is opts[1]  # order of the input is irrelevant
    assert frequency_for(list(reversed(opts)), 5) is opts[0]  # fastest when nothing fits
    with pytest.raises(PlanError):
        frequency_for([], 10)


@needs_data
def test_frequency_for_on_profile(synth: dict[tuple[int, str], Points]) -> None:
    opts = prepare_options(synth[(0, "forward")], unit_time_s=TAU, p_block_w=80.0)
    for o in opts:
        assert frequency_for(opts, o.quant) is o
    assert frequency_for(opts, 0).freq_mhz == 1410.0
    assert frequency_for(opts, 10**6).freq_mhz == 990.0


def test_fit_reports_overflowing_scale() -> None:
    # A spike at a long duration: a = A·exp(-b·q_min) overflows; the convex hull still works.
    qs, ys = [3000, 3001, 3002, 3003, 3050], [100.0, 1.0, 0.99, 0.98, 0.5]
    opts = [
        Option(freq_mhz=2000.0 - i, time_s=q * 1e-4, energy_j=y, quant=q, eff_energy_j=y)
        for i, (q, y) in enumerate(zip(qs, ys))
    ]
    with pytest.raises(PlanError, match="not finite"):
        fit_exponential(opts, unit_time_s=1e-4)
    hull = build_cost_model(opts, kind="convex", unit_time_s=1e-4)
    assert hull.cost(3000) == 100.0 and hull.cost(3050) == 0.5


def test_exp_falls_back_to_the_hull_with_two_points_or_a_degenerate_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from powerlib.planning.perseus import cost_model as cm

    two = prepare_options(
        [(1410.0, 0.0105, 10.0), (1200.0, 0.0135, 8.0)], unit_time_s=TAU, p_block_w=0.0
    )
    model = build_cost_model(two, kind="exp", unit_time_s=TAU)
    assert isinstance(model, cm.ConvexHullCostModel)
    assert (model.cost(10), model.cost(13)) == (pytest.approx(10.0), pytest.approx(8.0))

    three = prepare_options(
        [(1410.0, 0.0105, 10.0), (1300.0, 0.0115, 9.0), (1200.0, 0.0125, 8.5)],
        unit_time_s=TAU,
        p_block_w=0.0,
    )
    assert isinstance(build_cost_model(three, kind="exp", unit_time_s=TAU), cm.ExponentialCostModel)

    def degenerate(*args: object, **kwargs: object) -> None:
        raise PlanError("the exponential fit over durations [10, 12] is not finite")

    monkeypatch.setattr(cm, "fit_exponential", degenerate)
    assert isinstance(build_cost_model(three, kind="exp", unit_time_s=TAU), cm.ConvexHullCostModel)
