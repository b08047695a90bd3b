r"""
``qcomm bench``, one concept per module:

- :mod:`~qcomm.benchmark.command`: the command's options and the run.
- :mod:`~qcomm.benchmark.options`: the option mini-languages and the run's settings.
- :mod:`~qcomm.benchmark.launch`: local ranks or a launcher's, and the watchdog.
- :mod:`~qcomm.benchmark.children`: child processes that end with the command.
- :mod:`~qcomm.benchmark.session`: one rank's device and process groups; exit codes.
- :mod:`~qcomm.benchmark.link`: the emulated network link of ``--link``.
- :mod:`~qcomm.benchmark.measure`: what every rank measures, step by step.
- :mod:`~qcomm.benchmark.agreement`: the ranks' agreement on whether a step failed.
- :mod:`~qcomm.benchmark.progress`: the progress bar and the watchdog's heartbeat.
- :mod:`~qcomm.benchmark.rows`: the report's rows, typed, with what each field means.
- :mod:`~qcomm.benchmark.results`: the results around the rows (meta, link, roofline,
  advice, ``--train``'s model), typed, and the JSON file read back.
- :mod:`~qcomm.benchmark.figures`: the figures derived from the measured rows.
- :mod:`~qcomm.benchmark.meta`: what the report says of its run.
- :mod:`~qcomm.benchmark.candidates`: the codecs measured, and one codec's figures.
- :mod:`~qcomm.benchmark.series`: the collectives' inputs and what runs them.
- :mod:`~qcomm.benchmark.timing`: time-budgeted repetition of a call.
- :mod:`~qcomm.benchmark.metrics`: the formulas of the figures.
- :mod:`~qcomm.benchmark.advice`: which codec pair to use on a link.
- :mod:`~qcomm.benchmark.harness`: what every model of ``--train`` shares: the model's
  protocol, the rounds, the rows' figures and the report.
- :mod:`~qcomm.benchmark.train`: whole training steps of a sharded DLRM (``--train``).
- :mod:`~qcomm.benchmark.train_mlp`: those of an MLP under DDP (``--train-model mlp``).
- :mod:`~qcomm.benchmark.train_fsdp`: those of the MLP under FSDP2 (``--train-model fsdp``).
- :mod:`~qcomm.benchmark.report`: the terminal tables and the JSON file.
- :mod:`~qcomm.benchmark.plot`: the plot.
"""
