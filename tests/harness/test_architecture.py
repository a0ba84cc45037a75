"""The packages' layering, read from the source: nsa_core (the NSA) < kernels (its fast paths) <
nsa_validate (the harness) < suites (what it checks); inside the harness, its subpackages in the
order of ``HARNESS``. Every import, lazy ones included, points down or sideways; no import cycle
between modules; the dispatch log imports nothing of the project; every CUDA graph is captured
through one helper; the suites' conftest registers every hook and fixture of the suites' plugin."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nsa_validate.paths import REPO_ROOT

LAYERS = ["nsa_core", "kernels", "nsa_validate", "suites"]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (module-level or inside functions)."""
    got = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            # ``from pkg import mod`` imports the module; ``from mod import name`` the module holding it
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                got.add(t)
    return got


MODULES = _modules()
GRAPH = {m: _imports(p, m, set(MODULES)) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


# The harness, bottom up: each group imports only from the groups before it (or within itself).
# "base" and "cli" are the top-level modules; every other group is a subpackage of that name.
HARNESS = {
    "base": {"nsa_validate", "nsa_validate.errors", "nsa_validate.paths", "nsa_validate.safefs",
             "nsa_validate.orphans", "nsa_validate.startup", "nsa_validate.pycache"},
    "env": "what this machine is and can do",
    "measure": "timing, tolerances, hardware ceilings, roofline, evidence, Nsight Compute",
    "bench": "benchmarks as plain functions returning rows",
    "report": "the results schema and everything rendered from results.json",
    "config": "suites registry, typed profiles, routing thresholds",
    "suite": "what a suite's pytest process loads",
    "run": "the run lifecycle in the CLI's process",
    "cli": {"nsa_validate.cli", "nsa_validate.console", "nsa_validate.__main__"},
}
GROUPS = list(HARNESS)


def _group(module: str) -> str | None:
    for g, members in HARNESS.items():
        if isinstance(members, set):
            if module in members:
                return g
        elif module == f"nsa_validate.{g}" or module.startswith(f"nsa_validate.{g}."):
            return g
    return None


HARNESS_MODULES = sorted(m for m in MODULES if m.split(".")[0] == "nsa_validate")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    up = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module))
    assert not up, f"{module} imports {up}, a layer above it ({' < '.join(LAYERS)})"


@pytest.mark.parametrize("module", HARNESS_MODULES)
def test_the_harness_module_sits_in_its_group(module):
    """A new module goes into the subpackage of what it does (the groups above), not the top level."""
    assert _group(module) is not None, (f"{module} belongs to no group of nsa_validate/: put it in one of "
                                        f"{', '.join(g for g in GROUPS if not isinstance(HARNESS[g], set))}")


@pytest.mark.parametrize("module", HARNESS_MODULES)
def test_harness_imports_point_down_its_groups(module):
    here = GROUPS.index(_group(module))
    up = sorted(t for t in GRAPH[module] if t in HARNESS_MODULES and GROUPS.index(_group(t)) > here)
    assert not up, f"{module} ({_group(module)}) imports {up}, a group above it ({' < '.join(GROUPS)})"


def test_no_import_cycle():
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2
    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_dispatch_log_imports_nothing_of_the_project():
    assert GRAPH["nsa_core.dispatch"] == set()


def test_the_graph_was_read():
    """The checks above are about something: the known edges are there."""
    assert "nsa_core.routing" in GRAPH["kernels.routes"] and "nsa_validate.config.registry" in GRAPH["nsa_validate.config.profiles"]


def test_every_cuda_graph_is_captured_through_capturing():
    """``torch.cuda.graph`` appears in ``nsa_core/cuda_graph.py`` alone: every capture in the project,
    its suites and tests goes through ``capturing``, which keeps the garbage collector from freeing a CUDA
    graph, and so invalidating the capture, while it records."""
    helper = REPO_ROOT / "nsa_core" / "cuda_graph.py"
    this = Path(__file__).resolve()
    files = [p for d in (*LAYERS, "tests") for p in sorted((REPO_ROOT / d).rglob("*.py")) if p != this]
    direct = [f"{p.relative_to(REPO_ROOT)}:{i}" for p in files if p != helper
              for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
              if "torch.cuda.graph(" in line and not line.lstrip().startswith("#")]
    assert helper in files and not direct, f"captured without capturing: {direct}"


def test_the_suites_conftest_registers_every_hook_and_fixture_of_the_plugin():
    """``suites/conftest.py`` imports the plugin's hooks and fixtures by name: one it leaves out is never
    called, silently (the suite processes' early exit was inert so, until a test asked for its effect)."""
    tree = ast.parse((REPO_ROOT / "nsa_validate" / "suite" / "plugin.py").read_text(encoding="utf-8"))

    def fixture(f) -> bool:
        return any("fixture" in ast.unparse(d) for d in f.decorator_list)
    defined = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and (f.name.startswith("pytest_") or fixture(f))}
    conftest = ast.parse((REPO_ROOT / "suites" / "conftest.py").read_text(encoding="utf-8"))
    imported = {a.name for n in conftest.body if isinstance(n, ast.ImportFrom) and n.module == "nsa_validate.suite.plugin"
                for a in n.names}
    assert {"pytest_configure", "record"} <= defined and not defined - imported, sorted(defined - imported)
