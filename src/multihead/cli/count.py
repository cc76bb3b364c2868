"""`multihead count`: does it fit? The whole model's parameters and memory (multihead.sizing.whole_model), and
attention's parameters, FLOPs and memory (multihead.sizing.cost.report, cost.mla_report)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.flags import CliError
from multihead.cli.model import add_fit_flags, add_model_flags, causal, fit_model, layers, model_from_args, shown_memory


def add(sub: Any) -> None:
    p = sub.add_parser("count", help=COMMANDS["count"])
    add_model_flags(p)
    add_fit_flags(p)  # (--hardware among them: compare has it too)
    p.add_argument("--plot", type=flags.PATH, default=None, metavar="PNG",
                   help="with --hardware: write the roofline of the prefill and decode estimates to this PNG")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead import sizing

    if args.plot is not None and args.hardware is None:
        raise CliError("--plot draws the roofline of the --hardware estimate: give --hardware too")
    model = model_from_args(args)
    is_causal = causal(args, model)
    device = None
    if args.hardware is not None:
        from multihead.sizing.hardware import hardware

        device = hardware(args.hardware)
        if args.device_memory is None:
            args.device_memory = device.memory
    memory = args.device_memory
    fitting = fit_model(args)
    sizing.check_tp(model, args.tp)  # (for sizes given alone too, as compare checks it)
    r = sizing.attention_report(model, seq=args.seq, batch=args.batch, dtype=args.dtype, causal=is_causal,
                                cache=args.cache, memory=memory)
    whole = sizing.whole_model(model, seq=args.seq, batch=args.batch, dtype=args.dtype,
                               weights_dtype=fitting.weights_dtype, tp=args.tp, cache=args.cache, memory=memory,
                               prefill_chunk=args.prefill_chunk, reserve=fitting.reserve,
                               shard_embeddings=args.shard_embeddings)
    if whole is None and memory is not None and (args.preset is not None or args.config is not None):
        raise sizing.cannot_fit(model, memory, "the config has no vocab_size")  # a fit answer counts the weights
    if device is not None and whole is None:
        raise CliError("--hardware estimates the whole model's speed: describe the whole model with --preset or "
                       "--config (--d-model and --heads describe its attention alone; --device-memory sizes that)")
    if whole is not None:
        r["whole_model"] = whole
    if device is not None and whole is not None:  # (no "unavailable" here: with a memory, whole_model refuses)
        from multihead.sizing.hardware import estimate

        r["estimate"] = estimate(model, sizing.model_size(model), device, seq=args.seq, batch=args.batch,
                                 dtype=args.dtype, weights_dtype=fitting.weights_dtype, tp=args.tp, cache=args.cache,
                                 largest_batch=whole.get("largest_batch"), shard_embeddings=args.shard_embeddings)
        if args.plot is not None:
            from multihead.sizing.hardware import plot_roofline

            r["estimate"]["plot"] = plot_roofline(r["estimate"], args.plot, title=f"{model.name} at {args.seq:,} "
                                                  f"tokens on {args.hardware}" + (f" x {args.tp}" if args.tp > 1
                                                                                  else ""))
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    if whole is not None:
        _print_whole(whole, args)
    if "estimate" in r:
        _print_estimate(r["estimate"], args)
        if "plot" in r["estimate"]:
            print(f"{'roofline':<28}  {r['estimate']['plot']}")
    if whole is not None:
        print("attention alone:")
    if model.mla is not None:
        _print_mla(model, {**r["mla"], **{k: r[k] for k in ("context_limit_binds", "max_context_by_memory")
                                          if k in r}}, args)
        _print_attention(model, {**r, **r["as_mha"]}, args, is_causal)
    else:
        _print_attention(model, r, args, is_causal)
    return 0


def _print_attention(model: Any, r: dict[str, Any], args: argparse.Namespace, is_causal: bool) -> None:
    from multihead.sizing.units import format_bytes, format_count

    a, memory = model.attention, args.device_memory
    dk_note = f" (= {a.d_model} / {a.n_heads})" if a.head_dim == a.d_model // a.n_heads else " (explicit)"
    capped = r["kv_cache_tokens"] < args.seq or "by_layer_kind" in r
    kinds = r["layer_kinds"] if model.mla is None else f"as MHA: {model.n_layers} full"
    rows = [
        ("model", f"{model.name}: {layers(model.n_layers)}, {'causal' if is_causal else 'bidirectional'}"),
        ("layers", kinds),
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
         f"  ({r['kv_cache_bytes_total']:,} B, {args.dtype}"
         + (f"; {_windows(r)}" if capped else "") + ")"
         + (f"; as {args.cache}: {format_bytes(r['kv_cache_bytes_as_cached'])}" if args.cache != "full" else "")),
        ("attention matrix per layer", f"{format_bytes(r['attention_matrix_bytes_per_layer'])} on the math path "
         f"(b*h*s*t); {format_bytes(r['fused_attention_bytes_per_layer'])} fused"),
    ]
    if memory is not None:
        fit = r["max_context_in_device_memory"]
        rows.append((f"context that fits in {format_bytes(memory)}",
                     "any (the windows cap the cache)" if fit is None else
                     f"{fit:,} tokens (KV cache alone, {r['cache']} cache in {args.dtype}"
                     + ("; the model's own context binds: the memory alone would hold "
                        + ("any" if r["max_context_by_memory"] is None else f"{r['max_context_by_memory']:,}")
                        if r["context_limit_binds"] else "") + ")"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _windows(r: dict[str, Any]) -> str:
    """'21 sliding 4096 layers hold 4,095 tokens' for each kind whose cache stops short of the context."""
    kinds = r.get("by_layer_kind") or {r["layer_kinds"].split(" ", 1)[1]: {"layers": r["n_layers"],
                                                                          "kv_cache_tokens": r["kv_cache_tokens"]}}
    return ", ".join(f"{k['layers']} {name} layers hold {k['kv_cache_tokens']:,} tokens" for name, k in kinds.items()
                     if k["kv_cache_tokens"] < r["seq"]) or "every layer holds the context"


def _print_mla(model: Any, m: dict[str, Any], args: argparse.Namespace) -> None:
    from multihead.sizing.units import format_bytes, format_count

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
        binds = (f"; the model's own context binds: the memory alone would hold {m['max_context_by_memory']:,}"
                 if m["context_limit_binds"] else "")
        print(f"{'context in ' + format_bytes(args.device_memory):<28}  {m['max_context_in_device_memory']:,} tokens "
              f"(latent cache alone{binds})")
    print(f"as plain MHA with the same heads (head_dim = v_head_dim {mla.v_head_dim}):")


def _print_whole(w: dict[str, Any], args: argparse.Namespace) -> None:
    from multihead.sizing.units import format_bytes

    if "unavailable" in w:
        print(f"whole model: {w['unavailable']}")
        return
    memory = args.device_memory
    moe = w["active_parameters"] != w["total_parameters"]
    parts = ", ".join(f"{k} {v:,}" for k, v in w["parameters_by_part"].items())
    print(f"{'whole model, parameters':<28}  {w['total_parameters']:,}"
          + (f" total, {w['active_parameters']:,} active per token" if moe else "") + f"  ({parts})")
    print(f"{'layers':<28}  {w['layer_kinds']}")
    print(f"{'counted':<28}  {w['counted']}")
    tp = w["tp"]
    reserve = f" + reserve {format_bytes(w['reserve_bytes'])}" if w["reserve_bytes"] else ""
    print(f"{'memory per device' + (f' (tp {tp})' if tp > 1 else ''):<28}  weights "
          f"{format_bytes(w['weight_bytes_per_device'])} ({w['weights_dtype']}) + KV cache "
          f"{format_bytes(w['kv_bytes_per_device'])} ({w['cache']}, {args.seq} x {args.batch}) + activations "
          f"{format_bytes(w['activation_bytes_per_device'])} (prefill of {w['prefill_chunk']:,}){reserve} = "
          f"{format_bytes(w['bytes_per_device'])}")
    if tp > 1:
        rep = ", ".join(k.replace("lm_head", "LM head") for k in w["replicated_parts"]) or "nothing"
        kv_note = (f" (the model's {format_bytes(w['kv_bytes'])}: {w['kv_note']})"
                   if w["kv_bytes_all_devices"] != w["kv_bytes"] and w.get("kv_note") else "")
        print(f"{f'all {tp} devices':<28}  weights {format_bytes(w['weight_bytes_all_devices'])} (the model's "
              f"{format_bytes(w['weight_bytes'])}; {rep}: {format_bytes(w['weight_bytes_replicated_per_device'])} "
              f"on each device), KV cache {format_bytes(w['kv_bytes_all_devices'])}{kv_note}")
    if memory is not None:
        where = "fits in " + shown_memory(memory)
        if w["fits"]:
            limit = w["context_limit"]
            cap = (f" (the model's own context caps it; memory alone holds {w['largest_context_by_memory']:,})"
                   if w["context_limit_binds"] else "")
            print(f"{where:<28}  yes: up to {w['largest_context']:,} tokens at batch {args.batch}{cap}, or batch "
                  f"{w['largest_batch']:,} at {args.seq} tokens")
            if limit is not None and not w["context_limit_binds"]:
                print(f"{'':<28}  (the model's own context is {limit:,} tokens)")
        else:
            need = w["devices_needed"]
            weights_alone = w["weight_bytes_per_device"] > memory - w["reserve_bytes"]
            why = "the weights alone do not fit" if weights_alone else "weights, cache and activations together do not"
            more = (f"it needs {need} devices of that size (--tp {need})" if need is not None else
                    "no valid split over devices of that size holds it")
            print(f"{where:<28}  no: {why}; {more}")
    for note in w["notes"]:
        print(f"{'':<28}  note: {note}")


def _print_estimate(e: dict[str, Any], args: argparse.Namespace) -> None:
    hw, p, d = e["hardware"], e["prefill"], e["decode"]
    tp = f" x {e['tp']}" if e["tp"] > 1 else ""
    a = e["assumptions"]
    print(f"{'speed on ' + hw['name'] + tp:<28}  estimates: {a['compute_efficiency']:.0%} of peak "
          f"{hw['flops'][e['compute_dtype']] / 1e12:.0f} TFLOP/s ({e['compute_dtype']}), "
          f"{a['bandwidth_efficiency']:.0%} of {hw['bandwidth'] / 1e9:,.0f} GB/s; ridge "
          f"{e['effective_ridge_flops_per_byte']:.0f} FLOP/B ({e['ridge_flops_per_byte']:.0f} at peak)"
          + ("" if hw["verified"] else " (datasheet figures, not checked here)"))
    ar = e["allreduce"]
    if ar["calls_per_step"]:
        print(f"{'all-reduce':<28}  {ar['calls_per_step']} a step (2 a layer), each "
              f"{ar['latency_seconds'] * 1e6:,.1f} us of latency + its bytes over "
              f"{hw['interconnect'] / 1e9:,.0f} GB/s ({ar['model']})")
    print(f"{'prefill':<28}  {p['tokens']:,} tokens x {p['batch']}: {p['seconds'] * 1e3:,.1f} ms ({p['bound']}-bound: "
          f"{p['arithmetic_intensity']:,.0f} FLOP/B; all-reduce {p['allreduce_seconds'] * 1e3:,.1f} ms)")
    rows = [("decode", d)] + ([("decode, largest batch", e["decode_largest_batch"])]
                              if "decode_largest_batch" in e else [])
    for name, x in rows:
        print(f"{name:<28}  batch {x['batch']:,} at {x['context']:,} tokens: "
              f"{x['tokens_per_second_per_sequence']:,.1f} tok/s per sequence, {x['tokens_per_second']:,.0f} tok/s "
              f"in all ({x['bound']}-bound: "
              f"{x['arithmetic_intensity']:,.1f} FLOP/B; {x['step_seconds'] * 1e3:,.2f} ms a step, all-reduce "
              f"{x['allreduce_seconds'] * 1e3:,.3f} ms)")
