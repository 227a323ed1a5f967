"""Read the installed SGLang (0.5.23, `pip install --no-deps`) on CPU, for the plugin's tests.

`import sglang` runs `sglang/__init__.py`, which needs triton and a GPU stack. `import_srt`
puts a bare `sglang` package whose `__path__` is the installed folder into `sys.modules`, so
light submodules (`sglang.srt.plugins`, `sglang.srt.environ`) import from the real files
without that `__init__`. Modules that need CUDA are read with `ast` instead: `function_def`,
`class_fields`, `exec_definitions` (runs chosen top-level definitions of an installed file,
unchanged, in a namespace the test provides).
"""

from __future__ import annotations

import ast
import importlib.util
import importlib.machinery
import sys
import types
from pathlib import Path


def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None, "sglang must be installed: pip install --no-deps sglang==0.5.23"
    return Path(list(spec.submodule_search_locations)[0])


def import_srt(name: str):
    """Import `sglang.srt.<...>` from the installed files without running sglang/__init__.py."""
    if "sglang" not in sys.modules:
        root = str(sglang_root())
        pkg = types.ModuleType("sglang")
        pkg.__path__ = [root]
        # a real spec, so later find_spec("sglang") calls still locate the installed files
        pkg.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
        pkg.__spec__.submodule_search_locations = [root]
        sys.modules["sglang"] = pkg
    return importlib.import_module(name)


def source_tree(rel: str) -> ast.Module:
    return ast.parse((sglang_root() / rel).read_text())


def class_def(rel: str, cls: str) -> ast.ClassDef:
    for node in source_tree(rel).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return node
    raise AssertionError(f"class {cls} not found in sglang/{rel}")


def function_def(rel: str, qualname: str) -> ast.FunctionDef:
    """`Class.method` or `function` of an installed file."""
    parts = qualname.split(".")
    body = source_tree(rel).body if len(parts) == 1 else class_def(rel, parts[0]).body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == parts[-1]:
            return node
    raise AssertionError(f"{qualname} not found in sglang/{rel}")


def arg_names(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def class_fields(rel: str, cls: str) -> dict[str, tuple[str, bool]]:
    """Annotated fields of a (msgspec) struct class and its bases in the same file:
    name -> (annotation source, has a default)."""
    tree = source_tree(rel)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, tuple[str, bool]] = {}

    def walk(name: str) -> None:
        node = classes[name]
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                walk(base.id)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = (ast.unparse(stmt.annotation), stmt.value is not None)

    walk(cls)
    return out


def exec_definitions(rel: str, names: list[str], namespace: dict) -> dict:
    """Execute the named top-level defs/classes of an installed file, unchanged, in `namespace`."""
    tree = source_tree(rel)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert {n.name for n in nodes} == set(names), f"missing in sglang/{rel}: {set(names) - {n.name for n in nodes}}"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(sglang_root() / rel), "exec"), namespace)
    return namespace
