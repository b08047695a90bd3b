r"""
Sphinx configuration of qcomm's documentation.

Build it with warnings as errors (``tests/unit/test_docs.py`` does the same)::

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import sys
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.ext.napoleon import Config as NapoleonConfig
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util.docutils import SphinxDirective

import qcomm

project = "qcomm"
author = "qcomm contributors"
copyright = "qcomm contributors"
release = qcomm.__version__
version = release

# Google-style sections (Args:, Returns:, ...) are parsed by napoleon's
# GoogleDocstring, called from _google_docstring below rather than through the
# sphinx.ext.napoleon extension: see there why.
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build"]
templates_path: list[str] = []

# Every cross-reference must resolve; the few that cannot are listed below.
nitpicky = True
# No intersphinx: the build runs without network, so the inventories of
# Python, torch and TorchRec cannot be fetched. Sphinx resolves builtins and
# typing names itself; types of those projects are left as plain text.
_EXTERNAL = "|".join(
    sorted(sys.stdlib_module_names | {"torch", "torchrec", "fbgemm_gpu", "matplotlib"})
)
nitpick_ignore_regex = [(r"py:(class|obj|exc|data)", rf"({_EXTERNAL})\..+")]
nitpick_ignore = [
    # Google-style "(Type, optional)": the py domain reads "optional" as a type.
    ("py:class", "optional"),
    # torch's types as docstrings spell them, without the module.
    ("py:class", "Tensor"),
    ("py:class", "ProcessGroup"),
    # Awaitable's type variable is not an object of its own.
    ("py:class", "W"),
    ("py:class", "qcomm.awaitable.W"),
]

# House style opens every docstring with the call signature: autodoc shows it
# as the signature and strips it from the text.
autodoc_docstring_signature = True
autodoc_member_order = "bysource"
# undoc-members: dataclass fields and enum members carry no docstring of their
# own, but they are public API and the docstrings :attr:-reference them.
# inherited-members: codec classes inherit their whole contract from private
# bases (e.g. one row-wise FP8 base for E4M3 and E5M2); the standard library's
# bases are left out.
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "inherited-members": "object,BaseException,Exception,Enum,Generic,ABC,Protocol",
}

# "Returns: Type: text" reads as one line, like TorchRec's rendered docs.
# napoleon documents this Config for calling GoogleDocstring directly.
_NAPOLEON: Any = NapoleonConfig(napoleon_numpy_docstring=False, napoleon_use_rtype=False)

html_theme = "alabaster"
html_title = f"qcomm {release}"
html_theme_options = {
    "description": "Quantized collective communication for PyTorch embeddings",
    "page_width": "1160px",
    "sidebar_width": "240px",
    "fixed_sidebar": True,
}
html_show_sourcelink = False
html_static_path = ["_static"]
html_css_files = ["qcomm.css"]


def _readable_signature(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str] | None:
    if what == "property":
        # Sphinx 9 glues a docstring-signature return type onto a property's
        # name (".. py:property:: C.p -> T"), which breaks its target; the type
        # still shows, from the annotation. Without a signature line there is
        # nothing to replace (Sphinx fails on an answer then).
        return ("", "") if signature is not None else None
    if what == "class" and getattr(obj, "_is_protocol", False):
        # A Protocol is never called: "(*args, **kwargs)" would mislead.
        return "", ""
    if what == "class" and signature and dataclasses.is_dataclass(obj):
        # Show "forward=NoOpQuantizedCommCodec()" rather than "<factory>".
        for field in dataclasses.fields(obj):
            factory = field.default_factory
            if factory is not dataclasses.MISSING:
                label = getattr(factory, "__name__", repr(factory))
                pattern = rf"(\b{re.escape(field.name)}\b[^=,]*=\s*)<factory>"
                signature = re.sub(pattern, rf"\g<1>{label}()", signature)
        return signature, return_annotation or ""
    return None


def _google_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    # As sphinx.ext.napoleon does, with one change: napoleon reads the first
    # line of a property's docstring as "type: text", which turns house-style
    # prose such as "The wire dtype: ``torch.float16``." into a bogus type
    # (the type is in the signature line already). Parse it as a method's.
    kind: Any = "method" if what == "property" else what
    lines[:] = GoogleDocstring(lines, _NAPOLEON, app, kind, name, obj, options).lines()


class AutoSubmodules(SphinxDirective):
    r"""
    ``.. autosubmodules:: package`` documents every public module of a package,
    each under a title underlined with the ``:heading:`` character (``-``).

    Built-in codecs land one module at a time; this way each appears in the
    docs as soon as it exists, without editing the page.
    """

    required_arguments = 1
    # The underline character of the modules' titles, to nest them at any level.
    option_spec = {"heading": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        underline = self.options.get("heading", "-")
        # Modules may appear between builds: read this page again every time.
        self.env.note_reread()
        package = importlib.import_module(self.arguments[0])
        names = sorted(
            info.name
            for info in pkgutil.iter_modules(package.__path__, package.__name__ + ".")
            if not info.name.rpartition(".")[2].startswith("_")
        )
        text = "\n".join(
            f"{name}\n{underline * len(name)}\n\n.. automodule:: {name}\n" for name in names
        )
        return self.parse_text_to_nodes(text, allow_section_headings=True)


def setup(app: Sphinx) -> dict[str, Any]:
    r"""
    setup(app: Sphinx) -> dict[str, Any]

    Registers the handlers and the directive above with Sphinx.

    Args:
        app (Sphinx): the application building the docs.

    Returns:
        dict[str, Any]: extension metadata.
    """
    app.connect("autodoc-process-docstring", _google_docstring)
    app.connect("autodoc-process-signature", _readable_signature)
    app.add_directive("autosubmodules", AutoSubmodules)
    return {"parallel_read_safe": True}
