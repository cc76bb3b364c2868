"""multihead's caches in transformers models (multihead.hf.cache, hf.new_cache): every kind through ``forward`` and
``generate`` of tiny random Llama, Qwen2, Qwen3 and Mistral models against the uncached model under the kind's mask
(made with the hook points: each layer's pattern restricted to the keys the kind keeps), the real bytes, and SmolLM2
in transformers equal to multihead's own port with the same head plan."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from torch import Tensor

from multihead import hf
from multihead.cache import HeadPlan, sink_keep
from multihead.errors import MultiheadError
from multihead.layers.hooks import hooks
from multihead.sizing import cost

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
P, STEPS = 24, 10  # prompt tokens, then decode steps


def _model(family: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    common = {"vocab_size": 97, "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "qwen2": lambda: transformers.Qwen2Config(**common),
              "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32),
              "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None)}[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return hf.enable(model)


def _plan() -> HeadPlan:
    return HeadPlan(full=[[True, False], [False, True]], sinks=2, window=8, model="tiny", shape=(2, 4, 2, 32))


def _restricted(model, tokens: Tensor, keep: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
    """The uncached model whose every layer's pattern is restricted to ``keep`` (L, h, n, n) and renormalised: the
    softmax over the kept keys only, exactly (the math path after a replaced pattern)."""
    def restrict(layer: int):  # type: ignore[no-untyped-def]
        def fn(w: Tensor, point: object) -> Tensor:
            kept = w * keep[layer][None]
            return kept / kept.sum(-1, keepdim=True)
        return fn

    points = {f"model.layers.{i}.self_attn.hook_pattern": restrict(i) for i in range(keep.shape[0])}
    with torch.no_grad(), hooks(model, points):
        return model(tokens).logits  # type: ignore[no-any-return]


def _cached(model, tokens: Tensor, cache) -> Tensor:  # type: ignore[no-untyped-def]
    """Logits of a prompt of P tokens through the cache, then one token a step (teacher-forced)."""
    with torch.no_grad():
        out = [model(tokens[:, :P], cache=cache).logits]
        for i in range(P, tokens.shape[1]):
            out.append(model(tokens[:, i:i + 1], cache=cache).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_decodes_as_the_uncached_model_under_its_mask(family: str) -> None:
    model = _model(family)
    tokens = torch.randint(0, 97, (1, P + STEPS))
    n = tokens.shape[1]
    with torch.no_grad():
        plain = model(tokens).logits
    torch.testing.assert_close(_cached(model, tokens, hf.new_cache(model, n)), plain, atol=2e-5, rtol=2e-5)
    pos = torch.arange(n)
    sink = sink_keep(pos, pos, window=8, sink_tokens=2)
    got = _cached(model, tokens, hf.new_cache(model, window=8, sink_tokens=2))
    torch.testing.assert_close(got, _restricted(model, tokens, sink[None, None].expand(2, 4, n, n)), atol=2e-5,
                               rtol=2e-5)
    plan = _plan()
    cache = hf.new_cache(model, n, plan=plan)
    got = _cached(model, tokens, cache)
    torch.testing.assert_close(got, _restricted(model, tokens, plan.mask(n)), atol=2e-5, rtol=2e-5)
    assert cache.bytes == cost.headwise_cache_bytes(plan, batch=1, max_len=n, dtype="fp32")
    assert not torch.allclose(got, plain, atol=1e-3)  # the plan changes what is computed: the check can fail
    quantized = _cached(model, tokens, hf.new_cache(model, n, bits=8, group=16, residual=8))
    torch.testing.assert_close(quantized, plain, atol=0.05, rtol=0.05)  # 8-bit keys and values: close, not equal


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_takes_every_kind_and_the_full_one_gives_transformers_own_tokens(family: str) -> None:
    model = _model(family)
    ids = torch.randint(0, 97, (1, P))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=STEPS, do_sample=False)  # transformers' own DynamicCache
        kinds = {"full": {"max_len": P + STEPS}, "sink": {"window": 8, "sink_tokens": 2},
                 "int4": {"max_len": P + STEPS, "bits": 4, "group": 16, "residual": 8},
                 "plan": {"max_len": P + STEPS, "plan": _plan()}}
        for name, kind in kinds.items():
            cache = hf.new_cache(model, **kind)
            got = model.generate(ids, cache=cache, max_new_tokens=STEPS, do_sample=False)
            assert got.shape == want.shape and cache.inner.used == P + STEPS - 1, name
            if name == "full":
                assert torch.equal(got, want)
            # compiled decoding cannot hold a view: the cache says so and transformers decodes it eagerly (its own
            # warning), to the same tokens
            assert cache.is_compileable is False, name
            again = model.generate(ids, cache=hf.new_cache(model, **kind), max_new_tokens=STEPS, do_sample=False,
                                   compile_config=transformers.CompileConfig())
            assert torch.equal(again, got), name


def test_a_chunked_prefill_and_a_compressed_full_prefill_decode_as_the_kind_does() -> None:
    """A prompt in chunks is one cache step a forward pass; the shared-prefill protocol (multihead.cache.compress of
    a full cache's prefill into the kind, then the question decoded through it) equals the uncached model whose
    prompt rows are causal and whose later rows see what the kind keeps."""
    from multihead.cache import compress

    model = _model("llama")
    tokens = torch.randint(0, 97, (1, P + STEPS))
    n = tokens.shape[1]
    plan = _plan()
    chunked = hf.new_cache(model, n, plan=plan)
    with torch.no_grad():
        out = [model(tokens[:, a:b], cache=chunked).logits for a, b in ((0, 10), (10, 17), (17, n))]
    torch.testing.assert_close(torch.cat(out, 1), _restricted(model, tokens, plan.mask(n)), atol=2e-5, rtol=2e-5)
    full = hf.new_cache(model, n)
    small = hf.new_cache(model, n, plan=plan)
    with torch.no_grad():
        model(tokens[:, :P], cache=full)
        compress(full.inner, small.inner)
        got = torch.cat([model(tokens[:, i:i + 1], cache=small).logits for i in range(P, n)], 1)
    keep = plan.mask(n).clone()
    keep[:, :, :P] = torch.ones(n, n, dtype=torch.bool).tril()[:P]  # the prompt was prefilled with every key
    torch.testing.assert_close(got, _restricted(model, tokens, keep)[:, P:], atol=2e-5, rtol=2e-5)


def test_the_cache_refuses_what_it_cannot_hold_by_name() -> None:
    model = _model("llama")
    with pytest.raises(MultiheadError, match=r"n_kv_heads"):
        hf.new_cache(model, 32, plan=HeadPlan(full=[[True, False, True]] * 2, sinks=2, window=8, model="x",
                                              shape=(2, 4, 3, 32)))
    with pytest.raises(MultiheadError, match="exceeds the model's context"):
        hf.new_cache(model, 1000)
    with pytest.raises(MultiheadError, match="needs max_len"):
        hf.new_cache(model)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        with pytest.raises(MultiheadError, match="padding"):
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[1, :4] = 0
            model(ids, attention_mask=mask, cache=hf.new_cache(model, batch=2, window=8))
        with pytest.raises(MultiheadError, match="beam search"):
            model.generate(ids[:1], cache=hf.new_cache(model, 32), num_beams=2, max_new_tokens=2, do_sample=False)
        with pytest.raises(MultiheadError, match="num_return_sequences"):
            model.generate(ids[:1], cache=hf.new_cache(model, 32), num_return_sequences=2, max_new_tokens=2,
                           do_sample=True)
    plain = transformers.LlamaForCausalLM(model.config).eval()
    plain.set_attn_implementation("sdpa")
    with pytest.raises(MultiheadError, match=r"hf\.enable"):
        hf.new_cache(plain, 32)


SLIDING = 6  # the sliding layers' own window: shorter than the prompt, so it matters


def _sliding_model(family: str):  # type: ignore[no-untyped-def]
    """Tiny Gemma 2, Gemma 3 (text) and Mistral models whose layer 0 slides (window SLIDING) and layer 1 is global
    (Mistral: both slide); their windows as multihead.hf.cache reads them."""
    torch.manual_seed(0)
    common = {"vocab_size": 97, "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "head_dim": 32,
              "sliding_window": SLIDING}
    types = ["sliding_attention", "full_attention"]
    config = {"gemma2": lambda: transformers.Gemma2Config(**common, layer_types=types),
              "gemma3": lambda: transformers.Gemma3TextConfig(**common, layer_types=types),
              "mistral": lambda: transformers.MistralConfig(**common)}[family]()
    model = hf.enable(transformers.AutoModelForCausalLM.from_config(config).eval())
    windows = [SLIDING, SLIDING] if family == "mistral" else [SLIDING, None]
    return model, windows


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_sliding_layers_keep_their_window_in_every_kind(family: str) -> None:
    """In a sliding layer every kind attends within the layer's own window (sinks included: past the window a sink
    is not seen); the head-wise cache stores a sliding layer's full heads as a ring of its window and its streaming
    heads as sinks + the smaller window, and its bytes are cost.headwise_cache_bytes with the windows."""
    from multihead.hf.cache import layer_windows

    model, windows = _sliding_model(family)
    assert layer_windows(model.config, 2) == windows
    tokens = torch.randint(0, 97, (1, P + STEPS))
    n = tokens.shape[1]
    with torch.no_grad():
        plain = model(tokens).logits
    torch.testing.assert_close(_cached(model, tokens, hf.new_cache(model, n)), plain, atol=2e-5, rtol=2e-5)
    pos = torch.arange(n)
    for sinks, window in ((2, 8), (2, 4)):  # a plan window wider and narrower than the layers' own
        sink = sink_keep(pos, pos, window=window, sink_tokens=sinks)
        got = _cached(model, tokens, hf.new_cache(model, window=window, sink_tokens=sinks))
        torch.testing.assert_close(got, _restricted(model, tokens, sink[None, None].expand(2, 4, n, n)),
                                   atol=2e-5, rtol=2e-5)
        plan = HeadPlan(full=[[True, False], [False, True]], sinks=sinks, window=window, model="tiny",
                        shape=(2, 4, 2, 32))
        cache = hf.new_cache(model, n, plan=plan)
        got = _cached(model, tokens, cache)
        torch.testing.assert_close(got, _restricted(model, tokens, plan.mask(n)), atol=2e-5, rtol=2e-5)
        assert cache.bytes == cost.headwise_cache_bytes(plan, batch=1, max_len=n, dtype="fp32", windows=windows)
        stores = {name: tuple(t.shape) for name, t in cache.inner.named_buffers() if name.startswith("k_")}
        assert stores["k_0_0"] == (1, 1, SLIDING - 1, 32)  # layer 0's full head: a ring of the layer's window
        assert stores["k_0_1"] == (1, 1, sinks + min(window, SLIDING) - 1, 32)
    assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_models_generate_and_compress_as_the_kind_does(family: str) -> None:
    """Gemma 2 and 3 (a sliding layer, a global one) through generate: the full cache gives transformers' own tokens
    and a head plan's cache decodes; a full prefill compressed into the plan's cache (the shared-prefill protocol)
    then decodes as the uncached model whose prompt rows are causal and whose later rows see what the plan keeps,
    within each layer's own window."""
    from multihead.cache import compress

    model, _ = _sliding_model(family)
    ids = torch.randint(0, 97, (1, P))
    plan = HeadPlan(full=[[True, False], [False, True]], sinks=2, window=8, model="tiny", shape=(2, 4, 2, 32))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=STEPS, do_sample=False)  # transformers' own cache
        got = model.generate(ids, cache=hf.new_cache(model, P + STEPS), max_new_tokens=STEPS, do_sample=False)
        assert torch.equal(got, want)
        planned = hf.new_cache(model, P + STEPS, plan=plan)
        tokens = model.generate(ids, cache=planned, max_new_tokens=STEPS, do_sample=False)
    assert tokens.shape == want.shape and planned.inner.used == P + STEPS - 1
    n = tokens.shape[1]
    full = hf.new_cache(model, n)
    small = hf.new_cache(model, n, plan=plan)
    with torch.no_grad():
        model(tokens[:, :P], cache=full)
        compress(full.inner, small.inner)
        got = torch.cat([model(tokens[:, i:i + 1], cache=small).logits for i in range(P, n)], 1)
    keep = plan.mask(n).clone()
    keep[:, :, :P] = torch.ones(n, n, dtype=torch.bool).tril()[:P]  # the prompt was prefilled with every key
    torch.testing.assert_close(got, _restricted(model, tokens, keep)[:, P:], atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_smollm2_in_transformers_decodes_with_a_head_plan_as_multiheads_own_port() -> None:
    """The real model: transformers' LlamaForCausalLM read from the GGUF, on multihead's attention with a head-wise
    cache of a shipped plan, gives the greedy tokens of multihead's own SmolLM2 port with the same plan's cache,
    and the same real bytes."""
    from pathlib import Path

    from multihead.models import load_llama
    from multihead.models.generate import generate_ids
    from tests_support import smollm2_gguf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = smollm2_gguf()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    hf.enable(theirs)
    ours, tok = load_llama()
    plan = HeadPlan.load(Path(__file__).parents[1] / "docs" / "experiments" / "smollm2-duo-50-plan.json")
    prompt = tok.encode("The passkey is 71432. Remember it. " + "The grass is green. " * 60 + "The passkey is")
    new = 12
    cache = hf.new_cache(theirs, len(prompt) + new, plan=plan)
    with torch.no_grad():
        got = theirs.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=new, do_sample=False)
    want = [t[0] for t in generate_ids(ours, [prompt], max_new_tokens=new, plan=plan)]
    assert got[0, len(prompt):].tolist() == want
    assert cache.bytes == ours.new_cache(1, len(prompt) + new, plan=plan).bytes


@pytest.mark.usefixtures("two_threads")
def test_a_switched_models_step_follows_the_load_as_our_models_do_and_gives_the_threads_back() -> None:
    """hf.enable makes each forward a step of multihead.kernels.cpu.step_threads: following the load with one core left
    free, the attention runs with one intra-op thread (an op spread over two waits for the thread the scheduler
    left off its core); the configured two come back after the forward, and after one that raised; idle, or not
    following the load (MULTIHEAD_FOLLOW_LOAD=0), every step keeps the configured threads. The logits are the same
    each way."""
    from multihead.kernels import cpu

    model = _model("llama")
    seen: list[int] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    tokens = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        want = model(tokens).logits
    try:
        cpu.follow_load(True)
        for spare, threads in [(1.0, 1), (2.0, 2)]:
            cpu.pin_spare_cores(spare)
            with torch.no_grad():
                torch.testing.assert_close(model(tokens).logits, want, atol=1e-5, rtol=1e-5)
            assert seen[-1] == threads and torch.get_num_threads() == 2
        cpu.pin_spare_cores(1.0)
        handle = model.model.layers[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError), torch.no_grad():
            model(tokens)  # raises in the second layer, after the first ran with one thread
        handle.remove()
        assert seen[-1] == 1 and torch.get_num_threads() == 2
        cpu.follow_load(False)
        with torch.no_grad():
            model(tokens)
        assert seen[-1] == 2
    finally:
        cpu.pin_spare_cores(None)
        cpu.follow_load(None)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("products", [True, False])
def test_a_switched_float32_models_logits_are_the_same_bits_on_an_idle_and_a_busy_machine(products: bool) -> None:
    """A float32 prefill of 13 tokens through SmolLM2-wide products (576 into 576: MKL's float32 product sums those by
    its thread count on the AMD EPYC host) gives the same logits, bit for bit, with two cores free and with one:
    multihead's products keep the configured threads inside a step that follows the load; a model that kept
    transformers' own products (products=False) keeps the configured threads for the whole step. A one-token step
    follows the load either way."""
    from multihead.kernels import cpu

    cpu.force_product(None)  # the default rules, not the fixture's forced split
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64)
    model = hf.enable(transformers.AutoModelForCausalLM.from_config(config).eval(), products=products)
    seen: list[int] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    tokens = torch.randint(0, 97, (1, 13))
    outs = []
    try:
        cpu.follow_load(True)
        for spare in (2.0, 1.0):
            cpu.pin_spare_cores(spare)
            with torch.no_grad():
                outs.append(model(tokens).logits)
        with torch.no_grad():
            model(input_ids=tokens[:, :1])  # one token, as a decode step
    finally:
        cpu.pin_spare_cores(None)
        cpu.follow_load(None)
    assert seen == [2, 1 if products else 2, 1] and torch.get_num_threads() == 2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_caches_decode_steps_write_in_place_and_equal_the_concatenating_path(bits: int) -> None:
    """Decode steps of a quantized cache write their token into the residual buffer in place (no gradient asked); with
    gradients on, the same steps concatenate the residual and the token (the path before the in-place write). The
    logits agree at every step, including the steps that quantize a group (here every 16 tokens, from token 40),
    where the commit comes before the last layer's attention in a transformers model."""
    model = _model("llama")
    tokens = torch.randint(0, 97, (1, P + 40))
    n = tokens.shape[1]

    def run(grad: bool) -> Tensor:
        cache = hf.new_cache(model, n, bits=bits, group=16, residual=8)
        with torch.set_grad_enabled(grad):
            out = [model(tokens[:, :P], cache=cache).logits.detach()]
            for i in range(P, n):
                out.append(model(tokens[:, i:i + 1], cache=cache).logits.detach())
        assert cache.inner.quantized == 48  # groups were quantized during the decode steps
        return torch.cat(out, 1)

    torch.testing.assert_close(run(False), run(True), atol=1e-6, rtol=1e-6)
