"""old_logprobs='engine': with num_iterations > 1 the sampler's logprobs stand in for the extra forward pass,
and (in fp32, where engine and trainer agree to 1e-4) the updates match the recomputed ones; with one iteration
they are the ratio's old logprobs all the same (TRL's AsyncGRPOTrainer's ratio)."""

import torch

from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from tests.helpers import fit, match_target, tiny_hf_folder, toy_rows


def tiny_module(tmp_path, **options):
    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "llama", vocab_size=32, hidden=32, heads=4, kv_heads=2,
                                           head_dim=8))
    return GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=4,
                      learning_rate=1e-2, rollout="native", micro_batch_size=8, **options)


def run(tmp_path, mode):
    module = tiny_module(tmp_path, num_iterations=2, old_logprobs=mode)
    passes = []
    real = module.update_phase._logps
    module.update_phase._logps = lambda m, b, rows, grad: passes.append(grad) or real(m, b, rows, grad)
    fit(module, toy_rows(8), 4, tmp_path / "logs")  # 4 optimizer steps: 2 batches x 2 iterations
    return [p.detach() for p in module.policy.parameters()], passes


def test_engine_logprobs_replace_the_extra_forward(tmp_path):
    recomputed, passes_trainer = run(tmp_path / "a", "trainer")
    engine, passes_engine = run(tmp_path / "b", "engine")
    assert passes_trainer.count(False) == 2 * 2 and passes_engine.count(False) == 0  # 2 micro-batches x 2 batches
    assert passes_engine.count(True) == passes_trainer.count(True)
    worst = max((a - b).abs().max().item() for a, b in zip(recomputed, engine))
    assert worst < 1e-4, worst


def test_with_one_iteration_engine_puts_the_samplers_logprobs_in_the_ratio(tmp_path, monkeypatch):
    from rlcu.grpo import update

    module = tiny_module(tmp_path, old_logprobs="engine")
    seen, staged, real_loss, real_batch = [], [], update.grpo_loss.per_token_loss, update.StagedBatch.of

    def staged_with_one_unknown(*a, **k):  # a sampler logprob not known (NaN) counts as the trainer's own
        batch = real_batch(*a, **k)
        batch.rows.sampler_logps[0, 0] = float("nan")
        staged.append(batch.rows.sampler_logps.clone())
        return batch

    monkeypatch.setattr(update.StagedBatch, "of", staged_with_one_unknown)
    monkeypatch.setattr(update.grpo_loss, "per_token_loss",
                        lambda logps, old, *a: seen.append((logps.detach(), old)) or real_loss(logps, old, *a))
    passes = []
    real = module.update_phase._logps
    module.update_phase._logps = lambda m, b, rows, grad: passes.append(grad) or real(m, b, rows, grad)
    fit(module, toy_rows(8), 2, tmp_path / "logs")
    assert passes.count(False) == 0 and len(staged) == 2  # no forward pass for the old policy
    per_step = len(seen) // 2
    for step, sampler in enumerate(staged):
        logps, old = (torch.cat(t) for t in zip(*seen[step * per_step:(step + 1) * per_step]))
        assert old[0, 0] == logps[0, 0] and not old.isnan().any()
        assert torch.equal(old.flatten()[1:], sampler.to(old).flatten()[1:])  # the sampler's, as drawn
        assert not torch.equal(old, logps)
