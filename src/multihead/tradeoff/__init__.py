"""The KV-cache trade-off, measured: what a model loses for each byte of cache saved.

:mod:`multihead.tradeoff.lm` evaluates a causal model's perplexity under each KV-saving method (attention sinks +
window, quantized caches, fewer KV heads, uptraining, pruning) on the evaluation text of :mod:`multihead.evals.text`;
:mod:`multihead.tradeoff.encoder` does the same for a sentence encoder with 1 - cosine as its metric;
:mod:`multihead.tradeoff.longctx` judges the methods by long-context retrieval (the needle cases of
:mod:`multihead.evals`). These experiments stand on the analyses of :mod:`multihead.heads` (importance, pooling),
never the other way round.
"""
