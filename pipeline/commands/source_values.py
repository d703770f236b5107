"""Constants of TensorFlow-importing modules, read from their source without importing them.

`dp-fedemb train --help` shows each flag's effective default and the flag checks name
the valid choices (algorithms, head losses, architectures), but the modules that define
them (tff_algorithms.train_job, client_work, models) import TensorFlow, which takes ~20 s.
This module parses their source with `ast` and resolves literal values, names and
`module.NAME` / `module.Class.field` references. Anything it cannot resolve is None:
callers fall back to a generic wording, and the job itself still validates everything.
"""

from __future__ import annotations

import ast
import functools
import os
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGES = ("tff_algorithms", "beam_jobs", "pipeline")
_UNRESOLVED = object()


@functools.cache
def _module_tree(module: str) -> ast.Module | None:
    for package in _PACKAGES:
        path = os.path.join(_ROOT, package, f"{module}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return ast.parse(f.read())
    return None


def _assignments(body: list[ast.stmt]) -> dict[str, ast.expr]:
    found: dict[str, ast.expr] = {}
    for node in body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            if isinstance(node.target, ast.Name):
                found[node.target.id] = node.value
    return found


def _class_body(module: str, name: str) -> list[ast.stmt] | None:
    tree = _module_tree(module)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.body
    return None


def _resolve(module: str, node: ast.expr, depth: int = 0) -> Any:
    if depth > 20:
        return _UNRESOLVED
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_resolve(module, item, depth + 1) for item in node.elts]
        return _UNRESOLVED if _UNRESOLVED in items else tuple(items)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _resolve(module, node.operand, depth + 1)
        return -inner if isinstance(inner, (int, float)) else _UNRESOLVED
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.Mult)):
        left = _resolve(module, node.left, depth + 1)
        right = _resolve(module, node.right, depth + 1)
        if not all(isinstance(v, (int, float)) for v in (left, right)):
            return _UNRESOLVED
        return left**right if isinstance(node.op, ast.Pow) else left * right
    if isinstance(node, ast.Name):
        tree = _module_tree(module)
        value = _assignments(tree.body).get(node.id) if tree is not None else None
        if value is not None:
            return _resolve(module, value, depth + 1)
        source = _imported_from(tree, node.id) if tree is not None else None
        return _UNRESOLVED if source is None else _module_value(source, node.id)
    if isinstance(node, ast.Attribute):
        parts = []
        current: ast.expr = node
        while isinstance(current, ast.Attribute):
            parts.append(current.attr)
            current = current.value
        if not isinstance(current, ast.Name):
            return _UNRESOLVED
        parts.reverse()
        return module_value(current.id, ".".join(parts))
    return _UNRESOLVED


def _imported_from(tree: ast.Module, name: str) -> str | None:
    """The project module `name` is imported from (`from package.module import name`)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            package, _, module = node.module.partition(".")
            if package in _PACKAGES and module and any(a.name == name for a in node.names):
                return module
    return None


def find_constant(name: str) -> Any:
    """A module-level constant `name` of whichever tff_algorithms module defines it (the
    modules are being reorganised; the name is what stays), or None."""
    directory = os.path.join(_ROOT, "tff_algorithms")
    for filename in sorted(os.listdir(directory)):
        if filename.endswith(".py"):
            tree = _module_tree(filename[:-3])
            if tree is not None and name in _assignments(tree.body):
                value = module_value(filename[:-3], name)
                if value is not None:
                    return value
    return None


def module_value(module: str, dotted: str) -> Any:
    """The value of `NAME` or `Class.field` in module `module` (a file of tff_algorithms,
    beam_jobs or pipeline), or None when it cannot be read statically."""
    value = _module_value(module, dotted)
    return None if value is _UNRESOLVED else value


def _module_value(module: str, dotted: str) -> Any:
    tree = _module_tree(module)
    if tree is None:
        return _UNRESOLVED
    parts = dotted.split(".")
    if len(parts) == 1:
        value = _assignments(tree.body).get(parts[0])
        return _UNRESOLVED if value is None else _resolve(module, value)
    if len(parts) == 2:
        body = _class_body(module, parts[0])
        value = _assignments(body).get(parts[1]) if body is not None else None
        return _UNRESOLVED if value is None else _resolve(module, value)
    return _UNRESOLVED


def _find_class(name: str) -> str | None:
    for package in _PACKAGES[:1]:
        directory = os.path.join(_ROOT, package)
        for filename in sorted(os.listdir(directory)):
            if not filename.endswith(".py"):
                continue
            with open(os.path.join(directory, filename), encoding="utf-8") as f:
                if f"class {name}" in f.read():
                    module = filename[:-3]
                    if _class_body(module, name) is not None:
                        return module
    return None


@functools.cache
def train_job_defaults() -> dict[str, Any]:
    """TrainJobConfig's field defaults that can be read statically (field -> value)."""
    module = _find_class("TrainJobConfig")
    if module is None:
        return {}
    body = _class_body(module, "TrainJobConfig") or []
    defaults = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is None:
                continue
            value = _resolve(module, node.value)
            if value is not _UNRESOLVED:
                defaults[node.target.id] = value
    return defaults


def accounting_bounds() -> dict[str, Any]:
    """The accountant's documented input ranges (tff_algorithms.accounting, "Bounds")."""
    names = (
        "MAX_POPULATION",
        "MAX_ROUNDS",
        "MAX_NOISE_MULTIPLIER",
        "MIN_DELTA",
        "MAX_TARGET_EPSILON",
    )
    return {name: module_value("accounting", name) for name in names}


@functools.cache
def train_job_constant(name: str) -> Any:
    """A module-level constant of the module defining TrainJobConfig, or None."""
    module = _find_class("TrainJobConfig")
    return None if module is None else module_value(module, name)


@functools.cache
def train_job_annotations() -> dict[str, str]:
    """TrainJobConfig's field annotations as source text (field -> e.g. 'float | None')."""
    module = _find_class("TrainJobConfig")
    body = (_class_body(module, "TrainJobConfig") if module else None) or []
    return {
        node.target.id: ast.unparse(node.annotation)
        for node in body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def class_values(module: str, name: str) -> tuple[Any, ...] | None:
    """The values assigned in class `name`'s body, in order (an Enum's member values),
    or None when any cannot be read statically."""
    body = _class_body(module, name)
    if body is None:
        return None
    values = tuple(_resolve(module, node) for node in _assignments(body).values())
    return None if not values or _UNRESOLVED in values else values
