"""
The built-in codecs' C kernels (``qcomm_builtin._kernels``) as tests see
them; the ``isa`` fixture (``tests/conftest.py``) runs a test once with each
compiled copy this CPU can run.
"""

from __future__ import annotations

from typing import Any

from qcomm_builtin import _native

KERNELS: Any = _native._load()  # the extension module: untyped
MISSING = (
    "qcomm_builtin._kernels is not there (not built: no C compiler when qcomm was "
    "installed, or a build error): the codecs run their torch code"
)
