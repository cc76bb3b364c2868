"""A transformers model from a local folder or a .gguf file, switched to multihead's attention (:func:`load`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multihead.errors import MultiheadError, require
from multihead.hf.switch import enable


def load(path: str | Path, *, dtype: torch.dtype = torch.float32, task: str | None = None,
         backend: str = "auto", products: bool = True) -> nn.Module:
    """A transformers model from a local folder (config.json and safetensors) or a .gguf file, already switched to
    multihead's attention (:func:`~multihead.hf.enable`, with ``backend`` and ``products``). ``task`` picks the
    head: "causal-lm" (default for decoders), "masked-lm", "base" (AutoModel, default for encoders) or
    "seq2seq-lm"."""
    require("transformers", "hf")
    import transformers

    p = Path(path)
    if not p.exists():
        raise MultiheadError(f"model path {str(p)!r} does not exist: give a model folder or a .gguf file")
    kwargs: dict[str, Any] = {"dtype": dtype}
    if p.is_file():
        if p.suffix != ".gguf":
            raise MultiheadError(f"{str(p)!r} is a file but not a .gguf: give a model folder or a .gguf file")
        folder, kwargs["gguf_file"] = p.parent, p.name
        config_model_type = None
    else:
        folder = p
        config_file = p / "config.json"
        if not config_file.is_file():
            raise MultiheadError(f"model folder {str(p)!r} has no config.json")
        if not (list(p.glob("*.safetensors")) or list(p.glob("*.bin"))):
            raise MultiheadError(f"model folder {str(p)!r} has no weights (*.safetensors)")
        from multihead.models.loaders import read_json

        config_model_type = read_json(config_file).get("model_type")
    auto = _auto_class(transformers, task, config_model_type)
    try:
        model = auto.from_pretrained(str(folder), **kwargs)
    except Exception as err:  # any failure of transformers' readers on a user's file is one clear error naming it
        raise MultiheadError(f"transformers could not load {str(p)!r}: {type(err).__name__}: {err}") from None
    return enable(model.eval(), backend=backend, products=products)


_ENCODERS = {"bert", "roberta", "modernbert", "distilbert", "electra", "xlm-roberta", "mpnet"}
_SEQ2SEQ = {"t5", "bart", "mt5", "mbart", "pegasus", "marian"}


def _auto_class(transformers: Any, task: str | None, model_type: str | None) -> Any:
    tasks: dict[str, Callable[..., Any]] = {
        "causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
        "base": transformers.AutoModel, "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
    }
    if task is None:
        task = "base" if model_type in _ENCODERS else "seq2seq-lm" if model_type in _SEQ2SEQ else "causal-lm"
    if task not in tasks:
        raise MultiheadError(f"task {task!r} is unknown: choose one of {', '.join(tasks)}")
    return tasks[task]
