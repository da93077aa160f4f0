"""Training a small SDAR block dLLM from scratch (the model the accuracy evaluation runs).

Data flows corpus -> tokenizer -> stream -> windows -> objective -> trainer -> checkpoint:

* :mod:`herald.train.corpus`: the third-party ``.py`` files of the running interpreter, stdlib
  held out, the data recipe and its manifest;
* :mod:`herald.train.tokenizer_train`: byte-level BPE with EOS / pad / mask, corpus encoding;
* :mod:`herald.train.data`: the cached uint16 token stream and seeded, resumable windows;
* :mod:`herald.train.task_mix`: RULER-style task sequences (``--task-mix``) among the windows,
  built by :mod:`herald.eval.ruler` on the training corpus's files (never the stdlib);
* :mod:`herald.train.objective`: noising, the 2L-token block-diffusion mask (flex / dense), loss;
* :mod:`herald.train.config`: model shape and hyper-parameters;
* :mod:`herald.train.trainer`: the loop; :mod:`herald.train.schedule`: learning rate, AdamW and
  noise seeding; :mod:`herald.train.run_outputs`: what a run writes at its end;
  :mod:`herald.train.checkpoint`: HF checkpoint + state;
* :mod:`herald.train.cli`: ``herald train``.
"""
