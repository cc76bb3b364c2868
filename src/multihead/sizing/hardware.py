"""How fast: hardware presets and a roofline estimate of prefill and decode for the whole model.

A :class:`Hardware` holds one device's memory, memory bandwidth, peak dense matrix FLOP/s per dtype and the
interconnect bandwidth between devices. :func:`estimate` answers, for a model (:mod:`multihead.sizing`) at a context::

    prefill  time = FLOPs / (peak x efficiency)          FLOPs = 2 (linear params) s b + attention core pair by pair
    decode   time = max(bytes / (bandwidth x efficiency), FLOPs / (peak x efficiency)) per step,
             bytes = active weights + KV cache at the context (one device's share)
    bound    arithmetic intensity (FLOPs / bytes) against the ridge point at the assumed efficiencies
             (peak x compute efficiency / (bandwidth x bandwidth efficiency)): whichever time is longer
    all-reduce per step (tensor parallel): 2 per layer of b x D activations, each a ring (:func:`allreduce_seconds`):
             latency + 2 (tp - 1) hop latency + 2 (tp - 1) / tp x bytes / interconnect

The efficiencies are assumptions, stated in every answer (defaults below); the benchmark benchmarks/decode_estimate.py
holds the decode estimate against a measured SmolLM2 decode on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from multihead.errors import MultiheadError

if TYPE_CHECKING:
    from multihead.sizing import ModelSize
    from multihead.sizing.presets import ModelConfig

COMPUTE_EFFICIENCY = 0.5  # assumed fraction of peak FLOP/s a prefill's matmuls reach
BANDWIDTH_EFFICIENCY = 0.8  # assumed fraction of peak bandwidth a decode step's reads reach


@dataclass(frozen=True)
class Hardware:
    """One device: memory (bytes), bandwidth (bytes/s), peak dense FLOP/s by dtype, interconnect (bytes/s, one
    direction per device), where the figures come from, and whether they were checked against that source here.
    ``allreduce_latency`` and ``hop_latency`` (seconds): what one all-reduce over the interconnect costs before its
    bytes, a fixed part per call and a part per ring step (2 (n - 1) steps over n devices; :func:`allreduce_seconds`),
    from the collective library's own model (:data:`NCCL_LATENCY`)."""

    name: str
    memory: int
    bandwidth: float
    flops: dict[str, float]
    interconnect: float
    source: str
    verified: bool = False
    _: dataclasses.KW_ONLY
    allreduce_latency: float = 0.0
    hop_latency: float = 0.0

    def peak(self, dtype: str) -> float:
        key = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
               "int8": "fp8"}.get(dtype, dtype)
        if key not in self.flops:
            raise MultiheadError(f"{self.name} has no published {dtype} matrix rate: choose one of "
                                 f"{', '.join(self.flops)}")
        return self.flops[key]

    def ridge(self, dtype: str) -> float:
        """FLOPs per byte where the roofline bends (peak / bandwidth)."""
        return self.peak(dtype) / self.bandwidth


T, G = 1e12, 1e9
Gi = 2**30
# Memory: the datasheets' "80 GB" of HBM is binary (stacks of 2^k GiB: an H100 or A100 80GB reports 81,559 or
# 81,920 MiB in nvidia-smi, i.e. about 80 GiB, not 80e9 bytes), so capacities are taken as GiB; what the driver and
# runtime keep back is what --reserve is for. Bandwidths and FLOP/s are decimal, as the vendors state them.
# Dense (no 2:4 sparsity) tensor-core rates. Each figure is the vendor's published one for the SXM/OAM part; the
# vendor datasheets were not in the stored pages this was written from, so none is marked verified: the figures were
# cross-checked against third-party spec pages (glennklockwood.com/garden/processors/h100 for H100's matrix rates,
# 3.35 TB/s and 900 GB/s NVLink; yobitel.com/knowledge-base/nvidia-l4 and the sourcecode.com spec table for L4;
# codesota.com/hardware/mi300x and jaredwatkins.com's MI300 entry for MI300X's 192 GB, 5.3 TB/s, ~1.3 PFLOPS
# bf16). fp32 is the tensor-core TF32 rate where the vendor lists one.
class Latency(TypedDict):
    """What one all-reduce costs before its bytes (:func:`allreduce_seconds`), from the collective libraries' own
    cost model (without it, the 56 all-reduces of a 7B model's decode step took 0.001 ms, issue 42). NCCL's
    src/graph/tuning.cc (github.com/NVIDIA/nccl, read at commit b6475625) times a ring all-reduce of n ranks on one
    node as baseLat + 2 (n - 1) hwLat + bytes / bandwidth; for the LL protocol, the one it picks for small messages
    (a decode step's b x d_model activations), baseLat is 6.6 us and hwLat 0.6 us over NVLink, 1.0 us over PCIe.
    RCCL's tuning.cc (github.com/ROCm/rccl, read at commit 0023b9b0) has 20.5 us and 2.3 us for its NVLink-class
    (xGMI) links. The libraries' model, not a measurement here: two H100s give 7.8 us an all-reduce, 0.44 ms for the
    56 of a 28-layer model's step."""

    allreduce_latency: float  # seconds, once a call (baseLat)
    hop_latency: float  # seconds, each of a ring's 2 (n - 1) steps (hwLat)


NVLINK = Latency(allreduce_latency=6.6e-6, hop_latency=0.6e-6)
PCIE = Latency(allreduce_latency=6.6e-6, hop_latency=1.0e-6)
XGMI = Latency(allreduce_latency=20.5e-6, hop_latency=2.3e-6)
NCCL_LATENCY: dict[str, Latency] = {"nvlink": NVLINK, "pcie": PCIE, "xgmi": XGMI}
HARDWARE: dict[str, Hardware] = {
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet): 80 GB HBM3, 3.35 TB/s, BF16/FP16
    # 989 TFLOPS dense (1,979 sparse), FP8 1,979 dense, TF32 494.7 dense, NVLink 900 GB/s
    "h100-80g": Hardware("h100-80g", 80 * Gi, 3.35e12, {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T,
                                                         "fp32": 494.7 * T}, 450 * G,
                         "NVIDIA H100 SXM datasheet (nvidia.com/en-us/data-center/h100); NVLink 900 GB/s total, "
                         "450 GB/s per direction", **NVLINK),
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet): 141 GB HBM3e, 4.8 TB/s, the H100's
    # compute (BF16 989 dense, FP8 1,979 dense), NVLink 900 GB/s
    "h200": Hardware("h200", 141 * Gi, 4.8e12, {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T,
                                                 "fp32": 494.7 * T}, 450 * G,
                     "NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200)", **NVLINK),
    # https://www.nvidia.com/en-us/data-center/a100/ (A100 datasheet): 80 GB HBM2e SXM 2,039 GB/s; BF16/FP16 312
    # TFLOPS dense, TF32 156; no FP8; NVLink 600 GB/s
    "a100-80g": Hardware("a100-80g", 80 * Gi, 2.039e12, {"bf16": 312 * T, "fp16": 312 * T, "fp32": 156 * T},
                         300 * G, "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM 80GB", **NVLINK),
    # same datasheet, A100 40GB SXM: HBM2 1,555 GB/s
    "a100-40g": Hardware("a100-40g", 40 * Gi, 1.555e12, {"bf16": 312 * T, "fp16": 312 * T, "fp32": 156 * T},
                         300 * G, "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM 40GB", **NVLINK),
    # https://www.nvidia.com/en-us/data-center/l4/ (L4 datasheet): 24 GB GDDR6, 300 GB/s, BF16/FP16 121 TFLOPS
    # dense (242 sparse), FP8 242.5 dense (485 sparse), TF32 60 dense; PCIe Gen4 x16 (32 GB/s per direction)
    "l4": Hardware("l4", 24 * Gi, 300 * G, {"bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T, "fp32": 60 * T},
                   32 * G, "NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4); PCIe Gen4 x16", **PCIE),
    # https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (Ada whitepaper,
    # RTX 4090): 24 GB GDDR6X, 1,008 GB/s; FP16/BF16 tensor with FP32 accumulate 165.2 dense, FP8 330.3 dense
    # (FP16 accumulate: twice that); no NVLink: PCIe Gen4 x16
    "rtx-4090": Hardware("rtx-4090", 24 * Gi, 1008 * G, {"bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T,
                                                          "fp32": 82.6 * T}, 32 * G,
                         "NVIDIA Ada GPU architecture whitepaper, RTX 4090 (FP32 accumulate)", **PCIE),
    # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (MI300X datasheet): 192 GB HBM3,
    # 5.3 TB/s, BF16/FP16 1,307.4 TFLOPS dense, FP8 2,614.9 dense, TF32 653.7; Infinity Fabric 896 GB/s (7 links of
    # 128 GB/s, both directions): 448 GB/s per direction
    "mi300x": Hardware("mi300x", 192 * Gi, 5.3e12, {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T,
                                                     "fp32": 653.7 * T}, 448 * G,
                       "AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html)",
                       **XGMI),
}
HARDWARE_NAMES = (*HARDWARE, "cpu")


def measure_cpu(nbytes: int = 256 * 2**20, n: int = 512) -> Hardware:
    """This machine's CPU, measured: read bandwidth (a large float32 tensor summed, median of 5), float32 and
    bfloat16 matmul FLOP/s (n x n, median of 5), physical memory from the OS; interconnect: none (0)."""
    import torch

    def median_seconds(fn: Any) -> float:
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    a = torch.ones(nbytes // 4)
    bandwidth = nbytes / median_seconds(a.sum)
    flops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(n, n).to(dtype)
        flops[name] = 2 * n**3 / median_seconds(lambda x=x: x @ x)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware("cpu", memory, bandwidth, flops, 0.0, "measured on this machine", verified=True)


def hardware(name: str) -> Hardware:
    if name == "cpu":
        return measure_cpu()
    if name not in HARDWARE:
        raise MultiheadError(f"hardware {name!r} is unknown: choose one of {', '.join(HARDWARE_NAMES)}")
    return HARDWARE[name]


def allreduce_seconds(device: Hardware, tp: int, nbytes: int) -> float:
    """One ring all-reduce of ``nbytes`` over ``tp`` devices like ``device``: 2 (tp - 1) steps, each paying a hop's
    latency and moving 1 / tp of the bytes, after the call's own latency (NCCL's model, :data:`NCCL_LATENCY`)::

        allreduce_latency + 2 (tp - 1) hop_latency + 2 (tp - 1) / tp x nbytes / interconnect
    """
    if tp == 1:
        return 0.0
    if not device.interconnect:
        raise MultiheadError(f"{device.name} has no interconnect figure: --tp {tp} over it cannot be estimated")
    steps = 2 * (tp - 1)
    return device.allreduce_latency + steps * device.hop_latency + steps / tp * nbytes / device.interconnect


def estimate(model: ModelConfig, size: ModelSize, device: Hardware, *, seq: int, batch: int, dtype: str,
             weights_dtype: str, tp: int = 1, cache: str = "full", largest_batch: int | None = None,
             compute_efficiency: float = COMPUTE_EFFICIENCY,
             bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY, shard_embeddings: bool = False) -> dict[str, Any]:
    """Prefill and decode estimates of the whole model (``model``, ``size`` as multihead.sizing gives them) on
    ``tp`` devices like ``device``, at a context of ``seq`` tokens (module docstring: the formulas). A device reads
    its own share of the weights and the KV cache, as multihead.sizing.fit holds them (replicated parts whole, a KV
    head on several devices where there are fewer than ``tp``)."""
    from multihead import sizing
    from multihead.sizing import cost

    sizing.check_seq(model, seq)
    sizing.check_tp(model, tp)
    a, layers = model.attention, model.layers()
    compute = sizing.activation_dtype(dtype)
    peak = device.peak(compute) * compute_efficiency
    bandwidth = device.bandwidth * bandwidth_efficiency
    vocab = size.parts.get("embeddings", 0)
    head = size.parts.get("lm_head", 0) or (vocab if size.tied else 0)
    linear = size.active - vocab - size.parts.get("lm_head", 0)  # parameters a token's matmuls pass through

    def core(s: int, t: int) -> int:
        """Attention's Q K^T and P V over the model's layers, pair by pair (multihead.sizing.cost)."""
        if model.mla is not None:
            return model.n_layers * cost.mla_flops(model.mla, s=s, t=t, batch=batch, causal=True,
                                                   path="absorbed" if s == 1 else "expanded").attention
        by_kind: dict[str, int] = {}
        for layer in layers:
            key = layer.describe()
            if key not in by_kind:  # (its window, or a chunked layer's chunk)
                by_kind[key] = layer.flops(a, s=s, t=t, batch=batch, causal=True).attention
        return sum(by_kind[layer.describe()] for layer in layers)

    kv = sizing.kv_bytes(model, context=seq, batch=batch, dtype=dtype, cache=cache)
    weights = sizing.parts_weight_bytes(sizing.size_parts(size, size.active), weights_dtype, name=size.name)
    weights_dev, _ = sizing.weights_on_device(model, size, params=size.active, weights_dtype=weights_dtype, tp=tp,
                                              shard_embeddings=shard_embeddings)
    calls = 2 * model.n_layers  # all-reduces a forward: after attention's W_O and after the MLP, each layer

    def allreduce(tokens: int) -> float:
        """The step's all-reduces of tokens x d_model activations (:func:`allreduce_seconds` each)."""
        return calls * allreduce_seconds(device, tp, tokens * a.d_model * cost.dtype_bytes(compute))

    prefill_flops = 2 * linear * seq * batch + 2 * head * batch + core(seq, seq)
    prefill_bytes = weights + kv
    prefill_bytes_dev = weights_dev + sizing.kv_on_device(model, kv, tp)
    prefill_compute_s, prefill_memory_s = prefill_flops / tp / peak, prefill_bytes_dev / bandwidth
    prefill_s = max(prefill_compute_s, prefill_memory_s) + allreduce(seq * batch)

    def decode(b: int) -> dict[str, Any]:
        kv_b = kv // batch * b
        step_bytes = weights_dev + sizing.kv_on_device(model, kv_b, tp)  # one device's share (an MLA latent: all)
        step_flops = (2 * (linear + head) * b + core(1, seq + 1) // batch * b) / tp
        memory_s, compute_s = step_bytes / bandwidth, step_flops / peak
        step = max(memory_s, compute_s) + allreduce(b)
        intensity = step_flops / step_bytes
        return {"batch": b, "context": seq, "bytes_per_step": int(step_bytes), "flops_per_step": int(step_flops),
                "arithmetic_intensity": intensity, "bound": "memory" if memory_s >= compute_s else "compute",
                "memory_seconds": memory_s, "compute_seconds": compute_s, "allreduce_seconds":
                allreduce(b), "step_seconds": step, "tokens_per_second_per_sequence": 1 / step,
                "tokens_per_second": b / step}

    out: dict[str, Any] = {
        "hardware": asdict(device), "tp": tp, "compute_dtype": compute,
        "assumptions": {"compute_efficiency": compute_efficiency, "bandwidth_efficiency": bandwidth_efficiency,
                        "moe": "decode reads one token's experts (active parameters); a batch touches more"},
        "ridge_flops_per_byte": device.ridge(compute),  # the datasheet's: peak / bandwidth
        # where the assumed efficiencies bend the roofline: the bound named below is the side of this a step is on
        "effective_ridge_flops_per_byte": peak / bandwidth,
        "allreduce": {"calls_per_step": calls if tp > 1 else 0,
                      "latency_seconds": allreduce_seconds(device, tp, 0),
                      "model": "ring: latency + 2 (tp - 1) hop latency + 2 (tp - 1) / tp x bytes / interconnect "
                               "(NCCL's model)"},
        "prefill": {"tokens": seq, "batch": batch, "flops": prefill_flops, "bytes": prefill_bytes,
                    "bytes_per_device": prefill_bytes_dev,
                    "compute_seconds": prefill_compute_s, "memory_seconds": prefill_memory_s,
                    "allreduce_seconds": allreduce(seq * batch), "seconds": prefill_s,
                    "arithmetic_intensity": prefill_flops / tp / prefill_bytes_dev,
                    "bound": "compute" if prefill_compute_s >= prefill_memory_s else "memory"},
        "decode": decode(batch),
    }
    if largest_batch is not None and largest_batch > 0:
        out["decode_largest_batch"] = decode(largest_batch)
    return out


def plot_roofline(e: dict[str, Any], path: str | Path, *, title: str) -> str:
    """A PNG roofline of one estimate (:func:`estimate`): attainable FLOP/s against arithmetic intensity for the
    device (its bandwidth slope and peak at the assumed efficiencies), and the prefill and decode points."""
    from multihead.errors import require
    from multihead.files import save_figure

    matplotlib = require("matplotlib", "plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hw, a = e["hardware"], e["assumptions"]
    peak = hw["flops"][e["compute_dtype"]] * a["compute_efficiency"]
    bandwidth = hw["bandwidth"] * a["bandwidth_efficiency"]
    points = [("prefill", e["prefill"])] + [(f"decode, batch {d['batch']}", d) for d in
                                           (e["decode"], e.get("decode_largest_batch")) if d is not None]
    xs = [p["arithmetic_intensity"] for _, p in points]
    lo, hi = min([*xs, 0.5]) / 2, max([*xs, e["ridge_flops_per_byte"]]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(grid, [min(peak, x * bandwidth) for x in grid], color="black",
            label=f"{hw['name']}: {a['bandwidth_efficiency']:.0%} of bandwidth, {a['compute_efficiency']:.0%} of peak")
    for name, p in points:
        ax.scatter([p["arithmetic_intensity"]], [min(peak, p["arithmetic_intensity"] * bandwidth)], zorder=3,
                   label=f"{name} ({p['bound']}-bound)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attainable FLOP/s per device")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        out = save_figure(fig, Path(path), make_folder=False)  # (a --plot path in a missing folder is refused)
    finally:
        plt.close(fig)
    return str(out)
