"""The KV-cache trade-off, measured: what a model loses for each byte of cache saved.

:mod:`multihead.tradeoff.text` is the evaluation text; :mod:`multihead.tradeoff.lm` evaluates a causal model's
perplexity under each KV-saving method (attention sinks + window, quantized caches, fewer KV heads, uptraining,
pruning); :mod:`multihead.tradeoff.encoder` does the same for a sentence encoder with 1 - cosine as its metric.
"""
