"""What the command line shows a person at a terminal: tables that fit, marks, one-line warnings, help, names."""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path

import pytest

from mumoe_tn.cli import main
from mumoe_tn.cli.main import build_parser
from mumoe_tn.costs.display import FOOTNOTE_MARKS

MILLION = ["compare", "--experts", "32", "32", "32", "32", "--decompositions", "cp", "tr", "tt", "tucker"]
#: Ranks in multiples of 96: TR's closest count is +29 % from the budget, CP's within it.
MISSED = ["compare", "--experts", "32", "32", "32", "32", "--decompositions", "cp", "tr", "--rank-multiple", "96"]


def _json(capsys, args: list[str]) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _tokens(out: str) -> set[str]:
    return set(out.translate({ord(mark): " " for mark in FOOTNOTE_MARKS}).split())


def _cells(row: dict) -> list[str]:
    """The numbers of a JSON row as the terminal prints them, by hand."""
    cells = []
    for key, value in row.items():
        if key.endswith("_vs_reference"):
            cells.append(f"{value:,.0f}×" if value >= 100 else f"{value:.2f}×")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value):
            cells.append(f"{int(value):,}")
    return cells


@pytest.mark.parametrize("width", [80, 40])
@pytest.mark.parametrize("args", [["compare"], MILLION, ["compare", "--match", "mlp", "--batch", "4096"]])
def test_wide_tables_fit_the_terminal_show_every_cell_and_break_words_only_at_spaces(capsys, monkeypatch, width, args):
    data = _json(capsys, args)
    monkeypatch.setenv("COLUMNS", str(width))
    assert main([*args, "--wide"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= width, max(out.splitlines(), key=len)
    assert "left out" not in out and "…" not in out
    tokens = _tokens(out)
    for row in data["rows"]:
        for cell in _cells(row):
            assert cell in tokens, f"{row['name']}: {cell} is not shown whole"
        words = row["name"].split() + [f"{bond}={size}" for bond, size in (row["ranks"] or {}).items()]
        for word in words:
            assert word in tokens or f"{word}," in tokens, f"{row['name']}: {word!r} is broken across lines"


@pytest.mark.parametrize("width", [60, 40])
def test_narrow_tables_fit_and_name_what_they_leave_out(capsys, monkeypatch, width):
    data = _json(capsys, MILLION)
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(MILLION) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= width
    assert "left out to fit" in " ".join(out.split())
    tokens = _tokens(out)
    for row in data["rows"]:
        assert f"{row['params_total']:,}" in tokens
        assert all(word in tokens for word in row["name"].split())


def test_a_row_that_missed_its_budget_is_marked_with_a_footnote_giving_the_miss(capsys, monkeypatch):
    data = _json(capsys, MISSED)
    capsys.readouterr()
    target = data["config"]["target_params"]
    missed = [row for row in data["rows"] if row["spec"] and abs(row["params_total"] - target) / target > 0.05]
    assert [row["name"] for row in missed] == ["tr μMoE"]
    (row,) = missed
    miss = (row["params_total"] - target) / target
    note = f"{row['name']}: {row['params_total']:,} parameters, {100 * miss:+.1f}% from the budget of {target:,}"
    for args, width in ((MISSED, 80), ([*MISSED, "--wide"], 100), ([*MISSED, "--markdown"], 200)):
        monkeypatch.setenv("COLUMNS", str(width))
        assert main(args) == 0
        out = capsys.readouterr().out
        assert f"¹ {note}" in " ".join(out.split()), args
        marked = [line for line in out.splitlines() if "¹" in line]
        rows = [line for line in marked if f"{row['name']}¹" in line]
        assert rows and all(line in rows or line.startswith("¹ ") for line in marked), marked
        assert "²" not in out  # no other row missed
    assert "| tr μMoE¹ |" in out  # the Markdown row carries the mark too


def test_warnings_are_one_line_each_in_the_programs_words(capsys):
    assert main([*MISSED, "--csv"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.startswith("mumoe-tn compare: warning: ") for line in err), err
    assert len(err) == len(set(err)) == 1  # TR's missed budget, once
    assert "+29.1%" in err[0] and ".py" not in err[0] and "warn(" not in err[0]


def test_a_warning_from_any_command_is_one_line(capsys, monkeypatch):
    from mumoe_tn.cli import plan_command

    def noisy(args):
        import warnings

        warnings.warn("something to know,\n  over two lines", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(plan_command, "run", noisy)
    assert main(["plan", "cp"]) == 0
    assert capsys.readouterr().err == "mumoe-tn plan: warning: something to know, over two lines\n"


def _actions(parser: argparse.ArgumentParser, prefix: str = "mumoe-tn"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{prefix} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prefix, action


def test_every_option_of_every_command_has_help():
    actions = list(_actions(build_parser()))
    commands = {prefix for prefix, _ in actions}
    assert {"mumoe-tn compare", "mumoe-tn plan", "mumoe-tn demo", "mumoe-tn specialisation"} <= commands
    missing = [
        f"{prefix} {action.option_strings or action.dest}"
        for prefix, action in actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"options without help: {missing}"


@pytest.mark.parametrize(
    ("args", "unknown", "suggestion"),
    [
        (["plan", "foo"], "unknown network name 'foo'", None),
        (["plan", "tucer"], "unknown network name 'tucer'", "did you mean 'tucker'?"),
        (["compare", "--decompositions", "cp", "tq"], "unknown decomposition 'tq'", "did you mean 'tt'?"),
        (["compar"], "invalid choice: 'compar'", "did you mean 'compare'?"),
        (["compare", "--dtype", "float31"], "invalid choice: 'float31'", "did you mean 'float32'?"),
        (["specialisation", "--gates", "softmax+batchnrm"], "invalid choice", "did you mean 'softmax+batchnorm'?"),
    ],
)
def test_an_unknown_name_lists_the_known_ones_and_suggests_the_closest(capsys, args, unknown, suggestion):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert unknown in line
    if (args[0] == "compare" and "--dtype" not in args) or args[0] == "plan":
        from mumoe_tn.decompositions.registry import available

        assert f"the known ones are {', '.join(available())}" in line
        assert {"cp", "tr", "tt", "tucker"} <= set(available())
    assert (suggestion in line) if suggestion else "did you mean" not in line


def test_the_specialisation_table_fits_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    args = ["specialisation", "--quick", "--no-progress", "--experts", "1", "4", "--gates", "entmax15+batchnorm"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 80
    assert "entmax15+batchnorm" in _tokens(out) and "classes" in out and "polysemanticity" in out
    spreads = re.findall(r"\d+\.\d+ ± \d+\.\d+", out)
    assert len(spreads) == 2 * 9  # two rows of nine mean ± std cells, none cut


class _Frames:
    """A tqdm that records the count shown with every displayed postfix (its regular refresh kept)."""

    def __init__(self, mininterval: float) -> None:
        from tqdm import tqdm

        frames = self.frames = []

        class Recorder(tqdm):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "file": io.StringIO(), "mininterval": mininterval})

            def display(self, msg=None, pos=None):
                if msg is None:
                    frames.append((self.n, self.postfix))
                return super().display(msg, pos)

        self.tqdm = Recorder


@pytest.mark.parametrize("mininterval", [0.0, 3600.0])
def test_the_examples_progress_bars_never_show_a_step_before_its_count(monkeypatch, mininterval):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    import char_gpt

    frames = _Frames(mininterval)
    monkeypatch.setattr(char_gpt, "tqdm", frames.tqdm)
    char_gpt.main(["--quick", "--threads", "1", "--variants", "MLP"])  # 40 steps
    # a loss is computed after a step: a frame that shows one also counts that step
    assert all(count >= 1 for count, postfix in frames.frames if postfix), frames.frames
    if mininterval == 0.0:
        assert max(count for count, _ in frames.frames) == 40


def test_the_specialisation_bar_advances_with_its_postfix(monkeypatch):
    import tqdm

    from mumoe_tn.analysis.specialisation_study import ExperimentConfig, run_experiment

    frames = _Frames(3600.0)
    monkeypatch.setattr(tqdm, "tqdm", frames.tqdm)
    config = ExperimentConfig.quick()
    config = type(config)(**{**config.__dict__, "expert_counts": (1,), "seeds": (0,), "gates": ("softmax+batchnorm",)})
    run_experiment(config, progress=True)
    assert all(count >= 1 for count, postfix in frames.frames if postfix), frames.frames


@pytest.mark.parametrize("example", ["char_gpt", "mixer_digits"])
def test_the_examples_time_column_never_rounds_a_short_run_to_zero(monkeypatch, example):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    module = __import__(example)
    assert [module.seconds(s) for s in (0.04, 0.4, 3.14159, 12.6)] == ["0.04", "0.4", "3.1", "13"]
    del sys.modules[example]


def test_plan_output_fits_the_terminal_and_keeps_words_whole(capsys, monkeypatch):
    spec = "A: n1 a b, B: a i c, C: b c o"
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", spec, "--rank", "16", "--batch", "64"]) == 0
    wide = capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["plan", spec, "--rank", "16", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 60 < max(map(len, wide.splitlines()))
    assert out.split() == wide.split()  # the same words, only the line breaks moved
