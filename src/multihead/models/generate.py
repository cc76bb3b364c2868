"""Text generation with a KV cache: a batch of prompts of different lengths decodes together, one token a step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.models.llama import LlamaModel


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or temperature + nucleus (top-p) sampling with a seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise MultiheadError(f"temperature ({self.temperature}) must be >= 0 (0 is greedy)")
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
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)  # keep the smallest nucleus
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    picked = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return picked.to(logits.device)


StepFn = Callable[[Tensor, Tensor], Tensor]


def generate_ids(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: set[int] | frozenset[int] = frozenset(),
    step: StepFn | None = None,
) -> Iterator[list[int | None]]:
    """Yield, at each step, the new token of every prompt (None once a prompt has stopped).

    The prompts are written into one cache right-padded; each sequence then continues from its own length.
    ``step(tokens, positions)`` may replace the model call (a compiled function, say); it must write the cache.
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
    if total > model.config.max_context:
        raise MultiheadError(
            f"the prompt ({longest} tokens) and max_new_tokens ({max_new_tokens}) need {total} positions, more than "
            f"the model's context of {model.config.max_context}"
        )
    b = len(prompts)
    device = model.device
    tokens = torch.zeros(b, longest, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    cache = model.new_cache(b, total)
    gen = sampling.generator()

    with torch.no_grad():
        logits = model(tokens, cache=cache)  # (b, s, vocab): each sequence from position 0
        cache.advance(longest, lengths=lengths)
        last = logits[torch.arange(b, device=device), torch.tensor(lengths, device=device) - 1]  # (b, vocab)
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
