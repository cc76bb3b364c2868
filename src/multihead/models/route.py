"""One model route: what ``--model`` names (a shipped model's name, a GGUF file of any architecture transformers
reads, a model folder) and which engine runs it, decided in one place for every command that takes ``--model``.

::

    r = route("gemma3")            # Route(path=.../gemma-3-270m-q4_k_m.gguf, engine="transformers", arch="gemma3", ..)
    r.describe()                   # 'gemma3 (gemma3 GGUF) on transformers: multihead has no port of gemma3'
    r = route("model.gguf", "ours")   # our port, or a MultiheadError naming the architecture when there is none

``engine`` "auto" takes multihead's own port where one applies (Llama-architecture GGUF files and folders, BERT
sentence encoders: the fast path) and transformers (with its attention switched to multihead's) otherwise;
"ours" and "transformers" force one. The decision reads a GGUF's ``general.architecture`` or a folder's
``config.json`` ``model_type``, never the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from multihead.errors import MultiheadError
from multihead.names import ENGINES

MODEL_NAMES = ("smollm2", "minilm", "gemma3")  # the models that ship as packages (multihead.models' finders)


def _finders() -> dict[str, Callable[[], Path]]:
    from multihead.models.loaders import default_gemma3_path, default_gguf_path, default_minilm_dir

    return {"smollm2": default_gguf_path, "minilm": default_minilm_dir, "gemma3": default_gemma3_path}


@dataclass(frozen=True)
class Route:
    """A model to load: its ``path``, the ``label`` tables give it, its architecture (``arch``: a GGUF's
    general.architecture or a folder's model_type; None when unknown), the ``engine`` that runs it ("ours" or
    "transformers"), ``port`` (the port that reads it: "llama", "bert" or None) and ``why`` that engine."""

    path: Path
    label: str
    arch: str | None
    engine: str
    port: str | None
    why: str
    gguf: bool

    def describe(self) -> str:
        """One line for people: the model, what it is and which engine runs it, why."""
        what = f"{self.arch or 'unknown'} {'GGUF' if self.gguf else 'folder'}"
        engine = "multihead's own port" if self.engine == "ours" else "transformers (multihead's attention)"
        return f"{self.label} ({what}) on {engine}: {self.why}"


def architecture(path: Path) -> str | None:
    """A GGUF file's general.architecture or a folder's config.json model_type (None where neither says)."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise MultiheadError(f"{str(path)!r} is a file but not a .gguf: give a .gguf file or a model folder")
        from multihead.models.gguf_file import GGUFFile

        gguf = GGUFFile(path)
        try:
            arch = gguf.field("general.architecture", None)
        finally:
            gguf.close()
        return None if arch is None else str(arch)
    config = path / "config.json"
    if not config.is_file():
        return None
    from multihead.models.loaders import read_json

    found = read_json(config).get("model_type")
    return None if found is None else str(found)


def route(name: str | None, engine: str = "auto", *, default: str = "smollm2") -> Route:
    """Where ``name`` is and which engine runs it (the module docstring): a name of :data:`MODEL_NAMES` (None:
    ``default``), a .gguf file or a model folder. Raises a MultiheadError that names the value: a path that does not
    exist, a file that is not a GGUF, a folder without config.json, ``engine="ours"`` for an architecture multihead
    has no port of, an unknown engine."""
    if engine not in ENGINES:
        raise MultiheadError(f"engine {engine!r} is unknown: choose one of {', '.join(ENGINES)}")
    key = default if name is None else name
    finders = _finders()
    path = finders[key]() if key in finders else Path(key)
    if key not in finders and not path.exists():
        raise MultiheadError(f"model {key!r} does not exist: give one of {', '.join(MODEL_NAMES)}, a .gguf file or a "
                             "model folder")
    gguf = path.is_file()
    arch = architecture(path)
    if not gguf and arch is None:
        raise MultiheadError(f"model folder {str(path)!r} has no config.json (with a model_type): give a model folder "
                             "as saved by save_pretrained, or a .gguf file")
    label = key if key in finders else (path.stem if gguf else path.name)
    from multihead.models.loaders import SUPPORTED_GGUF

    port = ("llama" if (arch in SUPPORTED_GGUF if gguf else arch == "llama")
            else "bert" if (not gguf and arch == "bert") else None)
    if engine == "ours":
        if port is None:
            raise MultiheadError(f"{label} is a {arch} {'GGUF' if gguf else 'folder'}: multihead has no port of it "
                                 "(Llama-architecture decoders and BERT sentence encoders): use --engine transformers "
                                 "(or auto)")
        return Route(path, label, arch, "ours", port, "asked for (--engine ours)", gguf)
    if engine == "transformers":
        return Route(path, label, arch, "transformers", port, "asked for (--engine transformers)", gguf)
    if port is not None:
        return Route(path, label, arch, "ours", port, f"multihead ports {arch} (the faster path; --engine "
                     "transformers runs transformers' modules instead)", gguf)
    return Route(path, label, arch, "transformers", None, f"multihead has no port of {arch}", gguf)


__all__ = ["MODEL_NAMES", "Route", "architecture", "route"]
