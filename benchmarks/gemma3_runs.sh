#!/usr/bin/env bash
# Issue 49 item 5: the long-context evaluation on Gemma 3 270M (hybrid: 15 sliding layers of window 512, 3 global
# layers, one KV head each), shared-prefill protocol, as one resumable chain of runs.
#
# Every step writes into a folder of its own under $ROOT (default docs/experiments/shared-runs): one JSON line a
# case, a stopped run resumes where it stopped, a finished one is skipped at once. Run it again after any stop.
# Hours of CPU on two cores: start it in the background, and SIGSTOP / SIGCONT it around anything that is timed.
#
#   1. gemma3-train-passkey-WORDING  the passkey wording, chosen on training cases (--split train --seed 1): each of
#                 needles.PASSKEY_PROMPTS on 4 prompts at 4,096 and 4 at 8,192 tokens, the full cache alone; the
#                 wording whose full cache answers most, ties to the higher mean log-probability of the answer, is
#                 $WORDING (docs/experiments/gemma3-long-context.md gives the counts)
#   2. gemma3-retrieval-train  Wu et al.'s retrieval scores on training cases (--split train --seed 2: passkey and
#                 single-number, $PLAN_PROMPTS prompts each at 4,096 tokens) and the plans over the 3 global layers
#                 they rank: 1 of 3 and 2 of 3 global layers whole, the others 4 sinks + 512 (the sliding layers'
#                 window), copied to $PLANS/gemma3-retrieval-{33,67}-plan.json (default docs/experiments)
#   3. gemma3-test-4k-8k  the evaluation: test split, seed 0, $TEST passkey prompts at 4,096 and at 8,192 tokens;
#                 the full cache, a window of 25%, 4 sinks + window 50% and 25%, int8 and int4, each on the global
#                 layers only (--layers global: the sliding layers keep their window), the two plans and their
#                 uniform controls of the same bytes
#   4. gemma3-test-16k  the same at 16,384 tokens
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-docs/experiments/shared-runs}
PLANS=${PLANS:-docs/experiments}  # where the two plans are copied and read from
PY=${PY:-.venv/bin/python}
WORDING=${WORDING:-number}
PLAN_PROMPTS=${PLAN_PROMPTS:-8}
TEST=${TEST:-50}
run() { "$PY" -m multihead "$@"; }

for w in cue colon number important; do
  [ -f "$ROOT/gemma3-train-passkey-$w/shared-result.json" ] && continue  # finished: no model load to skip it
  run tradeoff --long --model gemma3 --protocol shared --lengths 4096,8192 --tasks passkey --prompts 4 \
    --split train --seed 1 --keep none --window-keep none --bits none --prune none --no-mqa --passkey-prompt "$w" \
    --out "$ROOT/gemma3-train-passkey-$w" >> "$ROOT/gemma3-train-passkey.log" 2>&1
done
if [ ! -f $PLANS/gemma3-retrieval-67-plan.json ]; then
  run heads --model gemma3 --retrieval --lengths 4096 --tasks passkey,single-number --prompts "$PLAN_PROMPTS" \
    --split train --seed 2 --passkey-prompt "$WORDING" --window 512 --budget 0.33,0.67 \
    --out "$ROOT/gemma3-retrieval-train" > "$ROOT/gemma3-retrieval-train.log" 2>&1
  cp "$ROOT"/gemma3-retrieval-train/*-retrieval-33-plan.json $PLANS/gemma3-retrieval-33-plan.json
  cp "$ROOT"/gemma3-retrieval-train/*-retrieval-67-plan.json $PLANS/gemma3-retrieval-67-plan.json
fi
EVAL=(tradeoff --long --model gemma3 --protocol shared --tasks passkey --prompts "$TEST" --layers global
      --passkey-prompt "$WORDING" --keep 0.5,0.25 --window-keep 0.25 --bits 8,4 --prune none --no-mqa
      --plan $PLANS/gemma3-retrieval-33-plan.json --plan $PLANS/gemma3-retrieval-67-plan.json)
for step in "4k-8k 4096,8192" "16k 16384"; do
  set -- $step
  [ -f "$ROOT/gemma3-test-$1/shared-result.json" ] && continue
  run "${EVAL[@]}" --lengths "$2" --out "$ROOT/gemma3-test-$1" >> "$ROOT/gemma3-test-$1.log" 2>&1
done
