r"""
The three collectives of sharded embeddings, each with a codec on the forward
and on the backward pass: :func:`~qcomm.all_to_all_pooled`,
:func:`~qcomm.reduce_scatter_pooled` and :func:`~qcomm.all_to_all_sequence`
(see :doc:`collectives`); and :func:`~qcomm.collectives.all_gather_pooled`,
the reduce-scatter's adjoint. What they share:

- A call starts its communication at once and returns an
  :class:`~qcomm.Awaitable`; the result is decoded and laid out on
  :meth:`~qcomm.Awaitable.wait`.
- The output is differentiable: its gradient goes back through the inverse
  collective, encoded with the backward codec.
- Every rank of ``group`` must make the same calls in the same order, with
  matching splits, trailing shapes, codecs and ``chunk_bytes``, and must run
  the backward pass if any rank does.
- The first call of each collective on each group checks that the ranks
  agree, and a rank whose arguments are invalid makes the others raise
  :class:`~qcomm.CodecError` naming it instead of waiting. Every call then
  carries each rank's status in-band: a codec failing on one rank makes
  every rank raise naming it, never return zeros. ``QCOMM_VERIFY=1`` checks
  every call in full, ``QCOMM_VERIFY=0`` only the statuses; the setting must
  be the same on all ranks (:doc:`collectives`, "Mistakes and failures").
- ``QCOMM_TRANSPORT=all_to_all`` forces the transport NCCL takes on any
  backend (:doc:`collectives`, "Pipelined, full duplex").
- ``chunk_bytes`` sets the chunk the pipeline cuts each peer's data into, in
  float32 bytes whatever the dtype; ``None`` picks it (:doc:`collectives`,
  "Pipelined, full duplex").
- A call has read ``input`` when it returns, whatever the codec: ``input``
  may be changed or reused at once, before :meth:`~qcomm.Awaitable.wait`,
  and its gradient still goes where it went when the call was made
  (:doc:`collectives`, "Asynchronous by default").
"""

# Registers its operator for torch.compile, as the others' modules do theirs.
import qcomm.collectives.all_reduce  # noqa: F401
from qcomm.collectives.all_gather import all_gather_pooled
from qcomm.collectives.all_to_all import all_to_all_pooled, all_to_all_sequence
from qcomm.collectives.reduce_scatter import reduce_scatter_pooled

__all__ = ["all_gather_pooled", "all_to_all_pooled", "all_to_all_sequence", "reduce_scatter_pooled"]
