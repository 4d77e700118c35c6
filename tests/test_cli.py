"""The command line, run as a user runs it: answers on stdout, one-line errors with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import TinyShape, write_tiny_model

from infero import LLM, SamplingParams
from infero.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, needle):
    assert code == 2
    errors = [line for line in err.strip().splitlines() if line.startswith("infero: error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and needle in errors[0], err
    assert "Traceback" not in err


def test_generate_json_greedy_matches_the_python_api(capsys, tiny_model_path):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--greedy", "--max-tokens", "12",
                             "--ignore-eos", "--json", "--logprobs", "3", "hello world")  # fmt: skip
    assert code == 0 and "ready:" in err
    result = json.loads(out)
    [expected] = LLM(tiny_model_path).generate(
        ["hello world"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert result["completion_ids"] == expected.completion_ids and len(expected.completion_ids) == 12
    assert result["text"] == expected.text
    assert result["finish_reason"] == "length"
    assert len(result["logprobs"]) == 12 and all(len(lp["top_logprobs"]) == 3 for lp in result["logprobs"])
    assert all(lp["top_logprobs"][0]["token_id"] == lp["token_id"] for lp in result["logprobs"])  # greedy = top-1


def test_generate_takes_batch_invariant_mode_and_gives_the_same_text(capsys, tiny_model_path):
    argv = ["generate", "--model", str(tiny_model_path), "--greedy", "--max-tokens", "8", "--json", "Hello"]
    code, out, _ = run_cli(capsys, *argv)
    code_inv, out_inv, _ = run_cli(capsys, *argv, "--batch-invariant")
    assert code == code_inv == 0 and json.loads(out_inv)["text"] == json.loads(out)["text"]


def test_generate_streams_text(capsys, tiny_model_path):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--seed", "3", "--max-tokens", "8",
                           "--ignore-eos", "hello")  # fmt: skip
    [expected] = LLM(tiny_model_path).generate(
        ["hello"], SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3, max_tokens=8,
                                  ignore_eos=True)
    )  # fmt: skip
    assert code == 0 and out == expected.text + "\n"


def test_generate_samples_with_the_model_files_defaults_where_no_flag_says(capsys, tmp_path):
    """As llama.cpp's CLI: general.sampling.* (what the converter copies from generation_config.json) replace the
    CLI's defaults; a flag replaces both."""
    path = write_tiny_model(tmp_path / "m.gguf", sampling=dict(temp=0.0, top_k=3))
    argv = ["generate", "--model", str(path), "--max-tokens", "10", "--ignore-eos", "--json", "--seed", "4", "hello"]
    texts = [json.loads(run_cli(capsys, *argv, *flags)[1])["text"] for flags in ([], ["--greedy"])]
    assert texts[0] == texts[1]  # the file's temperature 0
    [sampled] = LLM(path).generate(["hello"], SamplingParams(temperature=1.5, top_k=3, top_p=0.95, min_p=0.05,
                                                             seed=4, max_tokens=10, ignore_eos=True))  # fmt: skip
    assert json.loads(run_cli(capsys, *argv, "--temperature", "1.5")[1])["text"] == sampled.text


def test_tokenize_and_inspect(capsys, tiny_model_path):
    code, out, _ = run_cli(capsys, "tokenize", "--model", str(tiny_model_path), "hello<|im_end|>")
    assert code == 0
    ids = json.loads(out)
    assert ids[-1] == 2 and LLM(tiny_model_path).tokenizer.decode(ids) == "hello<|im_end|>"
    code, out, _ = run_cli(capsys, "inspect", "--model", str(tiny_model_path), "--json")
    info = json.loads(out)
    assert code == 0 and info["architecture"] == "llama" and info["layers"] == 2 and info["chat_template"]
    assert info["tensor_types"] == {"F32": 2 * 9 + 3}  # 9 per layer, embedding, output norm, output


@pytest.mark.parametrize("command", ["generate", "inspect", "tokenize"])
def test_missing_model_file(capsys, tmp_path, command):
    code, _, err = run_cli(
        capsys, command, "--model", str(tmp_path / "missing.gguf"), *(["x"] if command != "inspect" else [])
    )
    assert_one_line_error(code, err, "no such file")


def test_not_gguf_and_truncated(capsys, tmp_path, tiny_model_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model file at all")
    assert_one_line_error(*run_cli(capsys, "generate", "--model", str(text), "x")[::2], "not a GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model_path.read_bytes()[:200_000])
    assert_one_line_error(*run_cli(capsys, "generate", "--model", str(cut), "x")[::2], "truncated")


def test_unsupported_architecture_and_tensor_type(capsys, tmp_path):
    arch = write_tiny_model(tmp_path / "gpt2.gguf", shape=TinyShape(arch="gpt2"))
    assert_one_line_error(*run_cli(capsys, "generate", "--model", str(arch), "x")[::2], "architecture 'gpt2'")
    iq2 = write_tiny_model(tmp_path / "iq2.gguf", Q.Q8_0, embed_type=Q.IQ2_XXS)
    assert_one_line_error(*run_cli(capsys, "generate", "--model", str(iq2), "x")[::2], "IQ2_XXS")


def test_prompt_longer_than_context(capsys, tiny_model_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "hello " * 300)
    assert_one_line_error(code, err, "context")


def test_chat_without_template(capsys, tmp_path):
    path = write_tiny_model(tmp_path / "notemplate.gguf", chat_template=None)
    code, _, err = run_cli(capsys, "generate", "--model", str(path), "--chat", "hi")
    assert_one_line_error(code, err, "--chat-template")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    code, _, _ = run_cli(capsys, "generate", "--model", str(path), "--chat", "--chat-template", str(template),
                         "--max-tokens", "2", "hi")  # fmt: skip
    assert code == 0


def test_cuda_device_without_a_cuda_backend_is_a_clear_error(capsys, tiny_model_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--device", "cuda", "x")
    assert_one_line_error(code, err, "cuda")


def test_cuda_device_refuses_a_head_dim_its_attention_lacks_in_one_line(capsys):
    path = str(Path(__file__).parent / "fixtures" / "models" / "tiny-qwen35.gguf")  # heads of 32
    code, _, err = run_cli(capsys, "generate", "--model", path, "--device", "cuda", "x")
    assert_one_line_error(code, err, "attention heads of 32 run on the CPU backend only")


def test_entry_point_runs_as_a_program(tiny_model_path):
    proc = subprocess.run([sys.executable, "-m", "infero", "tokenize", "--model", str(tiny_model_path), "hello"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout)
    proc = subprocess.run([sys.executable, "-m", "infero", "inspect", "--model", "/nonexistent.gguf"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("infero: error:") and "Traceback" not in proc.stderr


def test_bench_decode_batch_sizes_are_checked(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--batch", "1,x"])
    assert exit_info.value.code == 2
    assert "positive integers separated by commas" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    import infero

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"infero {infero.__version__}\n"


@pytest.mark.parametrize(
    "command, shown",
    [
        (["generate"], ["--max-tokens N  stop after N tokens (default: 256)", "(default: the model file's, else 0.8)",
                        "(default: the model file's, else 40)", "(default: the model file's, else 0.95)",
                        "(default: the model file's, else 0.05)", "(default: the model file's, else 1.0)",
                        "(default: 0.0)", "(default: auto)"]),
        (["synth"], ["(default: Q4_K_M)", "(default: 0)"]),
        (["bench", "decode"], ["(default: 512)", "(default: 64)"]),
        (["serve"], ["(default: 8080)", "(default: 512)", "(default: 0.90)", "(default: auto)"]),
    ],
)  # fmt: skip
def test_help_shows_every_default(capsys, command, shown):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    for needle in shown:
        assert " ".join(needle.split()) in text, needle


def test_tokenize_refuses_a_text_longer_than_the_context(capsys, tiny_model_path):
    code, _, err = run_cli(capsys, "tokenize", "--model", str(tiny_model_path), "hello world " * 300)
    assert_one_line_error(code, err, "more than the model's context of 256")
