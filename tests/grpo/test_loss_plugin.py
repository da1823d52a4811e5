"""A loss type from a third-party package: registered under the `rlcu.losses` entry-point group by a package
laid out on sys.path as pip installs one (its .dist-info with entry_points.txt), listed by `rlcu plugins`,
chosen by name and trained with; a name that nothing registers is an error naming the group."""
import textwrap

import pytest
import torch

from rlcu import cli
from rlcu.grpo import loss as grpo_loss
from rlcu.grpo import registry
from rlcu.grpo.module import GRPOModule
from tests.helpers import fit, match_target, toy_model, toy_rows

PACKAGE = '''
from rlcu.grpo.loss import token_mean
from rlcu.grpo.registry import AdvantageEstimator, LossType

CALLS = []


def reinforce(terms):
    """Plain REINFORCE: -A log pi per token, no ratio and no clip."""
    CALLS.append(terms.logps.shape)
    return -terms.advantages * terms.logps


def centred(rewards, num_generations, scale):
    grouped = rewards.view(-1, num_generations)
    return (grouped - grouped.mean(1, keepdim=True)).view(-1)


REINFORCE = LossType("reinforce_token_mean", reinforce, token_mean, help="-A log pi, token mean")
CENTRED = AdvantageEstimator("centred", centred, help="reward minus its group mean")
'''


@pytest.fixture
def loss_package(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "my_rl_losses").mkdir(parents=True)
    (site / "my_rl_losses" / "__init__.py").write_text(PACKAGE)
    info = site / "my_rl_losses-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rl-losses\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""
        [rlcu.losses]
        reinforce_token_mean = my_rl_losses:REINFORCE
        centred = my_rl_losses:CENTRED
    """))
    monkeypatch.syspath_prepend(str(site))
    yield
    registry.LOSSES.pop("reinforce_token_mean", None)
    registry.ESTIMATORS.pop("centred", None)


def test_a_third_party_loss_is_listed_and_trains(loss_package, tmp_path, capsys):
    cli.main(["plugins"])
    out = capsys.readouterr().out
    assert "reinforce_token_mean" in out and "from my-rl-losses" in out and "built in: clipped surrogate" in out
    model, tok = toy_model(tmp_path / "m")
    before = [p.detach().clone() for p in model.parameters()]
    module = GRPOModule(model, tokenizer=tok, rewards=[match_target], num_generations=4, max_completion_length=4,
                        seed=0, learning_rate=1e-2, loss_type="reinforce_token_mean", advantage_estimator="centred")
    import my_rl_losses

    step = [m for m in fit(module, toy_rows(4), 1, tmp_path / "logs") if "reward" in m][-1]
    assert my_rl_losses.CALLS, "the plugin's surrogate was not used"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert step["loss"] != 0.0


def test_the_plugin_surrogate_is_what_the_loss_computes(loss_package):
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _, _ = grpo_loss.per_token_loss(logps, logps.detach(), torch.tensor([2.0]), mask,
                                          loss_type="reinforce_token_mean")
    total = grpo_loss.aggregate_loss(loss, mask, "reinforce_token_mean", 3)
    assert float(total.detach()) == pytest.approx(-2.0 * (-1.0 - 2.0) / 2)  # -A log pi, mean over the two masked tokens
    adv = registry.advantage_estimator("centred").advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, "group")
    assert adv.tolist() == [0.5, -0.5, 1.0, -1.0]


def test_an_unregistered_loss_names_the_entry_point_group(tmp_path):
    model, tok = toy_model(tmp_path / "m")
    with pytest.raises(ValueError, match=r"loss_type must be one of \('grpo'.* 'rlcu.losses' entry-point group\), "
                                         r"got 'ppo2'"):
        GRPOModule(model, tokenizer=tok, rewards=[match_target], loss_type="ppo2")
