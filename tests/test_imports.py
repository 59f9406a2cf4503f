"""Every module of the package imports on its own, and the package's imports form no cycle.

The graph is read from the source with `ast`: an edge A -> B for every `import slidetune...` and
`from <relative or absolute> import ...` statement in A that names a module of the package,
wherever the statement stands: at module level, inside a function or a method, under
`if TYPE_CHECKING`. A function-level import is counted because it ties the two modules together
as firmly as a module-level one (it only defers the failure to the first call), and because a
cycle through deferred imports is what hid in `bench/` (report <-> scenarios.common). In
`from pkg import name` the edge goes to the submodule `pkg.name` where there is one, else to `pkg`.
Not counted: the implicit import of a module's parent packages, and `importlib.import_module` of
a computed name (the scenario table in bench/scenarios/__init__.py).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "slidetune"


def package_modules() -> dict[str, Path]:
    """Dotted module name -> its source file ("slidetune.bench" -> .../bench/__init__.py)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (module-level and function-level statements alike)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # a relative import is resolved from the module's package: itself for an __init__.py
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != PACKAGE:
                    continue
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}              # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_reader_sees_relative_function_level_and_package_imports(tmp_path):
    """The reader itself, on a package written here: a cycle closed only inside a function is found."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import f\n")
    (pkg / "a.py").write_text("from .sub import b\nimport os\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    from ...x import y\n")
    modules = {f"{PACKAGE}.a": pkg / "a.py", f"{PACKAGE}.sub": pkg / "sub" / "__init__.py",
               f"{PACKAGE}.sub.b": pkg / "sub" / "b.py", PACKAGE: pkg / "__init__.py"}
    graph = import_graph(modules)
    assert graph == {f"{PACKAGE}.a": {f"{PACKAGE}.sub.b"}, f"{PACKAGE}.sub": {f"{PACKAGE}.sub.b"},
                     f"{PACKAGE}.sub.b": {f"{PACKAGE}.a"}, PACKAGE: set()}
    assert find_cycle(graph) in ([f"{PACKAGE}.a", f"{PACKAGE}.sub.b", f"{PACKAGE}.a"],
                                 [f"{PACKAGE}.sub.b", f"{PACKAGE}.a", f"{PACKAGE}.sub.b"])
    graph[f"{PACKAGE}.sub.b"].clear()
    assert find_cycle(graph) is None


def test_no_import_cycle_in_the_package():
    modules = package_modules()
    graph = import_graph(modules)
    assert len(modules) > 50 and f"{PACKAGE}.bench.output" in graph[f"{PACKAGE}.bench.tables"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Imports each module with no module of the package loaded before it (third-party ones such as torch
# stay loaded, so this takes seconds, not a fresh interpreter per module), in a child process so
# that this one's modules stay as they are; prints the modules that fail, with their error. A module
# whose own optional dependency is not installed here (triton: the CUDA kernels, which their callers
# import only on the GPU) is listed as skipped; a missing module of the package is a failure.
_IMPORT_EACH = """
import importlib, sys, traceback
failed, skipped = [], []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "slidetune" or m.startswith("slidetune.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "slidetune").split(".")[0] == "slidetune":
            failed.append(name + ":\\n" + traceback.format_exc(limit=-3))
        else:
            skipped.append(f"{name} (needs {e.name})")
    except BaseException:
        failed.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("skipped: " + ", ".join(skipped))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_alone():
    names = sorted(package_modules())
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])},
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # what the CPU machine lacks: triton (the CUDA kernels); anything else skipped is a new dependency
    skipped = done.stdout.splitlines()[0].removeprefix("skipped: ")
    assert all("(needs triton" in s for s in skipped.split(", ") if s), skipped
