"""A TRL user's options and rewards as TRL defines them: each case below failed before rlcu took TRL's meaning."""
import pytest
import torch

from rlcu.grpo.module import GRPOModule
from rlcu.rewards.base import resolve_reward
from tests.grpo.test_module import make
from tests.helpers import fit, match_target, toy_rows


def last_step(metrics):
    return [m for m in metrics if "reward" in m][-1]


def test_rewards_read_trainer_state_as_attributes_and_log_metrics_and_columns(tiny, tmp_path):
    seen = []

    def progress(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((trainer_state.global_step, trainer_state["max_steps"]))
        log_metric("my/fraction_long", sum(len(c) > 3 for c in completions) / len(completions))
        log_extra("chars", [len(c) for c in completions])
        return [float(len(c)) for c in completions]

    module = make(tiny, rewards=[progress])
    step = last_step(fit(module, toy_rows(8), steps=2, log_dir=tmp_path))
    assert seen == [(0, 2), (1, 2)]  # TRL's TrainerState: the step before this one's update, and the run's steps
    assert 0.0 <= step["my/fraction_long"] <= 1.0
    assert module.last_rollout.extra["chars"] == [len(c) for c in module.last_rollout.completions]


def test_trl_booleans_and_nones_mean_what_trl_means(tiny, tmp_path):
    assert make(tiny, scale_rewards=False).options.loss.scale_rewards == "none"
    assert make(tiny, scale_rewards=True).options.loss.scale_rewards == "group"
    module = make(tiny, min_p=None)  # TRL's default: no min-p filter
    assert module.sampling_params().min_p == 0.0
    fit(module, toy_rows(4), steps=1, log_dir=tmp_path)


def test_warmup_steps_below_one_is_a_ratio_of_the_run(tiny, tmp_path):
    module = make(tiny, lr_scheduler_type="linear", warmup_steps=0.25)  # TRL's names: 1 of the 4 steps warms up
    lrs = [m["learning_rate"] for m in fit(module, toy_rows(16), steps=4, log_dir=tmp_path) if "learning_rate" in m]
    assert lrs == pytest.approx([1e-2 * f for f in (1.0, 2 / 3, 1 / 3, 0.0)])
    assert module.options.optimizer.lr_scheduler == "linear"


def test_reward_funcs_is_trls_name_of_rewards(tiny):
    assert [r.name for r in make(tiny, rewards=("math_answer",), reward_funcs=[match_target]).rewards] == \
        ["match_target"]
    with pytest.raises(ValueError, match="reward_funcs and rewards are one argument"):
        make(tiny, rewards=["format_tags"], reward_funcs=[match_target])


def test_trls_reward_names_and_factories_resolve():
    trl_rewards = pytest.importorskip("trl.rewards")
    assert resolve_reward("accuracy_reward").fn is trl_rewards.accuracy_reward
    chat = [[{"role": "assistant", "content": "so \\boxed{4}"}], [{"role": "assistant", "content": "5"}]]
    assert resolve_reward("accuracy_reward").fn(chat, solution=["4", "4"]) == [1.0, 0.0]
    # a factory with its arguments, as YAML gives them: {name: ..., init_args: {...}}
    punish = resolve_reward({"name": "get_soft_overlong_punishment",
                             "init_args": {"max_completion_len": 10, "soft_punish_cache": 4}, "weight": 0.5})
    assert punish.weight == 0.5
    assert punish.fn(completion_ids=[[1] * 5, [1] * 8, [1] * 12]) == [0.0, -0.5, -1.0]


def test_normalize_then_sum_is_trls_aggregation():
    from rlcu.grpo.loss import nanstd, normalize_then_sum

    per_func = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, float("nan")], [1.0, 1.0]])
    weights = torch.tensor([1.0, 0.5])
    adv, zero = normalize_then_sum(per_func, weights, num_generations=2)
    # TRL 1.16's steps (grpo_trainer._calculate_rewards), written out for groups of 2
    g = per_func.view(2, 2, 2)
    z = ((g - torch.nanmean(g, 1, keepdim=True)) / (nanstd(g, 1).unsqueeze(1) + 1e-4)).view(4, 2)
    summed = (z * weights).nansum(1)
    expected = (summed - summed.mean()) / (nanstd(summed) + 1e-4)
    assert torch.allclose(adv, expected) and not zero.any()
    with pytest.raises(ValueError, match="normalize_then_sum.*advantage_estimator='grpo'"):
        from rlcu.grpo.options import LossOptions

        LossOptions(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo")


def test_chat_template_kwargs_reach_the_template(tmp_path):
    from rlcu.models import load_model
    from tests.helpers import tiny_hf_folder

    template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}t9{% endif %}")
    model, tok = load_model(tiny_hf_folder(tmp_path, "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8, chat_template=template))
    prompt = [{"role": "user", "content": "t1 t2"}]
    plain = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=2).encode(prompt, 0)
    quiet = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=2,
                       chat_template_kwargs={"enable_thinking": False}).encode(prompt, 0)
    assert quiet == plain + tok.convert_tokens_to_ids(["t9"])

    # the tool format of episodes and of agent programs renders with them too, as TRL's tool loop does
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    for tools_or_agent in ({"tools": [add], "tool_format": "hermes"},
                           {"agent": "tests.agents.test_programs:three_calls", "tool_format": "hermes"}):
        module = GRPOModule(model, tokenizer=tok, num_generations=2, chat_template_kwargs={"enable_thinking": False},
                            **tools_or_agent)
        fmt = module.agent.format if module.agent is not None else module.program[1]
        assert fmt.prompt_ids(prompt, None) == quiet


def test_reward_models_render_with_the_runs_chat_template_kwargs(tmp_path):
    """TRL applies chat_template_kwargs to a reward model's template as well."""
    import transformers

    from rlcu.models import load_model
    from rlcu.rewards.model import RewardModel
    from tests.helpers import tiny_hf_folder

    template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}t9{% endif %}")
    model, tok = load_model(tiny_hf_folder(tmp_path / "p", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8, chat_template=template))
    scorer = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_labels=1, pad_token_id=30))
    module = GRPOModule(model, tokenizer=tok, num_generations=2, reward_funcs=[scorer], reward_processing_classes=[tok],
                        chat_template_kwargs={"enable_thinking": False})
    reward = next(r.fn for r in module.rewards if isinstance(r.fn, RewardModel))
    texts = reward.texts([[{"role": "user", "content": "t1"}]], [[{"role": "assistant", "content": "t2"}]])
    assert texts == ["t1 t2 t9"]


def test_sync_ref_model_mixes_the_policy_into_the_reference(tiny, tmp_path):
    module = make(tiny, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    start = [p.detach().clone() for p in module.ref_model.parameters()]
    fit(module, toy_rows(4), steps=1, log_dir=tmp_path)
    for ref, live, before in zip(module.ref_model.parameters(), module.policy.parameters(), start):
        assert torch.allclose(ref, 0.5 * before + 0.5 * live.detach())
    assert any(not torch.equal(r, b) for r, b in zip(module.ref_model.parameters(), start))
    with pytest.raises(ValueError, match="sync_ref_model moves the reference of the KL term"):
        make(tiny, sync_ref_model=True)


def test_log_unique_prompts_keeps_one_row_a_prompt(tiny, tmp_path):
    import json
    from types import SimpleNamespace

    from rlcu.callbacks import CompletionsTable
    from rlcu.grpo.batch import ScoredRollout

    for unique, expected in ((False, 4), (True, 2)):
        module = make(tiny, log_unique_prompts=unique)
        module.last_rollout = ScoredRollout(["p1", "p1", "p2", "p2"], ["a", "b", "c", "d"], torch.zeros(4, 1),
                                            torch.zeros(4))
        folder = tmp_path / str(unique)
        trainer = SimpleNamespace(global_step=1, log_dir=str(folder), default_root_dir=str(folder),
                                  is_global_zero=True, loggers=[])
        CompletionsTable(every_n_steps=1).on_train_batch_end(trainer, module, None, None, 0)
        rows = [json.loads(line) for line in open(folder / "completions.jsonl")]
        assert len(rows) == expected


def test_steps_per_rollout_slices_a_rollout_over_optimizer_steps_on_its_own_policy(tiny, tmp_path, monkeypatch):
    """TRL's steps_per_generation > gradient_accumulation_steps: a rollout's rows, shuffled, split into slices,
    one optimizer step each, num_iterations passes over them; every slice's old logprobs are the rollout's
    policy's, taken before the first step."""
    from rlcu.grpo.update import Update

    seen = []
    accumulate, old_logprobs = Update._accumulate, Update._old_logprobs

    def recording(self, part, old, *args):
        seen.append((sorted(map(tuple, part.rows.input_ids.tolist())), old))
        return accumulate(self, part, old, *args)

    def old_before_any_step(self, part, slices=1):
        assert self.host.global_step == 0  # computed for every slice before the first step
        return old_logprobs(self, part, slices)

    monkeypatch.setattr(Update, "_accumulate", recording)
    monkeypatch.setattr(Update, "_old_logprobs", old_before_any_step)
    module = make(tiny, steps_per_rollout=2, num_iterations=2, learning_rate=0.05)
    fit(module, toy_rows(8), steps=4, log_dir=tmp_path)
    assert module.global_step == 4 and len(seen) == 4  # one rollout: 2 slices x 2 passes
    (a, old_a), (b, old_b), (c, _), (d, _) = seen
    assert len(a) == len(b) == 8 and sorted(a + b) == sorted(c + d)  # each row once a pass, the same slices again
    assert a != b and old_a is not None and old_b is not None
    assert [s for s, _ in seen] == [a, b, a, b]
