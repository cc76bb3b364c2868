"""benchmarks/cache_steps.py (outside the installed package): its arguments are checked, the rounds rotate and time
what they say, and runners stepped in turn each continue their own greedy sequence, as their model alone does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from multihead.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cache_steps


@pytest.mark.parametrize(("argv", "says"), [
    (["--length", "0"], "--length (0) must lie between 1 and SmolLM2's context (8192)"),
    (["--decode-tokens", "0"], "--decode-tokens (0) must be at least 1"),
    (["--warm-steps", "-1"], "--warm-steps (-1) at least 0"),
    (["--caches", "int3"], "unknown ['int3']"),
    (["--dtypes", "float16"], "unknown ['float16']"),
    (["--plan", "no-such-plan.json"], "--plan no-such-plan.json is not a file"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cache_steps.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.strip().splitlines()[-1].startswith("cache_steps.py: error:")


def test_rounds_rotate_the_order_and_time_only_after_the_warm_ones() -> None:
    calls: list[str] = []
    runners = {name: (lambda name=name: calls.append(name) or torch.zeros(1, 1)) for name in "abc"}
    times = cache_steps.interleave(runners, steps=4, warm=2)
    assert calls[:9] == list("abc" "bca" "cab")  # each round starts one further on
    assert len(calls) == 3 * 6 and {name: len(t) for name, t in times.items()} == {"a": 4, "b": 4, "c": 4}


def test_interleaved_runners_each_continue_their_own_greedy_sequence() -> None:
    """Stepped in turn, each runner's tokens are those its model gives alone: transformers' against its own
    generate, multihead's full and sink caches (a window longer than the text) against the uncached forward."""
    import transformers
    torch.manual_seed(0)
    L, h, g, d, n, steps = 2, 4, 2, 32, 40, 4
    ours = LlamaModel(LlamaConfig(vocab_size=128, d_model=h * d, n_layers=L, n_heads=h, n_kv_heads=g, ffn_dim=64,
                                  max_context=128)).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=h * d, intermediate_size=64, num_hidden_layers=L, num_attention_heads=h,
        num_key_value_heads=g, max_position_embeddings=128, attn_implementation="sdpa")).eval()
    s = cache_steps.Settings(length=n, dtypes=("float32",), caches=("full", "sink", "int8"),
                             decode_tokens=steps - 1, warm_steps=1, plan="-", transformers=True)
    tokens = torch.randint(0, 128, (1, n))
    runners = {kind: cache_steps.multihead_runner(ours, kind, tokens, s, None)[0] for kind in s.caches}
    runners["transformers"] = cache_steps.transformers_runner(hf, tokens)[0]
    seen: dict[str, list[int]] = {name: [] for name in runners}
    times = cache_steps.interleave(
        {name: (lambda name=name, step=step: seen[name].append(int(step())) or torch.zeros(1, 1))
         for name, step in runners.items()}, s.decode_tokens, s.warm_steps)
    assert all(len(t) == steps - 1 for t in times.values()) and all(len(x) == steps for x in seen.values())
    with torch.no_grad():
        want = hf.generate(tokens, max_new_tokens=steps + 1, do_sample=False)[0, n + 1:]  # after the prefill's token
        assert seen["transformers"] == want.tolist()
        first = int(ours(tokens)[0, -1].argmax())
        text = torch.cat([tokens, torch.tensor([[first, *seen["full"][:-1]]])], 1)
        uncached = ours(text)[0, n - 1:].argmax(-1)[1:].tolist()  # the greedy token after each decode step's input
    assert seen["full"] == uncached and seen["sink"] == uncached
