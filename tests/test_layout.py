"""The package's shape, as ARCHITECTURE.md states it: no import cycle (local imports
included: a function-level import hides a cycle from Python, not from this test), lower
layers import nothing from higher ones, modules stay small, setup.py ships every package,
and fairseq is patched only in install.py."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fairseq_fastgen"
MAX_LINES = 420  # "under about 400 lines"
LOWER = ("fairseq_fastgen.models", "fairseq_fastgen.config", "fairseq_fastgen.run_config",
         "fairseq_fastgen.checkpoint")
HIGHER = ("fairseq_fastgen.search", "fairseq_fastgen.tasks", "fairseq_fastgen.install")


def _modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name, path, modules):
    """The package modules that module ``name`` imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                head = ".".join(base[: len(base) - node.level + 1])
                mod = head + ("." + node.module if node.module else "")
            else:
                mod = node.module or ""
            # "from pkg import sub" imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # "import a.b.c" with c a function: a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {n: _imports(n, p, modules) for n, p in modules.items()}


def test_no_import_cycle(graph):
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_detection_sees_local_imports(tmp_path):
    """The walker counts an import inside a function (the kind that hid the old cycle)."""
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    mods = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    assert _imports("p.a", tmp_path / "a.py", mods) == {"p.b"}


def test_lower_layers_import_nothing_higher(graph):
    bad = [(n, m) for n, deps in graph.items() if n.startswith(LOWER)
           for m in deps if m.startswith(HIGHER)]
    assert not bad, bad


def test_modules_are_small():
    big = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not big, big


def test_setup_ships_every_package():
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    listed = set(re.findall(r'"(fairseq_fastgen(?:\.\w+)*)"', text))
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")}
    assert packages <= listed, packages - listed


def test_fairseq_patched_only_in_install():
    """No module but install.py assigns attributes of fairseq's modules or classes."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "install.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        fairseq_names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = getattr(node, "module", None) or ""
                for a in node.names:
                    full = mod if isinstance(node, ast.ImportFrom) else a.name
                    if full.split(".")[0] in ("fairseq", "fairseq_cli"):
                        fairseq_names.add(a.asname or a.name.split(".")[0])
        for node in ast.walk(tree):
            owners = []  # the objects whose attributes the node sets
            if isinstance(node, ast.Assign):
                owners = [t.value for t in node.targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                owners = node.args[:1]
            for root in owners:
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in fairseq_names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_implementation_counts_follow_the_code(tmp_path):
    """benchmarks/count_implementations.py: every implementation it lists is still where it
    says (a stale anchor fails), and the counts it reports are the package's."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "count_implementations", ROOT / "benchmarks" / "count_implementations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "counts.json"
    assert mod.main(["--json", str(out)]) == 0  # 2: a stale anchor
    counts = json.loads(out.read_text())
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in PKG.rglob("*.py"))
    assert counts["python lines"]["count"] == lines
    assert counts["user switches"]["count"] <= 12
    assert counts["decoder-step drivers"]["count"] >= 3  # stock's, the reference, one fast
    assert counts["candidate roles"]["count"] == 1
