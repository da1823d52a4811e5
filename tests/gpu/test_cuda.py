"""The same module on a CUDA device: run on the H200 with `pytest -m gpu` (skipped on CPU)."""
import pytest
import torch

from rlcu.grpo.module import GRPOModule
from rlcu.models import load_model
from tests.helpers import fit, grpo_batch, tiny_hf_folder

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-3), (torch.bfloat16, 0.1)])
def test_cuda_logits_match_cpu_fp32(tmp_path, dtype, atol):
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3"))
    ids = torch.randint(0, 62, (3, 37))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        cpu = model.logits(ids, mask)
        gpu = model.to("cuda", dtype).logits(ids.cuda(), mask.cuda()).float().cpu()
    assert (gpu - cpu)[mask.bool()].abs().max() < atol


@pytest.mark.parametrize("rollout", ["native", "reference"])
def test_grpo_learns_on_cuda(tmp_path, rollout):
    from tests.helpers import assert_rises, run_toy

    metrics = run_toy(tmp_path, accelerator="gpu", rollout=rollout)
    assert_rises([m["reward"] for m in metrics if "reward" in m], f"{rollout} on cuda")


@pytest.mark.slow
def test_smollm2_grpo_bf16_mixed_on_cuda(tmp_path, smollm2_folder):
    from rlcu.data.tasks import arithmetic

    module = GRPOModule("smollm2-135m-instruct", rewards=["math_answer", {"name": "overlong_penalty", "init_args": {
        "max_length": 16, "cache_length": 8}}], num_generations=8, max_completion_length=16, learning_rate=1e-5)
    start = [p.detach().clone() for p in module.policy.parameters()]
    metrics = fit(module, arithmetic(64), 3, tmp_path, accelerator="gpu", precision="bf16-mixed")
    changed = sum(not torch.equal(a, p.detach().cpu()) for a, p in zip(start, module.policy.parameters()))
    assert changed > 0.9 * len(start)
    last = [m for m in metrics if "reward" in m][-1]
    assert last["logprob_mismatch/mean"] < 0.05  # sampler and trainer both under bf16 autocast


def test_memory_does_not_grow_over_100_grpo_steps(tmp_path):
    """The engine's KV pool is taken for each rollout and released for training: after warm-up, the
    memory held between steps stays flat."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from rlcu.data.prompts import collate_rows
    from tests.helpers import match_target, toy_rows

    model, tok = load_model(tiny_hf_folder(tmp_path / "m", "qwen3", vocab_size=32, hidden=64, heads=4, kv_heads=2,
                                           head_dim=16))
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=8, max_completion_length=4,
                        learning_rate=5e-3, micro_batch_size=16)
    held = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())

    trainer = L.Trainer(max_steps=100, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[Probe()])
    trainer.fit(module, DataLoader(toy_rows(400), batch_size=4, collate_fn=collate_rows))
    assert len(held) == 100
    assert max(held[10:]) <= held[10] * 1.01 + 1024, f"memory grew: {held[10]} -> {max(held[10:])} bytes"


@pytest.mark.parametrize("autocast", [False, True])
def test_packed_varlen_flash_matches_padded_in_bf16(tmp_path, autocast):
    """The padding-free forward through torch's variable-length flash attention (bf16 weights, or fp32
    weights under bf16 autocast as the recipes run) against the padded forward; gradients included."""
    from rlcu.grpo.logprobs import completion_logprobs
    from rlcu.models.attention import _varlen

    if _varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen: packing uses SDPA with a block-diagonal mask")
    model, _ = load_model(tiny_hf_folder(tmp_path, "qwen3", hidden=128, heads=8, kv_heads=2, head_dim=64))
    model.to("cuda", torch.float32 if autocast else torch.bfloat16)
    ids, mask, c = grpo_batch([9, 30, 4, 17], [12, 3, 20, 7])
    ids, mask = ids.cuda(), mask.cuda()
    real = mask[:, -c:].bool()
    out = []
    for packed in (False, True):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logps, _ = completion_logprobs(model, ids, mask, c, packed=packed)
        logps[real].sum().backward()
        out.append((logps.detach().float(), torch.cat([q.grad.float().flatten() for q in model.parameters()])))
    (padded, g0), (packed_lp, g1) = out
    assert (padded - packed_lp)[real].abs().max() < 0.1  # bf16 logits over 64 classes
    assert (g0 - g1).norm() / g0.norm() < 0.05
