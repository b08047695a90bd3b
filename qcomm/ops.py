r"""
The collectives by name: :class:`~qcomm.CommOp`, the embedding collectives a
TorchRec registry is keyed by. Importable without torch, so that the command
line's front end (``qcomm list``, argument parsing) stays fast.
"""

from __future__ import annotations

import enum

from qcomm.errors import CodecError

__all__ = ["CommOp"]


# CommOp value -> the qcomm collective that runs it.
_COLLECTIVES = {
    "pooled_embeddings_all_to_all": "all_to_all_pooled",
    "pooled_embeddings_reduce_scatter": "reduce_scatter_pooled",
    "sequence_embeddings_all_to_all": "all_to_all_sequence",
}


class CommOp(enum.Enum):
    r"""
    The collectives of sharded embeddings a codec pair can be attached to: the
    member names key a TorchRec ``qcomm_codecs_registry``, the lower-case values
    are used in codec spec strings.
    """

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"

    # The name of the qcomm collective that runs it, e.g. "all_to_all_pooled".
    collective: str

    def __init__(self, value: str) -> None:
        self.collective = _COLLECTIVES[value]

    @classmethod
    def parse(cls, op: CommOp | str) -> CommOp:
        r"""
        parse(op: CommOp | str) -> CommOp

        Turns a :class:`~qcomm.CommOp`, its name or its value (any case) into a member.

        Args:
            op (CommOp | str): a member, its name or its value.

        Raises:
            CodecError: if ``op`` names no member; the message lists them.

        Examples::

            >>> CommOp.parse("pooled_embeddings_reduce_scatter").name
            'POOLED_EMBEDDINGS_REDUCE_SCATTER'
        """
        if isinstance(op, CommOp):
            return op
        if isinstance(op, str):
            key = op.strip().upper()
            if key in cls.__members__:
                return cls[key]
        known = ", ".join(m.value for m in cls)
        raise CodecError(f"unknown CommOp {op!r}: expected one of {known}")
