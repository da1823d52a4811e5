"""Each option is defined once (name, default, help, validation) in a frozen group that checks itself; the one
adapter takes TRL's flat names (and their aliases) to the groups; GRPOModule's signature, help and saved
hyper-parameters come from the same definitions."""
import dataclasses
import inspect

import pytest

from rlcu.grpo import options as O
from rlcu.grpo.module import GRPOModule

EXPLICIT = ["self", "model", "tokenizer", "rewards", "reward_weights", "rollout", "peft_config", "tools",
            "environment_factory", "agent", "reward_funcs", "reward_processing_classes"]


def test_each_option_is_defined_once_with_help_and_reaches_the_signature():
    names = [f.name for g in O.GROUPS for f in dataclasses.fields(g)]
    assert len(names) == len(set(names)), "an option defined in two groups"
    assert all(f.metadata["help"] for g in O.GROUPS for f in dataclasses.fields(g))
    params = inspect.signature(GRPOModule.__init__).parameters
    assert list(params) == EXPLICIT + names
    assert params["temperature"].annotation is float and params["temperature"].default == 1.0
    assert "temperature: [sampling] sampling temperature" in GRPOModule.__init__.__doc__


def test_groups_validate_themselves_with_one_line_naming_the_option():
    with pytest.raises(ValueError, match=r"^num_generations must be >= 2 \(GRPO compares completions within a "
                                         r"group\), got 1$"):
        O.SamplingOptions(num_generations=1)
    with pytest.raises(ValueError, match=r"^scale_rewards must be one of \('group', 'batch', 'none', True, False\), "
                                         r"got 'std'$"):
        O.LossOptions(scale_rewards="std")
    # the loss would divide the logits by it: NaN gradients three steps later
    with pytest.raises(ValueError, match=r"^temperature must be > 0, got 0.0: GRPO learns from the "):
        O.SamplingOptions(temperature=0.0)
    with pytest.raises(ValueError, match=r"^max_staleness=2 bounds the streaming rollout: set streaming=true, or "):
        O.StreamingOptions(max_staleness=2)
    assert O.StreamingOptions(streaming=True, max_staleness=2).max_staleness == 2
    with pytest.raises(ValueError, match="top_p must be <= 1"):
        O.SamplingOptions(top_p=1.5)
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_clip_min \(4\) must be <= "):
        O.CorrectionOptions(vllm_importance_sampling_clip_min=4, vllm_importance_sampling_clip_max=3)
    with pytest.raises(ValueError, match="reward_timeout must be >= 1e-09 seconds"):
        O.FaultOptions(reward_timeout=0)
    with pytest.raises(ValueError, match="master_weights=False updates the weights where they are; optimizer_offload "
                                         "moves fp32 masters to host memory: use one of the two"):
        O.OptimizerOptions(master_weights=False, optimizer_offload=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        O.SamplingOptions().temperature = 0.5


@pytest.mark.parametrize("name, value", [("beta", -0.1), ("epsilon_high", -0.5), ("max_grad_norm", -1.0),
                                         ("weight_decay", -0.01), ("entropy_target", -0.2),
                                         ("off_policy_mask_threshold", -0.5),
                                         ("vllm_importance_sampling_clip_max", -3.0),
                                         ("importance_sampling_clip_min", -1.0)])
def test_a_weight_norm_or_bound_below_zero_is_refused(name, value):
    """A negative max_grad_norm would scale the step by a negative factor (gradient ascent), a negative beta would
    reward drifting from the reference: each is refused in one line."""
    with pytest.raises(ValueError, match=r"^\w+ must be >= 0"):
        O.Options.from_flat({name: value})
    assert O.Options.from_flat({name: 0.0}) is not None  # zero stays allowed: off, or no penalty


def test_the_adapter_groups_flat_names_resolves_aliases_and_names_unknown_ones():
    opts = O.Options.from_flat({"temperature": 0.7, "learning_rate": 3e-6, "importance_sampling_mode": "token_mask",
                                "num_generations_eval": 2, "adam_betas": [0.9, 0.99]})
    assert opts.sampling.temperature == 0.7 and opts.optimizer.learning_rate == 3e-6
    assert opts.correction.mode == "token_mask" and opts.evaluation.eval_num_samples == 2
    assert opts.optimizer.adam_betas == (0.9, 0.99)
    flat = opts.flat()
    assert flat["vllm_importance_sampling_mode"] == "token_mask" and "importance_sampling_mode" not in flat
    assert O.Options.from_flat(flat) == opts  # what a checkpoint saves builds the same options
    with pytest.raises(TypeError, match="unknown GRPO option 'learning_rat'; did you mean 'learning_rate'"):
        O.Options.from_flat({"learning_rat": 1e-5})
    with pytest.raises(ValueError, match="num_generations_eval and eval_num_samples are one option"):
        O.Options.from_flat({"num_generations_eval": 2, "eval_num_samples": 8})


def test_sampling_options_build_the_samplers_parameters():
    s = O.SamplingOptions(max_completion_length=9, temperature=0.5, top_k=3, stop=["</a>"])
    p = s.params([2], seed=7)
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.stop_token_ids, p.seed) == (9, 0.5, 3, ["</a>"], [2], 7)
    assert s.params([2], greedy=True).temperature == 0.0


def test_the_module_keeps_its_options_and_saves_them_flat(tmp_path):
    from tests.helpers import match_target, toy_model

    model, tok = toy_model(tmp_path)
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, loss_type="grpo",
                        importance_sampling_correction=False)
    assert module.options.sampling.num_generations == 4 and module.options.loss.loss_type == "grpo"
    assert module.hparams["num_generations"] == 4 and module.hparams["vllm_importance_sampling_correction"] is False
    assert "importance_sampling_correction" not in module.hparams  # saved under its one name
    with pytest.raises(TypeError, match="unknown GRPO option 'num_generation'; did you mean 'num_generations'"):
        GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generation=4)


def test_a_value_of_the_wrong_type_is_one_line_naming_the_option_and_its_type():
    """Where a bound's comparison raised "'<' not supported between instances of 'str' and 'int'"."""
    import numpy as np

    with pytest.raises(ValueError, match=r"^num_generations must be an integer, got '8' \(str\)$"):
        O.SamplingOptions(num_generations="8")
    with pytest.raises(ValueError, match=r"^num_generations must be an integer, got 8.0 \(float\)$"):
        O.SamplingOptions(num_generations=8.0)
    with pytest.raises(ValueError, match=r"^packing must be true or false, got 1 \(int\)$"):
        O.OptimizerOptions(packing=1)
    with pytest.raises(ValueError, match=r"^epsilon must be a number, got True \(bool\)$"):
        O.LossOptions(epsilon=True)
    with pytest.raises(ValueError, match=r"^max_grad_norm must be a number or null, got 'high' \(str\)$"):
        O.OptimizerOptions(max_grad_norm="high")
    with pytest.raises(ValueError, match=r"^learning_rate is NaN: give a number$"):
        O.OptimizerOptions(learning_rate=float("nan"))
    # YAML 1.1 reads 1e-5 as text; a float option takes an int, and numpy's scalars (a sweep's)
    assert O.OptimizerOptions(learning_rate="1e-5").learning_rate == 1e-5
    assert O.SamplingOptions(temperature=1, num_generations=np.int64(4)).num_generations == 4
    assert O.LossOptions(scale_rewards=False, beta=np.float32(0.5)).scale_rewards == "none"  # TRL's false


def test_run_help_and_the_printed_config_show_each_option_with_its_group(capsys):
    from rlcu import cli

    with pytest.raises(SystemExit):
        cli.main(["run", "quickstart", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model.temperature TEMPERATURE [sampling] sampling temperature (> 0: the loss's logprobs" in out
    assert "--model.loss_type LOSS_TYPE [loss] grpo | bnpo" in out
    with pytest.raises(SystemExit):
        cli.main(["run", "quickstart", "--print_config=comments"])
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("  epsilon: 0.2")
    assert lines[at - 1].startswith("  # [loss] clip range (type: float, default: 0.2)")
