"""The package's imports run one way: no module imports, directly or through others, a module
that imports it back. Every import counts, function-local ones included. And no module grows past
600 lines."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zerojax"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import submodule` runs pkg/__init__ and then the submodule: both count
                edges.add(base)
                edges |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_zerojax_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "zerojax._step" in graph
    found = cycles(graph)
    detail = "\n".join(" <-> ".join(c) + "\n    " + "\n    ".join(f"{m} imports {sorted(graph[m] & set(c))}"
                                                               for m in c) for c in found)
    assert not found, f"import cycles:\n{detail}"


def test_the_package_root_is_imported_by_no_module():
    graph = import_graph()
    # zerojax/__init__ imports everything: a module importing it back closes a cycle through it
    offenders = sorted(m for m, deps in graph.items() if "zerojax" in deps and m != "zerojax")
    assert not offenders, f"these modules import the package root `zerojax`: {offenders}"


@pytest.mark.parametrize("old", ["zerojax.deepspeed", "zerojax.zenflow", "zerojax.estimate", "zerojax.distributed",
                                 "zerojax.compiled", "zerojax.offload.engine", "zerojax.offload.fused_adam"])
def test_no_shim_modules(old):
    """A 0.x library with no release drops old module paths instead of aliasing them; the
    package's functions of the same names stay what they are."""
    import importlib

    import zerojax as zj

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert callable(zj.estimate) and callable(zj.visualize)


MAX_MODULE_LINES = 600


def long_modules(root: pathlib.Path, limit: int = MAX_MODULE_LINES) -> dict:
    """Modules under ``root`` longer than ``limit`` lines, with their lengths."""
    lengths = {str(p.relative_to(root.parent)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {name: n for name, n in lengths.items() if n > limit}


def test_every_module_stays_under_600_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n")
    assert long_modules(tmp_path / "pkg") == {"pkg/long.py": MAX_MODULE_LINES + 1}
    assert long_modules(ROOT) == {}, "split these modules where their parts separate"
