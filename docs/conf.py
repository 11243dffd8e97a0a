# jaxfeed's manual: Sphinx with MyST Markdown, the tools the JAX ecosystem
# documents with (JAX, Flax, Optax, Orbax and Grain all build their sites with
# Sphinx and MyST), and sphinx-book-theme, the theme of JAX's and Flax's sites,
# so the pages look and navigate like the ones JAX users already read.
#
# Build: `bash scripts/docs.sh` (HTML into docs/_build/html);
# tests/test_docs.py builds it with warnings as errors and checks every link.

import pathlib
import sys

import jaxfeed

sys.path.insert(0, str(pathlib.Path(__file__).parent / "_ext"))

project = "jaxfeed"
author = "The jaxfeed authors"
copyright = "The jaxfeed authors"
release = jaxfeed.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "docstrings",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]
nitpicky = True
# Types from other packages (no intersphinx: the build reads nothing from
# the network) and jaxfeed's internal classes in signatures are plain text.
nitpick_ignore_regex = [
  (
    "py:class",
    r"(numpy|os|ssl|grpc|jax|jaxlib|etils|orbax|typing|collections"
    r"|concurrent|threading|pathlib)\..*",
  ),
  ("py:class", r"jaxfeed(\.[a-z_]+){2,}\.\w+"),
  # Dataset's base (its constructors), in the signatures of the mixtures.
  ("py:class", r"jaxfeed\.dataset_sources\.\w+"),
]
# compute_lengths raises it: it is documented as jaxfeed.coord.LengthIndexError.
nitpick_ignore = [("py:exc", "LengthIndexError")]

myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_member_order = "bysource"
# Dataset's constructors are typed by a type variable of their base class
# (jaxfeed/dataset_sources.py); readers see the Dataset they return.
autodoc_type_aliases = {"_DatasetT": "jaxfeed.Dataset"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False
templates_path = ["_templates"]

html_theme = "sphinx_book_theme"
html_title = "jaxfeed"
