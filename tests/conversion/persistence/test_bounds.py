"""Every bound the persistence holds a loaded file to stands in ``bounds.py``, documented, and is used.

Read from the source with ``ast``: a reviewer audits one module, so no other module of the
persistence may define a limit of its own, or compare a size against a literal.
"""

import ast
import pathlib

import pytest

from mumoe_tn.conversion.persistence import bounds

PERSISTENCE = pathlib.Path(bounds.__file__).resolve().parent
#: Modules outside the persistence that hold files to its bounds.
READERS_ELSEWHERE = ("distillation/resume_checks.py", "cli/design_command.py")
#: The largest literal a check may compare with or pass as a limit (small counts such as "one
#: link", "two dimensions" or the 8 bytes of a safetensors header length are no bounds).
LARGEST_PLAIN_LITERAL = 8


def _tree(path):
    return ast.parse(path.read_text())


def _is_number(node):
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    return False


def _checkers():
    return sorted(path for path in PERSISTENCE.glob("*.py") if path.name not in {"bounds.py", "__init__.py"})


def _bounds_assignments():
    body = _tree(PERSISTENCE / "bounds.py").body
    for index, node in enumerate(body):
        if isinstance(node, ast.Assign) and node.targets[0].id != "__all__":
            following = body[index + 1] if index + 1 < len(body) else None
            yield node.targets[0].id, following


@pytest.mark.parametrize("path", _checkers(), ids=lambda path: path.name)
def test_no_other_module_of_the_persistence_defines_a_numeric_limit(path):
    own = [
        f"{path.name}:{node.lineno}: {ast.unparse(node)}"
        for node in _tree(path).body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_number(node.value)
    ]
    assert own == [], "a limit belongs in persistence/bounds.py"


@pytest.mark.parametrize("path", _checkers(), ids=lambda path: path.name)
def test_no_check_compares_with_or_passes_a_literal_bound(path):
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Compare):
            operands = (node.left, *node.comparators)
        elif isinstance(node, ast.Call):
            operands = tuple(keyword.value for keyword in node.keywords if keyword.arg in {"limit", "high", "low"})
        else:
            continue
        for operand in operands:
            if _is_number(operand) and abs(ast.literal_eval(ast.unparse(operand))) > LARGEST_PLAIN_LITERAL:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "name the bound in persistence/bounds.py"


def test_every_bound_is_public_and_documented_after_its_assignment():
    names = []
    for name, following in _bounds_assignments():
        names.append(name)
        assert name.isupper(), name
        documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        assert documented and isinstance(following.value.value, str) and following.value.value.strip(), name
    assert sorted(names) == sorted(bounds.__all__)
    assert len(names) == len(set(names))


def test_the_bounds_module_imports_nothing():
    assert not [
        node for node in ast.walk(_tree(PERSISTENCE / "bounds.py")) if isinstance(node, (ast.Import, ast.ImportFrom))
    ]


def test_every_bound_is_read_by_a_check():
    package = PERSISTENCE.parent.parent
    readers = [*_checkers(), *(package / relative for relative in READERS_ELSEWHERE)]
    imported = set()
    for path in readers:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "mumoe_tn.conversion.persistence.bounds":
                imported |= {alias.name for alias in node.names}
    assert sorted(set(bounds.__all__) - imported) == []


def test_the_bounds_are_what_the_checks_hold_files_to():
    from mumoe_tn.conversion.persistence import config_checks, files, record, storage

    assert record.MAX_RECORD_CORES is bounds.MAX_RECORD_CORES == 256
    assert files.MAX_JSON_BYTES == bounds.MAX_JSON_BYTES == 64 << 20
    assert config_checks.MAX_LABELS == bounds.MAX_LABELS == 1 << 15
    assert storage.MAX_CHECKPOINT_TENSORS == bounds.MAX_CHECKPOINT_TENSORS == 1 << 16
    assert {str(dtype).removeprefix("torch.") for dtype in files._DTYPES.values()} == set(bounds.STORED_DTYPES.values())
