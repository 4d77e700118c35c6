"""The CPU backend's BLAS thread count (--cpu-threads, INFERO_CPU_THREADS, else 1) and the serve flags that show
the backends' defaults."""

import argparse

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from infero import LLM
from infero.backends.cpu import CpuBackend
from infero.backends.cpu.threads import ENV, set_blas_threads
from infero.engine.engine import EngineConfig
from infero.errors import InferoError
from infero.server import serve


def blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


@pytest.fixture(autouse=True)
def restore_blas_threads(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    before = blas_threads()
    yield
    set_blas_threads(max(before))


def test_numpy_uses_a_blas_that_threadpoolctl_controls():
    assert np.__name__ == "numpy" and blas_threads()  # numpy is loaded, so its BLAS must be listed


def test_the_cpu_backend_runs_one_blas_thread_by_default(tiny_model_path):
    set_blas_threads(2)
    llm = LLM(tiny_model_path, device="cpu")
    assert llm.backend.threads == 1 and blas_threads() == {1}


def test_the_configured_thread_count_wins_over_the_environment(tiny_model_path, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    llm = LLM(tiny_model_path, device="cpu", engine_config=EngineConfig(cpu_threads=2))
    assert llm.backend.threads == 2 and blas_threads() == {2}


def test_the_environment_sets_the_thread_count(tiny_model_path, monkeypatch):
    monkeypatch.setenv(ENV, "2")
    assert LLM(tiny_model_path, device="cpu").backend.threads == 2 and blas_threads() == {2}


@pytest.mark.parametrize("value", ["many", "0", "-3"])
def test_a_bad_thread_count_in_the_environment_says_what_to_set(tiny_model_path, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(InferoError, match=ENV):
        LLM(tiny_model_path, device="cpu")


def test_serve_flags_show_the_backends_defaults_and_pass_cpu_threads(monkeypatch):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert f"2048 on a GPU, {CpuBackend.default_max_num_batched_tokens} on the CPU" in text
    assert "BLAS threads of the CPU backend (default: 1;" in text and f"[env {ENV}]" in text
    config = serve.engine_config(parser.parse_args([]))
    assert config.max_num_batched_tokens is None and config.cpu_threads is None  # the backend chooses
    monkeypatch.setenv(ENV, "3")
    serve.add_arguments(parser := argparse.ArgumentParser())
    assert serve.engine_config(parser.parse_args([])).cpu_threads == 3
    assert serve.engine_config(parser.parse_args(["--cpu-threads", "2"])).cpu_threads == 2
