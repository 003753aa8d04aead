"""The architecture, checked: layers import only downward, the allocator and the index never import each
other, nothing imports in a cycle, the store imports none of its clients, clients use only the public
face of maru_shm, and the backend's parts never reach back into its SGLang adapter (calls go one way).

The layers are the folders of maru_shm/ (each sub-package's docstring says what it holds), listed below
from the bottom up; a module may import its own folder and the layers below, never one above nor another
folder of its own layer. The few modules that lie flat in maru_shm/ are named in the list like folders; the
flat modules of the top layer (the Store, its call boundary, administration, the package's face) may
import each other. This list is the layer map; docs/DESIGN.md section 11 describes each folder's modules.

The imports are read from the source (ast), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS = [
    {"errors", "sizes", "crashpoints", "batching"},  # L0 flat: public errors and sizes, crash points, SMALL_BATCH
    {"format"},                                     # L1 the file format
    {"locking"},                                    # L2 thread mutexes, OFD locks, the lock file
    {"allocator", "index", "copying"},              # L3 the leaves: allocator/ and index/ never import each other
    {"mapping"},                                    # L4 the pool file and this process's mapping
    {"processes", "datapath"},                      # L5 the processes sharing a pool; the get and put paths
    {"checks"},                                     # L6 check, repair, the read-only view
    {"store", "calls", "admin", "__init__"},        # L7 flat: the Store and its call boundary, administration, the face
    {"__main__"},                                   # L8 `python -m maru_shm`: the one module that imports a client
]
LAYER_OF = {name: layer for layer, names in enumerate(LAYERS) for name in names}
# Benchmarks (tools/benchmarks/) measure internals (lock costs, raw copies) on purpose; every other client
# uses the public face.
BENCHMARKS = ROOT / "tools" / "benchmarks"


def _component(module: str) -> str:
    """The folder or flat module a module belongs to: maru_shm.allocator.slabtable -> allocator;
    maru_shm.store -> store; maru_shm -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved; `from x import y`
    counts as x.y when y is a module of the package, else x)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() \
                    or (ROOT / sub.replace(".", "/") / "__init__.py").exists()
                out.append(sub if is_module else mod)
    return out


def _package_files(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _store_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _package_files("maru_shm"):
        name = _module_name(path)
        graph[name] = {m for m in _imports(path) if m == "maru_shm" or m.startswith("maru_shm.")}
    return graph


def test_every_store_module_has_a_layer():
    missing = {_component(m) for m in _store_graph()} - set(LAYER_OF)
    assert not missing, f"modules without a layer in tests/test_layering.py: {sorted(missing)}"


def test_every_layer_is_a_folder_or_a_flat_module():
    """The list names what is on disk: each name a sub-package (a folder with its docstring) or a flat module."""
    store = ROOT / "maru_shm"
    for name in LAYER_OF:
        folder = store / name / "__init__.py"
        assert folder.exists() or (store / f"{name}.py").exists(), f"{name}: no such folder or module"
        if folder.exists():
            assert ast.get_docstring(ast.parse(folder.read_text())), f"maru_shm/{name}/ says nothing of itself"
    folders = {p.parent.name for p in store.glob("*/__init__.py")}
    flat = {p.stem for p in store.glob("*.py")}
    assert folders | flat == set(LAYER_OF)


def test_layers_import_only_downward():
    upward = []
    for mod, deps in _store_graph().items():
        mine = LAYER_OF[_component(mod)]
        for dep in deps:
            if LAYER_OF.get(_component(dep), 99) > mine:
                upward.append(f"{mod} (L{mine}) imports {dep} (L{LAYER_OF.get(_component(dep))})")
    assert not upward, "\n".join(upward)


def test_folders_of_one_layer_never_import_each_other():
    face = LAYER_OF["__init__"]
    across = [f"{mod} imports {dep}" for mod, deps in _store_graph().items() for dep in deps
              if _component(dep) != _component(mod) and LAYER_OF[_component(mod)] == LAYER_OF.get(_component(dep))
              and LAYER_OF[_component(mod)] != face]
    assert not across, "\n".join(across)


def test_the_store_imports_no_client_but_from_its_entry_module():
    """maru_shm is the bottom of the stack: the backend and the tools import it, never the other way round.
    `python -m maru_shm` (__main__) is the one exception, for the command line it runs."""
    clients = ("maru_sglang", "tools", "maru_shm_tools")
    bad = [f"{_module_name(path)} imports {m}" for path in _package_files("maru_shm") if path.name != "__main__.py"
           for m in _imports(path) if m.split(".")[0] in clients]
    assert not bad, "\n".join(bad)
    assert "maru_shm_tools.cli" in _imports(ROOT / "maru_shm" / "__main__.py")  # the one exception is real and seen


@pytest.mark.parametrize("a, b", [("allocator", "index"), ("index", "allocator")])
def test_allocator_and_index_never_import_each_other(a, b):
    bad = [f"{mod} imports {dep}" for mod, deps in _store_graph().items() if _component(mod) == a
           for dep in deps if _component(dep) == b]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = _store_graph()
    # a package's __init__ re-exports its modules: an edge from a module to its own package is not a cycle
    edges = {m: {d for d in deps if d in graph and not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        state[m] = 2
        path.pop()
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def _client_files():
    for package in ("maru_sglang", "tools"):
        for path in _package_files(package):
            if BENCHMARKS in path.parents:
                continue
            yield path


@pytest.mark.parametrize("path", list(_client_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_clients_use_only_the_public_face(path):
    import maru_shm
    bad = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("maru_shm.")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("maru_shm."):
                bad.append(node.module)
            elif node.module == "maru_shm":
                bad += [f"maru_shm.{a.name}" for a in node.names if a.name not in maru_shm.__all__
                        and a.name != "__version__"]
    assert not bad, f"{path.name} reaches past `from maru_shm import ...`: {bad}"


# The backend's parts below its SGLang adapter: the adapter builds and calls them, they never call it back.
BELOW_THE_ADAPTER = ("hybrid", "tiers/local", "tiers/twotiers", "tiers/second", "tiers/status")
ADAPTER, ADAPTER_MODULE = "MaruStorage", "maru_sglang.maru_storage"


def _adapter_handles(tree: ast.AST) -> list[str]:
    """Where code (not a docstring or a message) names the adapter's class, or takes or reads a handle on the
    adapter (`storage`, the name its parts knew it by)."""
    out = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        where = f"line {getattr(node, 'lineno', '?')}"
        named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) \
            else node.value if isinstance(node, ast.Constant) else None  # (a Constant: a string annotation)
        if named == ADAPTER:
            out.append(f"{where}: names {ADAPTER}")
        elif isinstance(node, ast.arg) and node.arg == "storage":
            out.append(f"{where}: takes the adapter as a parameter `storage`")
        elif isinstance(node, ast.Attribute) and node.attr == "storage":
            out.append(f"{where}: reads an attribute `.storage`")
    return out


@pytest.mark.parametrize("module", BELOW_THE_ADAPTER)
def test_the_backend_parts_never_reach_back_into_the_adapter(module):
    """Calls go one way: MaruStorage (the SGLang adapter) gives each part what it uses (a store getter, the
    key space, the parts below it, flags, log_once); a part neither imports the adapter nor holds it."""
    path = ROOT / "maru_sglang" / f"{module}.py"
    bad = [f"imports {m}" for m in _imports(path) if m == ADAPTER_MODULE or m.startswith(ADAPTER_MODULE + ".")]
    bad += _adapter_handles(ast.parse(path.read_text(), str(path)))
    assert not bad, f"maru_sglang/{module}.py reaches back into {ADAPTER}:\n" + "\n".join(bad)


def test_adapter_handles_are_seen():
    """The test above would pass vacuously if _adapter_handles missed a handle on the adapter."""
    source = ("class Part:\n    def __init__(self, storage: 'MaruStorage'):\n        self.storage = storage\n"
              "    def call(self):\n        return self.storage.local_get_v1(MaruStorage.x)\n")
    found = " ".join(_adapter_handles(ast.parse(source)))
    assert found.count("names MaruStorage") == 2 and "parameter `storage`" in found and "`.storage`" in found
    assert _adapter_handles(ast.parse('"""Built by MaruStorage."""\nx = "MaruStorage: pool"\n')) == []


def test_relative_imports_are_resolved():
    """The tests above would pass vacuously if _imports missed relative imports."""
    probe = ROOT / "maru_shm" / "format" / "geometry.py"
    assert "maru_shm.format.sizeclasses" in _imports(probe)
    assert "maru_shm.errors" in _imports(probe)
    store = ROOT / "maru_shm" / "store.py"
    assert {"maru_shm.datapath.publish", "maru_shm.allocator"} <= set(_imports(store))


# No god classes: a newcomer reads one concept at a time (the limits below).
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 450, 400, 90


@pytest.mark.parametrize("package", ["maru_shm", "maru_sglang", "tools"])
def test_no_file_class_or_function_past_its_size_limit(package):
    too_long = []
    for path in _package_files(package):
        source = path.read_text()
        rel = path.relative_to(ROOT)
        if source.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{rel}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source, str(path))):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and length > MAX_CLASS_LINES:
                too_long.append(f"{rel}: class {node.name}, {length} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > MAX_FUNCTION_LINES:
                too_long.append(f"{rel}: {node.name}(), {length} lines")
    assert not too_long, "\n".join(too_long)
