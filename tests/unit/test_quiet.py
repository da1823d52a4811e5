"""What rlcu silences (rlcu/quiet.py) is silenced, and other warnings still show."""
import warnings

from lightning.pytorch.utilities import rank_zero_warn

from rlcu import quiet


def test_lightnings_note_on_checkpoints_after_a_manual_step_is_silenced_and_other_warnings_show(monkeypatch):
    """Lightning 2.6's ModelCheckpoint warns at every periodic save of a module that optimizes by hand (GRPOModule),
    eleven lines proposing to save the state before the step; the state after it is what a run resumes from."""
    monkeypatch.setattr(quiet, "_installed", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()  # in front of "always", as in front of Python's defaults in a run
        rank_zero_warn("Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
                       "pre-optimization state was saved. The checkpoint will contain the model state AFTER "
                       "optimization.")
        rank_zero_warn("The number of training batches (1) is smaller than the logging interval")
    assert [str(w.message) for w in caught] == ["The number of training batches (1) is smaller than the logging "
                                                 "interval"]
