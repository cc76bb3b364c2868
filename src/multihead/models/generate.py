"""Text generation with a KV cache: a batch of prompts of different lengths decodes together, one token a step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from multihead.cache import Cache, CacheSpec, HeadPlan, KVCache
from multihead.errors import MultiheadError
from multihead.models.llama import LlamaBlock, LlamaModel
from multihead.sizing import cost


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or temperature + nucleus (top-p) sampling with a seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise MultiheadError(f"temperature ({self.temperature}) must be finite and >= 0 (0 is greedy)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise MultiheadError(f"seed ({self.seed}) must be from 0 to 2^63 - 1")
        if not 0.0 < self.top_p <= 1.0:
            raise MultiheadError(f"top_p ({self.top_p}) must be in (0, 1]")

    def generator(self) -> torch.Generator | None:
        if self.temperature == 0.0:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def sample(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """Next tokens (b,) from logits (b, vocab)."""
    if sampling.temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.double()  # shifted first, so a tiny temperature gives 0 and -inf, never inf - inf
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)  # keep the smallest nucleus
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    picked = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return picked.to(logits.device)


StepFn = Callable[[Tensor, Tensor], Tensor]

CACHE_BUCKET = 256  # compiled decoding rounds the cache up to a multiple of this, so one graph serves many lengths


def compiled_step(model: LlamaModel, cache: KVCache) -> StepFn:
    """One decoding step of ``model`` compiled with torch.compile (static shapes), writing ``cache``.

    The compiled function is kept on the model and reused for every cache of the same shape: the first call for a
    new (batch, cache length) compiles (minutes on a small CPU; torch keeps compiled kernels on disk, so a new
    process is faster), later steps reuse the graph.
    """
    fn = getattr(model, "_compiled_decode", None)
    if fn is None:
        def decode(tokens: Tensor, positions: Tensor, c: KVCache) -> Tensor:
            out: Tensor = model(tokens, positions=positions, cache=c)
            return out

        fn = torch.compile(decode, dynamic=False)
        model._compiled_decode = fn  # type: ignore[assignment]

    def step(tokens: Tensor, positions: Tensor) -> Tensor:
        out: Tensor = fn(tokens, positions, cache)
        return out

    return step


def full_cache_bytes(model: LlamaModel, batch: int, max_len: int) -> int:
    """Bytes of the full :class:`KVCache` of ``max_len`` positions that :func:`generate_ids` makes without window= or
    plan= (``model.new_cache(batch, max_len)``), counted by :mod:`multihead.sizing.cost` instead of made: per layer
    2 * g * d * bytes(dtype) * max_len * batch for its g KV heads (this rank's when the model is split over
    processes; a pruned model's layers each their own). Another cache's ``bytes`` is read beside it."""
    total = 0
    for block in model.layers:
        attn = cast(LlamaBlock, block).attn
        config = dataclasses.replace(attn.config, n_kv_heads=attn.local_kv_heads)
        total += cost.kv_cache_bytes_per_token_per_layer(config, str(model.dtype)) * max_len * batch
    return total


def generate_ids(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: set[int] | frozenset[int] = frozenset(),
    step: StepFn | None = None,
    compile: bool = False,
    spec: CacheSpec | None = None,
    window: int | None = None,
    sink_tokens: int = 4,
    plan: HeadPlan | None = None,
    bits: int | None = None,
    on_cache: Callable[[Cache], None] | None = None,
) -> Iterator[list[int | None]]:
    """Yield, at each step, the new token of every prompt (None once a prompt has stopped).

    The prompts are written into one cache right-padded; each sequence then continues from its own length.
    ``step(tokens, positions)`` may replace the model call (a compiled function, say); it must write the cache.
    ``compile=True`` runs the decoding steps through :func:`compiled_step` (the prompt itself runs eagerly), with
    the cache rounded up to a multiple of CACHE_BUCKET positions so that later calls reuse the compiled graph.
    ``spec=``: the cache's kind, as a :class:`~multihead.cache.CacheSpec` (its max_len is set to the prompt and new
    tokens; a windowed spec is taken as it is); the keywords below make the same spec:
    ``window=N`` decodes with a :class:`~multihead.cache.SinkCache` (``sink_tokens`` first tokens and the last N):
    constant memory, any number of new tokens (also past the model's context); prompts of one length.
    ``plan=`` decodes with a :class:`~multihead.cache.HeadwiseCache` of that :class:`~multihead.cache.HeadPlan`
    (each KV head in full or as the plan's sinks + window; checked against the model's shape); prompts of one
    length, eagerly. ``bits=`` (4 or 8) decodes with a :class:`~multihead.cache.QuantizedKVCache` of that width
    (group 32, or the head's width where smaller; residual 128), the same way. ``on_cache`` is called with the
    cache once it is made, before the prompt runs (to read its ``bytes``, say).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise MultiheadError(f"max_new_tokens ({max_new_tokens!r}) must be a positive int")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise MultiheadError("every prompt needs at least one token")
    vocab = model.config.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise MultiheadError(f"token ids {bad[:5]} are outside the vocabulary of {vocab}")
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    total = longest + max_new_tokens
    spec = generate_spec(model, spec, window=window, sink_tokens=sink_tokens, plan=plan, bits=bits)
    if spec.kind == "window":
        windowed = spec
        yield from _generate_windowed(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                      stop_ids=stop_ids, compile=compile, step=step, on_cache=on_cache,
                                      make=lambda b: model.new_cache(b, spec=windowed))
        return
    if total > model.config.max_context:
        raise MultiheadError(
            f"the prompt ({longest} tokens) and max_new_tokens ({max_new_tokens}) need {total} positions, more than "
            f"the model's context of {model.config.max_context}"
        )
    if spec.kind in ("headwise", "quantized"):
        sized = spec.with_max_len(total)
        yield from _generate_windowed(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                      stop_ids=stop_ids, compile=compile, step=step, on_cache=on_cache,
                                      make=lambda b: model.new_cache(b, spec=sized),
                                      kind="head-wise" if spec.kind == "headwise" else "quantized")
        return
    b = len(prompts)
    device = model.device
    tokens = torch.zeros(b, longest, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    if compile and step is not None:
        raise MultiheadError("give either step or compile=True, not both")
    size = min(-(-total // CACHE_BUCKET) * CACHE_BUCKET, model.config.max_context) if compile else total
    cache = model.new_cache(b, spec=spec.with_max_len(size))
    assert isinstance(cache, KVCache)
    if on_cache is not None:
        on_cache(cache)
    if compile:
        step = compiled_step(model, cache)
    gen = sampling.generator()

    with torch.no_grad():
        if len(set(lengths)) == 1:  # the last position's logits only (no vocabulary product for the others)
            last = model(tokens, cache=cache, logits_to_keep=1)[:, -1]  # (b, vocab)
        else:  # (b, s, vocab): each sequence from position 0, its last real token's row taken
            logits = model(tokens, cache=cache)
            last = logits[torch.arange(b, device=device), torch.tensor(lengths, device=device) - 1]
        cache.advance(longest, lengths=lengths)
        done = [False] * b
        call = step if step is not None else (lambda t, pos: model(t, cache=cache))
        for n in range(max_new_tokens):
            nxt = sample(last, sampling, gen)  # (b,)
            ids = nxt.tolist()
            out: list[int | None] = []
            for i, t in enumerate(ids):
                out.append(None if done[i] else t)
                if not done[i] and t in stop_ids:
                    done[i] = True
            yield out
            if all(done) or n == max_new_tokens - 1:
                return
            logits = call(nxt[:, None], cache.next_positions(1))
            cache.advance(1)
            last = logits[:, -1]


def generate_spec(model: LlamaModel, spec: CacheSpec | None = None, *, window: int | None = None,
                  sink_tokens: int = 4, plan: HeadPlan | None = None, bits: int | None = None) -> CacheSpec:
    """The :class:`~multihead.cache.CacheSpec` :func:`generate_ids` decodes with: ``spec`` as given, or the one its
    keywords make (``window`` with ``sink_tokens``; ``plan``; ``bits`` with a group of 32, or the head's width where
    smaller); a full cache without either. A spec and keywords together, or keywords of two kinds, are refused."""
    if spec is not None:
        if not isinstance(spec, CacheSpec):
            raise MultiheadError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        given = [name for name, value in (("window", window), ("plan", plan), ("bits", bits)) if value is not None]
        if given:
            raise MultiheadError(f"give spec= alone or the cache's keywords, not both (got spec= with "
                                 f"{', '.join(name + '=' for name in given)})")
        return spec
    if window is not None:
        if plan is not None or bits is not None:
            raise MultiheadError("give either window= (a sink + window cache) or plan= / bits=, not both")
        return CacheSpec(window=window, sink_tokens=sink_tokens)
    if plan is not None and bits is not None:
        raise MultiheadError("give either plan= (a head-wise cache) or bits= (a quantized one), not both")
    if plan is not None:
        return CacheSpec(1, plan=plan)
    if bits is not None:
        head_dim = model.config.head_dim or model.config.d_model // model.config.n_heads
        return CacheSpec(1, bits=bits, group=min(32, head_dim))
    return CacheSpec(1)


def _generate_windowed(model: LlamaModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                       sampling: Sampling, stop_ids: set[int] | frozenset[int], compile: bool, step: StepFn | None,
                       make: Callable[[int], Cache], kind: str = "windowed",
                       on_cache: Callable[[Cache], None] | None = None) -> Iterator[list[int | None]]:
    """:func:`generate_ids` over a cache whose sequences hold one length, made by ``make(batch)``: a sink + window
    cache (StreamingLLM, memory bounded whatever the length; ``kind`` "windowed") or a head-wise one."""
    if compile or step is not None:
        raise MultiheadError(f"a {kind} cache decodes eagerly: drop compile/step, or the "
                             f"{ {'windowed': 'window', 'head-wise': 'plan'}.get(kind, 'bits') }")
    if len({len(p) for p in prompts}) != 1:
        raise MultiheadError(f"a {kind} cache holds sequences of one length: the prompts have lengths "
                             f"{sorted({len(p) for p in prompts})} (generate them one at a time)")
    if len(prompts[0]) > model.config.max_context:
        raise MultiheadError(f"the prompt ({len(prompts[0])} tokens) is longer than the model's context of "
                             f"{model.config.max_context}")
    cache = make(len(prompts))
    if on_cache is not None:
        on_cache(cache)
    tokens = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=model.device)
    gen = sampling.generator()
    with torch.no_grad():
        last = model(tokens, cache=cache, logits_to_keep=1)[:, -1]  # (b, vocab)
        cache.advance(tokens.shape[1])
        done = [False] * len(prompts)
        for n in range(max_new_tokens):
            nxt = sample(last, sampling, gen)
            out: list[int | None] = []
            for i, t in enumerate(nxt.tolist()):
                out.append(None if done[i] else t)
                done[i] = done[i] or t in stop_ids
            yield out
            if all(done) or n == max_new_tokens - 1:
                return
            last = model(nxt[:, None], cache=cache)[:, -1]
            cache.advance(1)
