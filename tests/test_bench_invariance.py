"""`infero bench invariance` on the numpy backend, which is bitwise batch invariant by construction (every op per
row, the delta rule token by token): every case equal, and the CLI's table and exit status."""

from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_tiny_model

from infero import LLM
from infero.bench.invariance import check
from infero.cli import main


def test_the_cpu_backend_gives_a_request_the_same_bits_every_way(tmp_path):
    path = write_tiny_model(tmp_path / "t.gguf", Q.Q4_1, seed=3)
    cases = check(LLM(path, device="cpu"), 40, chunks=(1, 7, 16), widths=(2, 5), mixed=(3, 20))
    assert [c.name for c in cases] == [
        "prefill in chunks of 1", "prefill in chunks of 7", "prefill in chunks of 16",
        "decode alone (vs the prefill's last row)", "decode, 2 sequences", "decode, 5 sequences",
        "decode + prefill of 3", "decode + prefill of 20",
    ]  # fmt: skip
    assert all(c.differ == 0 and c.worst == 0.0 for c in cases)
    assert [c.rows for c in cases[:3]] == [40, 40, 40]


def test_the_cli_prints_the_table_and_succeeds_when_nothing_differs(tmp_path, capsys):
    path = write_tiny_model(tmp_path / "t.gguf", Q.Q8_0, seed=4)
    status = main(["bench", "invariance", "--model", str(path), "--device", "cpu", "--prompt-tokens", "30"])
    out = capsys.readouterr().out
    assert status == 0
    assert "prefill in chunks of 7" in out and "decode, 64 sequences" in out
