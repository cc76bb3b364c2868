"""What a model's quality is judged on, below the analyses and the experiments that use it.

:mod:`multihead.evals.text` is the evaluation text (the Jargon File, split by position into training and held-out
tokens); :mod:`multihead.evals.needles` makes needle cases at a chosen length (passkeys, magic numbers and words);
:mod:`multihead.evals.case_files` writes and reads them as JSON lines; :mod:`multihead.evals.answers` prefills a case
through a cache and reads the model's teacher-forced answer (exact match, log-likelihood, step time). The retrieval
scores of :mod:`multihead.heads.retrieval` and the long-context trade-off of :mod:`multihead.tradeoff.longctx` both
stand on these.
"""
