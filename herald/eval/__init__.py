"""Accuracy evaluation (``herald eval``, the HERALD §VI-B analogs): long-context code tasks built
at run time from the local Python standard library, run through every engine mode, and
selection-recall analyses.

Map:

- :mod:`herald.eval.sources`: the stdlib corpus (which files, their hashes, imports, relatedness).
- :mod:`herald.eval.tasks`: the tasks, their examples and :func:`~herald.eval.tasks.build_examples`
  (RepoBench-P-style line completion, long-range identifier recall, RULER-style needles,
  variable tracking and common words), deterministic for a seed, with the selection recorded;
  the builders: :mod:`herald.eval.line_task` (target lines: :mod:`herald.eval.line_targets`),
  :mod:`herald.eval.recall_task`, :mod:`herald.eval.ruler_task` (on the standard library) over
  :mod:`herald.eval.ruler` (any text source; formats and exact-match rules:
  :mod:`herald.eval.ruler_formats`); shared text helpers: :mod:`herald.eval.task_text`.
- :mod:`herald.eval.metrics`: output post-processing, exact match (each task's rule), edit
  similarity.
- :mod:`herald.eval.runner`: one "unit" = one (task, context, mode, budget) run through an engine.
- :mod:`herald.eval.recall`: Fig. 7 / Fig. 9 analogs from data captured on a dense run
  (:mod:`herald.bench.capture`).
- :mod:`herald.eval.report`: merged results JSON, README and plots; its parts:
  :mod:`herald.eval.summary` (Table I numbers), :mod:`herald.eval.acceptance`,
  :mod:`herald.eval.stats` (bootstrap intervals), :mod:`herald.eval.report_markdown`,
  :mod:`herald.eval.plots` (needs the ``plot`` extra).
- :mod:`herald.eval.cli`: the ``herald eval`` subcommand; its checks
  (:mod:`herald.eval.cli_checks`) and recorded example selections (:mod:`herald.eval.selection`).
"""
