"""``--import MODULE`` runs a module's code, so it is imported only once the whole command line parses."""

import sys

import pytest

from mumoe_tn.cli import main

MODULE = "mumoe_cli_import_probe"


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module on the path that writes a sentinel file when it is imported."""
    sentinel = tmp_path / "imported"
    (tmp_path / f"{MODULE}.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield sentinel
    sys.modules.pop(MODULE, None)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (["explore", "x.py:f", "--title", f"--import={MODULE}"], "argument --title: expected one argument"),
        (["explore", "x.py:f", "--title", f"--imp={MODULE}"], "argument --title: expected one argument"),
        (["explore", "x.py:f", f"--imp={MODULE}", "--bogus"], "unrecognized arguments: --bogus"),
        ([f"--import={MODULE}", "explore"], "the following arguments are required: MODEL"),
        ([f"--import={MODULE}", "compare", "--experts"], "argument --experts: expected at least one argument"),
    ],
    ids=["value-missing", "abbreviated", "unknown-option", "positional-missing", "option-value-missing"],
)
def test_a_line_argparse_refuses_imports_nothing(probe, capsys, line, error):
    with pytest.raises(SystemExit) as stopped:
        main(line)
    assert stopped.value.code == 2
    assert error in capsys.readouterr().err
    assert not probe.exists(), "the module named by --import ran before the line was parsed"
    assert MODULE not in sys.modules


def test_a_line_argparse_accepts_imports_its_modules_first(probe, capsys):
    assert main(["compare", "--experts", "8", "--json", f"--imp={MODULE}"]) == 0
    assert probe.read_text() == "ran"
