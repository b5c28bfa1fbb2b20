"""Sphinx configuration for the deltacells docs."""

import os
from pathlib import Path

project = "deltacells"
author = "the deltacells developers"
copyright = "2026, the deltacells developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence"]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
autodoc_typehints = "description"
exclude_patterns = ["_build", "_static"]  # _static holds generated snippets that pages include
html_static_path = ["_static"]

# -- Cross-references: every name must resolve (the build runs with -n -W) -------------------
extensions.append("sphinx.ext.intersphinx")
nitpicky = True

#: Each project's docs, and where an offline machine may hold the same inventory: Debian's
#: python3-doc, python-scipy-doc, python-pandas-doc and python-fsspec-doc packages, which
#: ``tools/dev.sh docs`` installs when it can. The web inventory is tried after the local one.
_DEBIAN = "/usr/share/doc"
_INVENTORIES = {
    "python": ("https://docs.python.org/3/", f"{_DEBIAN}/python3.11/html/objects.inv"),
    "numpy": ("https://numpy.org/doc/stable/", None),
    "scipy": ("https://docs.scipy.org/doc/scipy/", f"{_DEBIAN}/python-scipy-doc/html/objects.inv"),
    "pandas": ("https://pandas.pydata.org/docs/", f"{_DEBIAN}/python-pandas-doc/html/objects.inv"),
    "anndata": ("https://anndata.readthedocs.io/en/stable/", None),
    "pyarrow": ("https://arrow.apache.org/docs/", None),
    "fsspec": ("https://filesystem-spec.readthedocs.io/en/latest/",
               f"{_DEBIAN}/python-fsspec-doc/html/objects.inv"),
    "torch": ("https://docs.pytorch.org/docs/stable/", None),
}
#: Set by tools/dev.sh when the machine cannot reach the web (CI: PyPI only). References into
#: projects without a local inventory are then left as text and listed, not checked.
_OFFLINE = os.environ.get("DELTACELLS_DOCS_OFFLINE") == "1"
intersphinx_mapping = {}
# numpy's DTypeLike and ArrayLike hints expand to private unions that numpy does not document.
nitpick_ignore_regex = [(r"py:class", r"numpy\._typing\..*")]
# Sphinx 9 names numpy 2's DTypeLike alias, and the Loader's ``np.ndarray`` hint, by their
# bare source text, which no inventory holds (numpy documents ``numpy.typing.DTypeLike``).
nitpick_ignore = [("py:class", "DTypeLike"), ("py:class", "np.ndarray")]
for _name, (_url, _local) in _INVENTORIES.items():
    _have_local = _local is not None and Path(_local).is_file()
    if _OFFLINE and not _have_local:
        nitpick_ignore_regex.append((r"py:.*", rf"{_name}(\..*)?"))
        print(f"deltacells docs: offline, {_name} references are not checked (no local inventory)")
        continue
    intersphinx_mapping[_name] = (_url, (_local, None) if _have_local else None)
intersphinx_timeout = 10

# Code blocks scroll sideways instead of being cut off, and pages use the window's width.
html_css_files = ["custom.css"]
