r"""
The three collectives of sharded embeddings, each with a codec on the forward
and on the backward pass: :func:`all_to_all_pooled`,
:func:`reduce_scatter_pooled` and :func:`all_to_all_sequence`.
"""

from qcomm.collectives.pooled import all_to_all_pooled
from qcomm.collectives.reduce_scatter import reduce_scatter_pooled
from qcomm.collectives.sequence import all_to_all_sequence

__all__ = ["all_to_all_pooled", "all_to_all_sequence", "reduce_scatter_pooled"]
