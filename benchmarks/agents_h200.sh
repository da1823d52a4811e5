#!/usr/bin/env bash
# Agents on one H200: multi-turn rollout throughput against single-turn rollouts of the same sampled token
# count (bench), the calculator recipe (calculator) beside TRL's GRPOTrainer(tools=...) on the same config
# (trl), the calculator-agent recipe (calculator-agent: the same task through an openai-client program and the
# endpoint) and the guess-number recipe (guess). Needs the SmolLM2 GGUF at $RLCU_SMOLLM2_GGUF.
#   benchmarks/agents_h200.sh OUT PART...      PART: bench | calculator | trl | calculator-agent | guess
# CALC_MINUTES / GUESS_MINUTES bound the recipe runs (defaults 3.5 and 5; CALC_MINUTES both calculator recipes).
set -uo pipefail
OUT=$1; shift
mkdir -p "$OUT"
CALC_MINUTES=${CALC_MINUTES:-3.5}
GUESS_MINUTES=${GUESS_MINUTES:-5}
hms() { python3 -c "s=int(float('$1')*60); print(f'00:{s//3600:02d}:{s%3600//60:02d}:{s%60:02d}')"; }

for part in "$@"; do
  case $part in
    bench)
      for n in 64 512; do
        for turns in 1 4; do
          rlcu bench rollout --sequences $n --new_tokens 512 --turns $turns --turn_tokens 32 \
            > "$OUT/rollout-$n-turns$turns.log" 2>&1
          tail -1 "$OUT/rollout-$n-turns$turns.log" > "$OUT/rollout-$n-turns$turns.json"
        done
      done ;;
    calculator)
      rlcu run calculator --trainer.max_time="$(hms "$CALC_MINUTES")" --trainer.enable_progress_bar=false \
        > "$OUT/calculator.log" 2>&1
      cp runs/calculator/version_0/metrics.csv "$OUT/calculator-metrics.csv" ;;
    calculator-agent)
      rlcu run calculator-agent --trainer.max_time="$(hms "$CALC_MINUTES")" --trainer.enable_progress_bar=false \
        > "$OUT/calculator-agent.log" 2>&1
      cp runs/calculator-agent/version_0/metrics.csv "$OUT/calculator-agent-metrics.csv" ;;
    trl)
      python3 recipes/trl_baseline.py calculator --out "$OUT/calculator-trl.csv" --max_minutes "$CALC_MINUTES" \
        > "$OUT/calculator-trl.log" 2>&1 ;;
    guess)
      rlcu run guess-number --trainer.max_time="$(hms "$GUESS_MINUTES")" --trainer.enable_progress_bar=false \
        > "$OUT/guess.log" 2>&1
      cp runs/guess-number/version_0/metrics.csv "$OUT/guess-metrics.csv" ;;
  esac
done
python3 benchmarks/agents_summary.py "$OUT"
