"""SmolLM2 on MultiHeadAttention against Hugging Face transformers' LlamaForCausalLM on the same GGUF weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from multihead import MultiheadError
from multihead.kernels import cpu
from multihead.models import LlamaConfig, LlamaModel, load_llama
from multihead.models.generate import Sampling, generate_ids
from tests_support import smollm2_gguf, teacher_forced_logits

PROMPTS = [
    "The",
    "The capital of France is",
    "Attention heads in a transformer each look at the sequence in their own way: some follow the previous "
    "token, some copy what came before, and some track the syntax of the sentence.",
]


def _ids(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tok.encode(text)


@pytest.mark.parametrize("text", PROMPTS, ids=["1-token", "short", "long"])
def test_logits_equal_transformers(smollm2, hf_smollm2, text: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    hf, _ = hf_smollm2
    ids = torch.tensor([_ids(tok, text)])
    with torch.no_grad():
        ours = model(ids)
        ref = hf(ids).logits
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 1e-4 * scale


def test_32_greedy_tokens_equal_transformers(smollm2, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    hf, _ = hf_smollm2
    prompt = _ids(tok, "Once upon a time, in a land far away, there lived")
    ours = [t for step in generate_ids(model, [prompt], max_new_tokens=32) for t in step]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert len(ours) == 32
    assert ours == ref[0, len(prompt):].tolist()


def test_tokenizer_equals_transformers_gguf_tokenizer(smollm2, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    _, tok = smollm2
    _, hf_tok = hf_smollm2
    texts = ["Hello world!", "  leading spaces and\ttabs\nnew lines", "Ünïcödé — and emoji 🤖 too",
             "<|im_start|>user\nHi<|im_end|>", "don't stop: it's fine"]
    for text in texts:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids, text
        assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_one_by_one_as_smollm_does(smollm2) -> None:  # type: ignore[no-untyped-def]
    _, tok = smollm2
    pieces = [tok.decode([i]) for i in tok.encode("in 2024")]
    assert pieces == ["in", " ", "2", "0", "2", "4"]


def test_cached_decoding_equals_the_uncached_forward_at_every_step(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    prompt = _ids(tok, "The quick brown fox")
    cache = model.new_cache(1, len(prompt) + 12)
    seq = list(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([seq]), cache=cache)
        cache.advance(len(seq))
        for _ in range(12):
            nxt = int(logits[0, -1].argmax())
            full = model(torch.tensor([seq]))  # no cache: the whole sequence again
            torch.testing.assert_close(logits[0, -1], full[0, -1], atol=1e-4, rtol=1e-4)
            seq.append(nxt)
            logits = model(torch.tensor([[nxt]]), cache=cache)
            cache.advance(1)


def test_a_batch_generates_what_each_prompt_generates_alone(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    prompts = [_ids(tok, t) for t in PROMPTS]
    together: list[list[int]] = [[] for _ in prompts]
    for step in generate_ids(model, prompts, max_new_tokens=12):
        for i, t in enumerate(step):
            if t is not None:
                together[i].append(t)
    for i, p in enumerate(prompts):
        alone = [t for step in generate_ids(model, [p], max_new_tokens=12) for t in step if t is not None]
        assert together[i] == alone


@pytest.mark.usefixtures("two_threads")
def test_the_cpu_fast_paths_change_no_token_and_no_logit_beyond_rounding(smollm2) -> None:  # type: ignore[no-untyped-def]
    """multihead.kernels.cpu's switch: the whole model with every CPU speed path and with none, one sequence (plain
    decode mask, slice cache writes) and a batch of two lengths (positions mask, indexed writes): same tokens, same
    logits."""
    model, tok = smollm2
    prompts = [tok.encode("The capital of France is"), tok.encode("Once upon a time, in a land far away,")]
    w = model.layers[0].attn.q_proj.weight
    assert cpu.split_product(1, w, torch.zeros(1, w.shape[1])) == 2  # the split product is on here ...
    for batch in ([prompts[0]], prompts):
        fast = list(generate_ids(model, batch, max_new_tokens=8))
        with cpu.disabled():
            assert cpu.split_product(1, w, torch.zeros(1, w.shape[1])) == 1  # ... and off here
            plain = list(generate_ids(model, batch, max_new_tokens=8))
        assert fast == plain
    ids = torch.tensor([prompts[1]])
    logits = {}
    for on in (True, False):
        cpu.set_enabled(on)
        try:
            logits[on] = teacher_forced_logits(model, ids)
        finally:
            cpu.set_enabled(True)
    torch.testing.assert_close(logits[True], logits[False], atol=2e-4, rtol=1e-4)


def test_sampling_is_reproducible_with_a_seed(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    prompt = [_ids(tok, "My favourite colour is")]
    runs = [[t for s in generate_ids(model, prompt, max_new_tokens=8, sampling=Sampling(0.9, 0.9, seed=7)) for t in s]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_hf_folder_loads_the_same_model(smollm2, hf_smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    hf, hf_tok = hf_smollm2
    # transformers refuses save_pretrained for a GGUF-loaded model: write the same Hugging Face layout by hand.
    from safetensors.torch import save_file

    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    hf_tok.save_pretrained(tmp_path)
    folder_model, folder_tok = load_llama(tmp_path)
    ids = torch.tensor([_ids(tok, PROMPTS[1])])
    with torch.no_grad():
        torch.testing.assert_close(folder_model(ids), model(ids), atol=1e-5, rtol=1e-5)
    assert folder_tok.encode("Hello world!") == tok.encode("Hello world!")


def test_decode_under_compile_reuses_one_graph() -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    config = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                         max_context=128)
    model = LlamaModel(config).eval()
    counter = CompileCounter()
    step = torch.compile(lambda t, pos, cache: model(t, cache=cache, positions=pos), backend=counter,
                         fullgraph=True)
    cache = model.new_cache(2, 80)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)), cache=cache)
        cache.advance(8)
        tokens = torch.randint(0, 64, (2, 1))
        for _ in range(64):
            logits = step(tokens, cache.next_positions(1), cache)
            cache.advance(1)
            tokens = logits[:, -1].argmax(-1, keepdim=True)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times over 64 decode steps"


def test_generate_with_compile_gives_the_eager_tokens_from_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile=True: the same tokens as eager decoding, one graph for every step and for a second call whose cache
    falls in the same bucket. (The graph is traced by dynamo and run without inductor's code generation, which
    takes minutes on 2 cores; benchmarks/decode.py --compile times the real thing.)"""
    from torch._dynamo.testing import CompileCounter

    from multihead.models import generate as gen

    torch._dynamo.reset()
    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, fullgraph=True))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                         max_context=512)
    model = LlamaModel(config).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    eager = list(gen.generate_ids(model, prompts, max_new_tokens=40))
    compiled = list(gen.generate_ids(model, prompts, max_new_tokens=40, compile=True))
    again = list(gen.generate_ids(model, [[9, 10, 11]], max_new_tokens=20, compile=True))
    assert compiled == eager
    assert again == list(gen.generate_ids(model, [[9, 10, 11]], max_new_tokens=20))
    assert counter.frame_count == 2, "one graph for batch 2 and one for batch 1, each reused across its steps"
    with pytest.raises(MultiheadError, match="either step or compile=True"):
        next(gen.generate_ids(model, prompts, max_new_tokens=2, compile=True, step=lambda t, p: t))


# ---------------------------------------------------------------------------------------------- bad input
def test_missing_truncated_and_corrupt_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match="does not exist"):
        load_llama(tmp_path / "missing.gguf")
    data = smollm2_gguf().read_bytes()
    for name, content, message in [
        ("empty.gguf", b"", "is empty"),
        ("notgguf.gguf", b"PK\x03\x04" + data[4:4096], "is not a GGUF file"),
        ("header.gguf", data[:2000], "truncated or corrupt"),
        ("half.gguf", data[: len(data) // 2], "is truncated: tensor"),
        ("badcount.gguf", data[:8] + (2**62).to_bytes(8, "little") + data[16:4096], "truncated or corrupt"),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(MultiheadError, match=message):
            load_llama(path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MultiheadError, match=r"general\.architecture = 'gpt2': expected a supported architecture"):
        load_llama(path)


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match=r"config\.json' does not exist"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(MultiheadError, match="describes a 'gpt2' model: supported is llama"):
        load_llama(tmp_path)


def test_prompts_and_lengths_out_of_range(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, _ = smollm2
    with pytest.raises(MultiheadError, match=r"max_new_tokens \(0\) must be a positive int"):
        next(generate_ids(model, [[1, 2]], max_new_tokens=0))
    with pytest.raises(MultiheadError, match=r"max_new_tokens \(-3\) must be a positive int"):
        next(generate_ids(model, [[1, 2]], max_new_tokens=-3))
    with pytest.raises(MultiheadError, match="need 8193 positions, more than the model's context of 8192"):
        next(generate_ids(model, [[1] * 8000], max_new_tokens=193))
    with pytest.raises(MultiheadError, match=r"token ids \[49152\] are outside the vocabulary of 49152"):
        next(generate_ids(model, [[1, 49152]], max_new_tokens=1))
    with pytest.raises(MultiheadError, match="every prompt needs at least one token"):
        next(generate_ids(model, [[]], max_new_tokens=1))




def test_a_tiny_temperature_samples_the_most_likely_token_instead_of_nan() -> None:
    from multihead.models.generate import Sampling, sample

    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [0.5, 0.25, 4.0, 4.0 - 1e-3]])
    sampling = Sampling(temperature=1e-40, seed=0)
    for _ in range(20):
        assert sample(logits, sampling, sampling.generator()).tolist() == [1, 2]
    with pytest.raises(MultiheadError, match=r"seed \(1180591620717411303424\) must be from 0 to 2\^63 - 1"):
        Sampling(temperature=1.0, seed=2**70)
    with pytest.raises(MultiheadError, match=r"temperature \(inf\) must be finite and >= 0"):
        Sampling(temperature=float("inf"))


def test_logits_to_keep_gives_the_last_rows_of_the_full_logits_and_the_same_cache() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                         max_context=128)
    model = LlamaModel(config).eval()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        for n in (1, 5, 12, 20):  # more than s keeps every row, as a slice does
            # the same rows (a product over fewer rows may round differently: within float32 rounding)
            torch.testing.assert_close(model(tokens, logits_to_keep=n), full[:, -n:], rtol=1e-6, atol=1e-6)
        a, b = model.new_cache(2, 16), model.new_cache(2, 16)
        model(tokens, cache=a)
        model(tokens, cache=b, logits_to_keep=1)
        a.advance(12)
        b.advance(12)
        step = torch.randint(0, 64, (2, 1))
        torch.testing.assert_close(model(step, cache=b), model(step, cache=a), rtol=0, atol=0)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(MultiheadError, match=r"logits_to_keep must be an int >= 0 .* not"):
            model(tokens, logits_to_keep=bad)  # type: ignore[arg-type]
