"""The plain-text tables of the ``qcomm`` command (``list`` and ``bench``)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int | None = None
) -> str:
    """Columns padded to their widest cell under a dashed rule; past the first
    ``text_columns`` (all when ``None``) cells align right, as figures do."""
    left = len(header) if text_columns is None else text_columns
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [
        "  ".join(
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
