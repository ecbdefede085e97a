"""Sphinx configuration of stratagem's documentation site (``make docs``).

Pages are Markdown (MyST); the API reference is autodoc over the package (docstrings are reST
with Google-style sections, rendered by napoleon). ``make docs`` builds with ``-W``: any warning
(a broken link, a missing reference, a docstring that does not render, an undocumented public
name) fails the build.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / '_ext'))
sys.path.insert(0, str(DOCS.parent))  # the checkout's stratagem, installed or not

from stratagem.version import __version__  # noqa: E402

project = 'stratagem'
author = 'the stratagem authors'
copyright = 'the stratagem authors'
version = release = __version__

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'myst_parser',
    'stratagem_docs',
]
source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
root_doc = 'index'
exclude_patterns = [
    '_build',
    '_generated/**/*.md',
    '_generated/**/*.rst',
    'schedules',
    'Thumbs.db',
    '.DS_Store',
]

# Markdown: `{ref}` targets for every heading up to level 3, `:::` fences for admonitions
myst_heading_anchors = 3
myst_enable_extensions = ['colon_fence', 'deflist']

# autodoc: public names only (each module's __all__), in source order, types in the text
autodoc_member_order = 'bysource'
autodoc_typehints = 'description'
autodoc_typehints_description_target = 'documented_params'
autodoc_class_signature = 'separated'
autodoc_default_options = {'members': True, 'undoc-members': True, 'show-inheritance': True}
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # `Attributes:` as fields: a dataclass's fields are documented once

# a reference to one of our names that does not resolve is a warning (so an error); references
# to torch, numpy and the standard library cannot resolve offline (no intersphinx inventories)
nitpicky = True
nitpick_ignore_regex = [
    (r'py:.*', r'^(?!stratagem\b).*'),
    (r'py:class', r'^stratagem(\.\w+)*\.[A-Z]$'),  # a TypeVar in a signature (F, T)
]

html_theme = 'furo'
html_title = f'stratagem {release}'
html_static_path = ['_static']
html_css_files = ['stratagem.css']
html_theme_options = {'sidebar_hide_name': False}
html_show_sourcelink = False
html_copy_source = False
pygments_style = 'friendly'
