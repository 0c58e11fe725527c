"""The import graph of ``cfp/`` and ``passes/`` has no circle, and the names users import keep
working where they are."""
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    """``cfp/models/gpt.py`` -> ``cfp.models.gpt``; ``passes/x.py`` -> ``cfp.passes.x``
    (installed there); a package's ``__init__.py`` is the package."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "passes":
        parts.insert(0, "cfp")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, here: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``tree`` imports anywhere: at the top, inside
    functions, and through ``importlib.import_module`` with a literal name. ``from P import
    n`` imports ``P.n`` where that is a module, else ``P``."""
    package = here if here in _packages(modules) else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
    return {m for m in out if m in modules and m != here}


def _packages(modules: set[str]) -> set[str]:
    return {m.rpartition(".")[0] for m in modules if "." in m}


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    names = {module_name(f): f for f in files}
    return {name: imported(ast.parse(path.read_text()), name, set(names))
            for name, path in names.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def source_files() -> list[Path]:
    return sorted(p for d in ("cfp", "passes") for p in (ROOT / d).rglob("*.py"))


def test_no_module_imports_itself_through_others():
    found = circles(import_graph(source_files()))
    assert found == [], f"import circles: {found}"


def test_a_planted_circle_is_found(tmp_path):
    """The control: the real graph plus one import inside a function, and one through
    importlib, that close circles."""
    graph = import_graph(source_files())
    assert "cfp.graph" in graph["cfp.blocks"]  # blocks reads the graph
    planted = ast.parse("def f():\n    from cfp import blocks\n")
    graph["cfp.graph"] |= imported(planted, "cfp.graph", set(graph))
    assert ["cfp.blocks", "cfp.graph"] in circles(graph)
    graph = import_graph(source_files())
    planted = ast.parse("import importlib\nimportlib.import_module('cfp.api')\n")
    graph["cfp.errors"] |= imported(planted, "cfp.errors", set(graph))
    assert any("cfp.errors" in c and "cfp.api" in c for c in circles(graph))


@pytest.mark.parametrize("module, names", [
    ("cfp", ["Plan", "Options", "autoshard", "run", "CfpError"]),
    ("cfp.api", ["autoshard", "Plan", "Options"]),
    ("cfp.models", ["user_workload", "Workload"]),
    ("cfp.models.state_step", ["state_shardings", "adapt", "StateLayout"]),
    ("cfp.plan", ["jit", "shardings", "step_shardings", "load_plan", "mesh_of"]),
])
def test_the_names_users_import_are_where_they_were(module, names):
    m = importlib.import_module(module)
    missing = [n for n in names if not hasattr(m, n)]
    assert not missing, f"{module} lacks {missing}"


def _cuda_lines(code: str) -> int:
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr.count("cuda drivers")


def test_the_cuda_plugins_lines_are_silenced_when_cfp_comes_first():
    """With JAX's CUDA plugin installed and no NVIDIA driver (the dev extra on a CPU machine),
    ``import cfp, jax`` prints no "Could not find cuda drivers" line: cfp loads the plugin
    quietly before JAX's first import. Control: ``import jax`` alone prints them."""
    import os
    from cfp.gpu_compile import cuda_plugin
    if cuda_plugin() is None or os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("needs JAX's CUDA plugin on a machine without an NVIDIA driver")
    assert _cuda_lines("import cfp, jax; jax.devices()") == 0
    assert _cuda_lines("import jax; jax.devices()") > 0


def _pulls_cuda_plugin(requirements: list[str], extras: dict) -> bool:
    """Whether ``requirements`` (of pyproject's extras ``extras``) install JAX's CUDA plugin."""
    for requirement in requirements:
        if "cuda" in requirement:
            return True
        if requirement.startswith("cfp["):
            names = requirement[4:requirement.index("]")].split(",")
            if any(_pulls_cuda_plugin(extras[n.strip()], extras) for n in names):
                return True
    return False


def test_the_dev_extra_installs_no_cuda_plugin():
    """``import jax`` prints the CUDA plugin's lines before cfp can run, so the extra the
    tests' tools come from leaves the plugin to ``gpu-compile``. Control: that extra pulls it."""
    import tomllib
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                              .read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert not _pulls_cuda_plugin(extras["dev"], extras)
    assert _pulls_cuda_plugin(extras["gpu-compile"], extras)
    assert _pulls_cuda_plugin(["cfp[dev,gpu-compile]"], extras)
