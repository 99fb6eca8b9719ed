"""Sphinx configuration for the spchain documentation (build with ``bash docs/build.sh``)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import spchain  # noqa: E402
from sphinx.util.inspect import TypeAliasForwardRef  # noqa: E402

project = "spchain"
author = "the spchain developers"
release = version = spchain.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "matplotlib.sphinxext.plot_directive",
]
# The figures of ``.. plot::`` (their code runs at build time): PNG only, no source links.
plot_formats = [("png", 100)]
plot_html_show_source_link = False
plot_html_show_formats = False

# numpydoc docstrings, read by napoleon; no Google style.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}
# Annotations show the aliases of spchain/_typing.py (and NumPy's ArrayLike) by name, not their expansions.
autodoc_type_aliases = {"Array": "spchain._typing.Array", "Shape": "spchain._typing.Shape",
                        "Sparse": "spchain._typing.Sparse", "Seed": "spchain._typing.Seed",
                        "ArrayLike": "numpy.typing.ArrayLike"}
# Sphinx writes such an alias inside a union or a tuple (``Array | None``) by its repr,
# "TypeAliasForwardRef('spchain._typing.Array')": show its name there too.
TypeAliasForwardRef.__repr__ = lambda self: self.name

# The build machine reaches only PyPI: no intersphinx, nothing fetched at build time.
exclude_patterns = ["_build"]
html_theme = "furo"
html_static_path = ["_static"]
html_title = f"spchain {release}"

# Tutorials run under `sphinx-build -b doctest`. Their models are tiny: one torch thread avoids
# oversubscribing a shared CI machine (which slows them tenfold) and keeps printed results
# bit-for-bit reproducible.
doctest_global_setup = """
import torch
torch.set_num_threads(1)
"""

# Docstring examples are tested with the code (tests/), where their imports live; the doctest
# builder runs the tutorials' directives only.
doctest_test_doctest_blocks = ""
