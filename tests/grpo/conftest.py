import pytest

from tests.helpers import toy_model


@pytest.fixture
def tiny(tmp_path):
    """(model, tokenizer) of the toy task."""
    return toy_model(tmp_path / "m")
