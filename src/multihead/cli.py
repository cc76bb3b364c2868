"""The ``multihead`` command: thin subcommands over library functions.

User errors (bad flags, impossible configurations) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from multihead.config import AttentionConfig
from multihead.errors import MultiheadError

ENGINES = ("auto", "ours", "transformers")  # multihead.heads.adapters.ENGINES, without importing the models

if TYPE_CHECKING:
    from multihead.presets import ModelConfig


class CliError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}")


MAX_INT = 2**50  # sizes and counts: far above any real model, low enough that products stay exact and fast
MAX_SEED = 2**63 - 1


def _integer(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_show(text)} is not an integer") from None
    if not low <= value <= high:
        shown = f"{value:,}" if len(str(value)) <= 30 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise argparse.ArgumentTypeError(f"{shown} must be {what} (from {low:,} to {high:,})")
    return value


def _show(text: str) -> str:
    """A flag's text as typed, shortened, with undecodable bytes shown as escapes."""
    shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return repr(shown if len(shown) <= 60 else shown[:57] + "...")


def _positive(text: str) -> int:
    return _integer(text, 1, MAX_INT, "a positive integer")


def _count(text: str) -> int:
    return _integer(text, 0, MAX_INT, "a count")


def _int(text: str) -> int:
    return _integer(text, -MAX_INT, MAX_INT, "an integer")


def _seed(text: str) -> int:
    return _integer(text, 0, MAX_SEED, "a seed")


def _number(low: float, high: float, *, open_low: bool = False) -> Any:
    """An argparse type: a finite float in [low, high] ((low, high] with open_low)."""
    import math

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_show(text)} is not a number") from None
        if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
            raise argparse.ArgumentTypeError(f"{_show(text)} must be a finite number in "
                                             f"{'(' if open_low else '['}{low:g}, {high:g}]")
        return value

    return parse


def _layers(n: int) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")


def _fmt(n: int) -> str:
    return f"{n:,}"


# ---------------------------------------------------------------------------------------------- shapes
def _add_shapes(sub: Any) -> None:
    p = sub.add_parser("shapes", help="walk the shapes of one attention layer, step by step (runs on the meta device)")
    p.add_argument("--d-model", type=_positive, default=None, help="model width d_model")
    p.add_argument("--heads", type=_positive, default=None, help="query heads n_heads")
    p.add_argument("--kv-heads", type=_positive, default=None, help="key/value heads (default: --heads, MHA)")
    p.add_argument("--head-dim", type=_positive, default=None, help="width of a head (default d_model / heads)")
    p.add_argument("--preset", default=None, help="a named real model's layer instead of the sizes "
                                                  "(see `multihead presets`; DeepSeek presets walk their MLA layer)")
    p.add_argument("--kv-lora-rank", type=_positive, default=None,
                   help="walk a multi-head latent attention (MLA) layer with this KV latent width")
    p.add_argument("--q-lora-rank", type=_positive, default=None, help="MLA: query latent width (default: none)")
    p.add_argument("--qk-rope-head-dim", type=_positive, default=None,
                   help="MLA: the shared RoPE key's width (default head_dim / 2)")
    p.add_argument("--v-head-dim", type=_positive, default=None, help="MLA: value head width (default head_dim)")
    p.add_argument("--path", choices=("expanded", "absorbed"), default="expanded",
                   help="MLA: the expanded (prefill) or absorbed (decode) path (default expanded)")
    p.add_argument("--seq", type=_positive, default=128, help="sequence length s (default 128)")
    p.add_argument("--batch", type=_positive, default=1, help="batch size b (default 1)")
    p.add_argument("--bias", action="store_true", help="give the projections biases (default: none, Llama-style)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_shapes)


def _run_shapes(args: argparse.Namespace) -> int:
    from multihead.config import MLAConfig
    from multihead.shapes import shape_walk

    mla: MLAConfig | None = None
    if args.preset is not None:
        if args.d_model is not None or args.heads is not None or args.kv_lora_rank is not None:
            raise CliError("give --preset or the sizes (--d-model, --heads, ...), not both")
        from multihead.presets import preset

        model = preset(args.preset)
        config, mla = model.attention, model.mla
    else:
        if args.d_model is None or args.heads is None:
            raise CliError("give --d-model and --heads (or --preset NAME)")
        if args.kv_lora_rank is not None:
            nope = args.head_dim or args.d_model // args.heads
            mla = MLAConfig(d_model=args.d_model, n_heads=args.heads, kv_lora_rank=args.kv_lora_rank,
                            qk_nope_head_dim=nope, qk_rope_head_dim=args.qk_rope_head_dim or max(2, nope // 2),
                            v_head_dim=args.v_head_dim or nope, q_lora_rank=args.q_lora_rank, bias=args.bias)
        config = AttentionConfig(d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                 head_dim=args.head_dim, bias=args.bias)
    if mla is not None:
        return _print_mla_walk(mla, args)
    walk = shape_walk(config, batch=args.batch, seq=args.seq)
    if args.json:
        print(json.dumps({
            "config": config.to_dict(),
            "variant": config.variant,
            "batch": walk.batch,
            "seq": walk.seq,
            "head_dim": config.head_dim,
            "steps": [{"step": s.name, "label": s.label, "legend": s.legend, "shape": list(s.shape)}
                      for s in walk.steps],
            "parameters": walk.parameters,
            "projection_parameters": walk.total_parameters,
        }, indent=2))
        return 0
    c = config
    print(f"d_model {c.d_model}, n_heads {c.n_heads}, n_kv_heads {c.n_kv_heads} ({c.variant}), "
          f"d_k = head_dim = {c.head_dim}"
          + ("" if args.head_dim or c.head_dim != c.d_model // c.n_heads else f" (= {c.d_model} / {c.n_heads})")
          + f", batch {walk.batch}, seq {walk.seq}")
    _print_steps(walk.steps, walk.parameters, walk.total_parameters)
    return 0


def _print_steps(steps: Any, parameters: dict[str, int], total: int) -> None:
    width = max([len(s.label) for s in steps] + [len(n) for n in parameters])
    shape_width = max(len(str(s.shape)) for s in steps)
    for s in steps:
        print(f"  {s.label:<{width}}  {s.shape!s:<{shape_width}}  {s.legend}")
    print("parameters:")
    for name, n in parameters.items():
        print(f"  {name:<{width}}  {_fmt(n)}")
    print(f"  {'total':<{width}}  {_fmt(total)}")


def _print_mla_walk(mla: Any, args: argparse.Namespace) -> int:
    from multihead.shapes import mla_shape_walk

    walk = mla_shape_walk(mla, batch=args.batch, seq=args.seq, path=args.path)
    if args.json:
        print(json.dumps({
            "config": mla.to_dict(), "variant": "MLA", "path": walk.path, "batch": walk.batch, "seq": walk.seq,
            "latent_dim": mla.latent_dim,
            "steps": [{"step": s.name, "label": s.label, "legend": s.legend, "shape": list(s.shape)}
                      for s in walk.steps],
            "parameters": walk.parameters, "projection_parameters": walk.total_parameters,
        }, default=str, indent=2))
        return 0
    print(f"MLA: d_model {mla.d_model}, n_heads {mla.n_heads}, kv_lora_rank {mla.kv_lora_rank}, q/k head "
          f"{mla.qk_nope_head_dim} + rope {mla.qk_rope_head_dim}, v head {mla.v_head_dim}"
          + (f", q_lora_rank {mla.q_lora_rank}" if mla.q_lora_rank else "")
          + f"; {walk.path} path, batch {walk.batch}, seq {walk.seq}; cached per token per layer: "
          f"{mla.latent_dim} values")
    _print_steps(walk.steps, walk.parameters, walk.total_parameters)
    return 0


# ---------------------------------------------------------------------------------------------- model sources
def _add_model_flags(p: argparse.ArgumentParser, *, seq_default: int = 4096) -> None:
    src = p.add_argument_group("model (one of --preset, --config, or --d-model with --heads)")
    src.add_argument("--preset", help="a named real model (exact name; see `multihead presets`)")
    src.add_argument("--config", metavar="CONFIG_JSON", help="a Hugging Face config.json, or a folder holding one")
    src.add_argument("--d-model", type=_positive, help="model width d_model")
    src.add_argument("--heads", type=_positive, help="query heads n_heads")
    src.add_argument("--kv-heads", type=_positive, help="key/value heads (default: --heads, MHA)")
    src.add_argument("--head-dim", type=_positive, help="width of a head (default d_model / heads)")
    src.add_argument("--layers", type=_positive, help="number of layers (default 1)")
    src.add_argument("--window", type=_positive, help="sliding window (causal): keys a query may see")
    src.add_argument("--bias", action="store_true", help="projections with biases (default: none)")
    p.add_argument("--seq", type=_positive, default=seq_default, help=f"context length (default {seq_default})")
    p.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    p.add_argument("--dtype", default="bf16", help="element type of the cache and activations: fp32, fp16, bf16, "
                   "int8, fp8 (default bf16)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal attention (default: the model's; decoders are causal, encoders not)")
    p.add_argument("--device-memory", metavar="SIZE", help="memory for the KV cache, e.g. 80GB or 24GiB: "
                   "prints the longest context that fits")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _model_from_args(args: argparse.Namespace) -> ModelConfig:
    from multihead.presets import from_hf_config, from_hf_dict, preset

    raw = [f for f in ("d_model", "heads", "kv_heads", "head_dim", "window") if getattr(args, f) is not None]
    chosen = [name for name, given in (("--preset", args.preset), ("--config", args.config),
                                       ("--d-model/--heads", raw or args.bias)) if given]
    if len(chosen) != 1:
        raise CliError(
            "give exactly one model: --preset NAME, --config config.json, or --d-model and --heads"
            + (f" (got {' and '.join(chosen)})" if chosen else "")
        )
    if args.preset is not None:
        model = preset(args.preset)
    elif args.config is not None:
        model = from_hf_config(args.config)
    else:
        if args.d_model is None or args.heads is None:
            raise CliError("--d-model and --heads are both needed to describe a model by its sizes")
        cfg: dict[str, Any] = {"d_model": args.d_model, "n_heads": args.heads,  # (spellings the reader knows)
                               "n_layers": args.layers or 1, "n_kv_heads": args.kv_heads,
                               "head_dim": args.head_dim, "sliding_window": args.window,
                               "attention_bias": bool(args.bias), "position_embedding_type": "none"}
        model = from_hf_dict(cfg, name=f"d_model {args.d_model}, {args.heads} heads")
    if args.layers is not None and (args.preset is not None or args.config is not None):
        model = dataclasses.replace(model, n_layers=args.layers)
    return model


def _causal(args: argparse.Namespace, model: ModelConfig) -> bool:
    return model.causal if args.causal is None else bool(args.causal)


# ---------------------------------------------------------------------------------------------- count
def _add_count(sub: Any) -> None:
    p = sub.add_parser("count", help="does it fit? the whole model's parameters and memory (weights, KV cache, "
                                     "activations), and attention's parameters, FLOPs and memory")
    _add_model_flags(p)
    p.add_argument("--weights-dtype", default=None,
                   help="how the weights are stored: fp32, bf16, fp8, int8, int4, or a GGUF type such as q4_1, "
                        "q8_0 (default: --dtype)")
    p.add_argument("--tp", type=_positive, default=1, help="devices the model is split over by tensor parallelism "
                                                           "(default 1)")
    p.add_argument("--cache", default="full", help="KV cache kind: full (default), window:N, int8, int4, int2, "
                                                   "latent (MLA models)")
    p.set_defaults(run=_run_count)


def _run_count(args: argparse.Namespace) -> int:
    from multihead import cost
    from multihead.units import format_bytes, format_count, parse_bytes

    model = _model_from_args(args)
    cost.dtype_bytes(args.dtype)
    causal = _causal(args, model)
    a = model.attention
    r = cost.report(a, n_layers=model.n_layers, seq=args.seq, batch=args.batch, dtype=args.dtype, causal=causal)
    r["model"] = model.name
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    if memory is not None:
        r["device_memory_bytes"] = memory
        r["max_context_in_device_memory"] = cost.max_context(
            a, memory_bytes=memory, batch=args.batch, n_layers=model.n_layers, dtype=args.dtype)
    mla = model.mla
    if mla is not None:
        r["mla"] = _mla_report(mla, model.n_layers, args.seq, args.batch, args.dtype, causal)
        if memory is not None:
            r["mla"]["max_context_in_device_memory"] = memory // (r["mla"]["cache_bytes_per_token"] * args.batch)
    whole = _whole_model(model, args, memory)
    if whole is not None:
        r["whole_model"] = whole
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    if whole is not None:
        _print_whole(model, whole, args, memory)
    if mla is not None:
        m = r["mla"]
        print(f"{'model':<28}  {model.name}: {_layers(model.n_layers)}, multi-head latent attention (MLA)")
        print(f"{'heads':<28}  {mla.n_heads} query heads over one latent of {mla.kv_lora_rank} + a shared RoPE key "
              f"of {mla.qk_rope_head_dim} (q/k head {mla.qk_head_dim}, v head {mla.v_head_dim}"
              + (f", q latent {mla.q_lora_rank}" if mla.q_lora_rank else "") + ")")
        print(f"{'MLA parameters per layer':<28}  {m['params_per_layer']:,}  (all layers {m['params_total']:,})")
        print(f"{'latent cache per token':<28}  {mla.latent_dim} values per layer: "
              f"{format_bytes(m['cache_bytes_per_token'])} all layers ({args.dtype})")
        print(f"{f'latent cache, {args.seq} x {args.batch}':<28}  {format_bytes(m['cache_bytes_total'])}  "
              f"({m['cache_bytes_total']:,} B; {m['cache_vs_mha']:.4f} of MHA's below)")
        print(f"{'decode step after ' + str(args.seq):<28}  absorbed {format_count(m['decode_flops_absorbed'], 'FLOP')}"
              f", expanded {format_count(m['decode_flops_expanded'], 'FLOP')} per layer")
        if memory is not None:
            print(f"{'context in ' + format_bytes(memory):<28}  {m['max_context_in_device_memory']:,} tokens "
                  "(latent cache alone)")
        print(f"as plain MHA with the same heads (head_dim = v_head_dim {mla.v_head_dim}):")
    dk_note = f" (= {a.d_model} / {a.n_heads})" if a.head_dim == a.d_model // a.n_heads else " (explicit)"
    rows = [
        ("model", f"{model.name}: {_layers(model.n_layers)}, {'causal' if causal else 'bidirectional'}"),
        ("d_model", f"{a.d_model}"),
        ("heads", f"{a.n_heads} query, {a.n_kv_heads} key/value ({a.variant})"),
        ("d_k = head_dim", f"{a.head_dim}{dk_note}"),
        ("attention parameters / layer", f"{r['params_per_layer']:,}"
         + "  (" + ", ".join(f"{k} {v:,}" for k, v in r["params_per_layer_by_projection"].items()) + ")"),
        ("attention parameters, all", f"{r['params_total']:,}"),
        (f"FLOPs forward (b {args.batch}, s {args.seq})", f"{format_count(r['flops_forward'], 'FLOP')}"
         f"  ({r['flops_forward']:,}; attention core {format_count(r['flops_attention_core'], 'FLOP')})"),
        ("FLOPs backward", f"{format_count(r['flops_backward'], 'FLOP')}"),
        ("KV cache per token", f"{format_bytes(r['kv_cache_bytes_per_token'])} all layers, "
         f"{r['kv_cache_bytes_per_token_per_layer']:,} B per layer ({args.dtype})"),
        (f"KV cache for {args.seq} tokens x {args.batch}", f"{format_bytes(r['kv_cache_bytes_total'])}"
         f"  ({r['kv_cache_bytes_total']:,} B" + (f"; window {a.window} caps it at {r['kv_cache_tokens']} tokens"
                                                  if a.window is not None and a.window < args.seq else "") + ")"),
        ("attention matrix per layer", f"{format_bytes(r['attention_matrix_bytes_per_layer'])} on the math path "
         f"(b*h*s*t); {format_bytes(r['fused_attention_bytes_per_layer'])} fused"),
    ]
    if memory is not None:
        fit = r["max_context_in_device_memory"]
        rows.append((f"context that fits in {format_bytes(memory)}",
                     "any (the window caps the cache)" if fit is None else f"{fit:,} tokens (KV cache alone)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _whole_model(model: Any, args: argparse.Namespace, memory: int | None) -> dict[str, Any] | None:
    """The whole model's parameters, memory and fit, or None for a model described by its attention sizes alone."""
    from multihead import sizing

    if model.hf is None or "vocab_size" not in model.hf:
        return None
    try:
        size = sizing.model_size(model)
    except MultiheadError as err:
        return {"unavailable": str(err)}
    wdtype = args.weights_dtype or args.dtype
    sizing.check_tp(model, args.tp)
    out: dict[str, Any] = {
        "total_parameters": size.total, "active_parameters": size.active, "parameters_by_part": size.parts,
        "tied_embeddings": size.tied, "notes": size.notes, "weights_dtype": wdtype, "tp": args.tp,
        "cache": args.cache,
    }
    f = sizing.fit(model, size, seq=args.seq, batch=args.batch, dtype=args.dtype, weights_dtype=wdtype,
                   memory=memory or 0, tp=args.tp, cache=args.cache)
    out.update({"weight_bytes": f.weights, "kv_bytes": f.kv, "activation_bytes": f.activations,
                "bytes_per_device": f.per_device})
    if memory is not None:
        common = {"dtype": args.dtype, "weights_dtype": wdtype, "memory": memory, "cache": args.cache}
        out["fits"] = f.fits
        out["devices_needed"] = sizing.devices_needed(model, size, seq=args.seq, batch=args.batch, **common)
        if f.fits:
            out["largest_context"] = sizing.largest(model, size, seq=args.seq, batch=args.batch, tp=args.tp,
                                                    what="context", **common)
            out["largest_batch"] = sizing.largest(model, size, seq=args.seq, batch=args.batch, tp=args.tp,
                                                  what="batch", **common)
    return out


def _print_whole(model: Any, w: dict[str, Any], args: argparse.Namespace, memory: int | None) -> None:
    from multihead.units import format_bytes

    if "unavailable" in w:
        print(f"whole model: {w['unavailable']}")
        return
    moe = w["active_parameters"] != w["total_parameters"]
    parts = ", ".join(f"{k} {v:,}" for k, v in w["parameters_by_part"].items())
    print(f"{'whole model, parameters':<28}  {w['total_parameters']:,}"
          + (f" total, {w['active_parameters']:,} active per token" if moe else "") + f"  ({parts})")
    tp = f" over {w['tp']} devices" if w["tp"] > 1 else ""
    print(f"{'memory' + tp:<28}  weights {format_bytes(w['weight_bytes'])} ({w['weights_dtype']}) + KV cache "
          f"{format_bytes(w['kv_bytes'])} ({w['cache']}, {args.seq} x {args.batch}) + activations "
          f"{format_bytes(w['activation_bytes'])} (prefill) = {format_bytes(w['bytes_per_device'])} per device")
    if memory is not None:
        if w["fits"]:
            print(f"{'fits in ' + format_bytes(memory):<28}  yes: up to {w['largest_context']:,} tokens at batch "
                  f"{args.batch}, or batch {w['largest_batch']:,} at {args.seq} tokens")
        else:
            need = w["devices_needed"]
            weights_alone = w["weight_bytes"] > memory * w["tp"]
            why = "the weights alone do not fit" if weights_alone else "weights, cache and activations together do not"
            more = (f"it needs {need} devices of that size (--tp {need})" if need is not None else
                    "no valid split over devices of that size holds it")
            print(f"{'fits in ' + format_bytes(memory):<28}  no: {why}; {more}")
    for note in w["notes"]:
        print(f"{'':<28}  note: {note}")
    print("attention alone:")


def _mla_report(mla: Any, n_layers: int, seq: int, batch: int, dtype: str, causal: bool) -> dict[str, Any]:
    from multihead import cost

    params = cost.mla_parameters(mla).total
    per_token = cost.mla_cache_bytes(mla, context=1, n_layers=n_layers, dtype=dtype)
    total = cost.mla_cache_bytes(mla, context=seq, batch=batch, n_layers=n_layers, dtype=dtype)
    mha = 2 * mla.n_heads * mla.v_head_dim * cost.dtype_bytes(dtype) * n_layers * seq * batch
    return {
        "kv_lora_rank": mla.kv_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim, "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "v_head_dim": mla.v_head_dim, "latent_dim": mla.latent_dim,
        "params_per_layer": params, "params_total": params * n_layers, "cache_bytes_per_token": per_token,
        "cache_bytes_total": total, "cache_vs_mha": total / mha,
        "flops_forward_expanded": cost.mla_flops(mla, s=seq, batch=batch, causal=causal).forward,
        "decode_flops_absorbed": cost.mla_flops(mla, s=1, t=seq + 1, batch=batch, causal=True,
                                                path="absorbed").forward,
        "decode_flops_expanded": cost.mla_flops(mla, s=1, t=seq + 1, batch=batch, causal=True).forward,
    }


# ---------------------------------------------------------------------------------------------- compare
def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="the same model as MHA, GQA and MQA: KV-cache memory side by side, and a plot")
    _add_model_flags(p, seq_default=8192)
    p.add_argument("--plot", default="multihead-compare.png", metavar="PNG",
                   help="where to write the plot of cache memory against context (default multihead-compare.png)")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.set_defaults(run=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from multihead.compare import compare_variants, plot_variants
    from multihead.units import format_bytes, parse_bytes

    model = _model_from_args(args)
    memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    rows = compare_variants(model, seq=args.seq, batch=args.batch, dtype=args.dtype, memory_bytes=memory)
    plot_path = None if args.no_plot else plot_variants(model, rows, args.plot, batch=args.batch, dtype=args.dtype,
                                                         memory_bytes=memory, seq=args.seq)
    if args.json:
        print(json.dumps({"model": model.name, "seq": args.seq, "batch": args.batch, "dtype": args.dtype,
                          "device_memory_bytes": memory, "variants": [dataclasses.asdict(r) for r in rows],
                          "plot": plot_path}, indent=2))
        return 0
    print(f"{model.name}: {_layers(model.n_layers)}, {model.attention.n_heads} query heads, head_dim "
          f"{model.attention.head_dim}; KV cache for {args.seq} tokens x batch {args.batch} in {args.dtype}")
    header = ["variant", "kv heads", "q per kv", "KV / token", "KV cache", "vs MHA", "attn params / layer"]
    whole = rows[0].weight_bytes is not None
    if whole:
        header.append(f"weights ({args.dtype})")
    if memory is not None:
        header.append(f"context in {format_bytes(memory)}" + (" beside the weights" if whole else ""))
    table = [header]
    for r in rows:
        line = [r.variant + (" *" if r.is_model else ""), str(r.n_kv_heads), str(r.group_size),
                format_bytes(r.kv_bytes_per_token), format_bytes(r.kv_cache_bytes), f"{r.ratio_to_mha:.3f}",
                f"{r.params_per_layer:,}"]
        if whole:
            line.append(format_bytes(r.weight_bytes or 0))
        if memory is not None:
            line.append("any" if r.max_context is None else f"{r.max_context:,}")
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                strict=True))))
    print("* the model's own configuration")
    if plot_path:
        print(f"plot: {plot_path}")
    return 0


# ---------------------------------------------------------------------------------------------- presets
def _add_presets(sub: Any) -> None:
    p = sub.add_parser("presets", help="list the named real-model configurations")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_presets)


def _run_presets(args: argparse.Namespace) -> int:
    from multihead.presets import PRESET_NAMES, preset

    models = [preset(n) for n in PRESET_NAMES]
    if args.json:
        print(json.dumps({m.name: {"attention": m.attention.to_dict(), "n_layers": m.n_layers, "causal": m.causal,
                                   "max_context": m.max_context, "source": m.source} for m in models}, indent=2))
        return 0
    for m in models:
        a = m.attention
        print(f"{m.name:<18} d_model {a.d_model:>5}  heads {a.n_heads:>3}/{a.n_kv_heads:<3} ({a.variant})  "
              f"head_dim {a.head_dim:>3}  layers {m.n_layers:>3}  {m.source}")
    return 0


# ---------------------------------------------------------------------------------------------- tensor parallel
def _add_tp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_positive, default=1, metavar="N",
                   help="split the heads over N processes (run under torchrun --nproc-per-node N)")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


# ---------------------------------------------------------------------------------------------- embed
def _add_embed(sub: Any) -> None:
    p = sub.add_parser("embed", help="sentence embeddings with all-MiniLM-L6-v2 running on multihead's layer")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="one or more texts")
    p.add_argument("--model", metavar="DIR", help="a sentence-transformers folder (default: the installed MiniLM)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the vectors")
    _add_tp(p)
    p.set_defaults(run=_run_embed)


def _run_embed(args: argparse.Namespace) -> int:
    from multihead.models import load_sentence_encoder

    encoder = load_sentence_encoder(args.model)
    if args.tp > 1:
        from multihead import parallel

        parallel.shard_bert(encoder.encoder, parallel.init(args.tp))
        if not _is_rank0():
            encoder.embed(args.texts)  # every rank takes part in each all-reduce; rank 0 prints
            return 0
    _, _, truncated = encoder.tokenize(args.texts)
    vectors = encoder.embed(args.texts)
    for text, cut in zip(args.texts, truncated, strict=True):
        if cut:
            print(f"multihead: note: {text[:40]!r}... is longer than {encoder.max_length} tokens and was truncated "
                  "(as the model was trained)", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": str(args.model or "all-MiniLM-L6-v2"), "dim": vectors.shape[1],
                          "embeddings": [{"text": t, "truncated": c, "embedding": v.tolist()}
                                         for t, c, v in zip(args.texts, truncated, vectors, strict=True)]}))
        return 0
    for text, v in zip(args.texts, vectors, strict=True):
        head = ", ".join(f"{x:+.4f}" for x in v[:6].tolist())
        print(f"{text[:50]!r:<54} [{head}, ...] ({v.shape[0]} dims)")
    if len(args.texts) > 1:
        sims = vectors @ vectors.T
        print("cosine similarity:")
        for i in range(len(args.texts)):
            print("  " + " ".join(f"{x:6.3f}" for x in sims[i].tolist()))
    return 0


# ---------------------------------------------------------------------------------------------- generate
def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text with SmolLM2 running on multihead's layer and KV cache")
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--model", metavar="PATH", help="a Llama GGUF file or Hugging Face folder (default: SmolLM2)")
    p.add_argument("--max-new-tokens", type=_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (the default)")
    p.add_argument("--temperature", type=_number(0, 1e6), default=None, help="sample at this temperature")
    p.add_argument("--top-p", type=_number(0, 1, open_low=True), default=None,
                   help="nucleus sampling: keep the top tokens with this mass")
    p.add_argument("--seed", type=_seed, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights (default float32)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding step with torch.compile (minutes the first time, then faster)")
    p.add_argument("--window", type=_positive, default=None,
                   help="decode with attention sinks + a sliding window of this many tokens: constant memory, "
                        "any length (StreamingLLM)")
    p.add_argument("--sinks", type=_count, default=4, help="sink tokens kept beside --window (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    _add_tp(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import time

    import torch

    from multihead.models import load_llama
    from multihead.models.generate import Sampling, generate_ids

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens ({args.max_new_tokens}) must be at least 1")
    sampled = args.temperature is not None or args.top_p is not None or args.seed is not None
    if args.greedy and sampled:
        raise CliError("--greedy cannot be combined with --temperature, --top-p or --seed")
    sampling = Sampling(temperature=args.temperature if args.temperature is not None else (1.0 if sampled else 0.0),
                        top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed)
    if args.compile and args.tp > 1:
        raise CliError("--compile cannot be combined with --tp (the compiled step runs in one process)")
    if args.window is not None and (args.compile or args.tp > 1):
        raise CliError("--window decodes eagerly in one process: drop --compile and --tp")
    model, tok = load_llama(args.model, dtype=getattr(torch, args.dtype))
    quiet = False
    if args.tp > 1:
        from multihead import parallel

        parallel.shard_llama(model, parallel.init(args.tp))
        quiet = not _is_rank0()
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt = tok.encode(text)
    out: list[int] = []

    def produced() -> Iterator[int]:
        for step in generate_ids(model, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 stop_ids=tok.stop_ids, compile=args.compile, window=args.window,
                                 sink_tokens=args.sinks):
            t = step[0]
            if t is None:
                return
            out.append(t)
            if t in tok.stop_ids:
                return
            yield t

    start = time.perf_counter()
    if args.json or quiet:
        for _ in produced():
            pass
        if quiet:
            return 0
    else:
        for piece in tok.stream(produced()):
            print(piece, end="", flush=True)
        print()
    seconds = time.perf_counter() - start
    if args.json:
        shown = [t for t in out if t not in tok.stop_ids]
        print(json.dumps({"prompt": args.prompt, "chat": args.chat, "prompt_tokens": len(prompt),
                          "text": tok.decode(shown), "tokens": out, "new_tokens": len(out),
                          "stopped": bool(out) and out[-1] in tok.stop_ids, "seconds": round(seconds, 3),
                          "tokens_per_second": round(len(out) / seconds, 2) if seconds > 0 else None}))
    return 0


# ---------------------------------------------------------------------------------------------- heads
def _add_heads(sub: Any) -> None:
    p = sub.add_parser("heads", help="what each head of a real model does: scores, labels, pictures, an HTML report")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), minilm, a .gguf file or a model folder")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): multihead's own port where one applies (Llama-style GGUF or folder, BERT), "
                        "else transformers with its attention on multihead; or force one")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="the text to analyse (default: the shipped public-domain passage)")
    text.add_argument("--file", help="a UTF-8 text file to analyse")
    p.add_argument("--out", default="multihead-heads", help="folder for the report and pictures "
                   "(default multihead-heads)")
    p.add_argument("--ablate", action="store_true", help="zero each head in turn and measure the change in loss")
    p.add_argument("--convert", action="store_true", help="mean-pool K/V into fewer KV heads (MHA -> GQA) and "
                   "measure the change")
    p.add_argument("--patch", action="store_true", help="activation patching of every head on the shipped "
                   "indirect-object prompt pairs (causal models), shown in the report")
    p.add_argument("--tokens", type=_positive, default=64, help="tokens shown in the pictures (default 64)")
    p.add_argument("--top", type=_positive, default=3, help="heads listed per score (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object (a record per head)")
    p.set_defaults(run=_run_heads)


def _run_heads(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multihead.heads.adapters import load_head_model
    from multihead.heads.analysis import analyse
    from multihead.heads.report import prepare_out_dir, result_json, write_all

    text = args.text
    if args.file is not None:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CliError(f"cannot read --file {args.file!r}: {err}") from None
    if text is not None and not text.strip():
        raise CliError("the text is empty: give some text to analyse")
    prepare_out_dir(args.out)  # fail before the long work if the report cannot be written
    model = load_head_model(args.model, engine=args.engine)
    from multihead.heads.patching import shipped_pairs

    report = analyse(model, text, display_tokens=args.tokens, ablate=args.ablate, convert=args.convert,
                     pairs=shipped_pairs() if args.patch else None, progress=not args.json)
    files = write_all(report, args.out)
    if args.json:
        print(json.dumps({**result_json(report), "files": files}))
        return 0
    scores = report.scores
    print(f"{report.model}: {report.n_layers} layers x {report.n_heads} query heads ({report.n_kv_heads} KV heads), "
          f"{'causal' if report.causal else 'bidirectional'}; engine: {report.engine}")
    names = ["previous_token", "induction", "duplicate_token", "first_token", "self", "local", "entropy"]
    if not report.causal:
        names.insert(1, "next_token")
    print(f"{'score':<16} top heads (layer.head = score)")
    for name in names:
        tops = "  ".join(f"{layer}.{head} = {value:.2f}" for layer, head, value in scores.top(name, args.top))
        print(f"{name:<16} {tops}")
    counts: dict[str, int] = {}
    for row in scores.labels:
        for label in row:
            counts[label] = counts.get(label, 0) + 1
    print("labels: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
    summary = report.ablation_summary()
    if summary:
        top = ", ".join(f"{r['layer']}.{r['head']} ({r['delta']:+.4f})" for r in summary["most_important"][:5])
        print(f"ablation ({report.metric_name}, baseline {report.baseline:.4f}): most important {top}; "
              f"{summary['share_below_1_percent']:.0%} of heads change it by less than 1%")
    for converted in report.conversion:
        print(f"GQA by mean-pooling to {converted['n_kv_heads']} KV heads: {report.metric_name} "
              f"{converted['metric']:.4f} ({converted['delta']:+.4f})")
    print(f"report: {files['html']}")
    print(f"pictures: {files['grid_png']}, {files['heads_png']}")
    return 0


# ---------------------------------------------------------------------------------------------- experiment
def _add_experiment(sub: Any) -> None:
    p = sub.add_parser("experiment", help="experiments on heads (heads-vs-width: many small heads or one wide head)")
    p.add_argument("name", choices=["heads-vs-width"], help="which experiment")
    p.add_argument("--task", choices=["recall", "lm"], default="recall",
                   help="recall: multi-query associative recall (default); lm: byte-level language modelling on the "
                        "Jargon File (held-out perplexity), Vaswani et al.'s setting")
    p.add_argument("--d-model", type=_positive, default=None, help="model width (default 64; 128 for lm)")
    p.add_argument("--layers", type=_positive, default=2, help="layers (default 2)")
    p.add_argument("--steps", type=_positive, default=None, help="training steps per model (default 500; 400 for lm)")
    p.add_argument("--seeds", type=_positive, default=3, help="seeds per configuration (default 3)")
    p.add_argument("--pairs", type=_positive, default=8, help="recall: key-value pairs per sequence (default 8)")
    p.add_argument("--context", type=_positive, default=64, help="lm: bytes per training window (default 64)")
    p.add_argument("--text", default=None,
                   help="lm: a UTF-8 text file, plain or .gz (default: the Jargon File that `make text` installs)")
    p.add_argument("--batch", type=_positive, default=None, help="sequences per step (default 64; 32 for lm)")
    p.add_argument("--lr", type=_number(0, 1, open_low=True), default=None,
                   help="learning rate (default 3e-3; 1e-2 for lm)")
    p.add_argument("--workers", type=_positive, default=2, help="training processes side by side (default 2)")
    p.add_argument("--heads", default=None,
                   help="comma-separated head counts (default 1,2,4,8,16; 1,2,4,8,16,32 for lm; plus GQA and MQA)")
    p.add_argument("--out", default="multihead-experiment", help="folder for the plot and the JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_experiment)


def _run_experiment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multihead.experiments.heads_vs_width import (
        LM_HEADS,
        LM_SETTINGS,
        Settings,
        TaskConfig,
        TextTask,
        Variant,
        default_variants,
        plot,
        run,
    )
    from multihead.heads.report import prepare_out_dir

    lm = args.task == "lm"
    base = LM_SETTINGS if lm else Settings()
    task: TaskConfig | TextTask
    if lm:
        task = TextTask(context=args.context, path=args.text)
        task.splits()  # a missing or unreadable text fails here, before any training
    else:
        task = TaskConfig(n_pairs=args.pairs)
    d_model = args.d_model or base.d_model
    settings = dataclasses.replace(base, d_model=d_model, n_layers=args.layers, steps=args.steps or base.steps,
                                   batch=args.batch or base.batch, lr=base.lr if args.lr is None else args.lr,
                                   seeds=tuple(range(args.seeds)),
                                   workers=args.workers, task=task)
    variants = default_variants(d_model, LM_HEADS if lm else (1, 2, 4, 8, 16))
    if args.heads:
        try:
            counts = [int(h) for h in args.heads.split(",")]
        except ValueError:
            raise CliError(f"--heads {args.heads!r} must be comma-separated integers, e.g. 1,4,16") from None
        variants = [Variant(f"MHA h={h}", h, h) for h in counts]
    out = prepare_out_dir(args.out)
    stem = "heads-vs-width-lm" if lm else "heads-vs-width"
    result = run(settings, variants, progress=not args.json)
    png = plot(result, str(Path(out) / f"{stem}.png"))
    from multihead.files import write_text

    write_text(Path(out) / f"{stem}.json", json.dumps(result))
    if args.json:
        slim = {**result, "rows": [{k: v for k, v in r.items() if k != "runs"} | {
            "heads": [run_["heads"] for run_ in r["runs"]]} for r in result["rows"]], "plot": png}
        print(json.dumps(slim))
        return 0
    if lm:
        print(f"byte-level LM on {args.text or 'the Jargon File'}, context {task.seq_len - 1}, d_model "
              f"{settings.d_model}, {settings.n_layers} layers, {settings.steps} steps of {settings.batch}, "
              f"{len(settings.seeds)} seeds, {result['rows'][0]['runs'][0]['scored']:,} held-out bytes "
              f"({result['seconds']} s)")
        print(f"{'variant':<13} {'d_k':>4} {'attn params':>11} {'attn FLOPs':>11} {'KV B/token':>10} "
              f"{'held-out ppl':>15} {'bits/byte':>9}  head labels (mean per model)")
        for r in result["rows"]:
            labels = ", ".join(f"{name} {n:.1f}" for name, n in sorted(r["label_counts"].items(), key=lambda x: -x[1]))
            print(f"{r['variant']:<13} {r['head_dim']:>4} {r['attention_params_per_layer']:>11,} "
                  f"{r['attention_flops_per_layer']:>11,} {r['kv_cache_bytes_per_token']:>10,} "
                  f"{r['perplexity_mean']:>7.3f} ± {r['perplexity_std']:<5.3f} "
                  f"{r['loss_mean'] / math.log(2):>9.3f}  {labels}")
        print(f"plot: {png}")
        return 0
    assert isinstance(task, TaskConfig)
    print(f"MQAR, {task.n_pairs} pairs, d_model {settings.d_model}, {settings.n_layers} layers, "
          f"{settings.steps} steps, {len(settings.seeds)} seeds ({result['seconds']} s)")
    print(f"{'variant':<13} {'d_k':>4} {'attn params':>11} {'attn FLOPs':>11} {'KV B/token':>10} "
          f"{'loss':>13} {'accuracy':>13} {'prev heads':>10} {'ind heads':>9}")
    for r in result["rows"]:
        prev = statistics_mean([run_["heads"]["previous_token_heads"] for run_ in r["runs"]])
        ind = statistics_mean([run_["heads"]["induction_heads"] for run_ in r["runs"]])
        print(f"{r['variant']:<13} {r['head_dim']:>4} {r['attention_params_per_layer']:>11,} "
              f"{r['attention_flops_per_layer']:>11,} {r['kv_cache_bytes_per_token']:>10,} "
              f"{r['loss_mean']:>6.3f} ± {r['loss_std']:<4.3f} {r['accuracy_mean']:>6.3f} ± {r['accuracy_std']:<4.3f} "
              f"{prev:>10.1f} {ind:>9.1f}")
    print(f"plot: {png}")
    return 0


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# ---------------------------------------------------------------------------------------------- check
def _add_check(sub: Any) -> None:
    p = sub.add_parser("check", help="the correctness harness on this machine: 2x rule, empty rows, cache, determinism")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32,float16,bfloat16", help="comma-separated dtypes (default: all three)")
    p.add_argument("--backend", default="sdpa,math,flex",
                   help="comma-separated backends (default: all three; flex compiles for each shape on first use)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from multihead.check import run_checks

    results = run_checks(device=args.device, dtypes=[d.strip() for d in args.dtype.split(",") if d.strip()],
                         backends=tuple(b.strip() for b in args.backend.split(",") if b.strip()))
    failed = [r for r in results if not r.passed]
    if args.json:
        print(json.dumps({"device": args.device, "passed": not failed,
                          "results": [dataclasses.asdict(r) for r in results]}))
    else:
        for r in results:
            print(f"{'ok  ' if r.passed else 'FAIL'} {r.dtype:<9} {r.backend:<5} {r.check:<14} {r.detail}")
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------- patch
def _add_patch(sub: Any) -> None:
    p = sub.add_parser("patch", help="which heads cause a behaviour: activation and attribution patching per head")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file or a causal model folder")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="as for 'heads': our port where one applies (default), or transformers")
    p.add_argument("--clean", help="the clean prompt (default: the shipped indirect-object pairs)")
    p.add_argument("--corrupt", help="the corrupted prompt, of the same token length")
    p.add_argument("--answers", nargs=2, metavar=("RIGHT", "WRONG"),
                   help="the clean prompt's right and wrong next tokens (one token each, e.g. ' Mary' ' John')")
    p.add_argument("--point", choices=("z", "q", "k", "v", "pattern"), default="z",
                   help="what is patched per head (default z, each head's output; k and v per KV head)")
    p.add_argument("--method", choices=("both", "patching", "attribution"), default="both",
                   help="activation patching (a forward per 16 heads), attribution (one backward), or both")
    p.add_argument("--top", type=_positive, default=10, help="heads listed (default 10)")
    p.add_argument("--out", default=None, help="a folder for the layer x head heatmap PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_patch)


def _run_patch(args: argparse.Namespace) -> int:
    from multihead.heads.adapters import load_head_model
    from multihead.heads.patching import PromptPair, patch_pairs, shipped_pairs

    given = [args.clean is not None, args.corrupt is not None, args.answers is not None]
    if any(given) and not all(given):
        raise CliError("give --clean, --corrupt and --answers together (or none, for the shipped prompt pairs)")
    pairs = ([PromptPair(args.clean, args.corrupt, args.answers[0], args.answers[1])] if all(given)
             else shipped_pairs())
    if args.out is not None:
        from multihead.heads.report import prepare_out_dir

        prepare_out_dir(args.out)
    model = load_head_model(args.model, engine=args.engine)
    if not model.causal:
        raise CliError(f"{model.name} is not a causal language model: patching compares next-token logits")
    result = patch_pairs(model.logits, model.layers(), model.token_ids, pairs, point=f"hook_{args.point}",
                         patching=args.method != "attribution", attribution=args.method != "patching")
    files = {}
    if args.out is not None:
        from multihead.heads.report import write_patching_png

        files = write_patching_png(result, model.name, args.out)
    method = "patching" if result.patching is not None else "attribution"
    if args.json:
        print(json.dumps({
            "model": model.name, "engine": model.engine, "point": result.point, "pairs": result.pairs,
            "clean_logit_diff": result.clean, "corrupted_logit_diff": result.corrupted,
            "patching": None if result.patching is None else result.patching.tolist(),
            "attribution": None if result.attribution is None else result.attribution.tolist(),
            "correlation": result.correlation(), "seconds": result.seconds, "files": files,
        }))
        return 0
    unit = "KV head" if args.point in ("k", "v") else "head"
    print(f"{model.name} ({model.engine}): {result.pairs} prompt pair(s), logit difference clean "
          f"{result.clean:.3f}, corrupted {result.corrupted:.3f}; {args.point} patched per {unit}")
    print(f"top {unit}s by {method} (layer.{unit.split()[-1]} = recovered fraction): " + "  ".join(
        f"{layer}.{head} = {value:+.3f}" for layer, head, value in result.top(args.top, method)))
    if result.correlation() is not None:
        print(f"attribution vs activation patching, Pearson r over all {unit}s: {result.correlation():.3f}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items() if v))
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0


# ---------------------------------------------------------------------------------------------- tradeoff
def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_show(text)} must be comma-separated integers") from None
    if any(not 0 <= v <= MAX_INT for v in values):
        raise argparse.ArgumentTypeError(f"{_show(text)}: each value must be from 0 to {MAX_INT:,}")
    return values


def _fractions(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_show(text)} must be comma-separated fractions, e.g. 0.1,0.3") from None
    if any(not 0 <= v <= 1 for v in values):  # nan fails this too
        raise argparse.ArgumentTypeError(f"{_show(text)}: each fraction must be in [0, 1]")
    return values


def _add_tradeoff(sub: Any) -> None:
    p = sub.add_parser("tradeoff", help="the KV-cache trade-off: perplexity against KV bytes for each way of saving "
                                        "cache (sinks + window, quantization, fewer KV heads, uptraining)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), minilm (the encoder: 1 - cosine), or a "
                                                      ".gguf file or Llama model folder")
    p.add_argument("--text", default=None, help="another evaluation text (plain or .gz; default: the Jargon File)")
    p.add_argument("--texts", type=_positive, default=256, help="minilm: held-out paragraphs embedded (default 256)")
    p.add_argument("--context", type=_positive, default=1024, help="tokens per evaluation window (default 1024)")
    p.add_argument("--stride", type=_positive, default=512, help="tokens between windows, each scoring its last "
                                                                 "stride tokens (default 512)")
    p.add_argument("--windows", type=_positive, default=10, help="evaluation windows at most (default 10)")
    p.add_argument("--chunk", type=_positive, default=64, help="tokens per step through a cache (default 64)")
    p.add_argument("--window", type=_positive, default=256, help="sliding window of the sink caches (default 256)")
    p.add_argument("--sinks", type=_ints, default=(1, 4), help="sink token counts beside the window (default 1,4)")
    p.add_argument("--bits", type=_ints, default=(8, 4, 2), help="quantized cache widths (default 8,4,2)")
    p.add_argument("--group", type=_positive, default=32, help="quantization group size (default 32)")
    p.add_argument("--residual", type=_count, default=128, help="newest tokens kept in full precision (default 128)")
    p.add_argument("--prune", type=_fractions, default=(0.1, 0.25, 0.5),
                   help="fractions of KV groups pruned by importance (default 0.1,0.25,0.5; 'none' for none)")
    p.add_argument("--uptrain-steps", type=_count, default=40, help="distillation steps for pooled MQA (0: none; "
                                                                  "default 40)")
    p.add_argument("--uptrain-lr", type=_number(0, 1, open_low=True), default=3e-3,
                   help="uptraining learning rate (default 3e-3)")
    p.add_argument("--train", choices=("kv", "attention", "all"), default="kv",
                   help="what uptraining changes: the pooled K/V projections (default), attention, or all")
    p.add_argument("--resume", action="store_true", help="continue the uptraining checkpoint in --out")
    p.add_argument("--out", default="multihead-tradeoff", help="folder for the PNG, the JSON and the checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_tradeoff)


def _run_tradeoff(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multihead.files import write_text
    from multihead.heads.report import prepare_out_dir
    from multihead.tradeoff.lm import Settings, plot, run
    from multihead.tradeoff.uptrain import UptrainSettings

    if args.model not in ("smollm2", "minilm") and not Path(args.model).exists():
        raise CliError(f"--model {args.model!r} is neither smollm2, minilm nor an existing .gguf file or folder")
    if args.model == "minilm":
        return _run_tradeoff_encoder(args)
    if args.uptrain_steps < 0:
        raise CliError(f"--uptrain-steps ({args.uptrain_steps}) must be 0 or more")
    settings = Settings(context=args.context, stride=args.stride, windows=args.windows, chunk=args.chunk,
                        window=args.window, sinks=args.sinks, bits=args.bits, group=args.group,
                        residual=args.residual, prune=args.prune)
    up = None if args.uptrain_steps == 0 else UptrainSettings(steps=args.uptrain_steps, lr=args.uptrain_lr,
                                                               train=args.train)
    out = Path(prepare_out_dir(args.out))
    result = run(settings, model_path=None if args.model == "smollm2" else args.model, text_path=args.text,
                 uptrain_settings=up, out=out, resume=args.resume, progress=not args.json)
    result["plot"] = plot(result, out / "kv-tradeoff.png")
    write_text(out / "kv-tradeoff.json", json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}; {result['text']['scored_tokens']:,} held-out tokens of {result['text']['source']}; "
          f"KV bytes for one sequence of {settings.context} tokens in bf16 ({result['seconds']:.0f} s)")
    print(f"{'method':<30} {'KV MiB':>8} {'of full':>8} {'perplexity':>11} {'vs full':>9}")
    full = next(r for r in result["rows"] if r["series"] == "full")
    for r in result["rows"]:
        print(f"{r['method']:<30} {r['kv_bytes'] / 2**20:>8.2f} {r['kv_ratio']:>8.1%} {r['perplexity']:>11.3f} "
              f"{r['perplexity'] / full['perplexity'] - 1:>+9.1%}")
    print(f"plot: {result['plot']}")
    return 0


def _run_tradeoff_encoder(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multihead.files import write_text
    from multihead.heads.report import prepare_out_dir
    from multihead.tradeoff.encoder import EncoderSettings, plot, run

    settings = EncoderSettings(texts=args.texts, bits=args.bits, group=args.group, prune=args.prune)
    out = Path(prepare_out_dir(args.out))
    result = run(settings, text_path=args.text, progress=not args.json)
    result["plot"] = plot(result, out / "kv-tradeoff-minilm.png")
    write_text(out / "kv-tradeoff-minilm.json", json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {result['metric']} over {result['text']['texts']} held-out paragraphs "
          f"({result['seconds']:.0f} s)")
    print(f"{'method':<28} {'K/V B/token':>11} {'of full':>8} {'1 - cos':>10}")
    for r in result["rows"]:
        print(f"{r['method']:<28} {r['kv_bytes_per_token']:>11,.0f} {r['kv_ratio']:>8.1%} "
              f"{r['one_minus_cosine']:>10.2e}")
    print(f"plot: {result['plot']}")
    return 0


# ---------------------------------------------------------------------------------------------- main
_COMMANDS: list[Callable[[Any], None]] = [
    _add_heads, _add_shapes, _add_count, _add_compare, _add_presets, _add_embed, _add_generate, _add_experiment,
    _add_check, _add_patch, _add_tradeoff,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multihead", description="Multi-head attention: shapes, costs, real models and their heads.")
    from multihead import __version__

    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 user error)."""
    parser = build_parser()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        for i, arg in enumerate(argv):  # undecodable bytes arrive as lone surrogates (PEP 383)
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:
                raise CliError(f"multihead: argument {i + 1} ({_show(arg)}) is not valid UTF-8 text") from None
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args.run(args))
    except (CliError, MultiheadError) as err:
        message = str(err)
        if not message.startswith("multihead"):
            message = f"multihead: error: {message}"
        print(message.replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: files are whole or absent (multihead.files), so one line is all to say
        print("multihead: interrupted", file=sys.stderr)
        return 130


def entry() -> NoReturn:
    sys.exit(main())
