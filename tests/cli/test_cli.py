"""The mumoe-tn command line."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from mumoe_tn.cli import compare_command, main


def test_compare_default_is_the_papers_gpt2_layer(capsys):
    assert main(["compare", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["in_features"] == 768 and data["config"]["out_features"] == 3072
    assert data["config"]["expert_dims"] == [256]
    names = [row["name"] for row in data["rows"]]
    assert names == ["cp μMoE", "tr μMoE", "nn.Linear", "dense MoE (N=256)", "sparse top-2 MoE (N=256)"]
    linear = data["rows"][2]["params_total"]
    for row in data["rows"][:2]:  # parameter-matched to nn.Linear within one rank step
        assert abs(row["params_total"] - linear) / linear < 0.01


def test_compare_options(capsys, tmp_path):
    plot = tmp_path / "params.png"
    args = ["compare", "--in", "64", "--out", "96", "--experts", "8", "4", "--decompositions", "cp", "tt", "tucker"]
    args += ["--rank", "cp=16", "--match", "mlp", "--no-bias", "--batch", "32", "--markdown", "--plot", str(plot)]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "64 → 96 → 64 block" in out.out and "| cp μMoE block | r=16 |" in out.out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", "--csv", "--match", "2e6"]) == 0
    assert capsys.readouterr().out.startswith("name,ranks,")
    assert main(["compare"]) == 0
    assert "nn.Linear" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "--match", "10"], "below the smallest possible count"),
        (["compare", "--decompositions", "nope"], "unknown decomposition 'nope'"),
        (["compare", "--rank", "tt=4"], "ranks given for ['tt']"),
        (["compare", "--match", "lots"], "--match takes 'linear', 'mlp', a number"),
        (["compare", "--rank", "cp"], "--rank takes NAME=R"),
    ],
)
def test_compare_errors_exit_2_with_a_message(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_command(capsys):
    assert main(["plan", "tr", "--experts", "32", "32", "--rank", "4", "4", "4", "128", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "ContractionPlan" in out and "expert rank <= 512" in out
    assert main(["plan", "A: n1 a b, B: a i c, C: b c o", "--experts", "16", "--rank", "8"]) == 0
    assert "(… n1) · (n1 a b) -> (… a b)" in capsys.readouterr().out


def test_plan_command_says_when_the_optimizer_asked_for_was_beyond_its_effort_bound(capsys):
    assert main(["plan", "cp", "--experts", *["2"] * 10, "--rank", "2", "--optimize", "optimal"]) == 0
    out = capsys.readouterr().out
    assert "note: 'optimal' is an exhaustive search over 23 operands" in out
    assert "planned with 'greedy'" in out


# ----------------------------------------------------------------------------- tables that fit

#: Terminal names of the columns the table may leave out when narrow (the others always show).
OPTIONAL = {
    "ranks": "ranks",
    "params_experts": "expert params",
    "params_gate": "gate params",
    "fma_closed_form": "FMA/token closed form",
    "peak_elements": "peak/batch elements",
    "max_rank": "rank bound",
}


def _expected_cells(record: dict) -> dict[str, str]:
    """Each number as it must appear in full: thousands separators, ratios with ×."""
    cells = {}
    for key, value in record.items():
        if key.endswith("_vs_reference"):
            cells[key] = f"{value:,.0f}×" if value >= 100 else f"{value:.2f}×"
        elif isinstance(value, float) and value == int(value):
            cells[key] = f"{int(value):,}"
        elif isinstance(value, int) and not isinstance(value, bool):
            cells[key] = f"{value:,}"
    return cells


def _json_rows(capsys, args: list[str]) -> list[dict]:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize(
    "args",
    [
        ["compare"],
        ["compare", "--experts", "32", "32", "32", "32", "--decompositions", "cp", "tr", "tt", "tucker"],
        ["compare", "--match", "mlp", "--batch", "4096", "--dtype", "bfloat16"],
    ],
    ids=["default", "32^4-experts", "mlp-batch-4096"],
)
def test_compare_fits_the_terminal_and_never_cuts_a_number(capsys, monkeypatch, width, args):
    rows = _json_rows(capsys, args)
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= width, max(lines, key=len)
    assert "…" not in out and "..." not in out
    flat = " ".join(out.split())  # the "left out" note may wrap
    left_out = flat.split("left out to fit", 1)[1] if "left out to fit" in flat else ""
    assert all(row["name"].split()[0] in out for row in rows)
    for row in rows:
        for key, cell in _expected_cells(row).items():
            if key in OPTIONAL and OPTIONAL[key] in left_out:
                continue
            assert cell in out, f"{row['name']} {key}: {cell} is not shown in full"


def test_compare_wide_shows_every_column_in_full(capsys, monkeypatch):
    args = ["compare", "--experts", "32", "32", "32", "32"]
    rows = _json_rows(capsys, args)
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*args, "--wide"]) == 0
    out = capsys.readouterr().out
    assert "left out" not in out and "…" not in out
    for header in ("expert", "gate", "closed form", "rank", "float32"):
        assert header in out
    for row in rows:
        for key, cell in _expected_cells(row).items():
            assert cell in out, f"{row['name']} {key}: {cell} is not shown in full"
    # 32^4 experts: the dense MoE's 2,477,927,694,336 parameters and a ratio above a million
    assert "2,477,927,694,336" in out and "1,048,917×" in out


def test_compare_in_a_very_narrow_terminal_still_never_cuts_a_number(capsys, monkeypatch):
    rows = _json_rows(capsys, ["compare"])
    monkeypatch.setenv("COLUMNS", "12")
    assert main(["compare"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    for row in rows:
        assert f"{row['params_total']:,}" in out


def test_compare_labels_batch_and_token_and_states_memory_for_the_dtype(capsys):
    assert main(["compare", "--batch", "64", "--dtype", "float64", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "FMA per token (planned)" in out and "peak intermediate per batch (elements)" in out
    assert "per batch of 64 tokens" in out and "peak intermediate per batch (float64)" in out
    rows = _json_rows(capsys, ["compare", "--batch", "64"])
    linear = next(row for row in rows if row["name"] == "nn.Linear")
    # nn.Linear keeps its output: 64 tokens × 3072 float64 = 1,572,864 bytes = 1.5 MiB
    assert linear["peak_elements"] == 64 * 3072
    assert "| nn.Linear |  | 2,362,368 |" in out and "| 196,608 | 1.5 MiB |" in out


def test_compare_spec_adds_custom_networks_next_to_cp_and_tr(capsys, monkeypatch):
    specs = ["A: n1 a b, B: a i c, C: b c o", "n1 r, i r, r o"]
    args = ["compare", "--spec", specs[0], "--spec", specs[1]]
    rows = _json_rows(capsys, args)
    assert len(rows) == 4 + 3  # cp, tr, the two specs, then nn.Linear and the two MoEs
    custom = rows[2:4]
    assert [row["name"] for row in rows[:2]] == ["cp μMoE", "tr μMoE"]
    assert all(row["name"].endswith("μMoE") and row["name"] not in ("cp μMoE", "tr μMoE") for row in custom)
    # the first spec, bonds a = b = c = R: 256 R² + 769 R² + 3072 R² expert parameters
    r = custom[0]["ranks"]["a"]
    assert custom[0]["ranks"] == {"a": r, "b": r, "c": r}
    assert custom[0]["params_experts"] == (256 + 769 + 3072) * r * r
    monkeypatch.setenv("COLUMNS", "100")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    assert f"{custom[0]['params_total']:,}" in out and f"{custom[1]['params_total']:,}" in out


SPEC = "A: n1 a b, B: a i c, C: b c o"


def _spec_row(capsys, args):
    """The row of the one --spec in ``args``, next to a CP row."""
    rows = _json_rows(capsys, ["compare", "--decompositions", "cp", *args])
    assert len(rows) == 2 + 3, rows  # cp, the spec, then nn.Linear and the two MoEs
    return rows[1]


@pytest.mark.parametrize(
    ("spec", "key"),
    [(f"myRow={SPEC}", "myRow"), (SPEC, "custom 1"), (f"  Wide.Net-2 = {SPEC}", "Wide.Net-2")],
)
def test_spec_rows_have_one_name_for_the_table_and_rank(capsys, spec, key):
    one = _spec_row(capsys, ["--spec", spec, "--rank", f"{key}=8"])
    assert one["name"] == f"{key} μMoE" and one["ranks"] == {"a": 8, "b": 8, "c": 8}
    # the first spec, bonds a = b = c = 8: (256 + 769 + 3072)·8² expert parameters
    assert one["params_experts"] == (256 + 769 + 3072) * 64
    in_order = _spec_row(capsys, ["--spec", spec, "--rank", f"{key}=2,3,5"])
    assert in_order["ranks"] == {"a": 2, "b": 3, "c": 5}
    assert in_order["params_experts"] == 256 * 2 * 3 + 769 * 2 * 5 + 3072 * 3 * 5
    by_bond = _spec_row(capsys, ["--spec", spec, "--rank", f"{key}=c=5,a=2,b=3"])
    assert by_bond["ranks"] == {"a": 2, "b": 3, "c": 5}


NAMED = ["--spec", f"myRow={SPEC}", "--rank"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*NAMED, "nope=4"], "given for ['nope'], which name no row; the rows are ['cp', 'tr', 'myRow']"),
        (["--spec", SPEC, "--rank", "Other=4"], "['Other'], which name no row; the rows are ['cp', 'tr', 'custom 1']"),
        ([*NAMED, "myRow=8,8"], "'myRow' has 3 bonds ['a', 'b', 'c'], so it takes one rank or 3"),
        ([*NAMED, "myRow=a=8,b=4"], "ranks for 'myRow' by bond {'a': 8, 'b': 4} leaves out ['c']"),
        ([*NAMED, "myRow=a=8,b=4,c=1,d=2"], "names no bond ['d']"),
        ([*NAMED, "myRow=a=8,a=4"], "bond 'a' twice"),
        (["--spec", f"my row={SPEC}"], "a named spec is NAME=SPEC"),
    ],
)  # fmt: skip
def test_spec_row_errors_name_the_row_as_typed(capsys, args, message):
    _fails_with_one_line(capsys, ["compare", *args], message)


# ----------------------------------------------------------------------------- consistency


def test_plan_takes_ranks_like_compare_and_folds_the_bias(capsys):
    assert main(["plan", "tr", "--experts", "32", "--rank", "4,4,64"]) == 0
    commas = capsys.readouterr().out
    assert main(["plan", "tr", "--experts", "32", "--rank", "4", "4", "64"]) == 0
    assert capsys.readouterr().out == commas
    assert "i = 769 (768 inputs + 1 folded bias" in commas and "i=769" in commas
    # TR 4,4,64 at 32 experts, i = 769, o = 3072: 4·32·4 + 4·769·64 + 64·3072·4 parameters
    assert f"params={4 * 32 * 4 + 4 * 769 * 64 + 64 * 3072 * 4}" in commas
    assert main(["plan", "tr", "--experts", "32", "--rank", "4,4,64", "--no-bias"]) == 0
    assert "i=768" in capsys.readouterr().out


def test_demo_writes_no_file_unless_asked(capsys, monkeypatch, tmp_path):
    calls = []

    def fake_run_demo(experts, *, epochs, rank, seed, plot):
        calls.append(plot)
        return [{"experts": 4, "test_accuracy": 0.5, "experts_changing_a_class": 1, "mean_polysemanticity": 0.25}]

    monkeypatch.setattr("mumoe_tn.cli.demo_command.run_demo", fake_run_demo)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--experts", "4", "--epochs", "1"]) == 0
    assert calls == [None] and list(tmp_path.iterdir()) == []
    assert "| 4 | 0.500 | 1 | 0.250 |" in capsys.readouterr().out
    assert main(["demo", "--experts", "4", "--plot", str(tmp_path / "curve.png")]) == 0
    assert calls[-1] == str(tmp_path / "curve.png")


# ----------------------------------------------------------------------------- one-line errors


def _fails_with_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "", "no work is done (and nothing printed) before the error"
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert message in captured.err, captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "--match", "1e400"], "got '1e400'"),
        (["compare", "--match", "-5"], "got '-5'"),
        (["compare", "--match", "nan"], "got 'nan'"),
        (["compare", "--batch", "0"], "--batch: expected a positive integer, got '0'"),
        (["compare", "--experts", "-4"], "--experts: expected a positive integer, got '-4'"),
        (["compare", "--rank", "tr=4,x,8"], "got '4,x,8'"),
        (["compare", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["plan", "tr", "--batch", "0"], "--batch: expected a positive integer, got '0'"),
        (["plan", "tr", "--batch", "-3"], "--batch: expected a positive integer, got '-3'"),
        (["plan", "tr", "--rank", "4,0,64"], "got '4,0,64'"),
        (["plan", "n1 a, a i b, b o", "--rank", "4,4,4"], "has 2 bonds ['a', 'b'], so it takes one rank or 2"),
        (["demo", "--epochs", "-1"], "--epochs: expected a positive integer, got '-1'"),
        (["demo", "--epochs", "0"], "--epochs: expected a positive integer, got '0'"),
        (["compare", "--match", "10"], "below the smallest possible count"),
    ],
)
def test_bad_arguments_get_one_line(capsys, args, message):
    _fails_with_one_line(capsys, args, message)


@pytest.mark.parametrize("command", [["compare"], ["demo", "--experts", "4", "--epochs", "1"]])
def test_plot_outputs_are_checked_before_any_work(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setattr("mumoe_tn.cli.demo_command.run_demo", lambda *a, **k: pytest.fail("the demo ran"))
    _fails_with_one_line(capsys, [*command, "--plot", str(tmp_path / "missing" / "p.png")], "does not exist")
    _fails_with_one_line(capsys, [*command, "--plot", str(tmp_path)], "is a directory")
    if Path("/proc/self").is_dir():  # Linux: no file can be created in /proc, whoever runs the test
        _fails_with_one_line(capsys, [*command, "--plot", "/proc/p.png"], "cannot write to the directory '/proc'")
    if os.geteuid() != 0:  # root writes into read-only directories
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        _fails_with_one_line(capsys, [*command, "--plot", str(locked / "p.png")], "cannot write to the directory")
        locked.rmdir()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    extra = "plot" if command[0] == "compare" else "examples"
    _fails_with_one_line(capsys, [*command, "--plot", str(tmp_path / "p.png")], f"pip install 'mumoe_tn[{extra}]'")
    assert list(tmp_path.iterdir()) == []


def test_unexpected_library_errors_are_one_line(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise OverflowError("int too large to convert\nsecond line")

    monkeypatch.setattr(compare_command, "compare", broken)
    _fails_with_one_line(capsys, ["compare"], "error: OverflowError: int too large to convert second line")


def test_the_cli_page_names_every_command(capsys):
    import re
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["--help"])
    commands = re.search(r"\{([a-z,]+)\}", capsys.readouterr().out).group(1).split(",")
    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    first = page.split("\n\n")[1]
    assert f"has {['no', 'one', 'two', 'three', 'four', 'five', 'six', 'seven'][len(commands)]} commands" in first
    assert all(f"`{command}`" in first for command in commands)


FORMAT_MODULE = """
from mumoe_tn import ExpertNetwork, Format
from mumoe_tn.decompositions import normalise_ranks


class {cls}(Format, name="{name}"):
    def network(self, expert_dims, in_features, out_features, rank, **options):
        a, b = normalise_ranks(self.name, rank, 2)
        return ExpertNetwork.from_spec(
            "E: n1 a, I: i a b, O: b o", expert_dims=expert_dims, in_features=in_features,
            out_features=out_features, ranks={{"a": a, "b": b}},
        )
"""


def _compare_rows(capsys, argv):
    assert main(argv) == 0
    return [row["name"] for row in json.loads(capsys.readouterr().out)["rows"]]


def test_user_formats_load_by_import_and_by_entry_point(tmp_path, monkeypatch, capsys):
    from mumoe_tn.decompositions import available, unregister

    (tmp_path / "my_formats.py").write_text(FORMAT_MODULE.format(cls="Chain", name="chain_cli"))
    package = tmp_path / "plugged"
    package.mkdir()
    (package / "__init__.py").write_text(FORMAT_MODULE.format(cls="Plugged", name="plugged_cli"))
    info = tmp_path / "plugged-0.1.dist-info"  # an installed distribution, as importlib.metadata finds one
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugged\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mumoe_tn.formats]\nplugged = plugged\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        args = ["compare", "--experts", "8", "--json", "--decompositions", "chain_cli", "plugged_cli"]
        assert _compare_rows(capsys, ["--import", "my_formats", *args])[:2] == ["chain_cli μMoE", "plugged_cli μMoE"]
        assert _compare_rows(capsys, [*args, "--import", "my_formats"])[0] == "chain_cli μMoE"  # after the command
        with pytest.raises(SystemExit) as stopped:
            main(["--import", "not_a_module_here", "compare"])
        assert stopped.value.code == 2
        assert "--import not_a_module_here: cannot import it (ModuleNotFoundError" in capsys.readouterr().err
    finally:
        for name in ("chain_cli", "plugged_cli"):
            if name in available():
                unregister(name)
