"""Every figure the README and the documentation state holds, or says where it was measured.

Two kinds of figure:

- **computed** ones (parameter counts, ranks, tolerances, defaults, figures read from a committed
  result file): the tests below recompute them, exactly or to the digits printed;
- **measured** ones (timings, training results): each table of them, and each section that states
  a duration, carries a label "Measured on MACHINE, YYYY-MM-DD, with `COMMAND`" whose command
  the reader can run (a ``mumoe-tn`` command line the parser accepts, an example or the
  benchmarks with options they define).
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
IDS = [str(page.relative_to(ROOT)) for page in PAGES]

#: "Measured on MACHINE, DATE, with `COMMAND`", or the benchmark report's
#: "Measured DATE TIME on MACHINE ...; `COMMAND`".
LABEL = re.compile(
    r"[Mm]easured (?:on (?P<machine>[^`]+?), (?P<date>\d{4}-\d{2}-\d{2})"
    r"|(?P<date2>\d{4}-\d{2}-\d{2})[^`]*? on (?P<machine2>[^`;]+?)(?:;| with ))[^`]*?`(?P<command>[^`]+)`"
)
#: A cell that is a figure: 1,234 · 0.43 · 1.2e-06 · 1.41× · 12 % · 0.723 ± 0.005.
FIGURE = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?:×| ?%)?(?: ± \d[\d,]*(?:\.\d+)?)?")
#: A duration in running text: 2.9 s, 105 s, 8 min, 827 ms.
DURATION = re.compile(r"(?<![\w.])\d[\d,.]*\s?(?:ms|s|min)\b")
#: Words that make a duration a stated limit rather than a measurement.
LIMIT = re.compile(r"(?:more than|at most|under|within|guards? of|limits? of)\s+[^.]*$")


def _without_code(text: str) -> str:
    """The page with fenced code blocks blanked (their lines kept, so sections keep their shape)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group().count("\n"), text, flags=re.DOTALL | re.MULTILINE)


def _sections(text: str) -> list[str]:
    """The page split at its headings (code blocks blanked)."""
    return re.split(r"^#{1,6} .*$", _without_code(text), flags=re.MULTILINE)


def _tables(section: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """``(offset, header, rows)`` of each Markdown table in ``section``."""
    found = []
    for match in re.finditer(r"(?:^\|.*\|[ \t]*\n?)+", section, flags=re.MULTILINE):
        lines = match.group().strip().splitlines()
        if len(lines) < 2 or not re.fullmatch(r"\|(?:\s*:?-+:?\s*\|)+", lines[1].replace(" ", "")):
            continue
        split = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
        found.append((match.start(), split[0], split[2:]))
    return found


def _flat(text: str) -> str:
    return " ".join(text.split())


def _labels(text: str) -> list[re.Match]:
    return list(LABEL.finditer(_flat(text)))


def test_the_label_pattern_reads_both_label_forms():
    hand = "Measured on the project's CPU machine (2 cores), 2026-11-24, with `python examples/x.py --quick`: ..."
    (label,) = _labels(hand)
    assert (label["machine"], label["date"], label["command"]) == (
        "the project's CPU machine (2 cores)",
        "2026-11-24",
        "python examples/x.py --quick",
    )
    report = "*Measured 2026-11-23 21:01 UTC on cpu (AMD EPYC, threads 1); `python -m benchmarks.run --threads 1`.*"
    (label,) = _labels(report)
    assert (label["date2"], label["machine2"], label["command"]) == (
        "2026-11-23",
        "cpu (AMD EPYC, threads 1)",
        "python -m benchmarks.run --threads 1",
    )
    assert not _labels("measured with `mumoe-tn demo`") and not _labels("Measured on 2026-11-24 somewhere.")


def test_the_table_reader_finds_figure_tables_and_nothing_in_code():
    text = "intro\n\n| a | b |\n|---|---:|\n| x | 1,234 |\n\n```\n| c | d |\n|---|---|\n| 1 | 2 |\n```\n"
    ((_, header, rows),) = _tables(_sections(text)[0])
    assert header == ["a", "b"] and rows == [["x", "1,234"]]
    assert FIGURE.fullmatch("0.723 ± 0.005") and FIGURE.fullmatch("1.41×") and FIGURE.fullmatch("1.2e-06")
    assert not FIGURE.fullmatch("`tests/test_x.py::test_y`") and not FIGURE.fullmatch("CP μMoE")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_table_of_figures_says_where_it_was_measured(page):
    """A table with figures in its cells has a label above it in its section.

    (No computed table is written by hand: cost tables are printed when the site is built.)
    """
    for section in _sections(page.read_text()):
        for offset, header, rows in _tables(section):
            if not any(FIGURE.fullmatch(cell) for row in rows for cell in row):
                continue  # a table of words (modules, promises, formulas)
            assert _labels(section[:offset]), (
                f"{page.name}: the table {' | '.join(header)} has figures but no 'Measured on MACHINE, DATE, with "
                "`COMMAND`' above it in its section"
            )


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_duration_in_the_text_is_measured_or_a_stated_limit(page):
    for section in _sections(page.read_text()):
        prose = re.sub(r"^\|.*$", "", section, flags=re.MULTILINE)  # tables are checked above
        prose = re.sub(r"`[^`]*`", "", _flat(prose))  # code spans hold options, not figures
        for duration in DURATION.finditer(prose):
            before = prose[max(0, duration.start() - 40) : duration.start()]
            if LIMIT.search(before):
                continue
            context = prose[max(0, duration.start() - 60) : duration.end() + 20]
            assert _labels(section), f"{page.name}: {duration.group()!r} ({context!r}) is in a section with no label"


def _check_command(command: str) -> None:
    """The labelled command is one the reader can run with this checkout."""
    from mumoe_tn.cli.main import build_parser

    argv = shlex.split(command)
    if argv[0] == "mumoe-tn":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as error:
            raise AssertionError(f"`{command}`: the command line does not parse") from error
        return
    if argv[:2] == ["python", "-m"] and argv[2].startswith("benchmarks."):
        script, options = ROOT / (argv[2].replace(".", "/") + ".py"), argv[3:]
    elif argv[0] == "python" and argv[1].startswith("examples/"):
        script, options = ROOT / argv[1], argv[2:]
    elif argv[0] == "python" and argv[1].startswith("tests/"):  # a test module that prints its figures
        script, options = ROOT / argv[1], argv[2:]
        assert '__name__ == "__main__"' in script.read_text(), f"`{command}`: {script.name} is not a script"
    else:
        raise AssertionError(f"`{command}` is neither a mumoe-tn command, an example, a test script nor the benchmarks")
    assert script.is_file(), f"`{command}`: {script.relative_to(ROOT)} does not exist"
    source = script.read_text()
    for option in options:
        if option.startswith("--"):
            assert f'"{option}"' in source, f"`{command}`: {script.name} has no option {option}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_label_names_a_machine_a_past_date_and_a_command_that_runs_here(page):
    for label in _labels(_without_code(page.read_text())):
        machine = label["machine"] or label["machine2"]
        date = datetime.date.fromisoformat(label["date"] or label["date2"])
        assert len(machine) >= 3, label.group()
        assert datetime.date(2026, 1, 1) <= date <= datetime.date.today(), label.group()
        _check_command(label["command"])


def test_a_label_with_a_command_that_does_not_parse_is_caught():
    with pytest.raises(AssertionError, match="does not parse"):
        _check_command("mumoe-tn compare --no-such-option")
    with pytest.raises(AssertionError, match="has no option"):
        _check_command("python examples/char_gpt.py --no-such-option")
    with pytest.raises(AssertionError, match="neither"):
        _check_command("bash measure.sh")


# ----------------------------------------------------------------------------- computed figures


def _text(name: str) -> str:
    return _flat((ROOT / name).read_text())


def test_getting_started_states_the_match_and_the_matchers_tolerance():
    import torch

    from mumoe_tn import MuMoE
    from mumoe_tn.costs.matching import TOLERANCE

    torch.manual_seed(0)
    matched = MuMoE(64, 128, expert_dims=(8, 4), decomposition="tr", match="linear")
    params = sum(p.numel() for p in matched.parameters())
    linear = 64 * 128 + 128  # nn.Linear(64, 128) with its bias, by hand
    page = _text("docs/getting-started.md")
    miss = (params - linear) / linear
    assert "the 8,320 of `nn.Linear(64, 128)`" in page and linear == 8320
    assert f"gives {params:,} parameters, {100 * miss:+.1f} %" in page
    assert abs(miss) <= TOLERANCE and f"tolerance is ±{100 * TOLERANCE:.0f} %" in page


def test_getting_started_lists_the_runtime_dependencies_of_pyproject():
    tomllib = pytest.importorskip("tomllib")
    names = [
        re.match(r"[\w.-]+", dep).group()
        for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    listed = re.search(r"Runtime dependencies: ([^.]+)\.", _text("docs/getting-started.md")).group(1)
    normal = lambda name: name.lower().replace("_", "-")  # noqa: E731
    assert sorted(map(normal, listed.split(", "))) == sorted(map(normal, names))


def test_the_plan_forward_default_the_home_page_states_is_the_codes():
    import inspect

    from mumoe_tn.contractions.plan import plan_forward

    default = inspect.signature(plan_forward).parameters["optimize"].default
    assert f'(`"{default}"` by default' in _text("docs/index.md")


def test_the_command_line_page_counts_the_commands():
    from mumoe_tn.cli.main import build_parser

    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    (commands,) = (action for action in build_parser()._actions if action.dest == "command")
    assert f"`mumoe-tn` has {words[len(commands.choices)]} commands" in _text("docs/cli.md")
    assert all(f"`{name}`" in _text("docs/cli.md") for name in commands.choices)


def test_readme_ranks_and_expert_counts():
    from mumoe_tn.decompositions.registry import build

    readme = _text("README.md")
    tr = build("tr", (256,), 768 + 1, 3072, 256)
    r1, r2, r3 = (tr.sizes[bond] for bond in tr.bonds)
    assert f"R1 = R2 = {r1}, R3 = {r3}" in readme and r1 == r2
    assert f"expert 3's {768 + 1} × 3072 matrix" in readme
    assert f"has {32**4:,} experts" in readme and f"32⁴ = {32**4:,} experts" in readme


def _table_with(text: str, column: str) -> list[list[str]]:
    """The rows of the one table of ``text`` with this column."""
    (rows,) = (rows for section in _sections(text) for _, header, rows in _tables(section) if column in header)
    return rows


def _number(cell: str) -> float:
    return float(cell.strip().replace(",", "").rstrip("×"))


def test_readme_upcycling_prose_quotes_its_measured_table():
    readme = (ROOT / "README.md").read_text()
    dense, match, exact = _table_with(readme, "upcycle error")
    flat = _flat(readme)
    assert f"off by {_number(match[3]) * 100:.0f} %" in flat
    assert _number(match[4]) < 0.01 and "moves by under 1 %" in flat
    assert f"its loss by {_number(match[5]) - _number(dense[5]):.3f}" in flat
    assert f"costs {_number(exact[2]) / _number(match[2]):.1f}× the MLP parameters" in flat


def test_results_prose_quotes_its_tables_and_the_benchmark_report():
    results = (ROOT / "docs" / "results.md").read_text()
    flat = _flat(results)
    start, end = "<!-- quality-cpu:start -->", "<!-- quality-cpu:end -->"
    block = results[results.index(start) : results.index(end)]
    examples = results[results.index("## Examples") : results.index("## Polysemanticity")]
    prose = _flat(examples.replace(block, ""))
    # every gap the prose quotes is a figure of the benchmark's tables: the page's block, or the
    # full report (which adds each factor study's own table)
    full_report = (ROOT / "benchmarks" / "quality-cpu.md").read_text()
    quoted = re.findall(r"[-+]\d+\.\d\d %", prose)
    assert quoted, "the examples' prose quotes no gap"
    for gap in quoted:
        assert gap in block or gap in full_report, f"the prose quotes {gap}, which no table of the benchmark shows"
    losses = block[block.index("validation loss (mean ± std)") :]  # the longest run's table comes first
    mlp = next(line.split("|") for line in losses.splitlines() if line.startswith("| MLP |"))
    mlp_block = int(_number(mlp[3]))
    assert f"1,048,576 × {mlp_block:,} / 2 ≈ {round(2**20 * mlp_block / 2 / 1e9)} billion" in flat
    report = (ROOT / "benchmarks" / "results-cpu.md").read_text()
    inference = report[report.index("## Inference") :]
    for tokens in (8, 512):
        (row,) = [line for line in inference.splitlines() if f"{tokens} tokens, pre-contracted" in line]
        fwd = row.split("|")[6].strip()
        assert f"{tokens} tokens to {fwd}" in flat or f"{tokens} tokens to {fwd.rstrip('×')}" in flat
    autotune = report[report.index("## Autotuning") : report.index("## Inference")]
    ratios = [
        _number(cell)
        for line in autotune.splitlines()
        if line.startswith("|") and "autotuned" in line
        for cell in (line.split("|")[4], line.split("|")[6])
    ]
    assert f"({min(ratios):.2f}×–{max(ratios):.2f}× of the default plan" in flat


#: The specialisation page's columns and the committed result's keys.
SPECIALISATION_COLUMNS = {
    "test acc.": "test_accuracy",
    "experts used": "experts_used",
    "experts per sample": "experts_per_sample",
    "top coefficient": "top_coefficient",
    "experts changing a class": "experts_changing_a_class",
    "mean p (changing experts)": "mean_polysemanticity",
    "mean p (all experts)": "mean_polysemanticity_all",
    "mean max_c d": "mean_max_drop",
    "classes dropped per expert": "mean_classes_dropped",
}


def test_the_specialisation_table_is_the_committed_result_to_its_printed_digits():
    result = json.loads((ROOT / "docs" / "specialisation.json").read_text())
    page = (ROOT / "docs" / "specialisation.md").read_text()
    (table,) = [t for section in _sections(page) for t in _tables(section) if t[1][0] == "gate"]
    _, header, rows = table
    assert len(rows) == len(result["table"]) == 21
    for row, expected in zip(rows, result["table"], strict=True):
        cells = dict(zip(header, row, strict=True))
        assert (cells["gate"], int(cells["N"])) == (expected["gate"], expected["experts"])
        for title, key in SPECIALISATION_COLUMNS.items():
            mean, spread = cells[title].split(" ± ")
            digits = len(mean.partition(".")[2])
            for shown, value in ((mean, expected[key]), (spread, expected[f"{key}_std"])):
                assert abs(float(shown) - value) <= 0.5 * 10**-digits + 1e-12, (title, cells["gate"], cells["N"])


def test_the_specialisation_summary_quotes_the_committed_result():
    result = json.loads((ROOT / "docs" / "specialisation.json").read_text())
    row = {(r["gate"], r["experts"]): r for r in result["table"]}
    page = _text("docs/specialisation.md")
    p = lambda gate, n: row[(gate, n)]["mean_polysemanticity"]  # noqa: E731
    entmax, softmax, none = "entmax15+batchnorm", "softmax+batchnorm", "entmax15+none"
    assert f"{p(entmax, 1024):.3f} against {p(softmax, 1024):.3f} at 1,024" in page
    assert f"lower at 16 ({p(softmax, 16):.3f} against {p(entmax, 16):.3f})" in page
    assert f"({p(softmax, 32):.3f} against {p(entmax, 32):.3f} here)" in page
    assert abs(p(softmax, 32) - p(entmax, 32)) < 0.05  # "close"
    assert f"{p(none, 1024):.2f} against {p(entmax, 1024):.2f} at 1,024" in page
    dropped = [row[(entmax, n)]["mean_classes_dropped"] for n in (16, 32, 64, 128, 256, 512, 1024)]
    assert " → ".join(f"{d:.1f}" for d in dropped) in page
    assert all(a > b for a, b in itertools.pairwise(dropped))  # "falls monotonically"
