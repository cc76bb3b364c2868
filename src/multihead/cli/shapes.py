"""`multihead shapes`: walk the shapes of one attention layer (MHA/GQA/MQA, or MLA), step by step."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS
from multihead.cli.flags import POSITIVE, CliError
from multihead.cli.model import preset_name


def add(sub: Any) -> None:
    p = sub.add_parser("shapes", help=COMMANDS["shapes"])
    p.add_argument("--d-model", type=POSITIVE, default=None, help="model width d_model")
    p.add_argument("--heads", type=POSITIVE, default=None, help="query heads n_heads")
    p.add_argument("--kv-heads", type=POSITIVE, default=None, help="key/value heads (default: --heads, MHA)")
    p.add_argument("--head-dim", type=POSITIVE, default=None, help="width of a head (default d_model / heads)")
    p.add_argument("--preset", type=preset_name, default=None,
                   help="a named real model's layer instead of the sizes (see `multihead presets`; DeepSeek presets "
                        "walk their MLA layer)")
    p.add_argument("--kv-lora-rank", type=POSITIVE, default=None,
                   help="walk a multi-head latent attention (MLA) layer with this KV latent width")
    p.add_argument("--q-lora-rank", type=POSITIVE, default=None, help="MLA: query latent width (default: none)")
    p.add_argument("--qk-rope-head-dim", type=POSITIVE, default=None,
                   help="MLA: the shared RoPE key's width (default head_dim / 2)")
    p.add_argument("--v-head-dim", type=POSITIVE, default=None, help="MLA: value head width (default head_dim)")
    p.add_argument("--path", choices=("expanded", "absorbed"), default="expanded",
                   help="MLA: the expanded (prefill) or absorbed (decode) path (default expanded)")
    p.add_argument("--seq", type=POSITIVE, default=128, help="sequence length s (default 128)")
    p.add_argument("--batch", type=POSITIVE, default=1, help="batch size b (default 1)")
    p.add_argument("--bias", action="store_true", help="give the projections biases (default: none, Llama-style)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.config import AttentionConfig, MLAConfig
    from multihead.sizing.shapes import shape_walk

    mla: MLAConfig | None = None
    causal: bool | None = None
    if args.preset is not None:
        if args.d_model is not None or args.heads is not None or args.kv_lora_rank is not None:
            raise CliError("give --preset or the sizes (--d-model, --heads, ...), not both")
        from multihead.sizing.presets import preset

        model = preset(args.preset)
        from multihead.sizing import check_seq

        check_seq(model, args.seq)  # as count and compare: a --seq past the model's own context is refused
        config, mla, causal = model.attention, model.mla, model.causal
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
        return _mla_walk(mla, args)
    walk = shape_walk(config, batch=args.batch, seq=args.seq, causal=causal)
    if args.json:
        print(json.dumps({
            "config": config.to_dict(), "variant": config.variant, "batch": walk.batch, "seq": walk.seq,
            "head_dim": config.head_dim, "steps": _steps(walk.steps),
            "parameters": walk.parameters, "projection_parameters": walk.total_parameters,
        }, indent=2))
        return 0
    c = config
    print(f"d_model {c.d_model}, n_heads {c.n_heads}, n_kv_heads {c.n_kv_heads} ({c.variant}), "
          f"d_k = head_dim = {c.head_dim}"
          + ("" if args.head_dim or c.head_dim != c.d_model // c.n_heads else f" (= {c.d_model} / {c.n_heads})")
          + (f", causal sliding window {c.window}" if c.window is not None else "")
          + f", batch {walk.batch}, seq {walk.seq}")
    _print_steps(walk.steps, walk.parameters, walk.total_parameters)
    return 0


def _steps(steps: Any) -> list[dict[str, Any]]:
    return [{"step": s.name, "label": s.label, "legend": s.legend, "shape": list(s.shape)} for s in steps]


def _print_steps(steps: Any, parameters: dict[str, int], total: int) -> None:
    width = max([len(s.label) for s in steps] + [len(n) for n in parameters])
    shape_width = max(len(str(s.shape)) for s in steps)
    for s in steps:
        print(f"  {s.label:<{width}}  {s.shape!s:<{shape_width}}  {s.legend}")
    print("parameters:")
    for name, n in parameters.items():
        print(f"  {name:<{width}}  {n:,}")
    print(f"  {'total':<{width}}  {total:,}")


def _mla_walk(mla: Any, args: argparse.Namespace) -> int:
    from multihead.sizing.shapes import mla_shape_walk

    walk = mla_shape_walk(mla, batch=args.batch, seq=args.seq, path=args.path)
    if args.json:
        print(json.dumps({
            "config": mla.to_dict(), "variant": "MLA", "path": walk.path, "batch": walk.batch, "seq": walk.seq,
            "latent_dim": mla.latent_dim, "steps": _steps(walk.steps),
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
