"""Accuracy evaluation (``herald eval``, issue 6): long-context code tasks built at run time from
the local Python standard library, run through every engine mode, and selection-recall analyses.

Map:

- :mod:`herald.eval.sources`: the stdlib corpus (which files, their hashes, imports, relatedness).
- :mod:`herald.eval.tasks`: example builders (RepoBench-P-style line completion, long-range
  identifier recall), deterministic for a seed, with the selection recorded.
- :mod:`herald.eval.metrics`: output post-processing, exact match, edit similarity.
- :mod:`herald.eval.runner`: one "unit" = one (task, context, mode, budget) run through an engine.
- :mod:`herald.eval.recall`: Fig. 7 / Fig. 9 analogs from data captured on a dense run.
- :mod:`herald.eval.report`: merged results JSON, markdown tables and plots.
- :mod:`herald.eval.cli`: the ``herald eval`` subcommand.
"""
