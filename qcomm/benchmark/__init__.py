r"""
The machinery behind ``qcomm bench``, one concept per module:

- :mod:`~qcomm.benchmark.metrics`: the figures (bandwidths like nccl-tests,
  error statistics, break-even link bandwidth), pure functions.
- :mod:`~qcomm.benchmark.timing`: time-budgeted repetition of a call.
- :mod:`~qcomm.benchmark.options`: the option mini-languages (sizes, codec
  lists, collectives) and the run's configuration.
- :mod:`~qcomm.benchmark.codecs`: the codecs measured, qcomm's and fbgemm's,
  and their encode/decode figures.
- :mod:`~qcomm.benchmark.collectives`: the collectives measured, qcomm's and
  TorchRec's, and how one message size of one of them is set up.
- :mod:`~qcomm.benchmark.runner`: what every rank does, step by step.
- :mod:`~qcomm.benchmark.launch`: local ranks or a launcher's, process groups,
  and the watchdog that keeps a run from hanging.
- :mod:`~qcomm.benchmark.report`: the terminal table, the JSON file, the plot.
"""
