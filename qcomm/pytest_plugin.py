r"""
pytest plugin shipped with qcomm (entry point ``pytest11``): installing qcomm
gives every test suite the ``qcomm_check_codec`` fixture, nothing to add to
``conftest.py``::

    from my_codecs import MyCodec

    def test_my_codec_conforms(qcomm_check_codec):
        report = qcomm_check_codec(MyCodec(block_size=32))
        assert report.worst_error <= 1.0

Importing this module is cheap: torch and the kit load only when the fixture
is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from qcomm.testing import CodecReport

__all__ = ["qcomm_check_codec"]


@pytest.fixture
def qcomm_check_codec() -> Callable[..., CodecReport]:
    r"""
    qcomm_check_codec() -> Callable[..., CodecReport]

    The conformance kit's :func:`~qcomm.testing.check_codec`, as a fixture.
    """
    from qcomm.testing import check_codec

    return check_codec
