"""`rlcu bench` end to end on the CPU with a tiny model (its speed is measured on the H200, never here)."""
import json
import os

import pytest
import torch

from rlcu.bench import QWEN3_06B
from rlcu.cli import main
from rlcu.data.tokenizers import word_tokenizer
from tests.helpers import tiny_hf_folder


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("lookahead", [[], ["--no_lookahead"]])
def test_bench_rollout_generates_full_length(tmp_path, capsys, lookahead):
    folder = tiny_hf_folder(tmp_path, "qwen3")
    main(["bench", "rollout", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--sequences", "6",
          "--generations", "3", "--prompt_len", "5", "--new_tokens", "7", "--repeats", "1", *lookahead])
    out = last_json(capsys)
    assert out["bench"] == "rollout" and out["sequences"] == 6 and out["tok_per_s"] > 0
    assert out["lookahead"] == (not lookahead)
    assert out["tokens"] == 6 * 7  # no early stop


def test_bench_rollout_profiles_an_extra_rollout(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "qwen3")
    main(["bench", "rollout", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--sequences", "4",
          "--prompt_len", "5", "--new_tokens", "6", "--repeats", "1", "--profile", str(tmp_path / "prof")])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["tokens"] == 4 * 6 and out["profile"]["generate"]["wall_ms"] > 0
    assert "generate:" in captured.err and "aten::" in captured.err
    assert (tmp_path / "prof" / "trace.json").stat().st_size > 0


def test_bench_rollout_runs_multi_turn_episodes(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "qwen3")
    main(["bench", "rollout", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--sequences", "4",
          "--generations", "2", "--prompt_len", "5", "--new_tokens", "12", "--turns", "4", "--turn_tokens", "3",
          "--repeats", "1"])
    out = last_json(capsys)
    assert out["turns"] == 4 and out["tokens"] == 4 * 12  # sampled tokens only: the appended ones do not count


@pytest.mark.parametrize("processes", [0, None])
def test_bench_rollout_runs_the_same_episodes_over_http(tmp_path, capsys, monkeypatch, processes):
    """--http: each episode a program making its four turns as /v1/completions calls to the agent endpoint, beside
    the in-process run; both sample the same tokens (the bench checks it), and every call went over HTTP, from a
    thread (--agent_processes 0) or from worker processes (the default under the rlcu command: one per 4 cores, 1
    to 4; on a folder without a tokenizer: the bench's episodes are token ids)."""
    import rlcu.agents.programs as programs
    import rlcu.bench as bench

    calls = []
    real = programs.ProgramRunner.completion

    async def counted(self, episode, body):
        calls.append(len(body["prompt"]))
        return await real(self, episode, body)

    monkeypatch.setattr(programs.ProgramRunner, "completion", counted)
    folder = tiny_hf_folder(tmp_path, "qwen3")
    if processes is None:
        for f in folder.glob("tokenizer*"):
            f.unlink()
    main(["bench", "rollout", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--sequences", "4",
          "--generations", "2", "--prompt_len", "5", "--new_tokens", "12", "--turns", "4", "--turn_tokens", "3",
          "--repeats", "1", "--http", *([] if processes is None else ["--agent_processes", str(processes)])])
    out = last_json(capsys)
    assert out["agent_processes"] == (max(1, min(4, (os.cpu_count() or 1) // 4)) if processes is None else 0)
    assert out["http"] is True and out["tokens"] == 4 * 12 and out["http_tok_per_s"] > 0 and out["http_ratio"] > 0
    assert out["http_ratio_median"] > 0
    assert len(calls) == 2 * 4 * 4  # two runs (warm-up, timed) of 4 episodes of 4 calls
    assert sorted(set(calls)) == [5, 5 + 3 + 3, 5 + 2 * (3 + 3), 5 + 3 * (3 + 3)]  # each prompt: served + appended
    with pytest.raises(ValueError, match="--http runs episodes"):
        bench.run(["rollout", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--http"])


def test_bench_step_reports_each_phase(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "llama")
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "5", "--steps", "2", "--micro_batch_size", "2"])
    out = last_json(capsys)
    assert len(out["step_seconds"]) == 2
    assert set(out["steady"]) == {"total", "generate", "score", "train", "idle"}
    assert out["gradient_checkpointing"] is True  # what the module ran with: TRL's default
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "3", "--steps", "1",
          "--no_gradient_checkpointing"])
    assert last_json(capsys)["gradient_checkpointing"] is False
    assert out["steady"]["generate"] + out["steady"]["train"] <= out["steady"]["total"] * 1.01
    assert out["mean_length"] == 5.0 and out["clipped_ratio"] == 1.0  # no stop token: all run to full length


def test_bench_step_takes_uneven_lengths_a_costly_reward_and_scoring_during_generation(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "llama")
    common = ["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
              "--generations", "4", "--prompt_len", "4", "--new_tokens", "12", "--steps", "2", "--stop_tokens", "20"]
    main(common + ["--reward_ms", "25", "--reward_wait_ms", "10"])
    out = last_json(capsys)
    assert out["stop_tokens"] == 20 and out["reward_ms"] == 25 and out["reward_wait_ms"] == 10
    assert out["score_during_generation"] is False
    assert out["mean_length"] < 12 and out["clipped_ratio"] < 1.0  # a third of the vocabulary stops a completion
    assert out["steady"]["score"] >= 8 * 0.035  # the reward's cost: 25 + 10 ms for each of the 8 completions
    main(common + ["--score_during_generation"])
    assert last_json(capsys)["score_during_generation"] is True


def test_bench_step_profiles_an_extra_step_by_phase(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "qwen3")
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "3", "--steps", "1", "--profile",
          str(tmp_path / "prof")])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert len(out["step_seconds"]) == 1  # the profiled step is not among the timings
    assert set(out["profile"]) == {"generate", "score", "train"}
    assert out["profile"]["train"]["wall_ms"] > 0 and "train:" in captured.err
    assert "host operators" in captured.err and "aten::" in captured.err  # the host's side of each phase
    assert (tmp_path / "prof" / "trace.json").stat().st_size > 0


def test_bench_step_profiles_several_steps_each_phase_apart(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "qwen3")
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "3", "--steps", "1", "--profile",
          str(tmp_path / "prof"), "--profile_steps", "2"])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert len(out["step_seconds"]) == 1
    assert set(out["profile"]) == {"generate", "score", "train", "generate 2", "score 2", "train 2"}
    assert "allocator retries" in captured.err
    with pytest.raises(SystemExit):
        main(["bench", "step", "--model", str(folder), "--device", "cpu", "--profile_steps", "0"])
    assert "--profile_steps must be >= 1" in capsys.readouterr().err


def test_standard_tokenizer_round_trips_every_id():
    tok = word_tokenizer(1000)
    ids = [0, 5, 997, 123]
    assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids
    assert QWEN3_06B["vocab_size"] == 151936 and QWEN3_06B["num_hidden_layers"] == 28


def test_a_misspelt_random_shape_names_the_shapes_and_a_folder_of_that_name_loads(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["bench", "rollout", "--model", "qwen3.5-2B-random", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--model qwen3.5-2B-random: no such random shape; rlcu bench builds" in err
    assert "qwen3.5-2b-random" in err and "qwen3-0.6b-random" in err
    folder = tiny_hf_folder(tmp_path / "mine-random", "llama")
    monkeypatch.chdir(tmp_path)
    main(["bench", "rollout", "--model", "mine-random", "--device", "cpu", "--dtype", "float32", "--sequences", "2",
          "--new_tokens", "2", "--prompt_len", "4", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == 4 and folder.is_dir()


@pytest.mark.parametrize("argv", [["rollout", "--new_tokens", "0"], ["rollout", "--sequences", "0"],
                                  ["rollout", "--repeats", "0"], ["rollout", "--turns", "0"], ["step", "--steps", "0"],
                                  ["step", "--prompts", "0"], ["step", "--devices", "0"]])
def test_bench_rejects_counts_below_one_before_any_work(argv, capsys):
    """A rollout of no sequences or a step count of zero would fail deep in the timing (an IndexError), and zero
    repeats or turns would report figures of runs never timed."""
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv, "--model", "x"])
    assert e.value.code == 2 and f"{argv[1]} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["step", "--prompt", "8"], ["rollout", "--new_token", "8"],
                                  ["step", "--shared_prefix", "yes"]])
def test_bench_rejects_truncated_options_and_unknown_choices(argv, capsys):
    """A truncated option name is an error, not the option it begins (argparse's abbreviations are off)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and argv[1] in capsys.readouterr().err


def test_bench_step_trains_lora_adapters(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path / "tiny", "qwen3")
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "3", "--steps", "1", "--lora_rank", "4"])
    assert last_json(capsys)["lora_rank"] == 4


def test_bench_step_puts_adapters_on_the_experts_and_reports_the_routing(tmp_path, capsys, monkeypatch):
    import rlcu.grpo.module as grpo_module
    from rlcu.models.lora import expert_adapters

    adapted = []
    add_lora = grpo_module.add_lora
    monkeypatch.setattr(grpo_module, "add_lora",
                        lambda model, config: (add_lora(model, config), adapted.append(len(expert_adapters(model)))))
    folder = tiny_hf_folder(tmp_path / "tiny", "qwen3_moe")
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "3", "--steps", "1", "--lora_rank", "4",
          "--lora_experts"])
    out = last_json(capsys)
    assert out["lora_experts"] and out["routing_mismatch_max"] == 0.0  # fp32 on the CPU: sampler and trainer agree
    assert adapted == [1]  # the experts of the tiny Qwen3-MoE's one MoE layer (its layer 1 is dense) are adapted


@pytest.mark.skipif(not __import__("rlcu.kernels._triton", fromlist=["x"]).HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the interpreter path is for CPU machines")
@pytest.mark.usefixtures("fixed_order_dot")
@pytest.mark.slow
def test_bench_exact_logprobs_reports_no_mismatch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLCU_TRITON", "1")
    folder = tiny_hf_folder(tmp_path, "llama")
    main(["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
          "--generations", "2", "--prompt_len", "4", "--new_tokens", "4", "--steps", "1", "--exact_logprobs"])
    out = last_json(capsys)
    assert out["exact_logprobs"] is True and out["logprob_mismatch_max"] == 0.0


# parameters of the released checkpoints whose shapes FAMILY_SHAPES copies (from their model cards), in billions
PUBLIC_SIZES = {"gemma3-1b-random": 1.00, "gemma2-2b-random": 2.61, "smollm3-3b-random": 3.08,
                "mistral-7b-random": 7.25, "phi4-mini-random": 3.84, "pythia-1b-random": 1.01,
                "qwen3-30b-a3b-random": 30.5, "gpt-oss-20b-random": 20.9, "olmo2-1b-random": 1.48,
                "olmo3-7b-random": 7.30, "granite-3.3-2b-random": 2.53, "qwen2.5-72b-random": 72.7}
# copied from Qwen3.5-2B's config.json, or transformers' defaults ("Qwen3.5-9B style", "Qwen3-Next-80B-A3B style"): the
# model cards give totals with the vision tower
HYBRID_SHAPES = {"qwen3.5-2b-random", "qwen3.5-9b-random", "qwen3-next-80b-a3b-random"}


@pytest.mark.parametrize("name", sorted(HYBRID_SHAPES))
def test_hybrid_shapes_build_natively_as_transformers_counts_them(name):
    import torch
    from transformers import AutoModelForCausalLM

    from rlcu.bench import family_config
    from rlcu.models.config import ModelConfig
    from rlcu.models.decoder import CausalLM

    hf = family_config(name)
    with torch.device("meta"):
        ours, theirs = CausalLM(ModelConfig.from_hf(hf.to_dict())), AutoModelForCausalLM.from_config(hf)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(ours) == count(theirs) and len(ours.config.linear_layers) * 4 == 3 * hf.num_hidden_layers


@pytest.mark.parametrize("name", sorted(PUBLIC_SIZES))
def test_family_shapes_have_the_public_checkpoints_sizes(name):
    import torch
    from transformers import AutoModelForCausalLM

    from rlcu.bench import FAMILY_SHAPES, family_config
    from rlcu.models.config import ModelConfig
    from rlcu.models.decoder import CausalLM
    from rlcu.models.spec import family

    assert set(PUBLIC_SIZES) | HYBRID_SHAPES == set(FAMILY_SHAPES)
    hf = family_config(name)
    with torch.device("meta"):
        ours = CausalLM(ModelConfig.from_hf(hf.to_dict())) if family(hf.model_type) else None
        theirs = AutoModelForCausalLM.from_config(hf)
    count = lambda m: sum(p.numel() for p in m.parameters()) / 1e9  # noqa: E731  (tied weights count once)
    assert count(theirs) == pytest.approx(PUBLIC_SIZES[name], rel=0.02)
    if ours is not None:  # the native decoder built from the same config holds the same parameters
        assert count(ours) == count(theirs)


def test_the_qwen3_32b_shape_has_the_public_checkpoints_size():
    import torch

    from rlcu.bench import QWEN3_06B, SHAPES
    from rlcu.models.config import ModelConfig
    from rlcu.models.decoder import CausalLM

    with torch.device("meta"):
        model = CausalLM(ModelConfig(**dict(QWEN3_06B, **SHAPES["qwen3-32b-random"])))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(32.8, rel=0.01)  # Qwen3-32B's card


@pytest.mark.parametrize("name,path", [("gemma3-1b-random", "native"), ("pythia-1b-random", "fallback"),
                                       ("qwen3.5-2b-random", "native"), ("gpt-oss-20b-random", "native")])
def test_bench_runs_a_family_shape_natively_or_on_the_fallback(monkeypatch, capsys, name, path):
    import rlcu.bench as bench

    tiny = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    shape = dict(bench.FAMILY_SHAPES[name], **tiny)
    shape.update({k: v for k, v in dict(head_dim=16, sliding_window=4, num_key_value_heads=2, linear_num_key_heads=2,
                                        linear_num_value_heads=4, linear_key_head_dim=8,
                                        linear_value_head_dim=8).items() if k in shape})
    monkeypatch.setitem(bench.FAMILY_SHAPES, name, shape)
    common = ["--model", name, "--device", "cpu", "--dtype", "float32", "--prompt_len", "5", "--new_tokens", "6"]
    main(["bench", "rollout", *common, "--sequences", "3", "--repeats", "1"])
    out = last_json(capsys)
    assert out["path"] == path and out["tokens"] == 3 * 6
    main(["bench", "step", *common, "--prompts", "2", "--generations", "2", "--steps", "1", "--micro_batch_size", "4"])
    out = last_json(capsys)
    assert out["path"] == path and out["mean_length"] == 6.0 and len(out["step_seconds"]) == 1


def test_bench_step_streams_on_long_tail_lengths_the_same_samples_as_the_synchronous_step(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, "llama")
    common = ["bench", "step", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--prompts", "2",
              "--generations", "4", "--prompt_len", "4", "--new_tokens", "40", "--steps", "3", "--lengths", "lognormal"]
    main(common)
    sync = last_json(capsys)
    assert sync["lengths"] == "lognormal" and sync["streaming"] is False and 1 <= sync["mean_length"] < 40
    main(common + ["--streaming", "--max_staleness", "2"])
    stream = last_json(capsys)
    assert stream["streaming"] is True and len(stream["step_seconds"]) == 3 and stream["fill_seconds"] >= 0
    assert stream["trained_tokens_per_s"] > 0 and stream["decode_batch_mean"] > 0
    assert 0 <= stream["staleness_mean"] <= 2 and stream["dropped_stale"] == 0
    main(common + ["--streaming", "--max_staleness", "2", "--decode_steps_during_training", "8"])
    beside = last_json(capsys)
    assert beside["decode_steps_during_training"] == 8 and len(beside["step_seconds"]) == 3
    assert beside["trained_tokens_per_s"] > 0 and 0 <= beside["staleness_mean"] <= 2
    assert 0 < beside["decode_steps_beside_mean"] <= min(9, beside["decode_steps_mean"])  # 8, +1 the step ahead
    assert stream["decode_steps_beside_mean"] == 0
    main(common + ["--streaming", "--max_staleness", "2", "--decode_steps_during_training", "8", "--max_num_seqs", "1",
                   "--beside_priority", "-1"])
    capped = last_json(capsys)  # the engine's options reach it: one sequence a decode step, where 1.7 ran uncapped
    assert capped["max_num_seqs"] == 1 and capped["beside_priority"] == -1 and capped["decode_batch_mean"] <= 1
    assert beside["max_num_seqs"] == 256 and beside["decode_batch_mean"] > 1
    from rlcu.engine.scheduler import Scheduler

    assert Scheduler.postprocess.__name__ == "postprocess"  # the planned lengths end with the bench


def test_a_shape_no_one_gpu_holds_is_refused_before_any_memory_is_taken(monkeypatch):
    """Qwen3-Next-80B-A3B's shape on one H200-sized GPU: rlcu's model of the shape, counted on the meta device, holds
    what transformers' own module of the same config holds (79.7B parameters, 159.3 GB in bf16), more than the GPU,
    and the benchmark says so in one line instead of running out of memory."""
    import torch
    import transformers

    from rlcu.bench import build_model, family_config
    from tests.models.test_loading import gpu_of

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(family_config("qwen3-next-80b-a3b-random"))
    gigabytes = 2 * hf.num_parameters() / 1e9
    assert round(gigabytes, 1) == 159.3
    gpu_of(monkeypatch, 150.0)
    with pytest.raises(ValueError, match=rf"^qwen3-next-80b-a3b-random: {gigabytes:.1f} GB of weights do not fit "
                                         r"one NVIDIA H200 \(150\.0 GB\)"):
        build_model("qwen3-next-80b-a3b-random", "cuda", "bfloat16")


def test_bench_rollout_and_step_keep_a_hybrids_states_in_bf16(tmp_path, capsys, monkeypatch):
    """`--mamba_ssm_cache_dtype bfloat16` reaches the engine of both benches (the state pools they make hold bf16
    matrices) and the JSON says so; a model on the transformers fallback refuses it in one line."""
    from rlcu.engine import model_runner

    pools, real = [], model_runner.StatePool
    monkeypatch.setattr(model_runner, "StatePool", lambda *a, **k: pools.append(real(*a, **k)) or pools[-1])
    folder = tiny_hf_folder(tmp_path, "qwen3_5_text")
    common = ["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--new_tokens", "4",
              "--mamba_ssm_cache_dtype", "bfloat16"]
    main(["bench", "rollout", *common, "--sequences", "3", "--prompt_len", "5", "--repeats", "1"])
    assert last_json(capsys)["mamba_ssm_cache_dtype"] == "bfloat16"
    main(["bench", "step", *common, "--prompts", "2", "--generations", "2", "--prompt_len", "5", "--steps", "1"])
    assert last_json(capsys)["mamba_ssm_cache_dtype"] == "bfloat16"
    assert len(pools) >= 2 and {p.matrix.dtype for p in pools} == {torch.bfloat16}
    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--model", str(tiny_hf_folder(tmp_path / "neox", "gpt_neox")), "--device", "cpu",
              "--sequences", "2", "--new_tokens", "2", "--mamba_ssm_cache_dtype", "bfloat16"])
    assert "--mamba_ssm_cache_dtype measure the native engine only" in capsys.readouterr().err


class _ExpandingTokenizer:
    """A real tokenizer's trait in miniature: a decoded id reads back as 1-3 ids (byte pieces, a special token's
    name), one per letter (ids 0-25, which read back as themselves), with a BOS in front."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) * (1 + i // 26 % 3) for i in ids)

    def __call__(self, text, add_special_tokens=True):
        encode = lambda t: [99] * add_special_tokens + [ord(c) - 97 for c in t]  # noqa: E731
        return {"input_ids": encode(text) if isinstance(text, str) else [encode(t) for t in text]}


def test_bench_step_prompts_fit_the_limit_on_a_tokenizer_that_reads_them_back_longer():
    from rlcu.bench import prompt_texts, random_prompt_ids

    tok, prompts = _ExpandingTokenizer(), random_prompt_ids(12, 20, 1000)
    assert max(len(tok(tok.decode(p))["input_ids"]) for p in prompts) > 28  # as decoded, they would be refused
    lengths = [len(tok(t)["input_ids"]) for t in prompt_texts(tok, prompts, 28)]
    assert max(lengths) <= 28 and min(lengths) >= 20
    words = word_tokenizer(1000)  # the random shapes' tokenizer reads its prompts back as they were
    assert prompt_texts(words, prompts, 28) == [words.decode(p) for p in prompts]
    with pytest.raises(ValueError, match="pass a larger --prompt_len"):
        prompt_texts(tok, prompts[:1], 1)  # the BOS alone fills it


def test_step_floors_count_what_transformers_counts():
    """benchmarks/step_floors.py as docs/benchmarks.md runs it, against the floors in closed form from transformers'
    own parameter count: SmolLM3-3B (tied head, full fine-tuning) and OLMo-3-7B (untied embedding, LoRA)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from rlcu.bench import family_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "benchmarks/step_floors.py", "smollm3-3b-random:3.69:22.71",
                          "olmo3-7b-random:lora"], cwd=root, capture_output=True, text=True, check=True).stdout
    rows = {r.split("|")[1].strip(): [c.strip().strip("*") for c in r.split("|")[2:]] for r in out.splitlines()[2:]}
    flops, bandwidth, seqs, groups, prompt, new = 788e12, 4.24e12, 64, 8, 128, 512
    tokens, pairs = seqs * (prompt + new), seqs * (prompt + new) * (prompt + new + 1) / 2
    reads = seqs * new * (new + 1) / 2 + groups * prompt * new  # own tokens, then each group's prompt once a step
    for name, passes, embedding in [("smollm3-3b-random", 4, 0), ("olmo3-7b-random LoRA", 3, 1)]:
        hf = family_config(name.split()[0])
        with torch.device("meta"):
            params = AutoModelForCausalLM.from_config(hf).num_parameters()
        weights = params - embedding * hf.vocab_size * hf.hidden_size  # an untied lookup is not a matmul
        width = hf.num_attention_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        train = passes * (2 * weights * tokens + hf.num_hidden_layers * 4 * width * pairs) / flops
        kv = hf.num_hidden_layers * 2 * hf.num_key_value_heads * (width // hf.num_attention_heads) * 2
        decode = (new * 2 * weights + kv * reads) / bandwidth
        assert float(rows[name][0].rstrip(" s")) == pytest.approx(decode, abs=0.01)
        assert float(rows[name][2].rstrip(" s")) == pytest.approx(train, abs=0.01)
    assert rows["smollm3-3b-random"][7].startswith("100%")  # 10x TRL's 22.71 s asks the whole floor
