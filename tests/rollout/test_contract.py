"""The rollout contract: capabilities are declared, read once and named in errors; the module's one adapter
gives each backend only what it declared it takes, and runs episodes turn by turn for the others."""
from pathlib import Path

import pytest

from rlcu.contracts import Reply, RolloutBatch, SamplingParams, continuation_workers
from rlcu.grpo.module import GRPOModule
from rlcu.rollout import Capabilities, capabilities_of, resolve_rollout, turns
from tests.helpers import match_target, toy_model


class Plain:
    """A backend that declares nothing: generate(prompt_token_ids, sampling) and no keyword at all."""

    def __init__(self):
        self.calls = []

    def setup(self, policy, tokenizer):
        self.bound = (policy, tokenizer)

    def generate(self, prompt_token_ids, sampling):
        self.calls.append([list(p) for p in prompt_token_ids])
        out = [[7] * min(2, sampling.max_tokens) for _ in prompt_token_ids]
        return RolloutBatch([list(p) for p in prompt_token_ids], out, [[-1.0] * len(c) for c in out],
                            ["length"] * len(out))

    def release(self):
        pass

    def on_weights_updated(self):
        pass


class Episodic(Plain):
    capabilities = Capabilities(continuation=True, on_finished=True)

    def generate(self, prompt_token_ids, sampling, continuation=None, on_finished=None):
        self.hooks = (continuation, on_finished)
        return super().generate(prompt_token_ids, sampling)


def test_capabilities_are_declared_and_default_to_none():
    assert capabilities_of(Plain()) == Capabilities()
    assert capabilities_of(resolve_rollout("native")).names() == ["continuation", "on_finished", "exact_numerics",
                                                                 "lora", "streaming", "interruptible",
                                                                 "native_models_only", "spawns"]
    assert capabilities_of(resolve_rollout("reference")).names() == ["lora", "interruptible"]
    bad = Plain()
    bad.capabilities = {"lora": True}
    with pytest.raises(TypeError, match=r"Plain.capabilities must be rlcu.rollout.Capabilities"):
        resolve_rollout(bad)


def test_the_adapter_passes_hooks_only_to_a_backend_that_declares_them():
    sampling = SamplingParams(max_tokens=8)
    plain, episodic = Plain(), Episodic()
    turns.generate(plain, [[1, 2]], sampling, on_finished=print)  # would raise TypeError if passed on
    assert plain.calls == [[[1, 2]]]

    def one_more_turn(turn):  # a tool that answers once with two tokens, then ends the episode
        return Reply(None, "stop") if len(turn.completion_ids) > 2 else Reply([9, 9])

    out = turns.generate(plain, [[1, 2]], sampling, continuation=one_more_turn)
    assert plain.calls[1:] == [[[1, 2]], [[1, 2, 7, 7, 9, 9]]]  # turn by turn, each turn its whole history
    assert out.completion_ids == [[7, 7, 9, 9, 7, 7]] and out.tool_mask == [[1, 1, 0, 0, 1, 1]]
    turns.generate(episodic, [[1]], sampling, continuation=one_more_turn)
    assert episodic.hooks == (one_more_turn, None) and len(episodic.calls) == 1  # the backend ran the episode
    turns.generate(episodic, [[1]], sampling, on_finished=print)
    assert episodic.hooks == (None, print)


def test_the_module_binds_the_backend_to_its_policy_and_tokenizer(tmp_path: Path):
    model, tok = toy_model(tmp_path)
    backend = Plain()
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], rollout=backend, num_generations=2)
    module.setup("fit")
    assert backend.bound == (module.policy, module.tokenizer)


@pytest.mark.parametrize("option, capability", [({"score_during_generation": True}, "on_finished"),
                                                ({"peft_config": {"r": 2, "target_modules": "all-linear"}}, "lora")])
def test_an_option_that_needs_a_missing_capability_is_refused_at_construction(tmp_path, option, capability):
    model, tok = toy_model(tmp_path)
    with pytest.raises(ValueError, match=f"needs a rollout backend with the '{capability}' capability .* Plain does "
                                         "not declare it: use rollout: native"):
        GRPOModule(model, tokenizer=tok, rewards=[match_target], rollout=Plain(), num_generations=2, **option)


def test_backend_abilities_are_never_guessed_from_signatures():
    root = Path(__file__).resolve().parents[2] / "rlcu"
    guessed = [p.name for p in root.rglob("*.py") if "takes(" in p.read_text()]
    # where a backend is set up and called (grpo/options.py builds GRPOModule's own signature: not a guess)
    callers = [*(root / "rollout").rglob("*.py"), *(root / "grpo" / n for n in ("module.py", "score_phase.py",
                                                                              "update.py", "evaluation.py"))]
    inspected = [p.name for p in callers if "inspect.signature(" in p.read_text()]
    assert guessed == [] and inspected == []


def test_the_engines_numerics_are_the_modules_option_alone():
    from rlcu.rollout.native import NativeRollout

    with pytest.raises(ValueError, match="set exact_logprobs .*not rollout.init_args.engine.numerics"):
        NativeRollout({"numerics": "exact"})


def test_a_continuation_declares_how_many_of_its_turns_may_wait_at_once():
    def tools(turn):
        return Reply(None)

    class Team:
        waiting_turns = 40

        def __call__(self, turn):
            return Reply(None)

    assert continuation_workers(tools, 16) == 16 and continuation_workers(Team(), 16) == 40
    Team.waiting_turns = "40"
    with pytest.raises(TypeError, match="waiting_turns must be a non-negative int"):
        continuation_workers(Team(), 16)
