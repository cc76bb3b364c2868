"""`multihead presets`: the named real-model configurations."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS


def add(sub: Any) -> None:
    p = sub.add_parser("presets", help=COMMANDS["presets"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from multihead.sizing.cost import layers_summary
    from multihead.sizing.presets import PRESET_NAMES, preset

    models = [preset(n) for n in PRESET_NAMES]
    if args.json:
        print(json.dumps({m.name: {"attention": m.attention.to_dict(), "n_layers": m.n_layers, "causal": m.causal,
                                   "max_context": m.max_context, "source": m.source, "note": m.note,
                                   "mla": None if m.mla is None else {**dataclasses.asdict(m.mla),
                                                                      "latent_dim": m.mla.latent_dim},
                                   "layer_kinds": layers_summary(m.layers())} for m in models}, indent=2))
        return 0
    for m in models:
        a = m.attention
        if m.mla is not None:  # one latent per token, not MHA's keys and values
            kind = f"(MLA)  latent {m.mla.kv_lora_rank} + rope {m.mla.qk_rope_head_dim}, v head {m.mla.v_head_dim}"
            print(f"{m.name:<18} d_model {a.d_model:>5}  heads {a.n_heads:>3}/MLA {kind}  layers {m.n_layers:>3}  "
                  f"{m.source}")
            continue
        window = "" if a.window is None else f"  ({layers_summary(m.layers())})"
        print(f"{m.name:<18} d_model {a.d_model:>5}  heads {a.n_heads:>3}/{a.n_kv_heads:<3} ({a.variant})  "
              f"head_dim {a.head_dim:>3}  layers {m.n_layers:>3}{window}  {m.source}"
              + (f"\n{'':<18} note: {m.note}" if m.note else ""))
    return 0
