"""The package's layout is its architecture: imports point one way, with no circles.

Read from the source with ``ast`` (imports inside functions included; imports only for type
checkers excluded, since they never run).
"""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mumoe_tn"

#: Lower floors never import higher ones. Gate descriptors report their own costs to the cost
#: model, so the gates sit below the costs. The design search stands on the costs alone, but it
#: can fit a pretrained layer (conversion) and time one (layers), so it sits above them; those
#: two import torch on use only. ``plugins`` registers conversion with other libraries when they load.
FLOORS = {
    "validation": 0,
    "caching": 0,
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
    "experiments": 7,
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


def _compared_strings(node):
    for operand in [node.left, *node.comparators]:
        items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        yield from (item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str))


def test_no_code_outside_the_registries_compares_with_a_format_or_block_kind_name():
    from mumoe_tn.decompositions import available
    from mumoe_tn.layers.mlp_blocks import registered_mlp_blocks

    names = set(available()) | set(registered_mlp_blocks())
    registries = {ROOT / "decompositions", ROOT / "layers" / "mlp_blocks.py"}
    found = []
    for path in ROOT.rglob("*.py"):
        if any(path == place or place in path.parents for place in registries):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            compared = set(_compared_strings(node)) if isinstance(node, ast.Compare) else set()
            found += [f"{path.relative_to(ROOT)}:{node.lineno} compares with {name!r}" for name in compared & names]
    assert found == []
