r"""
The adaptive series of ``qcomm bench --train`` (see :doc:`/bench`, "Training
steps"): TorchRec's DLRM with :data:`ADAPTIVE` on its embedding collectives,
and where its codecs settled, read from :func:`~qcomm.error_history` of its
registry once the run is over. No torch here: the report reads these.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qcomm.history import CallRecord

__all__ = ["ADAPTIVE", "format_settled", "settled"]

#: The adaptive series' codec on every embedding collective, forward and
#: backward, at the default budget (``qcomm.adaptive.DEFAULT_MAX_ERROR``).
ADAPTIVE = "adaptive:mx4|int8|bf16"


def settled(
    records: Iterable[CallRecord],
) -> tuple[dict[str, str], dict[str, dict[str, float]], dict[str, int]]:
    r"""
    settled(records: Iterable[CallRecord]) -> tuple[dict[str, str], dict[str, dict[str, float]], dict[str, int]]

    Where an adaptive registry's calls settled, per collective and pass
    (e.g. ``"all_to_all_pooled forward"``): the codec of its last call, each
    codec's share of its calls, and its switches.

    Args:
        records (Iterable[qcomm.CallRecord]): the registry's calls, oldest first
            (:func:`~qcomm.error_history`).

    Returns:
        tuple[dict[str, str], dict[str, dict[str, float]], dict[str, int]]:
        the last call's codec, the shares (summing to 1) and the switches, by
        collective and pass.

    Examples::

        >>> from qcomm.history import CallRecord
        >>> calls = [CallRecord("all_to_all_pooled forward", n, c, (), (), 0, 0) for n, c in enumerate(["bf16", "int8", "int8", "int8"])]
        >>> settled(calls)
        ({'all_to_all_pooled forward': 'int8'}, {'all_to_all_pooled forward': {'bf16': 0.25, 'int8': 0.75}}, {'all_to_all_pooled forward': 0})
    """
    last: dict[str, str] = {}
    counts: dict[str, dict[str, int]] = {}
    switches: dict[str, int] = {}
    for r in records:
        last[r.collective] = r.codec
        by_codec = counts.setdefault(r.collective, {})
        by_codec[r.codec] = by_codec.get(r.codec, 0) + 1
        switches[r.collective] = switches.get(r.collective, 0) + (r.switched_to is not None)
    shares = {
        collective: {codec: n / sum(by_codec.values()) for codec, n in by_codec.items()}
        for collective, by_codec in counts.items()
    }
    return last, shares, switches


def format_settled(rows: Iterable[Any]) -> list[str]:
    r"""
    format_settled(rows: Iterable[DlrmRow]) -> list[str]

    The report's lines on the rows that carry where their codecs settled
    (``settled``, ``codec_shares``, ``switches``): one per collective and pass.

    Args:
        rows (Iterable[DlrmRow]): the run's rows.
    """
    lines = []
    for row in rows:
        if row.status != "ok" or not row.settled:
            continue
        lines.append(
            f"{row.label}: where each collective settled (its last call's codec; share of calls):"
        )
        for collective, codec in sorted(row.settled.items()):
            shares = sorted(
                (row.codec_shares or {}).get(collective, {}).items(), key=lambda s: -s[1]
            )
            shown = ", ".join(f"{name} {100 * share:.0f}%" for name, share in shares)
            switches = (row.switches or {}).get(collective, 0)
            plural = "" if switches == 1 else "es"
            lines.append(f"  {collective}: {codec} ({shown}; {switches} switch{plural})")
    return lines
