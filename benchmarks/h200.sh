#!/usr/bin/env bash
# rlcu's speed benchmarks and the peers', side by side on one GPU (docs/benchmarks.md quotes these runs).
#   benchmarks/h200.sh OUT_DIR PART [PEERS_DIR]
# PART: rlcu (rollout 64 and 512 sequences, GRPO steps 8x8 and 32x8, with and without shared-prefix decode, and
# the micro-batch variants), targets (issue #20's 0.6B rows with profiles, and TRL's), targets-long (its 1.7B
# rows: 8x8x4096 with a profiled extra step and with FP8 keys and values, 16x16x2048; TRL's are the long part),
# uneven (uneven completion lengths: scoring during generation, packing), profile (the two rollouts under the
# profiler), rlcu-extra (no look-ahead, packing),
# trl8 / trl32 (TRL's GRPO step), hf (transformers generate), ddp (the countdown recipe on one GPU, then two
# under DDP and under FSDP; needs the SmolLM2 weights, RLCU_SMOLLM2_GGUF), ab (rollouts 64 and 512 and the 8x8
# step of the tree in $BASE, an older checkout's rlcu/, then of this one, alternating: a change that must not
# cost speed; KV the kv_cache_dtype, default auto), memory (the 1.7B and 4B
# shapes, full fine-tuning, fp32 and bf16 AdamW moments, on GPU 0 while TRL runs them on GPU 1), fsdp8b (the 8B
# shape, full fine-tuning, under fsdp2 on two GPUs), long (GRPO steps of reasoning length at the Qwen3-1.7B shape,
# 8x8x4096 and 16x16x2048, padded and packed, on GPU 0 while TRL runs each on GPU 1, or after it on a machine of
# one GPU; LONG picks the workloads, MB rlcu's micro-batch, SIDES as for curves, KV rlcu's kv_cache_dtype),
# families (issue #40's dense families at public shapes beside TRL; FAMILIES picks them), hybrids (issue #43's rows
# at the Qwen3.5 shapes beside TRL; HYBRID picks them among rollout, turns, step, step-bf16-moments, step-lean,
# step-prof, delta-train, bf16-states, trl, lora, trl-lora, trl-fla and trl-lora-fla; TRL_PYTHONPATH is trl and trl-lora's
# PYTHONPATH, default rlcu's: leave fla off it where fla's backward refuses the machine's Triton, and TRL runs
# transformers' PyTorch delta rule; trl-fla and trl-lora-fla run TRL on rlcu's path with fla, its guard lifted where
# its backward probes right, TRL_FLA=lifted in benchmarks/trl_family.py),
# scaling (issue #46: per-GPU throughput of the host's GPUs against one at the same batch per GPU; SCALE picks
# "ddp" (1.7B), "stream" (0.6B, streaming under ddp) and "fsdp" (8B, fsdp2)), tp (issue #46: tensor parallelism at
# the 8B, 32B and 72B shapes, as many as the host's GPUs allow; TP picks them),
# exact (issue #45: exact mode and the default side by side; EXACT picks rollout, step, big, fp8, rows, hybrid),
# fp8 (the rollouts and the two 0.6B steps with kv_cache_dtype auto, then fp8), streaming (issue #44: the 8x8 step
# synchronous and streaming, each step's phases and allocator retries, then streaming with four extra steps under one
# profile; BESIDE="64 128" adds streaming with that many decode steps beside each step's training, and the 1.7B
# long tail synchronous, then streaming with 0 and BESIDE's first, or LONG_BESIDE's values, beside, at
# max_staleness LONG_STALENESS, default 2, and LONG_ARGS: say "--beside_priority -1 --max_num_seqs 512"), http (issue #42: 64 episodes of 4 turns in-process, then as HTTP agent programs with the default agent_processes, on a thread, and in AGENT_PROCESSES worker processes),
# stream-curves (issue #44: recipes synchronous and streaming over seeds, held-out accuracy per sample trained;
# RECIPES, SEEDS, STEPS, EVERY), curves (recipes trained for MINUTES minutes, default 8, with held-out accuracy, on GPU 0 while
# recipes/trl_baseline.py runs the same recipe on GPU 1, or after it on a machine of one GPU; RECIPES picks them,
# default "gsm8k reasoning-gym", MODEL the model, default smollm2-135m-instruct, TRL_EVAL_EVERY TRL's steps between
# held-out evaluations, default the recipe's; SIDES "rlcu", "trl" or both, the default: one side per run of
# the script when both do not fit in one, then `python3 recipes/curves.py` on the two CSVs). RUNS picks ddp's
# runs (default "one ddp fsdp"). PEERS_DIR holds ../shared/peers (default .peers).
set -uo pipefail
out=${1:?OUT_DIR}; part=${2:?PART}; peers=${3:-.peers}
mkdir -p "$out"
rlcu() { python3 -m rlcu.cli "$@"; }
log() { local name=$1; shift; echo "== $name: $*"; "$@" > "$out/$name.log" 2>&1; echo "rc=$?"; grep -E '^\{|^TRL|^HFGEN|^DIAG|run [0-9]|step [0-9]' "$out/$name.log" | tail -8; }
case $part in
  rlcu)
    log rollout64 rlcu bench rollout --sequences 64 --new_tokens 512
    log rollout512 rlcu bench rollout --sequences 512 --new_tokens 512
    log step8x8 rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 4 --profile "$out/prof8x8"
    log step32x8 rlcu bench step --prompts 32 --generations 8 --new_tokens 512 --steps 3
    log step32x8nockpt rlcu bench step --prompts 32 --generations 8 --new_tokens 512 --steps 3 --micro_batch_size 32 \
      --no_gradient_checkpointing
    # shared-prefix decode (by default at decode steps of 256 sequences or more) off; and forced on at 128
    log step32x8plain rlcu bench step --prompts 32 --generations 8 --new_tokens 512 --steps 3 --shared_prefix off
    log step16x8 rlcu bench step --prompts 16 --generations 8 --new_tokens 512 --steps 3
    log step16x8shared rlcu bench step --prompts 16 --generations 8 --new_tokens 512 --steps 3 --shared_prefix on
    # the micro-batch: 16 rows (the peer's) leave the GPU waiting on the host's kernel launches
    log step8x8mb16 rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 4 --micro_batch_size 16 ;;
  profile)
    # where a rollout's time goes: wall time against the GPU's busy time, kernels, host operators
    log rollout64prof rlcu bench rollout --sequences 64 --new_tokens 512 --repeats 1 --profile "$out/prof-rollout64"
    log rollout512prof rlcu bench rollout --sequences 512 --new_tokens 512 --repeats 1 --profile "$out/prof-rollout512"
    ;;
  rlcu-extra)
    # without the engine's look-ahead, for its share; padding-free training (off by default)
    log rollout512nola rlcu bench rollout --sequences 512 --new_tokens 512 --no_lookahead
    log step8x8pack rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 4 --packing ;;
  families)
    # the dense families at public shapes (random weights, rlcu bench's FAMILY_SHAPES): rollouts 64 and 512, the 8x8
    # step, then TRL's step on the same transformers model (benchmarks/trl_family.py); FAMILIES picks them; the 7B
    # trains LoRA r=16 on both sides (TRL's fp32 full fine-tuning of 7B does not fit); pythia-1b is the fallback
    for f in ${FAMILIES:-gemma3-1b smollm3-3b phi4-mini mistral-7b pythia-1b}; do
      lora=0; case $f in mistral-7b|olmo3-7b) lora=16 ;; esac
      log rollout64-$f rlcu bench rollout --model "$f-random" --sequences 64 --new_tokens 512
      log rollout512-$f rlcu bench rollout --model "$f-random" --sequences 512 --new_tokens 512
      log step8x8-$f rlcu bench step --model "$f-random" --prompts 8 --generations 8 --new_tokens 512 --steps 3 \
        --lora_rank $lora
      [ "$lora" = 0 ] && lora=
      LORA=$lora log trl-$f python3 benchmarks/trl_family.py "$peers" "$f-random" 8 8 512 2
    done ;;
  hybrids)
    # issue #43: the 2B shape's 512-sequence rollout, then a shorter one under the profiler; 64 episodes of 4 turns
    # against single turns of the same tokens; the 8x8 steps at 2B (also with bf16 AdamW moments), and at 9B with LoRA
    # r=16; TRL's on the same models
    q=qwen3.5-2b-random; q9=qwen3.5-9b-random
    for w in ${HYBRID:-rollout turns step trl lora trl-lora}; do
      case $w in
        rollout)
          log rollout512-$q rlcu bench rollout --model $q --sequences 512 --new_tokens 512 --repeats 2
          log rollout512-prof-$q rlcu bench rollout --model $q --sequences 512 --new_tokens 128 --repeats 1 \
            --profile "$out/prof-rollout512-$q" ;;
        turns)
          log rollout64-$q rlcu bench rollout --model $q --sequences 64 --new_tokens 512 --repeats 2
          log turns4-$q rlcu bench rollout --model $q --sequences 64 --new_tokens 512 --turns 4 --repeats 2 ;;
        step) log step8x8-$q rlcu bench step --model $q --prompts 8 --generations 8 --new_tokens 512 --steps 3 ;;
        # the delta rule's states in bf16 in the pool (vLLM's mamba_ssm_cache_dtype): the rollouts at 512 and 64
        # sequences and the 9B LoRA step, each beside its fp32-state run of the same part (rollout, turns, lora)
        bf16-states)
          log rollout512-bf16-states-$q rlcu bench rollout --model $q --sequences 512 --new_tokens 512 --repeats 2 \
            --mamba_ssm_cache_dtype bfloat16
          log rollout64-bf16-states-$q rlcu bench rollout --model $q --sequences 64 --new_tokens 512 --repeats 2 \
            --mamba_ssm_cache_dtype bfloat16
          log step8x8-lora-bf16-states-$q9 rlcu bench step --model $q9 --prompts 8 --generations 8 --new_tokens 512 \
            --steps 3 --lora_rank 16 --mamba_ssm_cache_dtype bfloat16 ;;
        # one layer's delta rule forward and backward at the step's shape, by training's path (fla's backward where
        # its probe found it right) and by the PyTorch chunked form's backward
        delta-train) log delta-train python3 benchmarks/gated_delta_train.py 64 640; tail -4 "$out/delta-train.log" ;;
        # AdamW's moments in bf16 (the peer trains bf16 weights with bf16 moments): the memory row's other setting
        step-bf16-moments) log step8x8-bf16-moments-$q rlcu bench step --model $q --prompts 8 --generations 8 \
          --new_tokens 512 --steps 3 --adam_state_dtype bfloat16 ;;
        # and no fp32 masters: the peer's 8 bytes a parameter (bf16 weights, gradients and moments)
        step-lean) log step8x8-lean-$q rlcu bench step --model $q --prompts 8 --generations 8 --new_tokens 512 \
          --steps 3 --adam_state_dtype bfloat16 --no_master_weights ;;
        # one more step under the profiler: where the step's generate and train phases go, by kernel
        step-prof) log step8x8-prof-$q rlcu bench step --model $q --prompts 8 --generations 8 --new_tokens 512 \
          --steps 2 --profile "$out/prof-step8x8-$q" ;;
        lora) log step8x8-lora-$q9 rlcu bench step --model $q9 --prompts 8 --generations 8 --new_tokens 512 --steps 3 \
          --lora_rank 16 ;;
        trl) PYTHONPATH=${TRL_PYTHONPATH:-$PYTHONPATH} log trl-$q python3 benchmarks/trl_family.py "$peers" $q 8 8 512 2 ;;
        trl-lora) PYTHONPATH=${TRL_PYTHONPATH:-$PYTHONPATH} LORA=16 log trl-lora-$q9 python3 benchmarks/trl_family.py \
          "$peers" $q9 8 8 512 ${TRL_STEPS:-2} ;;
        # TRL with fla (the targets' peer): rlcu's PYTHONPATH, fla's guard lifted where its backward probes right
        trl-fla) TRL_FLA=lifted log trl-fla-$q python3 benchmarks/trl_family.py "$peers" $q 8 8 512 2 ;;
        trl-lora-fla) TRL_FLA=lifted LORA=16 log trl-lora-fla-$q9 python3 benchmarks/trl_family.py "$peers" $q9 8 8 512 \
          ${TRL_STEPS:-2} ;;
      esac
    done ;;
  exact)
    # issue #45: exact mode beside the default mode in one run, each workload both ways; EXACT picks the workloads
    # (default "rollout step"; "big" is the 8x8 step at the 1.7B shape and LoRA r=16 at the 8B shape; "fp8" the
    # 512-sequence rollout and the 8x8 step over an FP8 KV cache; "rows" exact decode attention at 16 and 32 rows a
    # program, its bits against the training forward's; "hybrid" the 64-sequence rollout and the 8x8 step at the
    # Qwen3.5-2B shape, whose Gated DeltaNet layers run token by token in exact mode; "layers" the hybrids' exact
    # gap bisected by layer kind and by engine feature, benchmarks/exact_hybrid_layers.py). A 2-step run first, not
    # reported: on a fresh machine the first step run's last step took 0.24 s more (docs/benchmarks.md "48ce5f9"),
    # which would flatter exact mode, whose runs come second.
    log exact-warmup rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 2
    for w in ${EXACT:-rollout step}; do
      for mode in default exact; do
        e=; [ $mode = exact ] && e=--exact_logprobs
        case $w in
          rollout)
            log rollout64-$mode rlcu bench rollout --sequences 64 --new_tokens 512 $e
            log rollout512-$mode rlcu bench rollout --sequences 512 --new_tokens 512 $e ;;
          step) log step8x8-$mode rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 3 $e ;;
          rows) [ $mode = exact ] && log exact-decode-rows python3 benchmarks/exact_decode_rows.py ;;
          layers) [ $mode = exact ] && log exact-hybrid-layers python3 benchmarks/exact_hybrid_layers.py \
            q35-all-linear q35-all-linear:lookahead=0 q35-all-linear:cuda_graphs=0 \
            q35-all-linear:lookahead=0,cuda_graphs=0 q35-all-linear:max_num_seqs=128 q35-all-linear:ops=1 \
            qnext-default:ops=1
            [ $mode = exact ] && log exact-delta-kernels python3 -m pytest -q -rf tests/kernels/test_gated_delta.py \
              -k exact_sequences ;;
          hybrid)
            log rollout64-qwen3.5-2b-$mode rlcu bench rollout --model qwen3.5-2b-random --sequences 64 \
              --new_tokens 512 $e
            log step8x8-qwen3.5-2b-$mode rlcu bench step --model qwen3.5-2b-random --prompts 8 --generations 8 \
              --new_tokens 512 --steps 3 $e ;;
          fp8)
            log rollout512-fp8-$mode rlcu bench rollout --sequences 512 --new_tokens 512 --kv_cache_dtype fp8 $e
            log step8x8-fp8-$mode rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 3 \
              --kv_cache_dtype fp8 $e ;;
          big)
            log step8x8-1.7b-$mode rlcu bench step --model qwen3-1.7b-random --prompts 8 --generations 8 \
              --new_tokens 512 --steps 3 $e
            log step8x8-8b-lora-$mode rlcu bench step --model qwen3-8b-random --prompts 8 --generations 8 \
              --new_tokens 512 --steps 3 --lora_rank 16 $e ;;
        esac
      done
    done ;;
  ab)
    # python3 -m puts the working folder first on the path: each tree runs from its own folder
    base=$(cd "${BASE:?BASE: a folder holding an older rlcu/}" && pwd); out=$(cd "$out" && pwd)
    for round in $(seq 1 "${ROUNDS:-1}"); do
      for tree in "$base" "$PWD"; do
        tag=$( [ "$tree" = "$PWD" ] && echo head || echo base )$round
        (cd "$tree" && log rollout64-$tag rlcu bench rollout --sequences 64 --new_tokens 512 --kv_cache_dtype "${KV:-auto}";
         log rollout512-$tag rlcu bench rollout --sequences 512 --new_tokens 512 --kv_cache_dtype "${KV:-auto}";
         log step8x8-$tag rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 4 --kv_cache_dtype "${KV:-auto}")
      done
    done ;;
  memory)
    (cd "$peers" && for shape in 1.7b 4b; do
       CUDA_VISIBLE_DEVICES=1 SHAPE=$shape log trl-$shape python3 trl_grpo.py 8 8 512 3; done) &
    for shape in 1.7b 4b; do
      for state in float32 bfloat16; do
        CUDA_VISIBLE_DEVICES=0 log step-$shape-$state rlcu bench step --model qwen3-$shape-random --prompts 8 \
          --generations 8 --new_tokens 512 --steps 4 --adam_state_dtype $state
      done
    done
    wait ;;
  scaling)
    # issue #46: per-GPU throughput of all the host's GPUs against one, at the same batch per GPU (8 prompts x 8):
    # the 1.7B shape under ddp, streaming at the 0.6B shape under ddp (SCALE picks "ddp", "stream", "fsdp"), the 8B
    # shape under fsdp2 (bf16 AdamW moments, so that one GPU holds it too)
    n=$(nvidia-smi -L | wc -l)
    for g in 1 "$n"; do
      s=ddp; f=fsdp2; [ "$g" = 1 ] && s=auto f=auto
      [[ " ${SCALE:-ddp stream fsdp} " == *" ddp "* ]] && log step-1.7b-$s$g rlcu bench step --model qwen3-1.7b-random \
        --prompts $((8 * g)) --generations 8 --new_tokens 512 --steps 3 --devices "$g" --strategy $s
      [[ " ${SCALE:-ddp stream fsdp} " == *" stream "* ]] && log step-0.6b-stream-$s$g rlcu bench step --prompts $((8 * g)) \
        --generations 8 --new_tokens 512 --steps 8 --stop_tokens 512 --streaming --devices "$g" --strategy $s
      [[ " ${SCALE:-ddp stream fsdp} " == *" fsdp "* ]] && log step-8b-$f$g rlcu bench step --model qwen3-8b-random \
        --prompts $((8 * g)) --generations 8 --new_tokens 512 --steps 3 --devices "$g" --strategy $f \
        --adam_state_dtype bfloat16
    done ;;
  tp)
    # issue #46: tensor parallelism over all the host's GPUs (TP picks the shapes, default "8b 32b 72b"): the 8B
    # shape on 1 GPU and on all (a ratio), the 32B shape on 4 or more, the 72B shape (145 GB in bf16) on 8; each rank
    # builds only its share (bf16 AdamW moments, so the 72B shape's optimizer state fits 8 GPUs)
    n=$(nvidia-smi -L | wc -l)
    [[ " ${TP:-8b 32b 72b} " == *" 8b "* ]] && for g in 1 "$n"; do
      s=tp; [ "$g" = 1 ] && s=auto
      log step-8b-$s$g rlcu bench step --model qwen3-8b-random --prompts 8 --generations 8 --new_tokens 512 --steps 3 \
        --devices "$g" --strategy $s --adam_state_dtype bfloat16
    done
    (( n >= 4 )) && [[ " ${TP:-8b 32b 72b} " == *" 32b "* ]] && log step-32b-tp$n rlcu bench step \
      --model qwen3-32b-random --prompts 8 --generations 8 --new_tokens 512 --steps 3 --devices "$n" --strategy tp \
      --adam_state_dtype bfloat16
    (( n >= 8 )) && [[ " ${TP:-8b 32b 72b} " == *" 72b "* ]] && log step-72b-tp$n rlcu bench step \
      --model qwen2.5-72b-random --prompts 8 --generations 8 --new_tokens 512 --steps 3 --devices "$n" --strategy tp \
      --adam_state_dtype bfloat16 ;;
  fsdp8b)
    for state in float32 bfloat16; do
      log step-8b-fsdp2-$state rlcu bench step --model qwen3-8b-random --prompts 8 --generations 8 --new_tokens 512 \
        --steps 3 --devices 2 --strategy fsdp2 --adam_state_dtype $state
    done ;;
  long)
    gpus=$(nvidia-smi -L | wc -l); trl_gpu=$(( gpus > 1 ? 1 : 0 )); sides=" ${SIDES:-rlcu trl} "
    for w in ${LONG:-8x8x4096 16x16x2048}; do
      IFS=x read -r p g l <<< "$w"
      trl() { (cd "$peers" && CUDA_VISIBLE_DEVICES=$trl_gpu SHAPE=1.7b log trl-1.7b-$w python3 trl_grpo.py "$p" "$g" \
        "$l" 2); }
      if (( gpus > 1 )) && [[ $sides == *" trl "* ]]; then trl & fi
      [[ $sides == *" rlcu "* ]] && for packing in "" --packing; do  # padded micro-batches, then padding-free
        CUDA_VISIBLE_DEVICES=0 log step-1.7b-$w${packing:+-packed} rlcu bench step --model qwen3-1.7b-random \
          --prompts "$p" --generations "$g" --new_tokens "$l" --steps 3 --micro_batch_size "${MB:-16}" \
          --adam_state_dtype bfloat16 --kv_cache_dtype "${KV:-auto}" $packing
      done
      if (( gpus > 1 )); then wait; elif [[ $sides == *" trl "* ]]; then trl; fi
    done ;;
  streaming)
    for mode in "" --streaming; do
      log step8x8${mode:+-stream} rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 16 \
        --stop_tokens 512 $mode
    done
    for n in ${BESIDE:-}; do
      log step8x8-stream-beside$n rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 16 \
        --stop_tokens 512 --streaming --decode_steps_during_training "$n"
    done
    if [[ -n ${BESIDE:-} ]]; then
      log longtail-sync rlcu bench step --model qwen3-1.7b-random --prompts 32 --generations 8 --new_tokens 4096 \
        --lengths lognormal --micro_batch_size 16 --packing --steps 3
      for n in ${LONG_BESIDE:-0 ${BESIDE%% *}}; do
        log longtail-stream-beside$n rlcu bench step --model qwen3-1.7b-random --prompts 32 --generations 8 \
          --new_tokens 4096 --lengths lognormal --micro_batch_size 16 --packing --steps 4 --streaming \
          --max_staleness "${LONG_STALENESS:-2}" --decode_steps_during_training "$n" ${LONG_ARGS:-}
      done
    fi
    log step8x8-stream-prof rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 8 --stop_tokens 512 \
      --streaming --profile "$out/prof-stream" --profile_steps 4 ;;
  http)
    # six timed runs each way, and http_ratio_median beside the best runs' ratio: the command as issue #42 gives it
    # (agent_processes at its default: worker processes, one per 4 cores, 1 to 4), the programs on a thread of the
    # engine's process, then in AGENT_PROCESSES worker processes (default none)
    log turns4-http-default rlcu bench rollout --sequences 64 --new_tokens 512 --turns 4 --http --repeats 6
    log turns4-http-thread rlcu bench rollout --sequences 64 --new_tokens 512 --turns 4 --http --repeats 6 \
      --agent_processes 0
    for n in ${AGENT_PROCESSES:-}; do
      log turns4-http-processes$n rlcu bench rollout --sequences 64 --new_tokens 512 --turns 4 --http --repeats 6 \
        --agent_processes "$n"
    done ;;
  fp8)
    for kv in auto fp8; do
      log rollout64-$kv rlcu bench rollout --sequences 64 --new_tokens 512 --kv_cache_dtype $kv
      log rollout512-$kv rlcu bench rollout --sequences 512 --new_tokens 512 --kv_cache_dtype $kv
      log step8x8-$kv rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 4 --kv_cache_dtype $kv
      log step32x8-$kv rlcu bench step --prompts 32 --generations 8 --new_tokens 512 --steps 3 --kv_cache_dtype $kv
    done ;;
  stream-curves)
    # issue #44: each recipe (RECIPES, default "arithmetic reasoning-gym") for STEPS optimizer steps (default 50),
    # held-out greedy accuracy every EVERY steps (default 10), synchronous then streaming, with each seed of SEEDS
    # (default "0 1 2") as both the run's and the sampler's seed; STALENESS streams at each max_staleness it lists
    # (modes streaming-kK; default the recipe's own, mode streaming), each with STREAM_ARGS (say
    # "--model.old_logprobs=engine"); then recipes/seed_curves.py on the CSVs. The runs
    # share the GPU, all at once (their curves are per sample trained, not per minute); MAX_TIME bounds each run
    # (Lightning's trainer.max_time, default null), so that a slow run still ends with its metrics written; a recipe
    # whose runs wrote none (reasoning-gym without its packages: benchmarks/offline_setup.sh) is named and skipped
    root=$PWD; out=$(cd "$out" && pwd); modes=synchronous
    for k in ${STALENESS:-default}; do [ "$k" = default ] && modes+=" streaming" || modes+=" streaming-k$k"; done
    for recipe in ${RECIPES:-arithmetic reasoning-gym}; do
      for mode in $modes; do
        extra=(--model.streaming="$([ $mode = synchronous ] && echo false || echo true)")
        case $mode in streaming-k*) extra+=(--model.max_staleness="${mode#streaming-k}") ;; esac
        [ $mode = synchronous ] || extra+=(${STREAM_ARGS:-})
        for seed in ${SEEDS:-0 1 2}; do
          dir="$out/$recipe-$mode-s$seed"; mkdir -p "$dir"
          (cd "$dir" && log "$recipe-$mode-s$seed" python3 -m rlcu.cli run "$recipe" --seed_everything="$seed" \
            --model.seed="$seed" --trainer.max_steps="${STEPS:-50}" --trainer.max_time="${MAX_TIME:-null}" \
            --trainer.val_check_interval="${EVERY:-10}" --model.eval_num_samples=0 "${extra[@]}") > "$dir.summary" 2>&1 &
        done
      done
    done
    wait
    for recipe in ${RECIPES:-arithmetic reasoning-gym}; do
      csvs=()
      for mode in $modes; do
        run=("--run" "$mode")
        for seed in ${SEEDS:-0 1 2}; do
          dir="$out/$recipe-$mode-s$seed"; cat "$dir.summary"
          cp "$dir/runs/$recipe/version_0/metrics.csv" "$out/$recipe-$mode-s$seed.csv" && run+=("$out/$recipe-$mode-s$seed.csv")
        done
        csvs+=("${run[@]}")
      done
      if ! ls "$out/$recipe"-synchronous-s*.csv "$out/$recipe"-streaming*-s*.csv > /dev/null 2>&1; then
        echo "stream-curves: $recipe has no metrics for one of its modes; see $out/$recipe-*.log"; continue
      fi
      per_step=$(python3 -c "import yaml; c = yaml.safe_load(open('$root/recipes/$recipe/config.yaml')); \
        print(c['data']['batch_size'] * c['model']['num_generations'])")
      python3 "$root/recipes/seed_curves.py" "${csvs[@]}" --samples_per_step "$per_step" --out "$out/$recipe-streaming.png" \
        | tee "$out/$recipe-streaming.md"
    done ;;
  curves)
    out=$(cd "$out" && pwd); root=$PWD; minutes=${MINUTES:-8}; model=${MODEL:-smollm2-135m-instruct}
    seconds=$(python3 -c "print(round(60 * $minutes))")
    # with one GPU the two runs take turns on it (rlcu first): never two processes sharing one GPU's time
    # both sides evaluate greedily only, as TRL's side does; rlcu's clock counts those evaluations, TRL's not
    gpus=$(nvidia-smi -L | wc -l); trl_gpu=$(( gpus > 1 ? 1 : 0 )); sides=" ${SIDES:-rlcu trl} "
    for recipe in ${RECIPES:-gsm8k reasoning-gym}; do
      mkdir -p "$out/$recipe"
      trl() { (cd "$out/$recipe" && CUDA_VISIBLE_DEVICES=$trl_gpu log trl-$recipe \
        python3 "$root/recipes/trl_baseline.py" "$recipe" --out "$out/$recipe-trl.csv" --max_minutes "$minutes" \
        --model "$model" ${TRL_EVAL_EVERY:+--eval_every $TRL_EVAL_EVERY}); }
      ours() { (cd "$out/$recipe" && CUDA_VISIBLE_DEVICES=0 log rlcu-$recipe python3 -m rlcu.cli run "$recipe" \
        --model.model="$model" --model.eval_num_samples=0 \
        --trainer.max_time="00:00:$(printf %02d $((seconds / 60))):$(printf %02d $((seconds % 60)))")
        cp "$out/$recipe"/runs/"$recipe"/version_0/metrics.csv "$out/$recipe-rlcu.csv"; }
      if (( gpus > 1 )) && [[ $sides == *" trl "* ]]; then trl & fi
      [[ $sides == *" rlcu "* ]] && ours
      if (( gpus > 1 )); then wait; elif [[ $sides == *" trl "* ]]; then trl; fi
      [ -f "$out/$recipe-rlcu.csv" ] && [ -f "$out/$recipe-trl.csv" ] &&
        python3 "$root/recipes/curves.py" "$out/$recipe-rlcu.csv" --trl "$out/$recipe-trl.csv" --out "$out/$recipe.png"
    done ;;
  targets)
    # the 0.6B rows of issue #20's targets (docs/benchmarks.md), each step with a profiled extra step (what bounds
    # a miss), then TRL's two steps; the 1.7B rows are the `long` part (TRL alone takes 420-490 s a step there)
    log rollout64 rlcu bench rollout --sequences 64 --new_tokens 512
    log rollout512 rlcu bench rollout --sequences 512 --new_tokens 512
    log rollout512-fp8 rlcu bench rollout --sequences 512 --new_tokens 512 --kv_cache_dtype fp8
    log rollout64prof rlcu bench rollout --sequences 64 --new_tokens 512 --repeats 1 --profile "$out/prof-rollout64"
    log step8x8 rlcu bench step --prompts 8 --generations 8 --new_tokens 512 --steps 4 --profile "$out/prof-step8x8"
    log step32x8 rlcu bench step --prompts 32 --generations 8 --new_tokens 512 --steps 3 --profile "$out/prof-step32x8"
    (cd "$peers" && log trl8x8 python3 trl_grpo.py 8 8 512 2 && log trl32x8 python3 trl_grpo.py 32 8 512 2) ;;
  targets-long)
    # the 1.7B rows of issue #20's targets: 8x8x4096 with a profiled extra step (what bounds the miss), the same with
    # the FP8 cache (opt-in), then 16x16x2048; TRL's side (420-490 s a step) is the `long` part's
    m="--model qwen3-1.7b-random --micro_batch_size 16 --adam_state_dtype bfloat16"
    log step-1.7b-8x8x4096 rlcu bench step $m --prompts 8 --generations 8 --new_tokens 4096 --steps 2 \
      --profile "$out/prof-1.7b-8x8x4096"
    log step-1.7b-8x8x4096-fp8 rlcu bench step $m --prompts 8 --generations 8 --new_tokens 4096 --steps 2 \
      --kv_cache_dtype fp8
    log step-1.7b-16x16x2048 rlcu bench step $m --prompts 16 --generations 16 --new_tokens 2048 --steps 2 ;;
  uneven)
    # completions of uneven length (--stop_tokens): a costly reward scored after the rollout or during it, and
    # padded against packed training (the 2026-12-02 sections of docs/benchmarks.md)
    u="--prompts 32 --generations 8 --new_tokens 512 --steps 4 --stop_tokens 512"
    log uneven-wait5 rlcu bench step $u --reward_wait_ms 5
    log uneven-wait5-during rlcu bench step $u --reward_wait_ms 5 --score_during_generation
    log uneven-python2 rlcu bench step $u --reward_ms 2
    log uneven-python2-during rlcu bench step $u --reward_ms 2 --score_during_generation
    log uneven-packed rlcu bench step $u --packing ;;
  trl8) (cd "$peers" && log trl8x8 python3 trl_grpo.py 8 8 512 3) ;;
  trl32) (cd "$peers" && log trl32x8 python3 trl_grpo.py 32 8 512 2) ;;
  hf) (cd "$peers" && log hf_generate python3 hf_generate.py) ;;
  ddp)
    # the countdown recipe on one GPU, under DDP on two, under FSDP on two (docs/benchmarks.md's DDP/FSDP table)
    out=$(cd "$out" && pwd); root=$PWD
    common="--trainer.limit_val_batches=0 --model.eval_at_start=false"
    for run in "one 1 auto 40" "ddp 2 ddp 40" "fsdp 2 fsdp2 40"; do
      set -- $run
      [[ " ${RUNS:-one ddp fsdp} " == *" $1 "* ]] || continue
      mkdir -p "$out/$1" && (cd "$out/$1" && log $1 python3 -m rlcu.cli run countdown --trainer.devices=$2 \
        --trainer.strategy=$3 --trainer.max_steps=$4 $common)
    done
    for run in ddp fsdp; do
      [ -d "$out/$run" ] && python3 "$root/benchmarks/ddp_throughput.py" \
        "$out/one/runs/countdown/version_0/metrics.csv:1" "$out/$run/runs/countdown/version_0/metrics.csv:2"
    done ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
