"""Profile ingestion and validation (powerlib.planning.profile)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from powerlib.errors import PlanError
from powerlib.planning.pipeline import BACKWARD, FORWARD
from powerlib.planning.profile import PROFILE_SCHEMA, Profile
from powerlib.planning.profile_rows import ProfileRow

SHARED = Path(__file__).resolve().parents[3] / "shared"
SYNTH4 = SHARED / "perseus_validation" / "synthetic" / "profile_synth4.csv"
GPT3_A100 = SHARED / "perseus_validation" / "sosp24_emulation" / "profile_gpt3-175b_a100_sxm.csv"

HEADER = "stage,instruction,frequency,time,energy"


def csv_lines(num_stages: int = 2, freqs: tuple[int, ...] = (1410, 1200)) -> list[str]:
    """Data lines of a small valid profile (lines 2.. of the file)."""
    lines = []
    for stage in range(num_stages):
        for kind, base_s in (("forward", 0.010), ("backward", 0.020)):
            for freq in freqs:
                time_s = base_s * 1410 / freq * (1 + stage / 10)
                lines.append(f"{stage},{kind},{freq},{time_s!r},{time_s * 200!r}")
    return lines


def write(tmp_path: Path, lines: list[str], name: str = "bad_profile.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def read_error(path: Path) -> str:
    with pytest.raises(PlanError) as info:
        Profile.read(path)
    message = str(info.value)
    assert "\n" not in message
    assert path.name in message
    return message


# --- the real files ------------------------------------------------------------------------------


@pytest.mark.skipif(not SYNTH4.exists(), reason="shared validation data not present")
def test_reads_synthetic_4_stage_profile() -> None:
    profile = Profile.read(SYNTH4)
    assert profile.stages == (0, 1, 2, 3)
    assert len(profile.rows) == 4 * 2 * 10
    for stage in profile.stages:
        for kind in (FORWARD, BACKWARD):
            options = profile.options(stage, kind)
            assert len(options) == 10
            freqs = [freq for freq, _, _ in options]
            assert freqs == sorted(freqs, reverse=True)
            assert profile.max_freq_mhz(stage, kind) == 1410.0
    assert profile.options(0, FORWARD)[0] == (1410.0, 0.03, 9.0)
    profile.validate_for(4)
    with pytest.raises(PlanError, match="covers 4 stages but the pipeline has 8"):
        profile.validate_for(8)


@pytest.mark.skipif(not GPT3_A100.exists(), reason="shared validation data not present")
def test_reads_gpt3_a100_emulation_profile() -> None:
    profile = Profile.read(GPT3_A100)
    assert profile.stages == tuple(range(8))
    assert len(profile.rows) == 8 * 2 * 38
    for stage in profile.stages:
        for kind in (FORWARD, BACKWARD):
            freqs = [freq for freq, _, _ in profile.options(stage, kind)]
            assert freqs == [1410.0 - 15 * i for i in range(38)]
    assert profile.options(0, FORWARD)[0] == (1410.0, 0.05016166687011708, 23.80547200000007)
    profile.validate_for(8)


@pytest.mark.parametrize("path", [SYNTH4, GPT3_A100], ids=["synth4", "gpt3"])
def test_real_files_round_trip(path: Path, tmp_path: Path) -> None:
    if not path.exists():
        pytest.skip("shared validation data not present")
    profile = Profile.read(path)
    profile.write_csv(tmp_path / "copy.csv")
    profile.write_json(tmp_path / "copy.json")
    from_csv = Profile.read(tmp_path / "copy.csv")
    from_json = Profile.read(tmp_path / "copy.json")
    assert from_csv.rows == profile.rows  # floats written with repr: exact
    assert from_json.rows == profile.rows
    assert from_json == profile and hash(from_json) == hash(profile)
    assert json.loads((tmp_path / "copy.json").read_text())["schema"] == PROFILE_SCHEMA


# --- parsing -------------------------------------------------------------------------------------


def test_columns_in_any_order_and_extra_columns_ignored() -> None:
    text = "energy,Frequency,note,time,instruction,stage\n" + "\n".join(
        [
            "9.0,1410,a,0.03,forward,0",
            "8.0,1200,b,0.04,Forward,0",
            "18.0,1410,c,0.06,BACKWARD,0",
            "16.0,1200,d,0.08,backward,0",
        ]
    )
    profile = Profile.from_csv_text(text)
    assert profile.options(0, FORWARD) == [(1410.0, 0.03, 9.0), (1200.0, 0.04, 8.0)]
    assert profile.options(0, BACKWARD) == [(1410.0, 0.06, 18.0), (1200.0, 0.08, 16.0)]
    assert {row.instruction for row in profile.rows} == {FORWARD, BACKWARD}


def test_rank_columns_are_aggregated_time_max_energy_mean() -> None:
    """Zeus writes one row per rank; a stage's TP ranks merge as time = max, energy = mean."""
    lines = ["rank,dp_rank,pp_rank,tp_rank," + HEADER]
    for tp_rank, (dt, de) in enumerate([(0.0, 0.0), (0.002, 1.0)]):
        for kind, t, e in (("forward", 0.03, 9.0), ("backward", 0.06, 18.0)):
            for freq, scale in ((1410, 1.0), (1200, 1.2)):
                lines.append(f"{tp_rank},0,0,{tp_rank},0,{kind},{freq},{t * scale + dt},{e + de}")
    profile = Profile.from_csv_text("\n".join(lines))
    assert len(profile.rows) == 4
    freq, time_s, energy_j = profile.options(0, FORWARD)[0]
    assert (freq, time_s, energy_j) == (1410.0, 0.032, 9.5)
    assert profile.options(0, BACKWARD)[1] == (1200.0, pytest.approx(0.074), 18.5)


def test_rank_columns_with_the_same_ranks_are_duplicates(tmp_path: Path) -> None:
    lines = ["rank," + HEADER] + [f"0,{line}" for line in csv_lines()]
    lines.append("0," + csv_lines()[0])
    message = read_error(write(tmp_path, lines))
    assert "line 10: duplicate row for stage 0 forward at 1410 MHz (first at line 2)" in message


def test_blank_lines_bom_and_spaces_are_tolerated() -> None:
    text = "\ufeff" + HEADER.replace(",", " , ") + "\n\n" + "\n".join(csv_lines()) + "\n\n"
    assert len(Profile.from_csv_text(text).rows) == 8


def test_integral_float_stage_accepted() -> None:
    lines = [HEADER] + [
        line.replace("0,", "0.0,", 1) if line[0] == "0" else line for line in csv_lines()
    ]
    assert Profile.from_csv_text("\n".join(lines)).stages == (0, 1)


def test_rows_are_sorted_and_constructor_accepts_rows() -> None:
    rows = [
        ProfileRow(stage=1, instruction="backward", freq_mhz=1000, time_s=0.2, energy_j=20.0),
        ProfileRow(stage=0, instruction="Forward", freq_mhz=1000, time_s=0.1, energy_j=9.0),
        ProfileRow(stage=0, instruction="forward", freq_mhz=1400, time_s=0.08, energy_j=10.0),
        ProfileRow(stage=0, instruction="backward", freq_mhz=1000, time_s=0.2, energy_j=20.0),
        ProfileRow(stage=0, instruction="backward", freq_mhz=1400, time_s=0.16, energy_j=22.0),
        ProfileRow(stage=1, instruction="backward", freq_mhz=1400, time_s=0.16, energy_j=22.0),
        ProfileRow(stage=1, instruction="forward", freq_mhz=1000, time_s=0.1, energy_j=9.0),
        ProfileRow(stage=1, instruction="forward", freq_mhz=1400, time_s=0.08, energy_j=10.0),
    ]
    profile = Profile(rows)
    assert [(r.stage, r.instruction, r.freq_mhz) for r in profile.rows] == [
        (0, "forward", 1400.0), (0, "forward", 1000.0), (0, "backward", 1400.0),
        (0, "backward", 1000.0), (1, "forward", 1400.0), (1, "forward", 1000.0),
        (1, "backward", 1400.0), (1, "backward", 1000.0),
    ]  # fmt: skip
    assert all(isinstance(r.freq_mhz, float) for r in profile.rows)
    assert profile.num_stages == 2
    assert profile.max_freq_mhz(1, BACKWARD) == 1400.0
    assert "2 stages" in repr(profile)
    # options() returns a copy
    profile.options(0, FORWARD).clear()
    assert len(profile.options(0, FORWARD)) == 2


def test_constructor_errors_name_the_row() -> None:
    rows = [
        ProfileRow(stage=0, instruction="forward", freq_mhz=1400, time_s=0.1, energy_j=1.0),
        ProfileRow(stage=0, instruction="forward", freq_mhz=1000, time_s=-0.1, energy_j=1.0),
    ]
    with pytest.raises(PlanError, match=r"^<rows>: rows\[1\]: time_s must be > 0"):
        Profile(rows)
    with pytest.raises(PlanError, match=r"^mine: the profile has no rows"):
        Profile([], source="mine")


def test_options_for_unknown_stage_or_kind() -> None:
    profile = Profile.from_csv_text("\n".join([HEADER, *csv_lines()]), source="p.csv")
    with pytest.raises(PlanError, match="p.csv: no profile for stage 5 'forward'"):
        profile.options(5, FORWARD)
    with pytest.raises(PlanError, match="no profile for stage 0 'recompute'"):
        profile.max_freq_mhz(0, "recompute")
    with pytest.raises(PlanError, match="no profile for stage 0 'recompute'"):
        profile.validate_for(2, kinds=("forward", "recompute"))
    profile.validate_for(2)


# --- every validation error: one line, file name, line number ------------------------------------

GOOD = csv_lines()  # lines 2..9: stage 0 F 1410, F 1200, B 1410, B 1200, stage 1 likewise


def replace(line_no: int, new: str) -> list[str]:
    """The good profile with file line ``line_no`` (2-based data) replaced."""
    lines = [HEADER, *GOOD]
    lines[line_no - 1] = new
    return lines


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            ["stage,instruction,frequency,time", *[line.rsplit(",", 1)[0] for line in GOOD]],
            "line 1: missing column(s) energy; the header needs stage,instruction,frequency,time,energy",
        ),
        (
            ["stage,kind,freq,t,e", *GOOD],
            "line 1: missing column(s) instruction, frequency, time, energy",
        ),
        (["stage,stage,instruction,frequency,time,energy"], "line 1: column 'stage' appears twice"),
        (replace(3, "0,forward,1200,fast,8.0"), "line 3: column time is not a number: 'fast'"),
        (replace(3, "0,forward,1200,0.01,"), "line 3: column energy is not a number: ''"),
        (replace(3, "0,forward,high,0.01,8.0"), "line 3: column frequency is not a number: 'high'"),
        (
            replace(4, "zero,backward,1410,0.02,4.0"),
            "line 4: column stage must be an integer, got 'zero'",
        ),
        (
            replace(4, "0.5,backward,1410,0.02,4.0"),
            "line 4: column stage must be an integer, got '0.5'",
        ),
        (
            replace(4, "-1,backward,1410,0.02,4.0"),
            "line 4: column stage must be an integer >= 0, got -1",
        ),
        (replace(5, "0,backward,1200,-0.02,4.0"), "line 5: column time must be > 0, got -0.02 s"),
        # issue 36: a zero time was let through to the planner's "point 0 needs ..."
        (replace(5, "0,backward,1200,0,4.0"), "line 5: column time must be > 0, got 0.0 s"),
        (replace(5, "0,backward,1200,0.02,-4.0"), "line 5: column energy must be >= 0, got -4.0 J"),
        (replace(5, "0,backward,1200,nan,4.0"), "line 5: column time must be finite, got nan s"),
        (replace(5, "0,backward,1200,0.02,inf"), "line 5: column energy must be finite, got inf J"),
        (replace(6, "1,forward,0,0.01,2.0"), "line 6: column frequency must be > 0, got 0.0 MHz"),
        (
            replace(6, "1,forward,-1410,0.01,2.0"),
            "line 6: column frequency must be > 0, got -1410.0 MHz",
        ),
        (
            replace(6, "1,forward,inf,0.01,2.0"),
            "line 6: column frequency must be finite, got inf MHz",
        ),
        (
            replace(3, GOOD[0]),
            "line 3: duplicate row for stage 0 forward at 1410 MHz (first at line 2)",
        ),
        (
            replace(7, "1,recompute,1200,0.01,2.0"),
            "line 7: unknown instruction 'recompute'; expected forward, backward, backward_input, backward_weight",
        ),
        (replace(7, "1,forward,1200"), "line 7: expected 5 fields as in the header, got 3"),
        (
            [HEADER, *[line for line in GOOD if ",1200," not in line or line.startswith("1,b")]],
            "line 2: stage 0 forward has only one frequency (1410 MHz); the planner needs at least two",
        ),
        (
            [
                HEADER,
                *[line.replace("1,", "3,", 1) if line.startswith("1,") else line for line in GOOD],
            ],
            "stage 1 is missing (stages present: 0, 3); stages must be numbered 0..N-1 without gaps",
        ),
        (
            [
                HEADER,
                *[line.replace("0,", "2,", 1) if line.startswith("0,") else line for line in GOOD],
            ],
            "stage 0 is missing (stages present: 1, 2)",
        ),
        (
            [HEADER, *[line for line in GOOD if not line.startswith("1,backward")]],
            "stage 1 has forward rows (first at line 6) but no backward rows",
        ),
        (
            [HEADER, *[line for line in GOOD if not line.startswith("0,forward")]],
            "stage 0 has backward rows (first at line 2) but no forward rows",
        ),
        ([HEADER], "the profile has a header but no rows"),
        ([""], "the profile is empty; expected a header stage,instruction,frequency,time,energy"),
    ],
)
def test_csv_validation_errors(tmp_path: Path, lines: list[str], expected: str) -> None:
    path = write(tmp_path, lines)
    message = read_error(path)
    assert message == f"{path}: {expected}" or message.startswith(f"{path}: {expected}"), message


def test_unknown_suffix_and_missing_file(tmp_path: Path) -> None:
    message = read_error(write(tmp_path, [HEADER, *GOOD], name="profile.txt"))
    assert "unknown profile format '.txt'; use .csv or .json" in message
    assert "cannot read the profile" in read_error(tmp_path / "absent.csv")


# --- JSON ----------------------------------------------------------------------------------------


def good_json() -> dict:
    return Profile.from_csv_text("\n".join([HEADER, *GOOD])).to_json()


def test_json_round_trip_in_memory() -> None:
    data = good_json()
    assert data["schema"] == "powerlib.profile.v1"
    assert set(data["rows"][0]) == {"stage", "instruction", "freq_mhz", "time_s", "energy_j"}
    assert Profile.from_json(data).to_json() == data
    assert Profile.from_json(json.loads(json.dumps(data))).to_json() == data


def test_json_accepts_integer_numbers() -> None:
    data = good_json()
    data["rows"][0]["freq_mhz"] = 1410
    data["rows"][0]["energy_j"] = 3
    profile = Profile.from_json(data)
    assert profile.options(0, FORWARD)[0][0] == 1410.0
    assert isinstance(profile.rows[0].energy_j, float)


def _mutated(change) -> dict:
    data = good_json()
    change(data)
    return data


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([], "a JSON profile must be an object with 'schema' and 'rows'"),
        (
            _mutated(lambda d: d.update(schema="powerlib.profile.v0")),
            "unknown schema 'powerlib.profile.v0'",
        ),
        (_mutated(lambda d: d.pop("schema")), "unknown schema None"),
        (_mutated(lambda d: d.update(rows={})), "'rows' must be a list of row objects"),
        (_mutated(lambda d: d["rows"].__setitem__(2, 7)), "rows[2]: expected an object, got 7"),
        (_mutated(lambda d: d["rows"][3].pop("time_s")), "rows[3]: missing field(s) time_s"),
        (
            _mutated(lambda d: d["rows"][1].update(stage="0")),
            "rows[1]: stage must be an integer, got '0'",
        ),
        (
            _mutated(lambda d: d["rows"][1].update(time_s="0.1")),
            "rows[1]: time_s must be a number, got '0.1'",
        ),
        (
            _mutated(lambda d: d["rows"][1].update(energy_j=True)),
            "rows[1]: energy_j must be a number, got True",
        ),
        (
            _mutated(lambda d: d["rows"][1].update(instruction=3)),
            "rows[1]: instruction must be a string, got 3",
        ),
        (
            _mutated(lambda d: d["rows"][4].update(instruction="fwd")),
            "rows[4]: unknown instruction 'fwd'",
        ),
        (
            _mutated(lambda d: d["rows"][5].update(time_s=-1.0)),
            "rows[5]: time_s must be > 0, got -1.0 s",
        ),
        (_mutated(lambda d: d["rows"][5].update(freq_mhz=0)), "rows[5]: freq_mhz must be > 0"),
        (
            _mutated(lambda d: d["rows"][5].update(time_s=0.0)),
            "rows[5]: time_s must be > 0, got 0.0 s",
        ),
        (_mutated(lambda d: d.update(p_block_w="80")), "p_block_w must be a number, got '80'"),
        (_mutated(lambda d: d.update(p_block_w=-1)), "p_block_w must be >= 0, got -1.0 W"),
        (_mutated(lambda d: d.update(unit_time_s=0)), "unit_time_s must be > 0, got 0.0 s"),
        (
            _mutated(lambda d: d["rows"].append(dict(d["rows"][0]))),
            "rows[8]: duplicate row for stage 0 forward at 1410 MHz (first at rows[0])",
        ),
    ],
)
def test_json_validation_errors(tmp_path: Path, data: object, expected: str) -> None:
    path = tmp_path / "bad_profile.json"
    path.write_text(json.dumps(data))
    message = read_error(path)
    assert message.startswith(f"{path}: {expected}"), message


def test_invalid_json_text(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"schema": "powerlib.profile.v1",\n "rows": [}\n')
    assert "line 2: invalid JSON" in read_error(path)


def test_to_csv_text_is_exact() -> None:
    profile = Profile.from_csv_text("\n".join([HEADER, *GOOD]))
    text = profile.to_csv_text()
    assert text.splitlines()[0] == HEADER
    assert text.splitlines()[1].startswith("0,forward,1410,")
    again = Profile.from_csv_text(text)
    assert again.rows == profile.rows
    assert all(math.isfinite(row.time_s) for row in again.rows)


# --- the planner settings a profile carries (issue 36) -------------------------------------------


def test_settings_round_trip_through_csv_and_json(tmp_path: Path) -> None:
    rows = Profile.from_csv_text("\n".join([HEADER, *GOOD])).rows
    profile = Profile(rows, p_block_w=83.64, unit_time_s=0.001)
    assert (profile.p_block_w, profile.unit_time_s) == (83.64, 0.001)
    profile.write_csv(tmp_path / "p.csv")
    profile.write_json(tmp_path / "p.json")
    header = (tmp_path / "p.csv").read_text().splitlines()[0]
    assert header == HEADER + ",p_block_w,unit_time_s"
    data = json.loads((tmp_path / "p.json").read_text())
    assert (data["p_block_w"], data["unit_time_s"]) == (83.64, 0.001)
    for name in ("p.csv", "p.json"):
        again = Profile.read(tmp_path / name)
        assert again == profile and (again.p_block_w, again.unit_time_s) == (83.64, 0.001)
    # without settings nothing changes: five columns, no JSON fields, and not equal to the above
    bare = Profile(rows)
    assert bare.to_csv_text().splitlines()[0] == HEADER
    assert "p_block_w" not in bare.to_json() and bare != profile


def test_csv_settings_are_one_value_and_empty_cells_are_absent(tmp_path: Path) -> None:
    lines = [HEADER + ",p_block_w", *[f"{line},80" for line in GOOD]]
    assert Profile.from_csv_text("\n".join(lines)).p_block_w == 80.0
    blank = [HEADER + ",unit_time_s", *[f"{line}," for line in GOOD]]
    assert Profile.from_csv_text("\n".join(blank)).unit_time_s is None
    lines[4] = lines[4][: -len("80")] + "70"
    message = read_error(write(tmp_path, lines))
    assert message.endswith(
        "line 5: column p_block_w is 70 here but 80.0 at line 2; a profile carries one value"
    )
    lines[4] = lines[4][: -len("70")] + "fast"
    assert "line 5: column p_block_w is not a number: 'fast'" in read_error(write(tmp_path, lines))
    lines[4] = lines[4][: -len("fast")] + "nan"
    assert "line 5: column p_block_w must be finite, got nan W" in read_error(
        write(tmp_path, lines)
    )
