#!/usr/bin/env bash
# Issue 39's long-context evaluation under the shared-prefill protocol, as one resumable chain of runs.
#
# Every step is a `multihead tradeoff --long --protocol shared` run into a folder of its own under $ROOT (default
# docs/experiments/shared-runs, so that the answers travel with the repository and a later session resumes them):
# one JSON line a case, a stopped run resumes where it stopped, a finished one is skipped at once. Run it again
# after any stop; it goes on with the first step that has cases left. Hours of CPU on two cores: start it in the
# background, and SIGSTOP / SIGCONT it around anything that is timed.
#
#   1. train-4k   plans chosen here: 4,096 tokens, --split train --seed 1 (haystacks from the text's training split,
#                 other needles and depths), $TRAIN prompts a task, every plan at 25% and 50% of KV heads
#   2. test-4k    the evaluation: the test split, seed 0, $TEST prompts a task, the same methods
#   3. test-8k    8,144 tokens (the longest SmolLM2's context leaves room for), $TEST8K prompts a task: the full
#                 cache, the uniform sinks + window at 50%, int4 and the plan chosen at 50% on train-4k (with its
#                 uniform control of the same bytes)
#   4. fp32-4k    the first $FP32 prompts a task of test-4k again in float32 (same case ids), the full cache, the
#                 uniform 50% and int4: does bfloat16 keep their answers?
#   5. stream-4k  the streaming protocol's sample (each method prefills through its own cache, float32, the real
#                 peak memory): the first $STREAM prompts a task of test-4k (the same case ids), the full cache, the
#                 uniform 50%, int4 and the duo plan at 50% with its uniform control; --threshold 0 so that every
#                 method runs on the passkey cell too
#   6. kvpress-4k kvpress's presses (StreamingLLM, SnapKV, Expected Attention, AdaKV, DuoAttention with kvpress's
#                 own on-the-fly head pattern) at 50% and 75% compression (the bytes of the uniform 50% and 25%) on
#                 the first $KVPRESS prompts a task of test-4k (the same case ids), bfloat16, in kvpress's own
#                 environment (benchmarks/kvpress_setup.sh; kvpress pins transformers < 5.3); resumable too. The
#                 same shared prefill: one a prompt, every press compressing it (kvpress_longctx run --protocol
#                 shared, checked bit for bit against each press's own prefill on the first 2 prompts), with
#                 transformers' full cache beside them.
#   7. duo-gates  the DuoAttention-style gates trained longer, at the evaluation's streaming window (4 sinks + 256)
#                 on 1,024-token prompts of the training split: $DUO_STEPS steps (the shipped gates had 40 at
#                 512 tokens and a window of 128), a checkpoint every 2 steps, resumed; with their 25% and 50% plans
#                 (plan-duo-25.json, plan-duo-50.json in the folder) for a later run beside the shipped plans.
#   8. train-4k-kvduo, test-4k-kvduo   kvpress's DuoAttention head choice (the duo pattern kvpress-4k scored on the
#                 training split, docs/experiments/kvpress-duo-pattern.json) as multihead plans at 25% and 50% of
#                 the KV heads (kvpress_longctx.py plan: smollm2-kvduo-25/50-plan.json, 4 sinks + 256), on train-4k's
#                 cases and then test-4k's, those plans alone (the other methods are in train-4k and test-4k, on the
#                 same case ids; shared_report combines the runs and --choose-on ranks every plan together).
#   9. train-4k-duo1024  the plans of duo-gates' step-400 gates (copied to
#                 docs/experiments/smollm2-duo1024-25/50-plan.json) on train-4k's cases, those plans alone, ranked
#                 with the others there.
#  10. duo-gates-avg  the same gates trained on from step 400 to 600 in a copy of duo-gates' folder, averaged over
#                 steps 401-600 (--average-from 400): single checkpoints' plans keep changing a few heads, the mean
#                 gates' do not (benchmarks/duo_settling.py); plans copied to smollm2-duoavg-25/50-plan.json.
#  11. train-4k-duoavg, test-4k-gates   the averaged gates' plans on train-4k's cases; then both gate runs' plans
#                 (duo1024 and duoavg, 25% and 50%) on test-4k's cases, in one run.
#  12. test-8k-quarter  the plan chosen at 24% of the KV heads on train-4k (duo1024, chosen after test-8k ran) at
#                 8,144 tokens on the first $QUARTER8K prompts a task of test-8k (the same case ids), with its uniform
#                 control and the full cache (test-8k's too: shared_report reports how often the two agree).
#
# Usage:  bash benchmarks/shared_runs.sh [STEP ...]     (default: every step, in the order
#         train-4k test-4k fp32-4k stream-4k test-8k kvpress-4k train-4k-kvduo test-4k-kvduo duo-gates
#         train-4k-duo1024 duo-gates-avg train-4k-duoavg test-4k-gates test-8k-quarter)
#         TRAIN=50 TEST=200 TEST8K=100 FP32=50 STREAM=10 KVPRESS=50 DUO_STEPS=400 QUARTER8K=50
#         ROOT=docs/experiments/shared-runs
# The report: .venv/bin/python benchmarks/shared_report.py --runs $ROOT/test-4k --choose-on $ROOT/train-4k ...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
ROOT="${ROOT:-docs/experiments/shared-runs}"
TRAIN="${TRAIN:-50}"
TEST="${TEST:-200}"
TEST8K="${TEST8K:-100}"
QUARTER8K="${QUARTER8K:-50}"
FP32="${FP32:-50}"
STREAM="${STREAM:-10}"
KVPRESS="${KVPRESS:-50}"
DUO_STEPS="${DUO_STEPS:-400}"
MH="${MH:-.venv/bin/multihead}"
PY="${PY:-.venv/bin/python}"

PLANS=()
for score in duo mass retrieval razor; do
  for pct in 25 50; do
    PLANS+=(--plan "docs/experiments/smollm2-$score-$pct-plan.json")
  done
done
COMMON=(tradeoff --long --protocol shared --tasks passkey,single-number --haystacks jargon,filler --no-mqa)
METHODS=(--bits 8,4 --keep 0.5,0.25 --window-keep none)  # with PLANS: the methods issue 39 names

logged() {  # NAME COMMAND...: the command's output in $ROOT/NAME.log, its last lines shown, a failure said
  local name="$1"; shift
  echo "== $name: $(date -u +%FT%TZ)"
  "$@" > "$ROOT/$name.log" 2>&1 || {
    echo "$name failed: the end of $ROOT/$name.log:"; tail -5 "$ROOT/$name.log"; exit 1; }
  tail -3 "$ROOT/$name.log"
}

step() {  # NAME FLAGS...: a shared-prefill run into $ROOT/NAME
  local name="$1"; shift
  logged "$name" "$MH" "${COMMON[@]}" --out "$ROOT/$name" "$@"
}

chosen_plan() {  # SHARE ("0.50", "0.24"): the plan chosen at that share of KV heads full on train-4k (and the plans
  # run later on its cases)
  "$PY" - "$1" "$ROOT/train-4k" "$ROOT/train-4k-kvduo" "$ROOT/train-4k-duo1024" "$ROOT/train-4k-duoavg" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from shared_report import choose
runs = [Path(f) for f in sys.argv[2:] if (Path(f) / "shared-settings.json").is_file()]
print(choose(runs)["by_full_share"][sys.argv[1]]["plan"])
EOF
}

PLANS_ONLY=(--bits none --keep none --window-keep none)
KVDUO=("${PLANS_ONLY[@]}" --plan docs/experiments/smollm2-kvduo-25-plan.json
       --plan docs/experiments/smollm2-kvduo-50-plan.json)
kvduo_plans() {  # the plans of kvpress's duo pattern (made by the kvpress-4k step, kept in docs/experiments)
  for pct in 25 50; do
    [ -f "docs/experiments/smollm2-kvduo-$pct-plan.json" ] || "$PY" benchmarks/kvpress_longctx.py plan \
      --pattern docs/experiments/kvpress-duo-pattern.json --fraction "0.$pct" \
      --out "docs/experiments/smollm2-kvduo-$pct-plan.json"
  done
}

DUO1024=(--plan docs/experiments/smollm2-duo1024-25-plan.json --plan docs/experiments/smollm2-duo1024-50-plan.json)
DUOAVG=(--plan docs/experiments/smollm2-duoavg-25-plan.json --plan docs/experiments/smollm2-duoavg-50-plan.json)
gate_plans() {  # FOLDER NAME: the plans a gate run wrote when its last step was done, as smollm2-NAME-<pct>-plan.json
  for pct in 25 50; do
    local made="$ROOT/$1/plan-duo-$pct.json"
    [ -f "$made" ] || { echo "no $made: run the step that trains $1 to its end first" >&2; exit 1; }
    local plan="docs/experiments/smollm2-$2-$pct-plan.json"
    [ -f "$plan" ] || cp "$made" "$plan"
  done
}

kvpress_step() {
  echo "== kvpress-4k: $(date -u +%FT%TZ)"
  bash benchmarks/kvpress_setup.sh > "$ROOT/kvpress-4k.log" 2>&1
  local kpy=out/kvpress-venv/bin/python cases=out/kvpress/test-4k-cases.jsonl pattern=out/kvpress/duo-pattern.json
  mkdir -p out/kvpress
  # the cases of test-4k by id (the same generator and settings), written for kvpress's reader
  "$MH" tradeoff --long --tasks passkey,single-number --haystacks jargon,filler --lengths 4096 --seed 0 \
    --prompts "$KVPRESS" --cases-jsonl "$cases" >> "$ROOT/kvpress-4k.log" 2>&1
  [ -f "$pattern" ] || "$kpy" benchmarks/kvpress_longctx.py duo-pattern --out "$pattern" >> "$ROOT/kvpress-4k.log" 2>&1
  "$kpy" benchmarks/kvpress_longctx.py run --cases "$cases" --out "$ROOT/kvpress-4k.json" --dtype bfloat16 \
    --presses full streaming_llm snapkv expected_attention adakv_expected_attention duo_attention --ratios 0.5 0.75 \
    --duo-pattern "$pattern" >> "$ROOT/kvpress-4k.log" 2>&1 || {
    echo "kvpress-4k failed: the end of $ROOT/kvpress-4k.log:"; tail -5 "$ROOT/kvpress-4k.log"; exit 1; }
  tail -3 "$ROOT/kvpress-4k.log"
}

mkdir -p "$ROOT"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(train-4k test-4k fp32-4k stream-4k test-8k kvpress-4k train-4k-kvduo test-4k-kvduo
                               duo-gates train-4k-duo1024 duo-gates-avg train-4k-duoavg test-4k-gates
                               test-8k-quarter)
for s in "${steps[@]}"; do
  case "$s" in
    # (train-4k was started with a plain window of 25% too, --window-keep 0.25, and resumes with it)
    train-4k) step train-4k --lengths 4096 --split train --seed 1 --prompts "$TRAIN" --dtype bf16 --bits 8,4 \
                --keep 0.5,0.25 --window-keep 0.25 "${PLANS[@]}" ;;
    test-4k)  step test-4k --lengths 4096 --split test --seed 0 --prompts "$TEST" --dtype bf16 "${METHODS[@]}" \
                "${PLANS[@]}" ;;
    test-8k)  best="$(chosen_plan 0.50)"; echo "plan chosen on train-4k at 50%: $best"
              step test-8k --lengths 8144 --split test --seed 0 --prompts "$TEST8K" --dtype bf16 --bits 4 \
                --keep 0.5 --window-keep none --plan "$best" ;;
    fp32-4k)  step fp32-4k --lengths 4096 --split test --seed 0 --prompts "$FP32" --dtype fp32 --bits 4 --keep 0.5 \
                --window-keep none ;;
    stream-4k) logged stream-4k "$MH" tradeoff --long --protocol streaming --tasks passkey,single-number \
                 --haystacks jargon,filler --lengths 4096 --seed 0 --prompts "$STREAM" --bits 4 --keep 0.5 \
                 --window-keep none --no-mqa --prune none --threshold 0 \
                 --plan docs/experiments/smollm2-duo-50-plan.json --out "$ROOT/stream-4k" ;;
    kvpress-4k) kvpress_step ;;
    train-4k-kvduo) kvduo_plans; step train-4k-kvduo --lengths 4096 --split train --seed 1 --prompts "$TRAIN" \
                      --dtype bf16 "${KVDUO[@]}" ;;
    test-4k-kvduo) kvduo_plans; step test-4k-kvduo --lengths 4096 --split test --seed 0 --prompts "$TEST" \
                     --dtype bf16 "${KVDUO[@]}" ;;
    train-4k-duo1024) gate_plans duo-gates-1024 duo1024; step train-4k-duo1024 --lengths 4096 --split train \
                        --seed 1 --prompts "$TRAIN" --dtype bf16 "${PLANS_ONLY[@]}" "${DUO1024[@]}" ;;
    duo-gates-avg) [ -d "$ROOT/duo-gates-1024-avg" ] || {
                     [ -f "$ROOT/duo-gates-1024/plan-duo-50.json" ] || {
                       echo "duo-gates has not run to its end: run it first" >&2; exit 1; }
                     mkdir "$ROOT/duo-gates-1024-avg"
                     cp "$ROOT"/duo-gates-1024/{state.json,duo.safetensors,gates.json} "$ROOT/duo-gates-1024-avg/"; }
                   logged duo-gates-1024-avg "$PY" -m multihead.tradeoff.duo --steps $((DUO_STEPS + 200)) \
                     --average-from "$DUO_STEPS" --length 1024 --sinks 4 --window 256 --every 2 --budget 0.25 \
                     --budget 0.5 --out "$ROOT/duo-gates-1024-avg" ;;
    train-4k-duoavg) gate_plans duo-gates-1024-avg duoavg; step train-4k-duoavg --lengths 4096 --split train \
                       --seed 1 --prompts "$TRAIN" --dtype bf16 "${PLANS_ONLY[@]}" "${DUOAVG[@]}" ;;
    test-4k-gates) gate_plans duo-gates-1024 duo1024; gate_plans duo-gates-1024-avg duoavg
                   step test-4k-gates --lengths 4096 --split test --seed 0 --prompts "$TEST" --dtype bf16 \
                     "${PLANS_ONLY[@]}" "${DUO1024[@]}" "${DUOAVG[@]}" ;;
    test-8k-quarter) gate_plans duo-gates-1024 duo1024; gate_plans duo-gates-1024-avg duoavg
                     quarter="$(chosen_plan 0.24)"; echo "plan chosen on train-4k at 24%: $quarter"
                     step test-8k-quarter --lengths 8144 --split test --seed 0 --prompts "$QUARTER8K" --dtype bf16 \
                       "${PLANS_ONLY[@]}" --plan "$quarter" ;;
    duo-gates) logged duo-gates-1024 "$PY" -m multihead.tradeoff.duo --steps "$DUO_STEPS" --length 1024 --sinks 4 \
                 --window 256 --every 2 --budget 0.25 --budget 0.5 --out "$ROOT/duo-gates-1024" ;;
    *) echo "unknown step $s: choose from train-4k test-4k fp32-4k stream-4k test-8k kvpress-4k duo-gates" \
         "train-4k-kvduo test-4k-kvduo train-4k-duo1024 duo-gates-avg train-4k-duoavg test-4k-gates" \
         "test-8k-quarter" >&2; exit 2 ;;
  esac
done
echo "== done: $(date -u +%FT%TZ)"
