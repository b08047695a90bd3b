"""Throw-away distributions for plugin tests: real dist-info folders on sys.path."""

from __future__ import annotations

import importlib
import pathlib
import sys
import textwrap
from typing import Any

# A minimal codec that follows the contract, for fake plugins to expose.
GOOD_CODEC = textwrap.dedent(
    """
    import torch
    import qcomm

    class Codec:
        def __init__(self, scale: float = 1.0, tag: str = ""):
            self.scale = scale
            self.tag = tag
            # Scaling by a constant is linear, so wire tensors may be summed.
            self.info = qcomm.CodecInfo(name="good", bits_per_element=32, summable=True)

        def encode(self, input_tensor, ctx=None):
            return input_tensor * self.scale

        def decode(self, input_grad, ctx=None):
            return input_grad / self.scale

        @property
        def quantized_dtype(self):
            return torch.float32

        def calc_quantized_size(self, input_len, ctx=None):
            return input_len

        def create_context(self):
            return None

        def padded_size(self, input_tensor, dim_per_rank, my_rank, qcomm_ctx):
            return dim_per_rank[my_rank], 0
    """
)


def make_dist(
    root: pathlib.Path,
    dist: str,
    module: str,
    source: str,
    codecs: dict[str, str],
    version: str = "1.0",
) -> None:
    """Writes ``module.py`` and a dist-info for ``dist`` registering ``codecs``.

    ``codecs`` maps codec name to ``attr`` inside ``module``. ``root`` must be
    put on ``sys.path`` by the caller (after all dists in it are written).
    """
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[qcomm.codecs]"] + [f"{name} = {module}:{attr}" for name, attr in codecs.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def activate(root: pathlib.Path, monkeypatch) -> None:  # noqa: ANN001 - pytest fixture
    """Puts ``root`` on ``sys.path`` for one test and forgets cached modules of it."""
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    for path in root.glob("*.py"):
        monkeypatch.delitem(sys.modules, path.stem, raising=False)


def load_good(spec: str, **options: Any) -> Any:
    """``load_codec`` for :data:`GOOD_CODEC`, whose ``scale`` and ``tag`` mypy cannot see."""
    import qcomm

    return qcomm.load_codec(spec, **options)
