"""The package's layout rules, read from its source: data flows one way (codec -> store ->
spatial -> read -> write -> train -> front doors), no import cycles (deferred imports inside
functions included), no module above the size limits, and docs/architecture.md showing the
layer diagram and every module as they are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "deltacells"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: Layers from the bottom up: a module may import its own layer and the ones below.
LAYERS = ("codec", "store", "spatial", "read", "write", "train", "front doors")
MAX_PY_LINES = 800
MAX_PYX_LINES = 900


def module_name(path: Path) -> str:
    """``deltacells.read.dataset`` for src/deltacells/read/dataset.py (packages by their
    ``__init__``)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*"))
        if p.suffix in (".py", ".pyx") and "__pycache__" not in p.parts
    }


def layer_of(module: str) -> str:
    """The layer of a module: its subpackage, or "front doors" for the top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else (
        "front doors")  # fmt: skip


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, at any depth of its code (deferred
    imports too). ``from deltacells.codec import _decode`` counts as the module ``_decode``
    only: a package's ``__init__`` runs before any of its modules, whoever imports them."""
    found: set[str] = set()
    if path.suffix == ".pyx":
        text = path.read_text()
        found |= set(re.findall(r"^\s*(?:from|cimport|import)\s+(deltacells[\w.]*)", text, re.M))
    else:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                submodules = {f"{node.module}.{a.name}" for a in node.names}
                found |= submodules & modules
                if not submodules <= modules:  # names of the module itself, not submodules
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
    me = module_name(path)
    return {m for m in found if m in modules and m != me}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each reported from where it closes)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up the layers (a lower layer importing a higher one)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(
        f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if rank[layer_of(b)] > rank[layer_of(a)]
    )


def layer_diagram(graph: dict[str, set[str]]) -> str:
    """One line per layer, top down: the layers its modules import."""
    uses: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for a, targets in graph.items():
        uses[layer_of(a)] |= {layer_of(b) for b in targets} - {layer_of(a)}
    width = max(map(len, LAYERS))
    lines = []
    for layer in reversed(LAYERS):
        below = [x for x in reversed(LAYERS) if x in uses[layer]]
        lines.append(f"{layer:<{width}} -> {', '.join(below) if below else '(nothing)'}")
    return "\n".join(lines)


def documented_block() -> str:
    text = ARCHITECTURE.read_text()
    block = r"<!-- layers:start -->\n```text\n(.*?)\n```\n<!-- layers:end -->"
    match = re.search(block, text, re.S)
    assert match, "docs/architecture.md lost its generated layer block"
    return match.group(1)


def test_the_checks_find_what_they_look_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert upward_imports({"deltacells.codec.tile": {"deltacells.read.dataset"}}) == [
        "deltacells.codec.tile (codec) imports deltacells.read.dataset (read)"
    ]
    assert layer_of("deltacells.cli") == "front doors"
    assert layer_of("deltacells.codec") == "codec"
    assert layer_of("deltacells.store.manifest") == "store"


def test_the_graph_is_really_read():
    graph = import_graph()
    assert "deltacells.codec.tile" in graph["deltacells.write.writer"]
    assert "deltacells.codec._status" in graph["deltacells.codec._decode"]  # a .pyx import
    # deferred: the writer opens the finished dataset inside a function
    assert "deltacells.read.dataset" in graph["deltacells.write.writer"]


def test_no_import_cycles_deferred_ones_included():
    assert cycles(import_graph()) == []


def test_data_flows_one_way_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_module_above_the_size_limits():
    too_big = []
    for name, path in all_modules().items():
        limit = MAX_PYX_LINES if path.suffix == ".pyx" else MAX_PY_LINES
        lines = len(path.read_text().splitlines())
        if lines > limit:
            too_big.append(f"{name}: {lines} lines (limit {limit})")
    assert too_big == []


def test_every_subpackage_says_what_it_owns():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring"


def test_architecture_page_shows_the_layers_as_they_are():
    expected = layer_diagram(import_graph())
    assert documented_block() == expected, (
        "docs/architecture.md's layer block is out of date; it should read:\n" + expected)


def test_architecture_page_names_every_module():
    text = ARCHITECTURE.read_text()
    missing = []
    for name, path in all_modules().items():
        shown = str(path.relative_to(PACKAGE)).removesuffix("/__init__.py")
        if name != "deltacells" and f"`{shown}`" not in text:
            missing.append(shown)
    assert missing == [], f"docs/architecture.md does not name {missing}"


def test_paths_before_the_layout_still_import():
    import importlib
    import importlib.util

    import deltacells
    from deltacells import _moved

    has_torch = importlib.util.find_spec("torch") is not None
    for old, targets in _moved.MOVED.items():
        if old == "torchdata" and not has_torch:  # the optional extra is not installed
            with pytest.raises(ModuleNotFoundError, match="torch"):
                importlib.import_module(f"deltacells.{old}")
            continue
        module = importlib.import_module(f"deltacells.{old}")
        assert getattr(deltacells, old) is module
        for target in targets:
            new = importlib.import_module(target)
            for name in getattr(new, "__all__", []):
                assert getattr(module, name) is getattr(new, name), f"deltacells.{old}.{name}"
    import deltacells.backed
    import deltacells.storage

    assert deltacells.storage.Store is deltacells.store.storage.Store
    new_home = deltacells.read.lazy_matrix
    assert deltacells.backed.written_values_dtype is new_home.written_values_dtype
    assert deltacells.spatial.SpatialIndex is deltacells.spatial.grid.SpatialIndex
    assert deltacells.codec.exception_limit is deltacells.codec.tile.exception_limit


def test_front_door_names_load_on_first_use(tmp_path):
    """``import deltacells``, a training process and ``deltacells info`` / ``verify`` do not
    import anndata and the reading stack (their memory is most of a loader's peak, their
    import most of the command's time); every public name still resolves."""
    import subprocess
    import sys

    import anndata as ad
    import numpy as np
    import scipy.sparse as sp

    import deltacells

    x = sp.random(300, 40, density=0.2, format="csr", random_state=0, dtype=np.float32)
    x.data = np.ceil(x.data * 9)
    deltacells.write_deltacells(ad.AnnData(x), tmp_path / "x.dc", progress=False)
    script = (
        "import sys, deltacells\n"
        "heavy = ('anndata', 'dask', 'h5py', 'zarr')\n"
        "assert not [m for m in heavy if m in sys.modules], sys.modules.keys()\n"
        f"loader = deltacells.Loader({str(tmp_path / 'x.dc')!r}, batch_size=64)\n"
        "assert sum(b.X.shape[0] for b in loader) == 300\n"
        # The command line's `info` and `verify` read a dataset without the writing stack.
        "from deltacells.cli import main\n"
        f"assert main(['info', {str(tmp_path / 'x.dc')!r}]) == 0\n"
        f"assert main(['verify', {str(tmp_path / 'x.dc')!r}]) == 0\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    for name in deltacells.__all__:
        if name == "TorchIterableDataset":
            continue  # needs the optional torch extra; test_loader covers it
        assert getattr(deltacells, name) is not None
        assert name in dir(deltacells)
    assert deltacells.read_deltacells is deltacells.read.assemble.read_deltacells
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        deltacells.nope  # noqa: B018
