r"""
pytest plugin shipped with qcomm (entry point ``pytest11``): gives every test
suite the ``qcomm_check_codec`` fixture of the conformance kit.

Installing qcomm is enough; there is nothing to add to ``conftest.py``. A
codec author's test then reads::

    from my_codecs import MyCodec

    def test_my_codec_conforms(qcomm_check_codec):
        report = qcomm_check_codec(MyCodec(block_size=32))
        assert report.worst_error <= 1.0

    def test_my_codec_from_its_entry_point(qcomm_check_codec):
        import qcomm

        qcomm_check_codec(qcomm.load_codec("my_codec:block_size=32"))

The fixture is :func:`qcomm.testing.check_codec` itself: it returns a
:class:`~qcomm.testing.CodecReport` and raises
:class:`~qcomm.testing.ConformanceError` (a :class:`~qcomm.CodecError`)
naming the rule, the codec and the input on the first rule broken, which
pytest reports as the test's failure.

Importing this module is cheap: torch and the kit load only when the fixture
is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["qcomm_check_codec"]


@pytest.fixture
def qcomm_check_codec() -> Callable[..., Any]:
    r"""
    qcomm_check_codec() -> Callable[..., CodecReport]

    The conformance kit's :func:`~qcomm.testing.check_codec`, as a fixture.

    Returns:
        Callable[..., CodecReport]: ``check_codec(codec, *, lengths=None,
        seed=0, block=None, device="cpu")``.
    """
    from qcomm.testing import check_codec

    return check_codec
