"""The codecs the suites run on, in one place: qcomm's built-in codecs, the
project's example plugin, and, only when ``QCOMM_TEST_PLUGINS=1``, every other
codec installed in the environment. A third-party plugin that fails to load
must not void the project's own suites; its author opts in to test it here."""

from __future__ import annotations

import os

import qcomm

#: the codecs the qcomm distribution registers, no-op aside
#: (tests/unit/test_discovery.py holds this list to pyproject.toml's entry points)
BUILTIN = ["bf16", "fp16", "fp8_e4m3", "fp8_e4m3_tensor", "fp8_e5m2", "int4", "int8", "mx4"]
#: the example out-of-tree plugin under plugins/example_codec
EXAMPLE = "example_fp16_scaled"
#: set to 1 to run the suites on every installed codec too
PLUGINS_ENV = "QCOMM_TEST_PLUGINS"


def suite_codecs() -> list[str]:
    """The built-in codecs and the example plugin's (if installed), plus with
    ``QCOMM_TEST_PLUGINS=1`` every other installed codec but the no-op one."""
    installed = qcomm.available_codecs()
    names = [*BUILTIN, *([EXAMPLE] if EXAMPLE in installed else [])]
    if os.environ.get(PLUGINS_ENV) == "1":
        names += [name for name in installed if name not in names and name != "noop"]
    return names
