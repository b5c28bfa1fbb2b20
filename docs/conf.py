"""Sphinx configuration for the deltacells docs."""

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
