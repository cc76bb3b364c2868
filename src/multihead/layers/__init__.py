"""The layers' room: the attention layers and what one forward passes through before the cache and the kernels.

In the order a forward visits them::

    attention.py   MultiHeadAttention (MHA, GQA, MQA): project -> rotate -> update -> attend -> merge
    latent.py      MultiHeadLatentAttention (MLA), the same route over a latent cache
    step.py        Step: what one model step shares across layers (mask spec, positions, RoPE tables, slots)
    masks.py       the one mask convention (True = may attend) and the MaskSpec a step carries
    linear.py      the projections' few-row products (their CPU decisions live in multihead.kernels)
    rope.py        rotary position embeddings
    hooks.py       hook points: read or replace q, k, v, pattern, z, out (and a block's residual points)
    norms.py       RMSNorm
    parallel.py    heads across processes (DTensor), the layer split by heads

The public names load from :mod:`multihead` itself (``multihead.MultiHeadAttention``); each module here is
imported when used.
"""
