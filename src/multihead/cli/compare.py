"""`multihead compare`: the same model as MHA, GQA and MQA (and MLA), KV-cache memory side by side, and a plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.model import add_fit_flags, add_model_flags, fit_model, layers, model_from_args, shown_memory


def add(sub: Any) -> None:
    p = sub.add_parser("compare", help=COMMANDS["compare"])
    add_model_flags(p, seq_default=8192)
    add_fit_flags(p)
    p.add_argument("--plot", type=flags.PATH, default=None, metavar="PNG",
                   help="also write the plot of cache memory against context to this PNG (its folder must exist; "
                        "default: no plot, nothing written)")
    p.add_argument("--no-plot", action="store_true", help="print the table only (the default; refused with --plot)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.sizing.compare import compare_variants, plot_variants
    from multihead.sizing.units import format_bytes

    model = model_from_args(args)
    device = None
    if args.hardware is not None:  # as count's: the speed on --tp such devices, and their memory
        from multihead.sizing.hardware import hardware

        device = hardware(args.hardware)
        if args.device_memory is None:
            args.device_memory = device.memory
    memory = args.device_memory
    fitting = fit_model(args)
    from multihead.sizing import check_tp

    check_tp(model, args.tp)
    if memory is not None and model.hf is not None and "vocab_size" not in model.hf and (
            args.preset is not None or args.config is not None):
        from multihead.sizing import cannot_fit

        raise cannot_fit(model, memory, "the config has no vocab_size")  # a fit answer counts the weights
    rows = compare_variants(model, seq=args.seq, batch=args.batch, dtype=args.dtype, memory_bytes=memory,
                            fitting=fitting, hardware=device)
    if args.no_plot and args.plot is not None:
        from multihead.cli.flags import CliError

        raise CliError("give --plot PNG or --no-plot, not both")
    plot_path = None if args.plot is None else plot_variants(model, rows, args.plot, batch=args.batch, dtype=args.dtype,
                                                         memory_bytes=memory, seq=args.seq, fitting=fitting)
    whole = rows[0].weight_bytes is not None
    counted = fitting.describe(args.seq) if whole else (
        f"the KV cache alone ({fitting.cache}, {args.dtype})" + (f" less a reserve of {fitting.reserve:,} B"
                                                                  if fitting.reserve else ""))
    if args.json:
        print(json.dumps({"model": model.name, "seq": args.seq, "batch": args.batch, "dtype": args.dtype,
                          "device_memory_bytes": memory, "weights_dtype": fitting.weights_dtype, "tp": args.tp,
                          "cache": args.cache, "prefill_chunk": args.prefill_chunk, "reserve_bytes": fitting.reserve,
                          "shard_embeddings": args.shard_embeddings, "counted": counted,
                          "hardware": args.hardware, "variants": [dataclasses.asdict(r) for r in rows],
                          "plot": plot_path}, indent=2))
        return 0
    tp = args.tp
    print(f"{model.name}: {layers(model.n_layers)}, {model.attention.n_heads} query heads, head_dim "
          f"{model.attention.head_dim}; KV cache for {args.seq} tokens x batch {args.batch} in {args.dtype}")
    header = ["variant", "kv heads", "q per kv", "KV / token", "KV cache" + (f", per device of {tp}" if tp > 1 else ""),
              "vs MHA", "attn params / layer"]
    if whole:
        header.append(f"weights ({fitting.weights_dtype})" + (f", per device of {tp}" if tp > 1 else ""))
    if memory is not None:
        header.append(f"context in {format_bytes(memory)}" + (f" x {tp}" if tp > 1 else ""))
    if device is not None:
        header += [f"prefill {args.seq:,} (ms)", "decode (tok/s)"]
    table = [header]
    for r in rows:
        line = [r.variant + (" *" if r.is_model else ""), str(r.n_kv_heads), str(r.group_size),
                format_bytes(r.kv_bytes_per_token),
                format_bytes(r.kv_cache_bytes) if tp == 1 else
                "n/a" if r.kv_cache_bytes_per_device is None else format_bytes(r.kv_cache_bytes_per_device),
                f"{r.ratio_to_mha:.3f}",
                f"{r.params_per_layer:,}"]
        if whole:
            shown = r.weight_bytes if tp == 1 else r.weight_bytes_per_device
            line.append("n/a" if shown is None else format_bytes(shown))
        if memory is not None:
            if r.note:
                cell = "n/a"
            elif r.max_context is None:
                cell = "any"
            else:
                cell = f"{r.max_context:,}" + (f" (memory: {r.max_context_by_memory:,})"
                                               if r.max_context_by_memory not in (None, r.max_context) else "")
            line.append(cell)
        if device is not None:
            line += (["n/a", "n/a"] if r.prefill_seconds is None or r.decode_tokens_per_second is None else
                     [f"{r.prefill_seconds * 1e3:,.1f}", f"{r.decode_tokens_per_second:,.1f} ({r.decode_bound})"])
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w)
                        for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
    print("* the model's own configuration")
    if whole and tp > 1:
        whole_parts = ("the norms" if args.shard_embeddings else "the embeddings, norms, LM head") + " (and routers)"
        print(f"weights per device: attention and MLP split over {tp} devices, {whole_parts} whole on each"
              + ("; the embeddings and LM head sharded by vocabulary" if args.shard_embeddings else "")
              + " (`count` gives the same)")
    if memory is not None:
        print(f"context: what fits in {shown_memory(memory)} per device, counting {counted}; capped at the model's "
              "own context (memory's answer in brackets where that cap binds); `count` gives the same")
        if any(r.max_context == 0 for r in rows) and whole:
            print("0: not even one token fits beside the weights; try --tp or a narrower --weights-dtype")
    if device is not None:
        from multihead.sizing.hardware import BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY

        print(f"speed on {device.name}" + (f" x {tp}" if tp > 1 else "") + f": `count --hardware`'s estimates "
              f"({COMPUTE_EFFICIENCY:.0%} of peak FLOP/s, {BANDWIDTH_EFFICIENCY:.0%} of bandwidth"
              + ("" if device.verified else "; datasheet figures, not checked here")
              + f"); decode per sequence at batch {args.batch} after {args.seq:,} tokens")
    replicated = [r for r in rows if r.devices_per_kv_head > 1]
    if replicated:
        print(", ".join(f"{r.variant} ({r.n_kv_heads} KV head{'s' if r.n_kv_heads > 1 else ''}, each on "
                        f"{r.devices_per_kv_head} devices)" for r in replicated)
              + f": fewer KV heads than the {tp} devices: each device holds one, its cache and K/V projections "
              "counted on every device that holds it, as vLLM replicates them")
    for r in rows:
        if r.note:
            print(f"n/a: {r.variant}: {r.note}")
    if plot_path:
        print(f"plot: {plot_path} (memory per device{f' of {tp}' if tp > 1 else ''}, as the table counts it)")
    return 0
