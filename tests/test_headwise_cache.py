"""HeadwiseCache and HeadPlan: each KV head full or sinks + window; equal to the uncached model under the plan's
per-head mask, token by token and chunk by chunk; real bytes; plans as JSON, refused for another shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import Tensor

from multihead import MultiheadError
from multihead.cache import HeadPlan, HeadwiseCache, KVCache, SinkCache
from multihead.layers.linear import linear
from multihead.models import LlamaConfig, LlamaModel
from multihead.sizing import cost

SINKS, WINDOW = 2, 5


def _model(n_kv_heads: int, n_layers: int = 3, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=n_kv_heads,
                         ffn_dim=48, max_context=128)
    return LlamaModel(config).eval()


def _plan(full: list[list[bool]], g: int, *, sinks: int = SINKS, window: int = WINDOW) -> HeadPlan:
    return HeadPlan(full=full, sinks=sinks, window=window, model="tiny", shape=(len(full), 4, g, 8),
                    method="test")


PLANS = {  # per layer: mixed, all streaming, all full (the one-group layers), for MHA, GQA, MQA; a layer's groups
    # are runs of consecutive KV heads (taken as views) or not (gathered), in head order or not
    4: [[True, False, False, True], [False] * 4, [True] * 4, [True, True, False, False]],
    2: [[False, True], [False, False], [True, True]],
    1: [[True], [False], [False]],
}


def _masked_logits(model: LlamaModel, tokens: Tensor, plan: HeadPlan) -> Tensor:
    """The reference: the uncached model, each layer under its own per-head mask (HeadPlan.mask)."""
    masks = plan.mask(tokens.shape[1])  # (L, h, n, n)
    h = model.embed(tokens)
    for i, block in enumerate(model.layers):
        h = block(h, step=block.attn.step(h, mask=masks[i][None]))
    return linear(model.norm(h), model.embed.weight)


def _run(model: LlamaModel, tokens: Tensor, cache: object, chunks: list[int]) -> Tensor:
    outs, at = [], 0
    for n in chunks:
        outs.append(model(tokens[:, at:at + n], cache=cache))  # type: ignore[arg-type]
        cache.advance(n)  # type: ignore[attr-defined]
        at += n
    return torch.cat(outs, dim=1)


def test_mask_is_causal_for_full_heads_and_sink_keep_for_streaming() -> None:
    plan = _plan([[True, False]], 2, sinks=1, window=2)
    m = plan.mask(5)  # (1, 4, 5, 5): query heads 0, 1 -> KV head 0 (full), 2, 3 -> KV head 1 (streaming)
    p = torch.arange(5)
    causal = p[None] <= p[:, None]
    stream = causal & ((p[None] > p[:, None] - 2) | (p[None] < 1))
    assert torch.equal(m[0, 0], causal) and torch.equal(m[0, 1], causal)
    assert torch.equal(m[0, 2], stream) and torch.equal(m[0, 3], stream)
    assert m[0, 2, 4].tolist() == [True, False, False, True, True]


@pytest.mark.parametrize("g", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("chunks", [[1] * 18, [7, 3, 1, 6, 1], [18]],
                         ids=["token-by-token", "chunks-around-the-window", "one-prefill"])
def test_decoding_equals_the_uncached_model_under_the_plans_mask(g: int, chunks: list[int]) -> None:
    model, plan = _model(g, n_layers=len(PLANS[g])), _plan(PLANS[g], g)
    tokens = torch.randint(0, 64, (2, sum(chunks)))
    with torch.no_grad():
        want = _masked_logits(model, tokens, plan)
        got = _run(model, tokens, model.new_cache(2, 40, plan=plan), chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_mask_matters_so_the_reference_is_not_the_causal_model() -> None:
    model, plan = _model(2), _plan(PLANS[2], 2)
    tokens = torch.randint(0, 64, (1, 24))
    with torch.no_grad():
        assert (_masked_logits(model, tokens, plan) - model(tokens)).abs().max() > 1e-3


def test_all_full_equals_kvcache_and_all_streaming_equals_sinkcache() -> None:
    model = _model(2)
    tokens = torch.randint(0, 64, (2, 20))
    chunks = [6, 1, 8, 1, 1, 1, 1, 1]
    with torch.no_grad():
        full = _run(model, tokens, model.new_cache(2, 20, plan=_plan([[True, True]] * 3, 2)), chunks)
        kv = _run(model, tokens, model.new_cache(2, 20), chunks)
        stream = _run(model, tokens, model.new_cache(2, 20, plan=_plan([[False, False]] * 3, 2)), chunks)
        sink = _run(model, tokens, model.new_cache(2, window=WINDOW, sink_tokens=SINKS), chunks)
    assert isinstance(model.new_cache(2, 20), KVCache)
    assert isinstance(model.new_cache(2, window=WINDOW, sink_tokens=SINKS), SinkCache)
    torch.testing.assert_close(full, kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stream, sink, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bytes_are_the_real_tensors_and_the_cost_formula(dtype: torch.dtype) -> None:
    plan = _plan(PLANS[4], 4)
    cache = HeadwiseCache(plan, batch=3, max_len=50, dtype=dtype)
    real = sum(t.nbytes for t in cache.buffers() if t.is_floating_point())
    size = 2 if dtype == torch.bfloat16 else 4
    by_hand = 2 * 3 * 8 * size * (8 * 50 + 8 * (SINKS + WINDOW - 1))  # 8 full and 8 streaming KV heads
    assert cache.bytes == real == by_hand
    assert cost.headwise_cache_bytes(plan, batch=3, max_len=50, dtype=str(dtype)) == by_hand
    full = HeadwiseCache(_plan([[True] * 4] * 3, 4), batch=3, max_len=50, dtype=dtype)
    assert full.bytes == KVCache(batch=3, n_kv_heads=4, head_dim=8, max_len=50, n_layers=3, dtype=dtype).bytes


def test_a_plan_of_another_shape_is_refused_with_both_shapes_named() -> None:
    model = _model(2)
    with pytest.raises(MultiheadError, match=r"made for tiny of shape \(n_layers 3, n_heads 4, n_kv_heads 4, "
                                             r"head_dim 8\) .* has shape \(n_layers 3, n_heads 4, n_kv_heads 2, "
                                             r"head_dim 8\)"):
        model.new_cache(1, 10, plan=_plan(PLANS[4][:3], 4))
    with pytest.raises(MultiheadError, match="without window=, sink_tokens= or bits="):
        model.new_cache(1, 10, plan=_plan(PLANS[2], 2), bits=4)


def test_overflow_is_refused_before_any_layer_writes() -> None:
    model = _model(2)
    cache = model.new_cache(1, 8, plan=_plan(PLANS[2], 2))
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        cache.advance(6)
        with pytest.raises(MultiheadError, match="KV cache overflow: 3 more token"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    assert cache.used == 6


def test_hooks_q_z_out_work_and_k_v_pattern_are_refused() -> None:
    from multihead.layers.hooks import hooks

    model, plan = _model(2), _plan(PLANS[2], 2)
    tokens = torch.randint(0, 64, (1, 12))

    def zero_head_1(z: Tensor, point: object) -> Tensor:
        z = z.clone()
        z[:, 1] = 0
        return z

    with torch.no_grad(), hooks(model, {"layers.*.attn.hook_z": zero_head_1}):
        want = _masked_logits(model, tokens, plan)
        got = _run(model, tokens, model.new_cache(1, 12, plan=plan), [5, 1, 6])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for point in ("hook_k", "hook_v", "hook_pattern"):
        with torch.no_grad(), hooks(model, {f"layers.0.attn.{point}": lambda t, p: None}), \
                pytest.raises(MultiheadError, match=f"{point} cannot be hooked with a HeadwiseCache"):
            model(tokens, cache=model.new_cache(1, 12, plan=plan))


def test_explain_names_each_groups_kernel_and_leaves_the_cache_unchanged() -> None:
    model, plan = _model(2), _plan(PLANS[2], 2)
    cache = model.new_cache(1, 12, plan=plan)
    block = model.layers[0]
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        choice = block.attn.explain(x, causal=True, cache=cache.layer(0))
    assert "full KV heads: sdpa" in choice.reason and "streaming KV heads: sdpa" in choice.reason
    assert cache.used == 0 and all(not t.any() for t in cache.buffers() if t.is_floating_point())


def test_a_layer_update_returns_each_group_of_kv_heads_with_its_keys_and_the_order_back() -> None:
    """The one verb: a head-wise layer's update gives a GroupedKV, the full heads' keys and the streaming heads'
    each with their KV heads and their own mask (the view carries what the kernel needs: full heads causal, streaming
    heads their sinks and window), and the permutation that puts them back in head order; a plain view is refused
    where keys must be one tensor."""
    from multihead.cache import GroupedKV
    from multihead.kernels import dense_view

    plan = HeadPlan(full=[[False, True, True, False]], sinks=1, window=2, model="tiny", shape=(1, 4, 4, 8))
    cache = HeadwiseCache(plan, batch=1, max_len=8)
    k = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 5, 8).contiguous()  # KV head j holds the value j
    view = cache.layer(0).update(k, -k, cache.reserve(5))
    assert isinstance(view, GroupedKV) and view.n_kv_heads == 4
    full, stream = view.groups
    assert full.heads.tolist() == [1, 2] and stream.heads.tolist() == [0, 3]  # type: ignore[union-attr]
    assert full.first == 1 and stream.first is None  # heads 1, 2 are one run (a view of the step's keys)
    assert torch.equal(full.kv.keys[0, :, 0, 0], torch.tensor([1.0, 2.0]))
    assert torch.equal(stream.kv.values[0, :, 0, 0], torch.tensor([-0.0, -3.0]))
    q, key = torch.arange(5)[:, None], torch.arange(5)[None]
    seen = {name: group.mask.dense(torch.device("cpu"), torch.float32)[0] for name, group in
            (("full", full), ("stream", stream))}
    assert torch.equal(seen["full"].reshape(5, 5), key <= q)  # type: ignore[union-attr]
    assert torch.equal(seen["stream"].reshape(5, 5), (key <= q) & ((key == 0) | (key > q - 2)))  # type: ignore[union-attr]
    assert torch.cat([full.heads, stream.heads])[view.order].tolist() == [0, 1, 2, 3]  # type: ignore[index,list-item]
    with pytest.raises(MultiheadError, match="no one"):
        dense_view(view)


def test_under_torch_compile_decoding_gives_the_eager_logits_from_one_graph() -> None:
    """Once the streaming slots are full (after the prompt here) every decode step reuses one graph (traced by
    dynamo, run without inductor's code generation)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model, plan = _model(2), _plan(PLANS[2], 2)
    counter = CompileCounter()
    step = torch.compile(lambda t, cache: model(t, cache=cache), backend=counter, fullgraph=True)
    tokens = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        eager = _run(model, tokens, model.new_cache(1, 20, plan=plan), [8] + [1] * 8)
        cache = model.new_cache(1, 20, plan=plan)
        outs = [model(tokens[:, :8], cache=cache)]
        cache.advance(8)
        for i in range(8, 16):
            outs.append(step(tokens[:, i:i + 1], cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(outs, 1), eager, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times over 8 decode steps"


# ---------------------------------------------------------------------------------------------- the plan
def test_from_scores_takes_the_top_fraction_and_breaks_ties_by_layer_then_head() -> None:
    scores = [[0.5, 0.9], [0.5, 0.1], [0.5, 0.5]]
    plan = HeadPlan.from_scores(scores, 0.5, sinks=1, window=4, model="m", shape=(3, 4, 2, 8), method="retrieval")
    assert plan.full == ((True, True), (True, False), (False, False))  # 0.9, then the 0.5s in (layer, head) order
    assert plan.full_fraction == 0.5 and plan.budget == 0.5 and plan.scores is not None
    assert HeadPlan.from_scores(torch.tensor(scores), 0.0, sinks=1, window=4, model="m", shape=(3, 4, 2, 8),
                                method="r").full_fraction == 0.0
    with pytest.raises(MultiheadError, match=r"field 'scores' .* must be a \(n_layers, n_kv_heads\) = \(3, 2\)"):
        HeadPlan.from_scores([[0.5, 0.9]], 0.5, sinks=1, window=4, model="m", shape=(3, 4, 2, 8), method="r")


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = HeadPlan.from_scores([[0.3, 0.1], [0.2, 0.9], [0.0, 0.4]], 0.5, sinks=4, window=16, model="SmolLM2",
                                shape=(3, 4, 2, 8), method="retrieval")
    path = plan.save(tmp_path / "a-plan.json")
    assert HeadPlan.load(path) == plan
    data = json.loads(path.read_text())
    assert data["shape"] == {"n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8}


def _good() -> dict:
    return _plan(PLANS[2], 2).to_json()


BAD = [
    ("model", "", "'model'"),
    ("sinks", -1, "'sinks' \\(-1\\)"),
    ("sinks", 9, "'sinks' \\(9\\) must not exceed the window"),
    ("window", 0, "'window' \\(0\\)"),
    ("window", "5", "'window' \\('5'\\)"),
    ("full", [[True, False]], "'full' .* must be a \\(n_layers, n_kv_heads\\) = \\(3, 2\\)"),
    ("full", [[True, 1], [False, False], [True, True]], "'full' .*matrix of bool"),
    ("scores", [[0.1, float("nan")], [0, 0], [0, 0]], "'scores'"),
    ("budget", 1.5, "'budget' \\(1.5\\)"),
    ("shape", {"n_layers": 3, "n_heads": 4, "n_kv_heads": 3, "head_dim": 8}, "'shape'"),
    ("shape", [3, 4, 2, 8], "'shape'"),
    ("format", "other", "'format'"),
    ("version", 2, "'version' \\(2\\)"),
    ("method", 7, "'method' \\(7\\)"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_every_bad_field_is_refused_naming_the_file_and_field(tmp_path: Path, field: str, value: object,
                                                              message: str) -> None:
    data = _good()
    data[field] = value
    path = tmp_path / "bad-plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(MultiheadError, match=re.escape(repr(str(path))) + ".*" + message):
        HeadPlan.load(path)


def test_missing_unknown_and_broken_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    with pytest.raises(MultiheadError, match="does not exist"):
        HeadPlan.load(path)
    path.write_text("{not json")
    with pytest.raises(MultiheadError, match="not valid JSON"):
        HeadPlan.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(MultiheadError, match="must hold a JSON object"):
        HeadPlan.load(path)
    for drop in ("full", "window", "scores"):
        data = _good()
        del data[drop]
        path.write_text(json.dumps(data))
        with pytest.raises(MultiheadError, match=f"field {drop!r} is missing"):
            HeadPlan.load(path)
    data = _good() | {"extra": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(MultiheadError, match="field 'extra' is unknown"):
        HeadPlan.load(path)


# ---------------------------------------------------------------------------------------------- real model, CLI
def test_smollm2_with_an_all_full_plan_generates_the_full_caches_tokens(smollm2) -> None:  # type: ignore[no-untyped-def]
    from multihead.models.generate import generate_ids

    model, tok = smollm2
    c, a = model.config, model.config.attention()
    plan = HeadPlan(full=[[True] * a.n_kv_heads] * c.n_layers, sinks=4, window=64, model="SmolLM2-135M-Instruct",
                    shape=(c.n_layers, a.n_heads, a.n_kv_heads, a.head_dim), method="all-full")
    prompt = [tok.encode("The capital of France is")]
    want = list(generate_ids(model, prompt, max_new_tokens=4))
    assert list(generate_ids(model, prompt, max_new_tokens=4, plan=plan)) == want


def test_cli_generate_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.cli import main
    from tiny_checkpoints import TINY, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    n_layers, h, g, d = TINY["n_layers"], TINY["n_heads"], TINY["n_kv_heads"], TINY["head_dim"]
    argv = ["generate", "the", "--model", str(gguf), "--max-new-tokens", "5", "--json"]
    full = HeadPlan(full=[[True] * g] * n_layers, sinks=1, window=2, model="tiny", shape=(n_layers, h, g, d))
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*argv, "--plan", str(full.save(tmp_path / "full-plan.json"))]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain
    other = HeadPlan(full=[[True] * g] * (n_layers + 1), sinks=1, window=2, model="other",
                     shape=(n_layers + 1, h, g, d))
    assert main([*argv, "--plan", str(other.save(tmp_path / "other-plan.json"))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"(n_layers {n_layers + 1}," in err and f"(n_layers {n_layers}," in err
    assert main([*argv, "--plan", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([*argv, "--plan", str(tmp_path / "full-plan.json"), "--window", "8"]) == 2
    assert "--plan brings its own sinks and window" in capsys.readouterr().err


def test_the_write_up_says_the_head_wise_cache_runs_through_hf_enable() -> None:
    """Issue 52 item 11: docs/experiments/head-wise-cache.md said the head-wise cache does not run through
    hf.enable; it does (multihead.hf.new_cache(model, max_len, plan=)), which this checks on a tiny transformers Llama
    before checking what the write-up says."""
    import transformers

    from multihead import hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = hf.enable(transformers.LlamaForCausalLM(config).eval())
    plan = HeadPlan(full=[[True, False], [False, True]], sinks=1, window=3, model="tiny", shape=(2, 4, 2, 8))
    cache = hf.new_cache(model, 12, plan=plan)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 10)), cache=cache, use_cache=True)
    assert isinstance(cache.inner, HeadwiseCache)
    assert cache.bytes == cost.headwise_cache_bytes(plan, batch=1, max_len=12, dtype="fp32")
    text = (Path(__file__).parents[1] / "docs" / "experiments" / "head-wise-cache.md").read_text()
    bullet = " ".join(text.split("- **`HeadwiseCache`**", 1)[1].split("\n- **", 1)[0].split())
    assert "Not through `hf.enable`" not in bullet
    assert "Through `hf.enable` too" in bullet and "`multihead.hf.new_cache(model, max_len, plan=plan)`" in bullet
