"""Fails when the Bazel BUILD files drift from the Python files they describe.

Reads the BUILD files as the plain Starlark they are (no Bazel needed, so CI runs
it in a second) and checks:
- every test_*.py under tests/ (at any folder depth: tests mirror the packages)
  has a `dp_py_test` target in tests/BUILD named by its path there without `.py`
  (`beam_jobs/test_dedup`), or is listed with its reason in MAKE_TEST_ONLY there,
  and every target names a test file that exists;
- every target's `data` names files that exist;
- a test's imports of project packages (tff_algorithms, ...) are declared as
  deps, and its imports of helper modules in tests/ are in :test_support;
- each project package's py_library declares the project packages it imports.

Prints one line per problem and exits 1, or prints a one-line summary. Checks this
checkout, or the repository root given as the only argument.
"""

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS_DIR = "tests"
TEST_MACRO = "dp_py_test"
TEST_SUPPORT = "test_support"
# A literal list in tests/BUILD of test files that only `make test` runs.
EXCLUSION_LIST = "MAKE_TEST_ONLY"


@dataclass
class BuildCall:
    """One rule or macro call in a BUILD file, with its literal keyword arguments."""

    rule: str
    line: int
    kwargs: dict[str, object] = field(default_factory=dict)


def read_build_assignment(build_file: Path, variable: str) -> object:
    """The literal value of a top-level `variable = ...` of a BUILD file, or None."""
    tree = ast.parse(build_file.read_text(), filename=str(build_file))
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and [
            target.id for target in statement.targets if isinstance(target, ast.Name)
        ] == [variable]:
            return ast.literal_eval(statement.value)
    return None


def read_build_calls(build_file: Path) -> list[BuildCall]:
    """Top-level calls of a BUILD file; non-literal arguments (glob(...)) are left out."""
    tree = ast.parse(build_file.read_text(), filename=str(build_file))
    calls = []
    for statement in tree.body:
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
            continue
        call = statement.value
        if not isinstance(call.func, ast.Name):
            continue
        kwargs = {}
        for keyword in call.keywords:
            try:
                kwargs[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError:
                continue
        calls.append(BuildCall(rule=call.func.id, line=call.lineno, kwargs=kwargs))
    return calls


def project_packages(repo: Path) -> list[str]:
    """Top-level Python packages of the repository other than the tests."""
    return sorted(
        path.parent.name
        for path in repo.glob("*/__init__.py")
        if path.parent.name != TESTS_DIR and not path.parent.name.startswith(".")
    )


def imported_modules(source_file: Path) -> set[str]:
    """Dotted names of every module a file imports, at any depth of the file, and of
    those it runs as `python -m MODULE` from a literal argument list."""
    tree = ast.parse(source_file.read_text(), filename=str(source_file))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            values = [
                element.value if isinstance(element, ast.Constant) else None
                for element in node.elts
            ]
            names.update(
                module
                for flag, module in zip(values, values[1:])
                if flag == "-m" and isinstance(module, str)
            )
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            # `from tests import processes` imports the module tests.processes.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def label_to_path(repo: Path, package: str, label: str) -> Path:
    """The source file a file label names: //pkg:file, //:file or file (in package)."""
    if label.startswith("//"):
        label_package, _, name = label[2:].partition(":")
        return repo / label_package / name
    return repo / package / label.lstrip(":")


def check_packages(repo: Path, packages: list[str]) -> list[str]:
    problems = []
    for package in packages:
        build_file = repo / package / "BUILD"
        if not build_file.is_file():
            problems.append(f"{package}/: Python package without a BUILD file")
            continue
        libraries = [
            call
            for call in read_build_calls(build_file)
            if call.rule == "py_library" and call.kwargs.get("name") == package
        ]
        if not libraries:
            problems.append(f"{package}/BUILD: no py_library named {package!r}")
            continue
        declared = set(libraries[0].kwargs.get("deps", []))
        imported = set()
        for source_file in sorted((repo / package).rglob("*.py")):
            imported |= {name.split(".")[0] for name in imported_modules(source_file)}
        for other in sorted((imported & set(packages)) - {package}):
            if f"//{other}" not in declared:
                problems.append(f"{package}/BUILD: imports {other} but deps lack //{other}")
    return problems


def helpers_outside_support(
    repo: Path, importer: str, imports: set[str], support_srcs: set[str]
) -> list[str]:
    """Problems for modules of tests/ (a helper, or a test module another one imports)
    that `importer` imports but :test_support lacks. Folders' __init__.py are left to
    Bazel, which makes them in every runfiles tree."""
    helpers = {
        "/".join(module.split(".")[1:]) + ".py"
        for module in imports
        if module.startswith(f"{TESTS_DIR}.")
    }
    return [
        f"{TESTS_DIR}/BUILD: {importer} imports {TESTS_DIR}/{helper}, not in :{TEST_SUPPORT} srcs"
        for helper in sorted(helpers)
        if (repo / TESTS_DIR / helper).is_file() and helper not in support_srcs
    ]


def check_tests(repo: Path, packages: list[str]) -> tuple[list[str], int, int]:
    """Problems, the number of test targets and the number of make-test-only files."""
    build_file = repo / TESTS_DIR / "BUILD"
    if not build_file.is_file():
        return [f"{TESTS_DIR}/BUILD: missing"], 0, 0
    calls = read_build_calls(build_file)
    problems = []
    support = [
        call
        for call in calls
        if call.rule == "py_library" and call.kwargs.get("name") == TEST_SUPPORT
    ]
    support_srcs = set(support[0].kwargs.get("srcs", [])) if support else set()
    if not support:
        problems.append(f"{TESTS_DIR}/BUILD: no py_library named {TEST_SUPPORT!r}")
    else:
        support_deps = set(support[0].kwargs.get("deps", []))
        for src in sorted(support_srcs):
            source_file = repo / TESTS_DIR / src
            if not source_file.is_file():
                problems.append(f"{TESTS_DIR}/BUILD: :{TEST_SUPPORT} names missing file {src}")
                continue
            imports = imported_modules(source_file)
            problems += helpers_outside_support(repo, src, imports, support_srcs)
            needed = {m.split(".")[0] for m in imports} & set(packages)
            for package in sorted(needed):
                if f"//{package}" not in support_deps:
                    problems.append(
                        f"{TESTS_DIR}/BUILD: {src} imports {package} "
                        f"but :{TEST_SUPPORT} deps lack //{package}"
                    )

    make_test_only = read_build_assignment(build_file, EXCLUSION_LIST) or []
    for file_name in make_test_only:
        if not (repo / TESTS_DIR / file_name).is_file():
            problems.append(f"{TESTS_DIR}/BUILD: {EXCLUSION_LIST} names missing file {file_name}")

    targets: dict[str, BuildCall] = {}
    for call in calls:
        if call.rule != TEST_MACRO:
            continue
        name = call.kwargs.get("name")
        where = f"{TESTS_DIR}/BUILD:{call.line}"
        if not isinstance(name, str):
            problems.append(f"{where}: {TEST_MACRO} needs a literal name")
            continue
        if name in targets:
            problems.append(f"{where}: target {name!r} declared twice")
        targets[name] = call
        if f"{name}.py" in make_test_only:
            problems.append(f"{where}: {name}.py is both a target and in {EXCLUSION_LIST}")
        if not (repo / TESTS_DIR / f"{name}.py").is_file():
            problems.append(f"{where}: target {name!r} names missing file {TESTS_DIR}/{name}.py")
        for label in call.kwargs.get("data", []):
            if not label_to_path(repo, TESTS_DIR, label).is_file():
                problems.append(f"{where}: target {name!r} has data {label!r}, no such file")

    tests_root = repo / TESTS_DIR
    for test_file in sorted(tests_root.rglob("test_*.py")):
        relative = test_file.relative_to(tests_root).as_posix()
        if relative in make_test_only:
            continue
        name = relative[: -len(".py")]
        call = targets.get(name)
        imports = imported_modules(test_file)
        needed = sorted({m.split(".")[0] for m in imports} & set(packages))
        if call is None:
            deps = ", ".join(f'"//{package}"' for package in needed)
            deps_argument = f", deps = [{deps}]" if deps else ""
            problems.append(
                f"{TESTS_DIR}/{relative}: no target; add to {TESTS_DIR}/BUILD: "
                f'{TEST_MACRO}(name = "{name}"{deps_argument})'
            )
            continue
        declared = set(call.kwargs.get("deps", []))
        for package in needed:
            if f"//{package}" not in declared:
                problems.append(
                    f"{TESTS_DIR}/BUILD:{call.line}: {name} imports {package} "
                    f"but deps lack //{package}"
                )
        problems += helpers_outside_support(repo, name, imports, support_srcs)
    return problems, len(targets), len(make_test_only)


def main(repo: Path = REPO) -> int:
    packages = project_packages(repo)
    problems = check_packages(repo, packages)
    test_problems, target_count, excluded_count = check_tests(repo, packages)
    problems += test_problems
    for problem in problems:
        print(f"check_bazel_targets: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"check_bazel_targets: {target_count} test targets match {TESTS_DIR}/**/test_*.py "
        f"({excluded_count} in {EXCLUSION_LIST}); "
        f"deps of {', '.join(packages)} match their imports"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: check_bazel_targets.py [REPOSITORY_ROOT]")
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) == 2 else REPO))
