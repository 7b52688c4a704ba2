"""The command line: demo (tiny, end to end, valid PNGs), bench and info on the CPU, usage errors."""

import json
import struct
import subprocess
import sys

import pytest

import deformconv
from deformconv.cli import main


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    w, h = struct.unpack(">II", head[16:24])
    return w, h


def test_demo_tiny_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    rc = main(["demo", "--epochs", "1", "--size", "16", "--train", "128", "--test", "64", "--width", "4",
               "--device", "cpu", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| plain |" in text and "| DCNv2 |" in text
    # --no-progress hides the bars only: each epoch's line stays
    assert " plain epoch 1/1: train loss " in text and " DCNv2 epoch 1/1: train loss " in text
    for name in ("sampling_locations.png", "training_curves.png"):
        w, h = _png_size(out / name)
        assert w > 100 and h > 100


def test_demo_curves_tick_whole_epochs(tmp_path, capsys, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    main(["demo", "--epochs", "3", "--size", "16", "--train", "32", "--test", "16", "--width", "4",
          "--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    curves = figures[-1]
    for ax in curves.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_demo_redirected_to_a_file_draws_no_bars(tmp_path):
    """Bars are for a terminal: redirected, the output is the epoch lines and the table, not tqdm's redraws."""
    pytest.importorskip("matplotlib")
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "deformconv", "demo", "--epochs", "2", "--size", "16", "--train",
                               "96", "--test", "32", "--width", "4", "--batch", "16", "--device", "cpu", "--out",
                               str(tmp_path)], stdout=out, stderr=err, timeout=300)
    assert proc.returncode == 0
    text, errors = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert "DCNv2 epoch 2/2" in text and "it/s" not in text + errors
    assert len(text) + len(errors) < 4000, len(text) + len(errors)


def test_demo_is_deterministic_for_a_seed(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = ["demo", "--epochs", "1", "--size", "16", "--train", "64", "--test", "32", "--width", "4",
            "--device", "cpu", "--no-progress", "--seed", "3", "--out", str(tmp_path)]
    rows = []
    for _ in range(2):
        main(args)
        rows.append([ln.rsplit("|", 2)[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")])
    assert rows[0] == rows[1]  # everything but the wall time


def test_demo_nets_have_matched_parameter_counts():
    from deformconv.cli.demo import build_nets, n_params

    plain, dcn = build_nets(12)
    assert abs(n_params(plain) - n_params(dcn)) / n_params(dcn) < 0.1


def test_info_prints_versions_and_backend_table(capsys, monkeypatch):
    monkeypatch.setenv("DEFORMCONV_FAST_LAUNCH", "0")
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "torch" in text and "deformconv" in text
    assert "DEFORMCONV_FAST_LAUNCH=0: `0`: every kernel launch goes through Triton's JIT call path" in text
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("device cpu  ")))
    header = lines[start].split()[2:]
    assert header == ["float16", "bfloat16", "float32", "float64"]
    ops = deformconv.ops.common.dispatch.ops()
    rows = {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 1 + len(ops)]}
    assert set(rows) == set(ops)  # every op has a row
    assert rows["deform_conv2d"][1] == rows["dcnv3"][1] == rows["ms_deform_attn"][1] == "cpu"  # bfloat16
    assert rows["deform_roi_pool"][1] == rows["deform_psroi_pool"][1] == "reference"  # RoI pooling has no cpu backend
    assert "cpu      float64    triton     " in text and "float64 has no tensor-core path" in text


def test_bench_cpu_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--shapes", "small", "--passes", "fwd", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| fwd | small | float32 |" in text
    data = json.loads(path.read_text())
    recs = data["records"]
    assert {r["impl"] for r in recs} >= {"deformconv", "conv2d"}
    assert all(r["median_ms"] > 0 for r in recs if "error" not in r)
    assert data["environment"]["torch"]


@pytest.mark.parametrize("argv,message", [
    (["demo", "--epochs", "0"], "must be a positive integer, got 0"),
    (["demo", "--size", "8"], "--size must be at least 16, got 8"),
    (["bench", "--shapes", "nope"], "unknown shape"),
    (["frobnicate"], "invalid choice"),
    (["demo", "--device", "foo"], "argument --device: expected cpu, cuda or cuda:N, got 'foo'"),
    (["demo", "--device", "mps"], "argument --device: deformconv runs on cpu or cuda, got 'mps'"),
    (["bench", "--device", "foo"], "argument --device: expected cpu, cuda or cuda:N, got 'foo'"),
    (["bench", "--device", "cuda:99"], "argument --device: 'cuda:99'"),
    (["demo", "--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    (["demo", "--lr", "abc"], "argument --lr: must be a positive number, got 'abc'"),
    (["demo", "--batch", "x"], "argument --batch: must be a positive integer, got 'x'"),
], ids=["epochs-zero", "size-small", "bench-shape", "unknown-command", "device-foo", "device-mps", "bench-device-foo",
        "device-index", "lr-negative", "lr-text", "batch-text"])
def test_bad_options_give_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0
    captured = capsys.readouterr()
    assert message in captured.err + captured.out + str(exc.value.code)


@pytest.mark.parametrize("argv", [["demo", "--device", "foo"], ["bench", "--device", "mps"], ["demo", "--lr", "0"]])
def test_bad_values_end_in_one_line_and_a_nonzero_exit(argv):
    """From the shell: usage, one error line, exit status 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "deformconv", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error:" in line] == [proc.stderr.strip().splitlines()[-1]]


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "deformconv", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout
