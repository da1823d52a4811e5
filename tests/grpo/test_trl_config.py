"""TRL's GRPO config as rlcu's: every field of TRL 1.16's GRPOConfig, and of the `trl grpo` script's other
arguments, is mapped, without effect for a stated reason, or refused by name; what a config leaves out takes
TRL's defaults; a `trl grpo` YAML as TRL's docs write one trains through `rlcu run --trl_config`."""
import csv
import dataclasses
import json
import textwrap

import pytest
import torch

from rlcu import cli
from rlcu.grpo.module import GRPOModule
from rlcu.grpo.trl_config import ALL, RULES, field_table, translate
from tests.helpers import CHAT_TEMPLATE, tiny_hf_folder

trl = pytest.importorskip("trl")


def trl_argument_classes():
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    return [GRPOConfig, GRPOScriptArguments, ModelConfig, DatasetMixtureConfig]


def default_of(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else ALL


def test_every_trl_field_is_mapped_or_refused_with_trls_default():
    for cls in trl_argument_classes():
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields if f.name not in RULES] == [], f"{cls.__name__} has unaccounted fields"
        wrong = [(f.name, RULES[f.name].default, default_of(f)) for f in fields
                 if RULES[f.name].default is not ALL and RULES[f.name].default != default_of(f)]
        assert wrong == [], f"rlcu's copy of {cls.__name__}'s defaults is off"
    assert all(why for _, why in field_table())


def test_a_config_object_translates_with_trls_defaults_and_builds_the_module(tmp_path):
    from trl import GRPOConfig

    folder = tiny_hf_folder(tmp_path / "m", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8)
    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, learning_rate=3e-6,
                     lr_scheduler_type="cosine", warmup_steps=0.1, per_device_train_batch_size=4,
                     gradient_accumulation_steps=4, num_generations=8, scale_rewards=False, max_steps=20)
    t = translate(cfg)
    assert t.data["batch_size"] == 2 and t.model["micro_batch_size"] == 4  # 4 x 4 completions / groups of 8
    assert (t.model["lr_scheduler"], t.model["warmup_steps"], t.model["max_completion_length"]) == ("cosine", 0.1, 512)
    assert t.seed == 42 and t.trainer["max_steps"] == 20 and t.trainer["precision"] == "32-true"
    module = GRPOModule.from_trl(cfg, model=str(folder), reward_funcs=[lambda completions, **kw: [0.0] * len(
        completions)], max_completion_length=8)
    assert module.options.loss.scale_rewards == "none" and module.options.optimizer.learning_rate == 3e-6
    assert module.options.sampling.seed == 42
    with pytest.raises(ValueError, match=r"TRL field push_to_hub=True is not supported: rlcu does not push"):
        translate({"push_to_hub": True})


def test_bad_trl_input_names_the_field_and_the_fix():
    with pytest.raises(ValueError, match="unknown TRL field 'learning_rat'"):
        translate({"learning_rat": 1e-5})
    with pytest.raises(ValueError, match="steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"):
        translate({"steps_per_generation": 3, "gradient_accumulation_steps": 2})
    with pytest.raises(ValueError, match="generation_batch_size=64 and steps_per_generation=2 disagree"):
        translate({"generation_batch_size": 64, "steps_per_generation": 2, "per_device_train_batch_size": 8})
    with pytest.raises(ValueError, match="not a multiple of num_generations=8"):
        translate({"per_device_train_batch_size": 6})
    with pytest.raises(ValueError, match=r"TRL field deepspeed='ds.json' is not supported: rlcu runs DDP"):
        translate({"deepspeed": "ds.json"})
    with pytest.raises(ValueError, match="report_to='mlflow'"):
        translate({"report_to": "mlflow"})
    with pytest.raises(ValueError, match="TRL field learning_rate='abc' must be a number"):
        translate({"learning_rate": "abc"})
    with pytest.raises(ValueError, match="TRL field use_vllm='yes' must be true or false"):
        translate({"use_vllm": "yes"})
    assert translate({"learning_rate": "1e-5"}).model["learning_rate"] == 1e-5  # YAML 1.1 reads 1e-5 as text
    lines = translate({"use_vllm": True, "vllm_mode": "server", "vllm_server_port": 8001}).lines[:3]
    assert [line.split(":")[0] for line in lines] == ["use_vllm=True", "vllm_mode='server'", "vllm_server_port=8001"]
    assert all("no effect here (rlcu samples with its own engine" in line for line in lines)


@pytest.mark.parametrize("flag", [["--trl_config", "grpo.yaml"], ["--trl_config=grpo.yaml"]])
def test_a_trl_config_after_a_recipe_says_where_it_goes(flag, capsys):
    from rlcu import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["run", "arithmetic", *flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--trl_config takes the place of a recipe" in err and err.count("\n") == 1


def test_a_trl_config_that_is_not_valid_yaml_is_one_line_naming_where(tmp_path, capsys):
    from rlcu import cli

    bad = tmp_path / "grpo.yaml"
    bad.write_text("learning_rate: 1.0e-6\nreward_funcs: [accuracy\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--trl_config", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"{bad} is not valid YAML at line 3, column 1 (expected ',' or ']'" in err


def test_a_trl_grpo_yaml_trains_a_step_through_rlcu_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tiny_hf_folder(tmp_path / "m", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                            chat_template=CHAT_TEMPLATE)
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"t{i} t{i + 1}"}]}) + "\n"
                            for i in range(16)))
    config = tmp_path / "grpo.yaml"  # as TRL's docs write one for `trl grpo --config`
    config.write_text(textwrap.dedent(f"""\
        model_name_or_path: {folder}
        dataset_name: {rows}
        dataset_train_split: train
        reward_funcs: [think_format_reward]
        output_dir: {tmp_path / "out"}
        learning_rate: 1.0e-5
        lr_scheduler_type: cosine
        warmup_steps: 0.5
        per_device_train_batch_size: 4
        gradient_accumulation_steps: 2
        num_generations: 4
        max_completion_length: 6
        max_steps: 2
        logging_steps: 1
        save_strategy: "no"
        bf16: false
        use_cpu: true
        seed: 7
        temperature: 0.9
        top_p: 0.95
        beta: 0.0
        loss_type: dapo
        scale_rewards: false
        report_to: none
        gradient_checkpointing: false
        dtype: float32
        """))
    cli.main(["run", "--trl_config", str(config), "--trainer.enable_progress_bar=false"])
    err = capsys.readouterr().err
    for shown in ("lr_scheduler_type='cosine' -> model.lr_scheduler", "warmup_steps=0.5 -> model.warmup_steps",
                  "-> data.batch_size=2 prompts a process, model.micro_batch_size=4",
                  "max_completion_length=6 -> model.max_completion_length", "seed=7"):
        assert shown in err, shown
    metrics = list(csv.DictReader(open(next((tmp_path / "out").glob("**/metrics.csv")))))
    steps = [r for r in metrics if r.get("reward")]
    assert len(steps) == 2 and "rewards/think_format_reward/mean" in steps[0]
    lrs = [float(r["learning_rate"]) for r in steps]
    assert lrs[0] == pytest.approx(1e-5)  # after the one warm-up step (0.5 of 2), cosine from the peak
    assert lrs[1] == pytest.approx(0.0, abs=1e-12)


def test_the_docs_field_table_is_the_code():
    from pathlib import Path

    from rlcu.grpo.trl_config import markdown_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "from-trl.md").read_text()
    assert page.endswith(markdown_table()), "regenerate with: python -m rlcu.grpo.trl_config"


def test_trls_async_config_streams_with_its_own_defaults(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    fields = dataclasses.fields(AsyncGRPOConfig)
    assert [f.name for f in fields if f.name not in RULES] == []
    t = translate(AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_staleness=2))
    assert t.model["streaming"] and t.model["max_staleness"] == 2 and t.model["max_completion_length"] == 2048
    assert t.model["old_logprobs"] == "engine"  # its loss's ratio is to the sampler's logprobs
    yaml_like = translate({"max_inflight_tasks": 64, "weight_sync_steps": 4})
    assert yaml_like.model["streaming"] and yaml_like.model["max_inflight_tasks"] == 64
    assert (yaml_like.model["max_completion_length"], yaml_like.model["lr_scheduler"]) == (2048, "constant")
    assert any("weight_sync_steps=4: no effect here" in line for line in yaml_like.lines)
    assert yaml_like.model["old_logprobs"] == "engine"
    assert {"streaming", "old_logprobs"}.isdisjoint(translate({"max_completion_length": 64}).model)


def test_steps_per_generation_feeds_several_optimizer_steps_from_one_rollout():
    t = translate({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_generation": 6,
                   "num_generations": 8})
    assert (t.data["batch_size"], t.model["steps_per_rollout"], t.model["micro_batch_size"]) == (6, 3, 8)
    assert translate({"per_device_train_batch_size": 8, "generation_batch_size": 32}).model["steps_per_rollout"] == 4
    assert "steps_per_rollout" not in translate({"per_device_train_batch_size": 8}).model


def test_a_config_objects_derived_generation_batch_size_holds_under_ddp(tmp_path):
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, steps_per_generation=4, num_generations=4)
    for world in (1, 2):  # the object derived generation_batch_size for one process; two translate alike
        t = translate(cfg, world_size=world)
        assert (t.data["batch_size"], t.model["steps_per_rollout"]) == (4, 2)


def test_cast_lm_head_to_fp32_trains_a_float32_head_beside_bf16_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import fit, toy_rows

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    folder = tiny_hf_folder(tmp_path / "m", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2, head_dim=8,
                            tie_word_embeddings=False)
    t = translate({"cast_lm_head_to_fp32": True, "model_init_kwargs": {"dtype": "bfloat16"}})
    assert t.model["cast_lm_head_to_fp32"] is True and t.model["dtype"] == "bfloat16"  # over ModelConfig's float32
    module = GRPOModule.from_trl({"cast_lm_head_to_fp32": True, "model_init_kwargs": {"dtype": "bfloat16"},
                                  "learning_rate": 1e-2, "lr_scheduler_type": "constant",
                                  "per_device_train_batch_size": 8, "num_generations": 4},
                                 model=str(folder), reward_funcs=[length], max_completion_length=4)
    head = module.policy.lm_head.weight
    assert head.dtype == torch.float32 and module.policy.model.norm.weight.dtype == torch.bfloat16
    before = head.detach().clone()
    fit(module, toy_rows(8), 1, tmp_path / "logs")
    assert module.policy.lm_head.weight is head and head.dtype == torch.float32
    assert (head.detach() - before).abs().max() > 1e-4
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32 needs a model rlcu runs natively"):
        GRPOModule(AutoModelForCausalLM.from_pretrained(folder), tokenizer=AutoTokenizer.from_pretrained(folder),
                   cast_lm_head_to_fp32=True)


def test_an_older_configs_max_prompt_length_is_taken_with_a_line():
    t = translate({"max_prompt_length": 256})
    assert t.model["max_prompt_length"] == 256
    assert any(line.startswith("max_prompt_length=256 -> model.max_prompt_length (TRL removed it in 0.28")
               for line in t.lines)


def test_the_trl_scripts_peft_fields_translate_with_expert_targets(tmp_path):
    """`trl grpo --use_peft` with TRL's ModelConfig fields: lora_target_parameters (a mixture of experts' stacked
    projections) and use_rslora reach rlcu's LoRA; the module builds on an MoE model with adapters on its experts."""
    from rlcu.models.lora import expert_adapters

    fields = {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "use_rslora": True,
              "lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    t = translate(fields)
    assert t.model["peft_config"] == {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear",
                                      "use_rslora": True,
                                      "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    folder = tiny_hf_folder(tmp_path, "qwen3_moe")
    module = GRPOModule.from_trl(fields, model=str(folder), reward_funcs=[lambda completions, **kw: [0.0] * len(
        completions)], max_completion_length=8)
    assert module.policy.lora_spec.scaling == 8 / 4 ** 0.5 and len(expert_adapters(module.policy)) == 1  # rsLoRA
    with pytest.raises(ValueError, match="lora_modules_to_save: rlcu trains adapters only"):
        translate({"use_peft": True, "lora_modules_to_save": ["lm_head"]})
