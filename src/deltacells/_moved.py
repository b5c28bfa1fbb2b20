"""The module paths of deltacells 0.x before the package was laid out by concern.

``import deltacells.storage`` and ``deltacells.manifest.Manifest`` keep working: each old path
is a read-only view of the names of the modules that now hold its code, so documented names,
user code and pickles written before the move still resolve. New code should use the new paths
(see ``docs/architecture.md``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

#: Old module path (under ``deltacells.``) -> the modules now holding its names, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    "format": ("deltacells.codec.format",),
    "npy": ("deltacells.codec.npy",),
    "_parallel": ("deltacells.codec.threads",),
    "_kernels": (
        "deltacells.codec._decode",
        "deltacells.codec._encode",
        "deltacells.codec._rows",
        "deltacells.codec._checksum",
        "deltacells.codec._status",
    ),
    "storage": ("deltacells.store.storage",),
    "manifest": ("deltacells.store.manifest",),
    "integrity": ("deltacells.store.integrity",),
    "ranged": ("deltacells.store.ranged",),
    "element_store": ("deltacells.store.element_store",),
    "elements": ("deltacells.store.elements",),
    "obs_dtypes": ("deltacells.store.obs_dtypes",),
    "spatial_query": ("deltacells.spatial.query",),
    "genemajor": ("deltacells.spatial.genemajor",),
    "dataset": (
        "deltacells.read.dataset",
        "deltacells.read.matrix_part",
        "deltacells.read.obs_part",
        "deltacells.read.var_part",
        "deltacells.read.stored",
    ),
    "backed": (
        "deltacells.read.assemble",
        "deltacells.read.lazy_matrix",
        "deltacells.read.integrations",
    ),
    "obscache": ("deltacells.read.obscache",),
    "outofcore": ("deltacells.read.outofcore",),
    "writer": (
        "deltacells.write.writer",
        "deltacells.write.plan",
        "deltacells.write.tiles",
        "deltacells.write.inputs",
    ),
    "loader": ("deltacells.train.loader",),
    "torchdata": ("deltacells.train.torchdata",),
}


class _MovedModule(types.ModuleType):
    """An old module path: attribute lookups go to the modules that hold the code now."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved: see {', '.join(targets)}.")
        self.__targets = targets

    def __getattr__(self, attr: str):
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"module {self.__name__!r} has no attribute {attr!r} (it moved to {self.__targets})"
        )

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self.__targets:
            names |= set(dir(importlib.import_module(target)))
        return sorted(names)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != "deltacells" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return _MovedModule(spec.name, MOVED[spec.name.partition(".")[2]])

    def exec_module(self, module) -> None:
        return None


def install() -> None:
    """Let the old module paths import (idempotent)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
