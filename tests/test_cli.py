"""The CLI's contract: JSON schema, stdin, stats line, one-line errors with the right exit codes, cheap --help."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import repo_id
from localmoe.cli import main

MODEL = repo_id("qwen3_moe")


def run(capsys, *args):
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_json_schema(capsys):
    code, out, err = run(capsys, "run", MODEL, "hi", "--json", "--max-new-tokens", "5", "--sparsity", "0")
    assert code == 0 and err == ""
    obj = json.loads(out.strip().splitlines()[-1])
    assert set(obj) == {"model", "text", "token_ids", "stats"}
    assert obj["model"] == MODEL and isinstance(obj["text"], str)
    assert all(isinstance(t, int) for t in obj["token_ids"]) and 0 < len(obj["token_ids"]) <= 5
    for key in ("prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "sparsity_target",
                "sparsity_realized", "peak_gpu_mem_gb"):
        assert key in obj["stats"]
    assert obj["stats"]["generated_tokens"] == len(obj["token_ids"])


def test_streams_text_and_stats_line(capsys):
    code, out, err = run(capsys, "run", MODEL, "hi", "--max-new-tokens", "4", "--sparsity", "0")
    assert code == 0
    assert "tok/s decode" in err and err.count("\n") == 1
    code, out2, err2 = run(capsys, "run", MODEL, "hi", "--max-new-tokens", "4", "--sparsity", "0", "--quiet")
    assert out2 == out and err2 == ""


def test_int4_experts_run(capsys):
    code, out, err = run(capsys, "run", MODEL, "hi", "--json", "--max-new-tokens", "4", "--experts", "int4")
    assert code == 0 and len(json.loads(out.strip().splitlines()[-1])["token_ids"]) > 0


def test_prompt_from_stdin(monkeypatch, capsys):
    import io

    class Stdin(io.StringIO):
        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdin", Stdin("hi"))
    code, out, _ = run(capsys, "run", MODEL, "--json", "--max-new-tokens", "4", "--sparsity", "0")
    direct = main(["run", MODEL, "hi", "--json", "--max-new-tokens", "4", "--sparsity", "0"])
    out2 = capsys.readouterr().out
    assert code == 0 and direct == 0
    assert json.loads(out.splitlines()[-1])["token_ids"] == json.loads(out2.splitlines()[-1])["token_ids"]


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["run", "qwen3.5-35", "hi"], 2, "did you mean qwen3.5-35b"),
        (["run", "./no/such/dir", "hi"], 2, "does not exist"),
        (["run", MODEL, "hi", "--sparsity", "1.5"], 2, "[0, 1)"),
        (["run", MODEL, "hi", "--temperature", "-1"], 2, "--temperature"),
        (["run", MODEL, "   "], 2, "empty"),
        (["run", repo_id("gpt_oss"), "hi"], 2, "GPT-OSS is not yet supported"),
        (["run", repo_id("qwen3_dense"), "hi"], 2, "supported: Qwen3.5-MoE"),
        (["run", "someorg/not-downloaded", "hi"], 1, "localmoe pull"),
        (["run", MODEL, "hi", "--experts", "int8"], 2, "--experts"),
    ],
)
def test_bad_input_one_line(capsys, args, code, needle):
    got, out, err = run(capsys, *args)
    assert got == code
    assert err.startswith("localmoe: error: ") and err.count("\n") == 1 and needle in err
    assert "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu(capsys):
    code, _, err = run(capsys, "run", MODEL, "hi", "--device", "cuda")
    assert code == 1 and "no CUDA GPU" in err


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(src_dir, tmp_path, capsys, damage):
    folder = tmp_path / "broken"
    shutil.copytree(src_dir / "olmoe", folder)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 64)
    code, _, err = run(capsys, "run", str(folder), "hi", "--sparsity", "0")
    assert code == 1 and "corrupt or truncated" in err and err.count("\n") == 1


def test_debug_shows_traceback(capsys):
    with pytest.raises(Exception):
        main(["--debug", "run", "./no/such/dir", "hi"])


def _fresh_python(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_help_and_models_do_not_import_torch(tmp_path):
    code = ("import sys; from localmoe.cli import main; "
            "main(['models']); main(['run', '--help']) if False else None; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    r = _fresh_python(code, tmp_path)
    assert r.returncode == 0 and "ALIAS" in r.stdout and "ok" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "localmoe", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "run" in r.stdout


def test_import_kernels_is_not_this_repo(tmp_path):
    code = ("import importlib.util as u, localmoe.kernels as k, localmoe.tui as t; "
            "print(u.find_spec('kernels')); print(u.find_spec('tui')); print(k.__name__, t.__name__)")
    r = _fresh_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert lines[0] == "None" or repo not in lines[0]  # Hugging Face's `kernels`, if installed, never ours
    assert lines[1] == "None"
    assert lines[2] == "localmoe.kernels localmoe.tui"
