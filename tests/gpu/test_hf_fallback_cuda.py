"""The transformers fallback's decode as CUDA graphs (`rlcu/models/hf_decode.py`), run on the H200: each
cache width captured once, replays equal to the same decoder run eagerly, and tokens equal to transformers'
own generate."""
import pytest
import torch
import transformers

from rlcu.models import hf_decode
from rlcu.models.hf import HFCausalLM
from rlcu.rollout import SamplingParams
from tests.helpers import PROMPTS, reference_generate, tiny_hf_folder

pytestmark = pytest.mark.gpu


def _rollouts(model, sp, graphs: bool, monkeypatch):
    monkeypatch.setattr(hf_decode.StaticDecoder, "__init__", _with_graphs(hf_decode.StaticDecoder.__init__, graphs))
    return reference_generate(model, PROMPTS, sp)


def _with_graphs(init, graphs):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_graphs = graphs
    return patched


@pytest.mark.parametrize("family", ["gpt_neox", "llama", "mistral"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_graph_replays_equal_the_eager_static_decoder(tmp_path, family, autocast, monkeypatch):
    monkeypatch.setattr(hf_decode, "COLS", 8)
    folder = tiny_hf_folder(tmp_path, family, hidden=128, heads=4, kv_heads=2, head_dim=32)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)).cuda()
    captured = []
    capture = hf_decode.StaticDecoder._capture
    monkeypatch.setattr(hf_decode.StaticDecoder, "_capture",
                        lambda self, *a: (captured.append(a[-1]), capture(self, *a))[1])
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        eager = _rollouts(model, sp, False, monkeypatch)
        graphed = _rollouts(model, sp, True, monkeypatch)
    assert len(captured) >= 3 and model.static_decoding  # 33 prompt columns + 24 tokens: widths 40, 48, 56, 64
    assert graphed.completion_ids == eager.completion_ids
    assert graphed.logprobs == eager.logprobs


def test_graphed_greedy_equals_transformers_generate(tmp_path):
    folder = tiny_hf_folder(tmp_path, "gpt_neox", hidden=128, heads=4, kv_heads=4, head_dim=32)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)).cuda()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    out = reference_generate(model, PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    want = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                        pad_token_id=62)[0, len(p):].tolist() for p in PROMPTS]
    same = sum(a == b for a, b in zip(out.completion_ids, want))
    assert same >= len(PROMPTS) - 1, f"{same}/{len(PROMPTS)} identical"
