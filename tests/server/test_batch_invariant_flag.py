"""`infero serve --batch-invariant` (and INFERO_BATCH_INVARIANT): off unless asked, the flag wins over the
environment, a value that is not a switch is a clear error; `infero generate --batch-invariant` runs."""

import argparse

import pytest

from infero.errors import InferoError
from infero.server.serve import add_arguments, batch_invariant


def test_the_flag_and_its_environment_variable(monkeypatch):
    monkeypatch.delenv("INFERO_BATCH_INVARIANT", raising=False)

    def invariant(argv):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return batch_invariant(parser.parse_args(argv))

    assert not invariant([]) and invariant(["--batch-invariant"]) and not invariant(["--no-batch-invariant"])
    monkeypatch.setenv("INFERO_BATCH_INVARIANT", "on")
    assert invariant([]) and not invariant(["--no-batch-invariant"])
    monkeypatch.setenv("INFERO_BATCH_INVARIANT", "sometimes")
    with pytest.raises(InferoError, match="INFERO_BATCH_INVARIANT"):
        invariant([])
