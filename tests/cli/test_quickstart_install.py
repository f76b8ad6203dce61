"""The README's commands work after the Quickstart install alone (``pip install -e .``, no extras).

The commands run in a fresh interpreter in which every installed distribution that the
Quickstart install would not have brought is hidden: the import system finds nothing of it, as
if it were not installed. What remains is the standard library, mumoe_tn and the closure of its
``[project] dependencies``. Every command then either succeeds or ends with one line naming the
extra to install; none fails on an import.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Hides every distribution outside the dependency closure of pyproject.toml, then runs each command.
SCRIPT = r"""
import contextlib, importlib.machinery, importlib.metadata as md, io, json, re, sys, tomllib

def name(requirement):
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower().replace("_", "-").replace(".", "-")

wanted = [r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
closure, todo = set(), [name(r) for r in wanted]
while todo:
    dist = todo.pop()
    if dist in closure:
        continue
    closure.add(dist)
    try:
        requires = md.requires(dist) or []
    except md.PackageNotFoundError:
        continue
    todo += [name(r) for r in requires if "extra" not in r.partition(";")[2]]
hidden = {
    module
    for module, dists in md.packages_distributions().items()
    if module != "mumoe_tn" and not any(name(d) in closure for d in dists)
}
assert not hidden & set(sys.modules), sorted(hidden & set(sys.modules))
PathFinder = importlib.machinery.PathFinder

class Hide:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname.partition(".")[0] in hidden:
            return None
        return PathFinder.find_spec(fullname, path, target)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):
        return PathFinder.find_distributions(*args, **kwargs)

sys.meta_path[:] = [Hide if finder is PathFinder else finder for finder in sys.meta_path]

from mumoe_tn.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in hidden)
print(json.dumps({"results": results, "hidden": sorted(hidden), "loaded": loaded}))
"""


def readme_commands() -> list[list[str]]:
    """Every ``mumoe-tn`` line of the README's shell blocks, as argument lists."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    commands = []
    for block in blocks:
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["mumoe-tn"]:
                    commands.append(words[1:])
    return commands


def test_the_readme_lists_every_command():
    from mumoe_tn.cli.main import build_parser

    (commands,) = (action for action in build_parser()._actions if action.dest == "command")
    assert {argv[0] for argv in readme_commands()} == set(commands.choices)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    pytest.importorskip("tomllib")
    listed = readme_commands()
    plot = str(tmp_path_factory.mktemp("plots") / "x.png")
    argvs = [
        *[[argv[0], "--help"] for argv in listed],
        *[[*argv[:-1], plot] if argv[-1].endswith(".png") else argv for argv in listed],
        ["specialisation", "--quick", "--no-progress", "--experts", "1", "--plot", plot],
    ]
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(argvs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path_factory.mktemp("home"))},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_optional_packages_are_hidden_and_never_imported(quickstart):
    hidden = set(quickstart["hidden"])
    # what the extras bring is hidden; the dependencies' own closure (numpy for tensorly, ...) is not
    assert {"matplotlib", "sklearn", "transformers", "pytest", "hypothesis", "cotengra"} <= hidden
    assert not hidden & {"torch", "tensorly", "tltorch", "opt_einsum", "entmax", "networkx", "rich", "tqdm", "numpy"}
    assert quickstart["loaded"] == []


def test_every_readme_command_runs_or_names_its_extra_in_one_line(quickstart):
    extras = re.compile(r"pip install 'mumoe_tn\[(\w+)\]'")
    outcomes = {}
    for result in quickstart["results"]:
        command = "mumoe-tn " + shlex.join(result["argv"])
        assert "Traceback" not in result["err"] and "ModuleNotFoundError" not in result["err"], command
        errors = [line for line in result["err"].splitlines() if ": error: " in line]
        if result["code"] == 0:
            assert not errors, command
            assert result["out"].strip(), f"{command} printed nothing"
            outcomes[command] = "ran"
        else:
            assert result["code"] == 2, command
            (line,) = errors  # one line
            assert extras.search(line), f"{command}: {line}"
            outcomes[command] = extras.search(line).group(1)
    # without matplotlib, every --plot names the extra that brings it; the demo needs scikit-learn
    assert {o for c, o in outcomes.items() if "--plot" in c} <= {"plot", "examples"}
    assert outcomes["mumoe-tn demo"] == "examples"
    plain = [argv for argv in readme_commands() if argv[0] != "demo" and not argv[-1].endswith(".png")]
    assert len(plain) >= 8 and all(outcomes["mumoe-tn " + shlex.join(argv)] == "ran" for argv in plain)
    assert all(o == "ran" for c, o in outcomes.items() if "--help" in c)


def _extras_closure(extras: set[str], table: dict[str, list[str]]) -> set[str]:
    """The requirements that ``pip install -e ".[extras]"`` brings, nested ``mumoe_tn[...]`` expanded."""
    requirements, todo = set(), list(extras)
    while todo:
        for requirement in table[todo.pop()]:
            nested = re.fullmatch(r"mumoe_tn\[([\w,]+)\]", requirement)
            if nested:
                todo += nested.group(1).split(",")
            else:
                requirements.add(requirement)
    return requirements


def test_the_readme_test_command_installs_everything_the_suite_covers():
    """No test skips for a package the README's test install leaves out, and CI installs the same."""
    tomllib = pytest.importorskip("tomllib")
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = re.compile(r"""pip install (?:--quiet )?-e "\.\[([\w,]+)\]"[^\n]*""")
    (readme,) = [m for m in installs.finditer((ROOT / "README.md").read_text()) if "pytest tests" in m.group()]
    (ci,) = installs.findall((ROOT / ".ci" / "run").read_text())
    installed = _extras_closure(set(readme.group(1).split(",")), table)
    assert _extras_closure(set(ci.split(",")), table) == installed
    tools = {"dev", "mutation"}  # the linter and the mutation tester are run, not tested
    for extra in set(table) - tools:
        assert _extras_closure({extra}, table) <= installed, extra
    docs_modules = {"mkdocs", "mkdocs-material", "mkdocstrings[python]", "markdown-katex-rs", "markdown-exec"}
    assert docs_modules <= {re.match(r"[\w.\[\]-]+?(?=[<>=]|$)", r).group() for r in installed}
