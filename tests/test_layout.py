"""The package's shape: no import circle among its modules, test oracles kept out of the library, and the native
runtime below the native files that build on it."""

import ast
import importlib.util
import re
from pathlib import Path

import jnntile

def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    root = Path(jnntile.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(("jnntile", *parts)).removesuffix(".__init__")] = path
    return modules


def _is_module(name: str, modules) -> bool:
    if name in modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _imports(name: str, path: Path, modules) -> set[str]:
    """The package's modules that `name` imports, wherever the import statement stands (functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod (the native one included); `from mod import name`
            # imports mod.
            found.update(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", modules) else base
                         for a in node.names)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_library_never_imports_a_reference_model():
    """References are test oracles: the library computes with its own modules only."""
    modules = _modules()
    for name, path in modules.items():
        if not name.endswith("reference"):
            assert not {m for m in _imports(name, path, modules) if m.endswith("reference")}, name


def test_the_native_runtime_includes_nothing_above_it():
    """The runtime's files (docs/design.md, "Code layout") include only each other, format.h and the CUDA context:
    tensor, task, distributed and bench build on the runtime, which starts StarPU-MPI through DistributedHooks."""
    native = Path(__file__).resolve().parents[1] / "xla_ffi"
    runtime = ["runtime.h", "runtime_state.h", "runtime.cc", "task_accounting.cc", "host_memory.cc", "swap.cc",
               "stats.cc"]
    allowed = {"runtime.h", "runtime_state.h", "format.h", "kernels/cuda/context.h"}
    for name in runtime:
        included = set(re.findall(r'^#include "([^"]+)"', (native / name).read_text(), re.MULTILINE))
        assert included <= allowed, f"xla_ffi/{name} includes {sorted(included - allowed)}"


def test_public_module_names_are_their_layers_modules():
    """Users import the short names (`import jnntile.optim`, `from jnntile.runtime import configure`): each is the
    module of its layer's folder, one object under both names."""
    import importlib

    for name, module in jnntile.PUBLIC_MODULES.items():
        assert importlib.import_module(f"jnntile.{name}") is module
        assert getattr(jnntile, name) is module
        assert module.__name__.count(".") == 2, f"jnntile.{name} is {module.__name__}, not a module of a layer"
