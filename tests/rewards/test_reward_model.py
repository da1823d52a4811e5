"""A reward model (a sequence classifier) scores completions as TRL's GRPOTrainer scores them: the reward model's
chat template over prompt + completion, right padding, no special tokens, the first logit; checked against
transformers' own forward of a tiny random LlamaForSequenceClassification saved to a folder."""
import math
import re

import pytest
import torch
import transformers

from rlcu.data.tokenizers import word_tokenizer
from rlcu.rewards.base import resolve_reward, resolve_rewards
from rlcu.rewards.scoring import score
from tests.helpers import CHAT_TEMPLATE, fit, toy_model, toy_rows

PROMPTS = [[{"role": "user", "content": "t1 t2"}], [{"role": "user", "content": "t3"}]]
COMPLETIONS = [[{"role": "assistant", "content": "t4 t5 t6"}], [{"role": "assistant", "content": "t7"}]]


@pytest.fixture
def reward_folder(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=30)
    model = transformers.LlamaForSequenceClassification(config).eval()
    tokenizer = word_tokenizer(32)
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm", model, tokenizer


def transformers_scores(model, tokenizer, prompts, completions):
    out = []
    for p, c in zip(prompts, completions):  # one at a time: no padding at all
        text = tokenizer.apply_chat_template(p + c, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_a_reward_model_folder_scores_as_transformers_does(reward_folder):
    folder, model, tokenizer = reward_folder
    reward = resolve_reward(str(folder))
    assert reward.name == "rm"
    got = reward.fn(PROMPTS, COMPLETIONS)
    assert got == pytest.approx(transformers_scores(model, tokenizer, PROMPTS, COMPLETIONS), abs=1e-5)
    texts = reward.fn(["t1 ", "t3 "], ["t4 t5", "t7"])  # text prompts: prompt + completion
    assert len(texts) == 2 and all(math.isfinite(v) for v in texts)


def test_a_reward_model_object_takes_its_processing_class(reward_folder):
    _, model, tokenizer = reward_folder
    (bound,) = resolve_rewards([model], processing_classes=[tokenizer])
    assert bound.fn(PROMPTS, COMPLETIONS) == pytest.approx(transformers_scores(model, tokenizer, PROMPTS,
                                                                                COMPLETIONS), abs=1e-5)
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries for 1 rewards"):
        resolve_rewards([model], processing_classes=[tokenizer, tokenizer])


def test_a_reward_model_that_returns_nan_is_a_fault_like_any_reward(reward_folder):
    from rlcu.rewards.base import NonFiniteReward

    folder, _, _ = reward_folder
    reward = resolve_reward(str(folder))
    with torch.no_grad():
        reward.fn.model.score.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteReward, match="reward 'rm' returned nan"):
        score([reward], PROMPTS, COMPLETIONS, [[4, 5, 6], [7]], {})


def test_grpo_trains_a_step_on_a_reward_model(reward_folder, tmp_path):
    from rlcu.grpo.module import GRPOModule

    folder, _, _ = reward_folder
    model, tok = toy_model(tmp_path / "m")
    module = GRPOModule(model, tokenizer=tok, rewards=[str(folder)], num_generations=4, max_completion_length=4,
                        learning_rate=1e-2)
    step = [m for m in fit(module, toy_rows(4, chat=True), 1, tmp_path / "logs") if "reward" in m][-1]
    assert "rewards/rm/mean" in step and step["reward_std"] > 0


@pytest.mark.parametrize("on_error", ["raise", "none"])
def test_a_reward_model_out_of_memory_goes_through_on_reward_error(reward_folder, monkeypatch, on_error):
    from rlcu.rewards.base import RewardError

    folder, _, _ = reward_folder
    reward = resolve_reward(str(folder))

    def forward(**batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(reward.fn.model, "forward", forward)
    if on_error == "raise":
        with pytest.raises(RewardError, match="reward model 'rm' ran out of memory scoring 2 texts.*lower its "
                                              "batch_size"):
            score([reward], PROMPTS, COMPLETIONS, [[4, 5, 6], [7]], {})
    else:
        out = score([reward], PROMPTS, COMPLETIONS, [[4, 5, 6], [7]], {}, on_error="none")
        assert torch.isnan(out).all() and out.shape == (2, 1)


@pytest.mark.parametrize("logits", [torch.zeros(2), torch.zeros(3, 1)], ids=["one-dimensional", "a row too many"])
def test_a_reward_model_with_the_wrong_output_shape_is_an_error_naming_it(reward_folder, monkeypatch, logits):
    from rlcu.rewards.base import RewardError

    folder, _, _ = reward_folder
    reward = resolve_reward(str(folder))
    output = transformers.modeling_outputs.SequenceClassifierOutput(logits=logits)
    monkeypatch.setattr(reward.fn.model, "forward", lambda **batch: output)
    says = f"reward model 'rm' returned logits of shape {tuple(logits.shape)} for 2 texts; a reward model"
    with pytest.raises(RewardError, match=re.escape(says)):
        score([reward], PROMPTS, COMPLETIONS, [[4, 5, 6], [7]], {})
    out = score([reward], PROMPTS, COMPLETIONS, [[4, 5, 6], [7]], {}, on_error="none")
    assert torch.isnan(out).all()
