"""`multihead count`: does it fit? The whole model's parameters and memory (multihead.sizing.whole_model), and
attention's parameters, FLOPs and memory (multihead.cost.report, cost.mla_report)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.model import TP_HELP, add_model_flags, cache_kind, causal, layers, model_from_args


def add(sub: Any) -> None:
    from multihead.sizing import WEIGHT_BITS

    p = sub.add_parser("count", help=COMMANDS["count"])
    add_model_flags(p)
    spelled = {s for names in flags.DTYPE_SPELLINGS.values() for s in names}
    gguf = tuple(k for k in WEIGHT_BITS if k not in spelled)  # int4 and llama.cpp's types, by multihead.sizing
    weights = flags.Dtype(("fp32", "fp16", "bf16", "int8", "fp8"), extra=gguf, what="weight dtype")
    p.add_argument("--weights-dtype", type=weights, default=None,
                   help="how the weights are stored: fp32, bf16, fp8, int8, int4, or a GGUF type such as q4_1, "
                        "q8_0 (default: --dtype)")
    p.add_argument("--tp", type=flags.POSITIVE, default=1, metavar="N",
                   help=f"{TP_HELP} (default 1); here a what-if: memory per device if it were split so")
    p.add_argument("--cache", type=cache_kind, default="full",
                   help="KV cache kind: full (default), window:N, int8, int4, int2, latent (MLA models)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead import cost, sizing

    model = model_from_args(args)
    is_causal = causal(args, model)
    a, memory = model.attention, args.device_memory
    r = cost.report(a, n_layers=model.n_layers, seq=args.seq, batch=args.batch, dtype=args.dtype, causal=is_causal)
    r["model"] = model.name
    if memory is not None:
        r["device_memory_bytes"] = memory
        r["max_context_in_device_memory"] = cost.max_context(
            a, memory_bytes=memory, batch=args.batch, n_layers=model.n_layers, dtype=args.dtype)
    if model.mla is not None:
        r["mla"] = cost.mla_report(model.mla, n_layers=model.n_layers, seq=args.seq, batch=args.batch,
                                   dtype=args.dtype, causal=is_causal)
        if memory is not None:
            r["mla"]["max_context_in_device_memory"] = memory // (r["mla"]["cache_bytes_per_token"] * args.batch)
    whole = sizing.whole_model(model, seq=args.seq, batch=args.batch, dtype=args.dtype,
                               weights_dtype=args.weights_dtype or args.dtype, tp=args.tp, cache=args.cache,
                               memory=memory)
    if whole is not None:
        r["whole_model"] = whole
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    if whole is not None:
        _print_whole(whole, args)
    if model.mla is not None:
        _print_mla(model, r["mla"], args)
    _print_attention(model, r, args, is_causal)
    return 0


def _print_attention(model: Any, r: dict[str, Any], args: argparse.Namespace, is_causal: bool) -> None:
    from multihead.units import format_bytes, format_count

    a, memory = model.attention, args.device_memory
    dk_note = f" (= {a.d_model} / {a.n_heads})" if a.head_dim == a.d_model // a.n_heads else " (explicit)"
    capped = a.window is not None and a.window < args.seq
    rows = [
        ("model", f"{model.name}: {layers(model.n_layers)}, {'causal' if is_causal else 'bidirectional'}"),
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
         f"  ({r['kv_cache_bytes_total']:,} B"
         + (f"; window {a.window} caps it at {r['kv_cache_tokens']} tokens" if capped else "") + ")"),
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


def _print_mla(model: Any, m: dict[str, Any], args: argparse.Namespace) -> None:
    from multihead.units import format_bytes, format_count

    mla = model.mla
    print(f"{'model':<28}  {model.name}: {layers(model.n_layers)}, multi-head latent attention (MLA)")
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
    if args.device_memory is not None:
        print(f"{'context in ' + format_bytes(args.device_memory):<28}  {m['max_context_in_device_memory']:,} tokens "
              "(latent cache alone)")
    print(f"as plain MHA with the same heads (head_dim = v_head_dim {mla.v_head_dim}):")


def _print_whole(w: dict[str, Any], args: argparse.Namespace) -> None:
    from multihead.units import format_bytes

    if "unavailable" in w:
        print(f"whole model: {w['unavailable']}")
        return
    memory = args.device_memory
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
