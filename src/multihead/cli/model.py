"""The flags that name a model for the arithmetic commands (count, compare), and the model they name."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from multihead.cli import flags
from multihead.cli.flags import POSITIVE, CliError

if TYPE_CHECKING:
    from multihead.presets import ModelConfig


def preset_name(text: str) -> str:
    """A preset's exact name (see `multihead presets`)."""
    from multihead.errors import MultiheadError
    from multihead.presets import preset

    try:
        preset(text)
    except MultiheadError as err:
        raise argparse.ArgumentTypeError(str(err)[:400]) from None
    return text


def memory_size(text: str) -> int:
    """--device-memory: a size such as 80GB or 24GiB (multihead.units.parse_bytes), more than zero bytes."""
    from multihead.errors import MultiheadError
    from multihead.units import parse_bytes

    try:
        value = parse_bytes(text)
    except MultiheadError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {flags.show(text)} is no memory at all: give more than 0 bytes")
    return value


def cache_kind(text: str) -> str:
    """--cache: full, window:N (N a positive number of tokens), int8, int4, int2 or latent."""
    if text in ("full", "int8", "int4", "int2", "latent"):
        return text
    if text.startswith("window:"):
        try:
            return f"window:{POSITIVE(text.split(':', 1)[1])}"
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"cache {flags.show(text)[:80]}: give window:N with N a number of tokens "
                                             f"({err})") from None
    raise argparse.ArgumentTypeError(f"cache {flags.show(text)[:80]} is unknown: choose full, window:N, int8, int4, "
                                     "int2 or latent")


WINDOW_HELP = "sliding window: each query sees at most the N most recent keys"
DTYPE_HELP = "element type of the model's tensors"
TP_HELP = "tensor parallelism: the heads are split over N devices"


def add_model_flags(p: argparse.ArgumentParser, *, seq_default: int = 4096) -> None:
    src = p.add_argument_group("model (one of --preset, --config, or --d-model with --heads)")
    src.add_argument("--preset", type=preset_name, help="a named real model (exact name; see `multihead presets`)")
    src.add_argument("--config", type=flags.PATH, metavar="CONFIG_JSON",
                     help="a Hugging Face config.json, or a folder holding one")
    src.add_argument("--d-model", type=POSITIVE, help="model width d_model")
    src.add_argument("--heads", type=POSITIVE, help="query heads n_heads")
    src.add_argument("--kv-heads", type=POSITIVE, help="key/value heads (default: --heads, MHA)")
    src.add_argument("--head-dim", type=POSITIVE, help="width of a head (default d_model / heads)")
    src.add_argument("--layers", type=POSITIVE, help="number of layers (default 1)")
    src.add_argument("--window", type=POSITIVE, metavar="N", help=f"{WINDOW_HELP} (the model's attention)")
    src.add_argument("--bias", action="store_true", help="projections with biases (default: none)")
    p.add_argument("--seq", type=POSITIVE, default=seq_default, help=f"context length (default {seq_default})")
    p.add_argument("--batch", type=POSITIVE, default=1, help="batch size (default 1)")
    p.add_argument("--dtype", type=flags.Dtype(), default="bf16",
                   help=f"{DTYPE_HELP}, here the KV cache and activations: fp32, fp16, bf16, int8, fp8 (default bf16)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal attention (default: the model's; decoders are causal, encoders not)")
    p.add_argument("--device-memory", type=memory_size, metavar="SIZE",
                   help="memory for the KV cache, e.g. 80GB or 24GiB: prints the longest context that fits")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    from multihead.presets import from_hf_config, from_hf_dict, preset

    raw = [f for f in ("d_model", "heads", "kv_heads", "head_dim", "window") if getattr(args, f) is not None]
    chosen = [name for name, given in (("--preset", args.preset is not None), ("--config", args.config is not None),
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


def causal(args: argparse.Namespace, model: ModelConfig) -> bool:
    return model.causal if args.causal is None else bool(args.causal)


def layers(n: int) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")
