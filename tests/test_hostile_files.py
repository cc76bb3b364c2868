"""Hostile checkpoint files (issues 18 and 21): every damaged or wrong file ends in a MultiheadError that names the
file, or loads a model that works; never another exception, a hang or a memory blow-up. Each case runs in a forked
child under a time and an address-space limit (tests/isolation.py)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isolation import Outcome, isolated, isolated_map
from multihead.models.loaders import load_llama
from tests_support import minilm_dir
from tiny_checkpoints import (
    ARRAY,
    BOOL,
    F32,
    F64,
    I32,
    I64,
    ST_FILES,
    STRING,
    U8,
    U32,
    U64,
    Field,
    gguf_bytes,
    nested_array,
    tiny_llama_gguf,
    write_tiny_bert,
    write_tiny_gguf,
    write_tiny_hf_llama,
)

SECONDS, MEMORY = 20.0, 1 << 30


def use_llama(path: Path) -> str:
    """Load, encode, run: what a user does first with a checkpoint."""
    model, tokenizer = load_llama(path)
    ids = tokenizer.encode("the hostile file")[:model.config.max_context]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    return f"loaded: {model.config.n_layers} layers, logits {tuple(logits.shape)}"


def use_bert(folder: Path) -> str:
    from multihead.models.bert import load_sentence_encoder

    return str(tuple(load_sentence_encoder(folder).embed(["a hostile file", "and another"]).shape))


def check(outcomes: dict[str, Outcome], where: str) -> Counter[str]:
    """Every outcome ok or a MultiheadError naming the file; the tally of kinds."""
    bad = {name: o for name, o in outcomes.items() if o.kind not in ("ok", "error")
           or (o.kind == "error" and where not in o.detail)}
    print(f"\nfuzz cases under {where}: {len(outcomes)} ({dict(Counter(o.kind for o in outcomes.values()))})")
    assert not bad, "\n".join(f"{name}: {o.kind}: {o.detail.strip().splitlines()[-1][:300]}"
                               for name, o in bad.items()) + f"\n({len(bad)} of {len(outcomes)})"
    return Counter(o.kind for o in outcomes.values())


# ---------------------------------------------------------------------------------------------- GGUF metadata values
def _numbers(key: str, value: Any) -> Iterator[tuple[str, int, Any]]:
    """Hostile replacements for a numeric field."""
    yield "zero", U32, 0
    yield "negative", I32, -1
    yield "one", U32, 1
    if isinstance(value, int):
        yield "one less", U32, max(0, value - 1)
        yield "one more", U32, value + 1
        yield "double", U32, 2 * value
    yield "2^31", U32, 2**31
    yield "2^40", U64, 2**40
    yield "2^63", U64, 2**63
    yield "2^64-1", U64, 2**64 - 1
    yield "-2^63", I64, -(2**63)
    yield "nan", F32, math.nan
    yield "inf", F64, math.inf
    yield "-inf", F32, -math.inf
    yield "tiny", F64, 1e-300
    yield "huge float", F64, 1e300
    yield "12.0", F32, 12.0
    yield "string", STRING, "12"
    yield "bool", BOOL, True
    yield "u8", U8, 7
    yield "array", ARRAY, (U32, [4, 4])
    yield "empty array", ARRAY, (U32, [])


def _strings(key: str, value: Any) -> Iterator[tuple[str, int, Any]]:
    yield "int", U32, 5
    yield "empty", STRING, ""
    yield "long", STRING, "x" * 100_000
    yield "array", ARRAY, (STRING, ["llama"])
    yield "controls", STRING, "\x00\u202e</script>"


def _arrays(key: str, value: Any) -> Iterator[tuple[str, int, Any]]:
    item, items = value
    yield "empty", ARRAY, (item, [])
    yield "one short", ARRAY, (item, items[:-1])
    yield "one more", ARRAY, (item, [*items, items[-1]])
    yield "ints", ARRAY, (I32, list(range(len(items))))
    yield "strings", ARRAY, (STRING, [str(i) for i in range(len(items))])
    yield "not an array", U32, len(items)
    yield "500 deep", ARRAY, nested_array(500)
    yield "huge ints", ARRAY, (U64, [2**63] * len(items))
    yield "negative ints", ARRAY, (I32, [-1] * len(items))
    yield "reversed", ARRAY, (item, list(reversed(items)))


def metadata_cases() -> Iterator[tuple[str, list[Field]]]:
    fields, _ = tiny_llama_gguf()
    for i, (key, kind, value) in enumerate(fields):
        yield f"{key} removed", fields[:i] + fields[i + 1:]
        mutations = (_arrays if kind == ARRAY else _strings if kind == STRING else _numbers)(key, value)
        for name, new_kind, new_value in mutations:
            yield f"{key} {name}", [*fields[:i], (key, new_kind, new_value), *fields[i + 1:]]
        yield f"{key} twice", [*fields, (key, kind, value)]
    tokens = fields[[k for k, _, _ in fields].index("tokenizer.ggml.tokens")][2][1]
    special = [("tokenizer.ggml.merges", ARRAY, (STRING, ["Ġ zz"])), ("tokenizer.ggml.merges", ARRAY, (STRING, ["he"])),
               ("tokenizer.ggml.merges", ARRAY, (STRING, ["h e", "h e"])),
               ("tokenizer.ggml.tokens", ARRAY, (STRING, [*tokens[:-1], tokens[0]])),
               ("tokenizer.ggml.bos_token_id", U32, len(tokens)), ("tokenizer.ggml.eos_token_id", U64, 2**40),
               ("tokenizer.ggml.token_type", ARRAY, (I32, [1] * len(tokens))),
               ("tokenizer.ggml.token_type", ARRAY, (I32, [3] * len(tokens))),
               ("llama.vocab_size", U32, len(tokens) - 1), ("llama.vocab_size", U32, len(tokens) + 1)]
    for key, kind, value in special:
        i = [k for k, _, _ in fields].index(key)
        yield f"{key} special {value!r:.40}", [*fields[:i], (key, kind, value), *fields[i + 1:]]


def tensor_cases() -> Iterator[tuple[str, list[Field], dict[str, Any], int]]:
    fields, tensors = tiny_llama_gguf()
    names = list(tensors)
    for name in names:
        rest = {k: v for k, v in tensors.items() if k != name}
        yield f"{name} missing", fields, rest, 32
        if tensors[name].ndim == 2 and len(set(tensors[name].shape)) == 2:  # a transposed square one loads
            yield f"{name} transposed", fields, {**tensors, name: tensors[name].T.copy()}, 32
        yield f"{name} one row more", fields, {**tensors, name: tensors[name][[0, *range(len(tensors[name]))]]}, 32
    yield "an extra block", fields, {**tensors, "blk.2.attn_norm.weight": tensors["blk.0.attn_norm.weight"]}, 32
    yield "blocks renumbered", fields, {k.replace("blk.1.", "blk.5."): v for k, v in tensors.items()}, 32
    yield "an output tensor", fields, {**tensors, "output.weight": tensors["token_embd.weight"]}, 32
    for alignment in (0, 3, 1 << 20):
        i = [k for k, _, _ in fields].index("general.alignment")
        yield f"alignment {alignment}", [*fields[:i], ("general.alignment", U32, alignment), *fields[i + 1:]], \
            tensors, 32


@pytest.mark.slow
def test_every_hostile_gguf_metadata_value_ends_in_a_clear_error_or_a_working_model(tmp_path: Path) -> None:
    _, tensors = tiny_llama_gguf()
    names, paths = [], []
    for k, (name, fields) in enumerate(metadata_cases()):  # a file each, so that two children run at a time
        paths.append(tmp_path / f"case{k}.gguf")
        paths[-1].write_bytes(gguf_bytes(fields, tensors))
        names.append(name)
    outcomes = dict(zip(names, isolated_map(use_llama, [(p,) for p in paths], seconds=SECONDS, memory=MEMORY),
                        strict=True))
    tally = check(outcomes, str(tmp_path))
    assert sum(tally.values()) >= 400, tally
    assert tally["error"] > tally["ok"], tally  # almost every value here is wrong


def test_every_tensor_table_mismatch_ends_in_a_clear_error(tmp_path: Path) -> None:
    outcomes = {}
    for k, (name, fields, tensors, _) in enumerate(tensor_cases()):
        path = tmp_path / f"case{k}.gguf"
        path.write_bytes(gguf_bytes(fields, tensors))
        outcomes[name] = isolated(use_llama, path, seconds=SECONDS, memory=MEMORY)
    tally = check(outcomes, str(tmp_path))
    assert tally["ok"] == 1, {k: str(o) for k, o in outcomes.items() if o.kind == "ok"}  # only the output tensor


# ---------------------------------------------------------------------------------------------- JSON files
HOSTILE_JSON: list[tuple[str, str]] = [
    ("zero", "0"), ("negative", "-1"), ("2^64", "18446744073709551616"), ("10^30", "1e30"), ("1e400", "1e400"),
    ("NaN", "NaN"), ("half", "0.5"), ("string", '"12"'), ("null", "null"), ("true", "true"), ("list", "[1, 2]"),
    ("5000 digits", "9" * 5000),
]
WHOLE_FILE: list[tuple[str, bytes]] = [
    ("empty", b""), ("list", b"[]"), ("null", b"null"), ("cut", b'{"a": '), ("not UTF-8", b'{"a": "\xff\xfe"}'),
    ("100,000 deep", b"[" * 100_000 + b"]" * 100_000), ("a number", b"42"), ("BOM", b"\xef\xbb\xbf{}"),
]


def json_cases(content: Any) -> Iterator[tuple[str, bytes]]:
    """Each key of a JSON object (or of each object of a list) replaced by each hostile value or removed, then
    whole-file replacements."""
    import json

    objects = [content] if isinstance(content, dict) else list(content)
    for k, obj in enumerate(objects):
        for key in obj:
            for name, literal in [*HOSTILE_JSON, ("removed", "")]:
                changed = {kk: vv for kk, vv in obj.items() if kk != key}
                text = json.dumps(changed)
                if literal:
                    text = text[:-1] + (", " if changed else "") + f"{json.dumps(key)}: {literal}}}"
                if isinstance(content, dict):
                    yield f"{key} {name}", text.encode()
                else:
                    items = [json.dumps(o) for o in objects]
                    items[k] = text
                    yield f"[{k}].{key} {name}", ("[" + ", ".join(items) + "]").encode()
    yield from WHOLE_FILE


def mutate_and_run(folder: Path, file: str, cases: Iterator[tuple[str, bytes]],
                   use: Callable[[Path], Any]) -> dict[str, Outcome]:
    """Write each case over ``folder/file``, run ``use(folder)`` isolated, restore the file."""
    path = folder / file
    original = path.read_bytes()
    outcomes = {}
    try:
        for name, content in cases:
            path.write_bytes(content)
            outcomes[f"{file}: {name}"] = isolated(use, folder, seconds=SECONDS, memory=MEMORY)
    finally:
        path.write_bytes(original)
    return outcomes


@pytest.mark.slow
def test_hostile_hugging_face_llama_config_values(tmp_path: Path) -> None:
    import json

    folder = write_tiny_hf_llama(tmp_path / "llama")
    assert isolated(use_llama, folder).kind == "ok"
    config = json.loads((folder / "config.json").read_text())
    outcomes = mutate_and_run(folder, "config.json", json_cases(config), use_llama)
    tally = check(outcomes, str(folder))
    assert sum(tally.values()) >= 190 and tally["error"] > tally["ok"], tally


@pytest.mark.slow
def test_hostile_sentence_transformers_files(tmp_path: Path) -> None:
    import json

    folder = write_tiny_bert(tmp_path / "bert", minilm_dir())
    assert isolated(use_bert, folder).kind == "ok"
    outcomes: dict[str, Outcome] = {}
    for file in ("config.json", *ST_FILES):
        outcomes |= mutate_and_run(folder, file, json_cases(json.loads((folder / file).read_text())), use_bert)
    tally = check(outcomes, str(folder))
    assert sum(tally.values()) >= 250 and tally["error"] > tally["ok"], tally


# ---------------------------------------------------------------------------------------------- byte mutations
HUGE = [2**60, 2**63, 2**64 - 1, 2**32 - 1, 2**31, 0]


@st.composite
def damage(draw: st.DrawFn, size: int, hot: int) -> list[tuple[Any, ...]]:
    """One to four edits of a file of ``size`` bytes, mostly within its first ``hot`` bytes (the header): a byte
    changed, a cut, bytes inserted or deleted, or eight bytes overwritten with a huge little-endian count."""
    where = st.one_of(st.integers(0, max(0, hot - 1)), st.integers(0, size - 1))
    edit = st.one_of(
        st.tuples(st.just("set"), where, st.integers(0, 255)),
        st.tuples(st.just("cut"), st.integers(0, size)),
        st.tuples(st.just("insert"), where, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), where, st.integers(1, 64)),
        st.tuples(st.just("huge"), where, st.sampled_from(HUGE)),
    )
    return draw(st.lists(edit, min_size=1, max_size=4))


def apply(data: bytes, edits: list[tuple[Any, ...]]) -> bytes:
    out = bytearray(data)
    for edit in edits:
        kind, at = edit[0], min(edit[1], len(out))
        if kind == "set" and at < len(out):
            out[at] = edit[2]
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = edit[2]
        elif kind == "delete":
            del out[at:at + edit[2]]
        elif kind == "huge":
            out[at:at + 8] = edit[2].to_bytes(8, "little")
    return bytes(out)


def fuzz_file(path: Path, use: Callable[[Path], Any], target: Path, *, examples: int, hot: int,
              seen: Counter[str]) -> None:
    """Hypothesis-driven damage to ``path`` (restored afterwards), then ``use(target)``; every case ends ok or in a
    MultiheadError naming the file. ``seen`` counts the outcomes."""
    original = path.read_bytes()

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(damage(len(original), hot))
    def one(edits: list[tuple[Any, ...]]) -> None:
        path.write_bytes(apply(original, edits))
        outcome = isolated(use, target, seconds=SECONDS, memory=MEMORY)
        seen[outcome.kind] += 1
        assert outcome.kind in ("ok", "error"), f"{edits}\n{outcome}"
        assert outcome.kind == "ok" or str(path.parent) in outcome.detail, f"{edits}\n{outcome}"

    try:
        one()
    finally:
        path.write_bytes(original)


@pytest.mark.slow
def test_damaged_gguf_bytes(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    fields, _ = tiny_llama_gguf()
    header = len(gguf_bytes(fields, {}))
    seen: Counter[str] = Counter()
    fuzz_file(path, use_llama, path, examples=500, hot=header + 2000, seen=seen)
    print(f"\nfuzz cases, damaged GGUF bytes: {sum(seen.values())} ({dict(seen)})")
    assert sum(seen.values()) >= 500 and seen["error"] > 0, seen


@pytest.mark.slow
def test_damaged_safetensors_config_and_tokenizer_bytes(tmp_path: Path) -> None:
    folder = write_tiny_hf_llama(tmp_path / "llama")
    seen: Counter[str] = Counter()
    for name, examples, hot in (("model.safetensors", 220, 4096), ("config.json", 90, 1 << 20),
                                ("tokenizer.json", 140, 1 << 20)):
        fuzz_file(folder / name, use_llama, folder, examples=examples, hot=hot, seen=seen)
    print(f"\nfuzz cases, damaged safetensors, config.json and tokenizer.json bytes: {sum(seen.values())} "
          f"({dict(seen)})")
    assert sum(seen.values()) >= 450 and seen["error"] > 0, seen


def test_a_tensor_type_the_gguf_package_cannot_dequantise_is_named(tmp_path: Path) -> None:
    from gguf.constants import GGMLQuantizationType

    from multihead import MultiheadError

    fields, tensors = tiny_llama_gguf()
    path = tmp_path / "i32.gguf"  # 16 float32 values relabelled as 16 int32 ones: the same bytes, a type not read
    path.write_bytes(gguf_bytes(fields, tensors, kinds={"output_norm.weight": GGMLQuantizationType.I32.value}))
    with pytest.raises(MultiheadError, match=r"tensor 'output_norm.weight' has type I32, which the gguf package "
                                             r"cannot dequantise"):
        load_llama(path)


def test_a_safetensors_index_cannot_point_outside_the_model_folder(tmp_path: Path) -> None:
    import json

    from multihead import MultiheadError

    folder = write_tiny_hf_llama(tmp_path / "llama")
    (folder / "model.safetensors").rename(tmp_path / "outside.safetensors")
    for name in ("../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "model.bin"):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))
        with pytest.raises(MultiheadError, match=r"weight_map\['model.norm.weight'\] = .*: expected the name of a "
                                                 r"\.safetensors file in the model folder"):
            load_llama(folder)
