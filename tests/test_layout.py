"""The package's layout is its architecture: imports point one way, with no circles.

Read from the source with ``ast`` (imports inside functions included; imports only for type
checkers excluded, since they never run).
"""

import ast
import importlib
import io
import pathlib
import re
import tokenize

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mumoe_tn"

#: Lower floors never import higher ones. Gate descriptors report their own costs to the cost
#: model, so the gates sit below the costs. The design search stands on the costs alone, but it
#: can fit a pretrained layer (conversion) and time one (layers), so it sits above them; those
#: two import torch on use only. ``plugins`` registers conversion with other libraries when they load.
FLOORS = {
    "validation": 0,
    "registry": 0,
    "caching": 0,
    "lazy_names": 0,
    "network": 1,
    "decompositions": 2,
    "gates": 2,
    "contractions": 3,
    "costs": 3,
    "masking": 4,
    "layers": 5,
    "conversion": 6,
    "analysis": 6,
    "design": 7,
    "distillation": 7,
    "cli": 8,
    "plugins": 8,
}


def _modules():
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_only(node, parents):
    return any(isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test) for p in parents)


def _imports(path):
    tree = ast.parse(path.read_text())
    stack = [(tree, [])]
    while stack:
        node, parents = stack.pop()
        for child in ast.iter_child_nodes(node):
            stack.append((child, [*parents, node]))
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mumoe_tn"):
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("mumoe_tn"))


def _graph():
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path):
            if target in modules and target != name and not name.startswith(target + "."):
                graph.add_edge(name, target)
    return graph


def _floor(name):
    parts = name.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_circles():
    graph = _graph()
    graph.remove_node("mumoe_tn")  # the package's lazy names point everywhere by design
    assert list(nx.simple_cycles(graph)) == []


#: Which parts of ``mumoe_tn.conversion`` each part may import: the persistence replays a record
#: with the surgery's blocks; the surgery and the fitting stand alone; ``convert`` (and the
#: package's front door) joins all three.
CONVERSION_IMPORTS = {
    "convert": {"surgery", "persistence", "fitting"},
    "persistence": {"surgery"},
    "surgery": set(),
    "fitting": set(),
}


def _conversion_part(name):
    parts = name.split(".")
    if parts[:2] != ["mumoe_tn", "conversion"]:
        return None
    return "convert" if len(parts) == 2 else parts[2]


def test_the_conversion_parts_import_one_way():
    modules = _modules()
    parts = {_conversion_part(name) for name in modules} - {None}
    assert parts == set(CONVERSION_IMPORTS), sorted(parts ^ set(CONVERSION_IMPORTS))
    crossing = [
        f"{a} -> {b}"
        for a, b in _graph().edges
        if _conversion_part(a)
        and _conversion_part(b) not in {None, _conversion_part(a)}
        and _conversion_part(b) not in CONVERSION_IMPORTS[_conversion_part(a)]
    ]
    assert crossing == []


def test_imports_point_down_the_floors():
    upward = [
        f"{a} -> {b}"
        for a, b in _graph().edges
        if _floor(a) is not None and _floor(b) is not None and _floor(b) > _floor(a)
    ]
    assert upward == []


def test_at_most_seven_top_level_modules_and_every_part_has_a_floor():
    modules = _modules()
    top = sorted(name for name in modules if name.count(".") == 1 and not (ROOT / name.split(".")[1]).is_dir())
    assert len(top) <= 7, top
    parts = {name.split(".")[1] for name in modules if name != "mumoe_tn"}
    assert parts <= set(FLOORS), sorted(parts - set(FLOORS))


def test_dir_lists_the_public_api_and_dunders_only():
    import mumoe_tn

    public = set(dir(mumoe_tn)) - {name for name in dir(mumoe_tn) if name.startswith("__") and name.endswith("__")}
    assert public == set(mumoe_tn.__all__)
    for name in mumoe_tn.__all__:
        assert getattr(mumoe_tn, name) is not None, name


def test_distill_and_explore_are_reachable_from_the_top_level():
    import mumoe_tn
    from mumoe_tn.analysis.explorer.explore import explore
    from mumoe_tn.distillation.training import distill

    assert mumoe_tn.distill is distill
    assert mumoe_tn.explore is explore


#: Modules at their 0.2 paths, which 0.3 kept with a DeprecationWarning and 0.4 removed.
REMOVED_MODULES = [
    "mumoe_tn.analysis.explorer.command",
    "mumoe_tn.analysis.validation",
    "mumoe_tn.conversion.distill",
    "mumoe_tn.conversion.faithfulness",
    "mumoe_tn.conversion.replacements",
    "mumoe_tn.conversion.streaming",
    "mumoe_tn.costs.frontier",
    "mumoe_tn.costs.transcoders",
    "mumoe_tn.deprecation",
    "mumoe_tn.design.command",
    "mumoe_tn.design.search",
    "mumoe_tn.experiments",
    "mumoe_tn.gates.options",
    "mumoe_tn.layers.transcoders",
]
#: Names at their 0.2 paths or spellings, likewise removed.
REMOVED_NAMES = [
    "mumoe_tn:materialize",
    "mumoe_tn.contractions:materialize",
    "mumoe_tn.contractions.dense:materialize",
    "mumoe_tn.conversion:distill",
    "mumoe_tn.conversion:select_blocks",
    "mumoe_tn.costs:materialize_fma",
    "mumoe_tn.costs.flops:materialize_fma",
    "mumoe_tn.decompositions:normalize_ranks",
    "mumoe_tn.decompositions.registry:normalize_ranks",
    "mumoe_tn.design.space:FAMILIES",
    "mumoe_tn.distillation.replacements:TOP_K_GATES",
    "mumoe_tn.layers:Transcoder",
    "mumoe_tn.network:normalize_expert_dims",
]


@pytest.mark.parametrize("old", REMOVED_MODULES)
def test_the_modules_0_3_deprecated_are_gone(old):
    path = ROOT.parent.joinpath(*old.split("."))
    assert not path.with_suffix(".py").exists() and not path.is_dir()
    assert old not in _modules()


@pytest.mark.parametrize("old", REMOVED_NAMES)
def test_the_names_0_3_deprecated_are_gone(old):
    module_name, name = old.split(":")
    module = importlib.import_module(module_name)
    with pytest.raises(AttributeError, match=name):
        getattr(module, name)


#: Modules 0.4 moved into the parts of ``mumoe_tn.conversion``, old path -> new path; nothing stands
#: at the old path (no forwarding module).
MOVED_IN_0_4 = {
    "mumoe_tn.conversion.adapters": "mumoe_tn.conversion.surgery.adapters",
    "mumoe_tn.conversion.block_kinds": "mumoe_tn.conversion.surgery.block_kinds",
    "mumoe_tn.conversion.blocks": "mumoe_tn.conversion.surgery.blocks",
    "mumoe_tn.conversion.building": "mumoe_tn.conversion.surgery.building",
    "mumoe_tn.conversion.checkpoints": "mumoe_tn.conversion.persistence.checkpoints",
    "mumoe_tn.conversion.config_checks": "mumoe_tn.conversion.persistence.config_checks",
    "mumoe_tn.conversion.files": "mumoe_tn.conversion.persistence.files",
    "mumoe_tn.conversion.quantizer": "mumoe_tn.conversion.persistence.quantizer",
    "mumoe_tn.conversion.record": "mumoe_tn.conversion.persistence.record",
    "mumoe_tn.conversion.record_checks": "mumoe_tn.conversion.persistence.record_checks",
    "mumoe_tn.conversion.replay": "mumoe_tn.conversion.persistence.replay",
    "mumoe_tn.conversion.storage": "mumoe_tn.conversion.persistence.storage",
    "mumoe_tn.conversion.fitting": "mumoe_tn.conversion.fitting.als",
    "mumoe_tn.conversion.upcycling": "mumoe_tn.conversion.fitting.upcycling",
    "mumoe_tn.conversion.interop": "mumoe_tn.conversion.fitting.interop",
}


@pytest.mark.parametrize("old", sorted(MOVED_IN_0_4))
def test_a_module_0_4_moved_stands_only_at_its_new_path(old):
    modules = _modules()
    assert MOVED_IN_0_4[old] in modules
    assert old not in modules or (ROOT.parent.joinpath(*old.split(".")) / "__init__.py").exists()
    assert not ROOT.parent.joinpath(*old.split(".")).with_suffix(".py").exists()


#: Basenames used with one meaning in several places: ``registry`` is the registry type
#: (mumoe_tn.registry) and each package's registry of its own kind (formats, gate classes).
SAME_MEANING = {"registry"}


def test_module_names_are_unique_across_the_package():
    seen = {}
    for name, path in _modules().items():
        basename = name.rsplit(".", 1)[-1]
        if path.name == "__init__.py" or basename in SAME_MEANING:
            continue
        seen.setdefault(basename, []).append(name)
    assert {base: names for base, names in seen.items() if len(names) > 1} == {}


def test_the_layout_page_draws_the_floors_this_file_enforces():
    page = (ROOT.parent / "docs" / "layout.md").read_text()
    diagram = page.split("```text\n", 1)[1].split("```", 1)[0]
    drawn = {
        match.group(2): int(match.group(1))
        for match in re.finditer(r"^\s+(\d+)\s+([a-z_]+)(?:/|\.py)\s", diagram, flags=re.MULTILINE)
    }
    assert drawn == FLOORS


#: Where formats and gates are defined and registered: the only code that may compare their names.
REGISTRIES = ("mumoe_tn/decompositions/", "mumoe_tn/gates/")


def _registered_names():
    from mumoe_tn.decompositions import available, get_format
    from mumoe_tn.gates.registry import top_k_gates

    names = set(available()) | set(top_k_gates())
    names |= {getattr(get_format(name), "mlp_block", None) for name in available()} - {None}
    return {name for name in names if isinstance(name, str)}


def _compared_strings(node):
    for operand in (node.left, *node.comparators):
        if isinstance(operand, ast.Constant) and isinstance(operand.value, str):
            yield operand.value
        elif isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
            yield from (e.value for e in operand.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))


def test_no_code_outside_the_registries_compares_a_format_or_gate_name():
    names = _registered_names()
    assert {"cp", "tr", "mxd", "softmax", "relu"} <= names
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT.parent).as_posix()
        if relative.startswith(REGISTRIES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(value in names for value in _compared_strings(node)):
                found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "ask the format or gate instead of testing its name:\n" + "\n".join(found)


#: The project's own words take British -ise spellings (CONTRIBUTING.md); these -ize stems are
#: the project's words, so a name spelt with one of them breaks the rule.
OWN_WORDS_IZE = re.compile(
    r"(?i)(normal|material|special|initial|random|recogn|standard|summar|synchron|vector|organ|visual|general|custom"
    r"|stabil|minim|maxim|regular|serial|memor|categor|symmetr|polar|central|local|canonical|optim|parameter)iz"
)
#: Names spelt as the library they come from spells them (torch, opt_einsum, transformers), and
#: the paper's "factorized experts".
FOREIGN_SPELLINGS = re.compile(
    r"(?i)optimiz(e|er|ers)\b|optimizers|HyperOptimizer|is_initialized|is_serializable|synchronize|minimize"
    r"|register_optimizer_step_post_hook"
)


def test_names_follow_one_spelling():
    offenders = []
    for name, path in sorted(_modules().items()):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.NAME and OWN_WORDS_IZE.search(FOREIGN_SPELLINGS.sub("", token.string)):
                offenders.append(f"{name}:{token.start[0]}: {token.string}")
    assert offenders == [], "British -ise spellings for the project's own words (CONTRIBUTING.md):\n" + "\n".join(
        offenders
    )


def test_the_tests_readme_lists_every_test_file():
    tests = ROOT.parent / "tests"
    listed = set(re.findall(r"`((?:[a-z_]+/)*test_[a-z0-9_]+\.py)`", (tests / "README.md").read_text()))
    files = {path.relative_to(tests).as_posix() for path in tests.rglob("test_*.py")}
    assert sorted(files - listed) == []


#: The most lines a module of the package may hold: past it a module holds more than one concern.
MAX_MODULE_LINES = 700


def test_no_module_is_longer_than_the_rule():
    long = {
        name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
