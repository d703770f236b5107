"""The packages of tff_algorithms and their layers (docs/design.md, "Layout").

Every module lives in a package; a package imports only packages below it in
`LAYERS`; an algorithm package reaches another algorithm only through the registry;
the lower layers import no TensorFlow. Each package's docstring says what it may
import. Read from the source (any import at any depth, `TYPE_CHECKING` blocks aside),
so a lazy import inside a function counts as much as one at the top.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests import paths

REPO = paths.REPO
ROOT = REPO / "tff_algorithms"
# Lowest first: a package may import its own and those before it.
LAYERS = ("base", "privacy", "config", "modeling", "evaluation", "federated", "jobs", "algorithms")
# What an algorithm package declares to the registry, TensorFlow-free and so read by
# `config` (job checks, recipes, the CLI's help): the registry itself, each algorithm
# package's __init__ (its spec) and the settings modules its spec checks with.
SPEC_MODULES = {
    "tff_algorithms.algorithms",
    "tff_algorithms.algorithms.registry",
    "tff_algorithms.algorithms.rules",
    "tff_algorithms.algorithms.dp_fedemb.shared_negatives_config",
    "tff_algorithms.algorithms.fdml.fields",
    "tff_algorithms.algorithms.user_dp_sgd.config",
}
# Imports against the layers, each with why it is there. Both check a setting by
# building the backbone, which needs TensorFlow, and so import it only when asked.
ALLOWED_UPWARD = {
    ("tff_algorithms.config.job_config", "tff_algorithms.federated.feature_cache"),
    ("tff_algorithms.config.model_config", "tff_algorithms.modeling.models"),
}
TENSORFLOW_FREE = ("base", "privacy", "config")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_spec(module: str) -> bool:
    parts = module.split(".")
    return module in SPEC_MODULES or (len(parts) == 3 and parts[1] == "algorithms")


def _layer(module: str) -> int:
    if _is_spec(module):
        return LAYERS.index("config")
    return LAYERS.index(module.split(".")[1])


def _algorithm_package(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 and parts[1] == "algorithms" else None


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return ids


def _imports(path: Path, known: set[str]) -> set[str]:
    """The tff_algorithms modules a file imports (a `from package import module` names
    the module; a `from module import name` the module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_blocks(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tff_algorithms."))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tff_algorithms"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
    return found - {"tff_algorithms"}


def test_every_module_lives_in_a_package_that_says_what_it_may_import():
    modules = _modules()
    loose = [m for m in modules if m.count(".") == 1 and m.split(".")[1] not in LAYERS]
    assert loose == [], f"modules outside a package: {loose}"
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / layer / "__init__.py").read_text())) or ""
        assert "import" in doc, f"tff_algorithms/{layer}/__init__.py: say what it may import"


def test_no_package_imports_a_package_above_it():
    modules = _modules()
    known = set(modules)
    wrong = []
    for module, path in modules.items():
        for target in sorted(_imports(path, known)):
            if (module, target) in ALLOWED_UPWARD:
                continue
            own_algorithm = _algorithm_package(module)
            if own_algorithm and _algorithm_package(target) == own_algorithm:
                continue  # within one algorithm's package (its spec imports its trainer lazily)
            if _algorithm_package(target) and not _is_spec(target):
                wrong.append(f"{module} -> {target} (another algorithm's implementation)")
            elif _layer(target) > _layer(module):
                wrong.append(f"{module} -> {target}")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_allowed_upward_imports_are_still_there():
    """An exception that no longer happens is removed from the list, not kept."""
    modules = _modules()
    known = set(modules)
    for module, target in ALLOWED_UPWARD:
        assert target in _imports(modules[module], known), (module, target)


@pytest.mark.parametrize("layer", TENSORFLOW_FREE)
def test_the_lower_layers_import_no_tensorflow(layer):
    names = [
        m
        for m in _modules()
        if m.count(".") and (_is_spec(m) if layer == "config" else m.split(".")[1] == layer)
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('tensorflow', 'tensorflow_federated', 'keras') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[-500:]
