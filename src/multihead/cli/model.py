"""The flags that name a model for the arithmetic commands (count, compare), and the model they name."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multihead.cli import flags
from multihead.cli.flags import POSITIVE, CliError
from multihead.values import MAX_LAYERS

if TYPE_CHECKING:
    from multihead.sizing import FitModel
    from multihead.sizing.presets import ModelConfig


def preset_name(text: str) -> str:
    """A preset's exact name (see `multihead presets`)."""
    from multihead.errors import MultiheadError
    from multihead.sizing.presets import preset

    try:
        preset(text)
    except MultiheadError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def memory_size(text: str) -> int:
    """--device-memory: a size with its unit, such as 80GB or 24GiB (multihead.sizing.units.parse_bytes), more than zero
    bytes; a bare number is refused (80 is not 80 bytes of an 80 GiB device)."""
    from multihead.errors import MultiheadError
    from multihead.sizing.units import parse_bytes

    if re.fullmatch(r"\s*[0-9.eE+-]+\s*", text) and not text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"size {flags.show(text)[:40]} has no unit: add a unit: GiB or GB "
                                         "(e.g. 80GiB = 85.9 GB, 80GB = 74.5 GiB)")
    try:
        value = parse_bytes(text)
    except MultiheadError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {flags.show(text)} is no memory at all: give more than 0 bytes")
    return value


class WeightsDtype:
    """--weights-dtype: one type (any spelling ``one`` takes), or the default then ``part=type`` items,
    ``bf16,experts=mxfp4``; the canonical spec, checked by multihead.sizing.weight_spec."""

    def __init__(self, one: flags.Dtype) -> None:
        self.one = one

    def __call__(self, text: str) -> str:
        from multihead.errors import MultiheadError
        from multihead.sizing import weight_spec

        items = []
        for item in flags.items(text, "weight dtypes, e.g. bf16,experts=mxfp4"):
            part, eq, dtype = item.rpartition("=")
            items.append(f"{part.strip()}{eq}{self.one.one(dtype)}")
        spec = ",".join(items)
        try:
            weight_spec(spec)
        except MultiheadError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return spec


@dataclass(frozen=True)
class Reserve:
    """--reserve: memory kept back for the runtime, in bytes or as a fraction of the device's memory."""

    size: int = 0
    fraction: float = 0.0

    def of(self, memory: int | None) -> int:
        return self.size + (0 if memory is None else int(memory * self.fraction))

    def __str__(self) -> str:
        return f"{self.fraction:.0%}" if self.fraction else f"{self.size:,} B"


def reserve(text: str) -> Reserve:
    """--reserve: a size (2GiB) or a percentage of --device-memory (10%, as vLLM's gpu_memory_utilization 0.9)."""
    if text.strip().endswith("%"):
        try:
            value = float(text.strip()[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"reserve {flags.show(text)[:40]} is not a percentage") from None
        if not 0 <= value < 100:  # nan fails this too
            raise argparse.ArgumentTypeError(f"reserve {flags.show(text)[:40]} must be from 0% to under 100%")
        return Reserve(fraction=value / 100)
    if re.fullmatch(r"\s*0+\s*", text):
        return Reserve()
    return Reserve(size=memory_size(text))


def shown_memory(n: int) -> str:
    """Both units: '80.0 GiB (85.9 GB)'."""
    from multihead.sizing.units import format_bytes

    return f"{format_bytes(n)} ({n / 1e9:.1f} GB)"


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


LAYERS = flags.Integer(1, MAX_LAYERS, "a number of layers")  # the layer-by-layer count holds one entry a layer
WINDOW_HELP = "sliding window: each query sees at most the N most recent keys"
DTYPE_HELP = "element type of the model's tensors"
TP_HELP = "tensor parallelism: the heads are split over N devices"


def add_model_flags(p: argparse.ArgumentParser, *, seq_default: int = 4096) -> None:
    src = p.add_argument_group("model (one of --preset, --config, or --d-model with --heads)")
    src.add_argument("--preset", type=preset_name, help="a named real model (exact name; see `multihead presets`)")
    src.add_argument("--config", type=flags.PATH, metavar="CONFIG_JSON",
                     help="a Hugging Face config.json, or a folder holding one, or a .gguf file (its metadata)")
    src.add_argument("--d-model", type=POSITIVE, help="model width d_model")
    src.add_argument("--heads", type=POSITIVE, help="query heads n_heads")
    src.add_argument("--kv-heads", type=POSITIVE, help="key/value heads (default: --heads, MHA)")
    src.add_argument("--head-dim", type=POSITIVE, help="width of a head (default d_model / heads)")
    src.add_argument("--layers", type=LAYERS, help=f"number of layers (default 1; at most {MAX_LAYERS:,})")
    src.add_argument("--window", type=POSITIVE, metavar="N", help=f"{WINDOW_HELP} (the model's attention)")
    src.add_argument("--bias", action="store_true", help="projections with biases (default: none)")
    p.add_argument("--seq", type=POSITIVE, default=None,
                   help=f"context length (default {seq_default}, or the model's own context where that is shorter; "
                        "past the model's own context is refused)")
    p.set_defaults(seq_default=seq_default)
    p.add_argument("--batch", type=POSITIVE, default=1, help="batch size (default 1)")
    p.add_argument("--dtype", type=flags.Dtype(), default="bf16",
                   help=f"{DTYPE_HELP}, here the KV cache (and the weights unless --weights-dtype): fp32, fp16, bf16, "
                        "int8, fp8 (default bf16); activations are in it when it is a float type, else in bf16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal attention (default: the model's; decoders are causal, encoders not)")
    p.add_argument("--device-memory", type=memory_size, metavar="SIZE",
                   help="memory of one device, with its unit, e.g. 80GiB or 80GB (not the same: 80GiB = 85.9 GB; "
                        "80G is 80GiB, as nvidia-smi and Slurm mean it): "
                        "weights, KV cache, prefill activations and --reserve must fit in it; prints the longest "
                        "context and the largest batch that do")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_fit_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the one fit model (multihead.sizing.FitModel) that count and compare share."""
    from multihead.sizing import WEIGHT_BITS

    spelled = {s for names in flags.DTYPE_SPELLINGS.values() for s in names}
    gguf = tuple(k for k in WEIGHT_BITS if k not in spelled)  # int4, mxfp4, nvfp4, llama.cpp's types (sizing)
    p.add_argument("--weights-dtype", type=WeightsDtype(flags.Dtype(("fp32", "fp16", "bf16", "int8", "fp8"),
                                                                    extra=gguf, what="weight dtype")),
                   default=None, metavar="DTYPE[,PART=DTYPE...]",
                   help="how the weights are stored: fp32, bf16, fp8, int8, int4, mxfp4 (4.25 bits: 4-bit elements, "
                        "an 8-bit scale per 32), nvfp4 (4.5 bits: an fp8 scale per 16), or a GGUF type such as q4_1, "
                        "q8_0, q4_k (q4_k_m and the other K-quant mixes counted at their base type, q4_k's 4.5 bits: "
                        "their few q6_k tensors make a real file somewhat larger); per part after the default, e.g. "
                        "bf16,experts=mxfp4 as gpt-oss ships (parts: embeddings, attention, mlp, norms, experts, "
                        "shared_experts, routers, lm_head) (default: --dtype)")
    p.add_argument("--tp", type=flags.POSITIVE, default=1, metavar="N",
                   help=f"{TP_HELP} (default 1); here a what-if: memory per device if it were split so")
    p.add_argument("--cache", type=cache_kind, default="full",
                   help="KV cache kind: full (default), window:N, int8, int4, int2, latent (MLA models)")
    p.add_argument("--prefill-chunk", type=flags.POSITIVE, default=None, metavar="N",
                   help="count the activations of a prefill of N tokens at a time (chunked prefill; default: the "
                        "whole --seq at once)")
    p.add_argument("--reserve", type=reserve, default=Reserve(), metavar="SIZE_OR_PCT",
                   help="memory kept back for the runtime (CUDA context, allocator, graphs), e.g. 2GiB or 10%% of "
                        "--device-memory (vLLM's gpu_memory_utilization 0.9 keeps 10%%; default 0)")
    p.add_argument("--shard-embeddings", action="store_true",
                   help="with --tp: split the embedding and LM head by vocabulary, as vLLM does (default: on every "
                        "device, as multihead.layers.parallel keeps them)")
    from multihead.sizing.hardware import HARDWARE_NAMES  # (no torch: the cpu preset imports it when measured)

    p.add_argument("--hardware", type=flags.OneOf(HARDWARE_NAMES, "hardware {value} is unknown: choose one of "
                                                               "{names}"), default=None, metavar="NAME",
                   help=f"estimate prefill and decode speed on --tp devices like this one ({', '.join(HARDWARE_NAMES)}"
                        "; cpu: this machine, measured); its memory is --device-memory unless that is given")


def fit_model(args: argparse.Namespace) -> FitModel:
    """The fit model the flags describe (weights in --dtype unless --weights-dtype)."""
    from multihead.sizing import FitModel

    return FitModel(dtype=args.dtype, weights_dtype=args.weights_dtype or args.dtype, cache=args.cache, tp=args.tp,
                    prefill_chunk=args.prefill_chunk, reserve=args.reserve.of(args.device_memory),
                    shard_embeddings=args.shard_embeddings)


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    from multihead.sizing.presets import from_hf_config, from_hf_dict, preset

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
    elif args.config is not None and str(args.config).lower().endswith(".gguf"):
        from pathlib import Path

        from multihead.models.gguf_file import hf_config

        model = from_hf_dict(hf_config(args.config), name=Path(args.config).stem, source=str(args.config))
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
        kinds = None if model.hf is None else model.hf.layer_kinds(args.layers)
        model = dataclasses.replace(model, n_layers=args.layers, layer_kinds=kinds)
    if getattr(args, "seq", 0) is None:  # the default: within the model's own context (a given one past it is refused)
        from multihead.sizing import context_limit

        limit = context_limit(model)
        args.seq = args.seq_default if limit is None else min(args.seq_default, limit)
    return model


def causal(args: argparse.Namespace, model: ModelConfig) -> bool:
    return model.causal if args.causal is None else bool(args.causal)


def layers(n: int) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")
