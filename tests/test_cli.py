"""The CLI's contract: JSON schema, stdin, stats line, one-line errors with the right exit codes, cheap --help, the
sampling settings and stop strings, calibrate's notice. What reaches a terminal: test_cli_terminal.py; the hub and
the registry: test_cli_hub.py."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
from cli_support import MODEL, run
from conftest import repo_id

from localmoe.cli.main import main


def test_json_schema(capsys):
    code, out, err = run(capsys, "run", MODEL, "hi", "--json", "--max-new-tokens", "5", "--sparsity", "0")
    assert code == 0 and err == ""
    obj = json.loads(out.strip().splitlines()[-1])
    assert set(obj) == {"model", "text", "reasoning", "token_ids", "stats"}
    assert obj["model"] == MODEL and isinstance(obj["text"], str) and obj["reasoning"] == ""
    assert all(isinstance(t, int) for t in obj["token_ids"]) and 0 < len(obj["token_ids"]) <= 5
    for key in (
        "prompt_tokens",
        "generated_tokens",
        "prefill_tok_s",
        "decode_tok_s",
        "sparsity_target",
        "sparsity_realized",
        "peak_gpu_mem_gb",
        "load_s",
        "ttft_s",
        "wall_s",
    ):
        assert key in obj["stats"]
    st = obj["stats"]
    assert st["load_s"] > 0 and 0 < st["ttft_s"] <= st["wall_s"]
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
    with pytest.raises(Exception) as info:  # noqa: B017  (whatever it is, --debug lets it through)
        main(["--debug", "run", "./no/such/dir", "hi"])
    assert not isinstance(info.value, SystemExit)


def _fresh_python(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_help_and_models_do_not_import_torch(tmp_path):
    code = (
        "import sys; from localmoe.cli.main import main; "
        "main(['models']); main(['run', '--help']) if False else None; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    r = _fresh_python(code, tmp_path)
    assert r.returncode == 0 and "ALIAS" in r.stdout and "ok" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "localmoe", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "run" in r.stdout


def _options(parser, path="localmoe"):
    """(command path, option strings, help) of every optional flag of `parser` and of its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings:
            yield path, action.option_strings, action.help


def test_every_flag_states_its_default():
    from localmoe.cli.parser import build_parser

    options = list(_options(build_parser()))
    assert len(options) > 60  # every subcommand walked
    missing = [
        f"{path} {'/'.join(flags)}: {help!r}"
        for path, flags, help in options
        if not {"-h", "--help", "--version"} & set(flags) and (not help or "default" not in help.lower())
    ]
    assert not missing, "\n".join(missing)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("where", ["elsewhere", "clone-root"])
def test_import_kernels_is_not_this_repo(tmp_path, where):
    """`kernels` and `tui` are never this clone's folders, also run from the clone's root (where `python -c` and
    `python -m` put the root first on sys.path): transformers imports Hugging Face's `kernels` package."""
    code = (
        "import importlib.util as u, localmoe.kernels as k, localmoe.tui as t; "
        "print(u.find_spec('kernels')); print(u.find_spec('tui')); print(k.__name__, t.__name__)"
    )
    r = _fresh_python(code, tmp_path if where == "elsewhere" else REPO)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    ours = os.path.join(REPO, "kernels", "__init__.py")  # (a venv inside the clone holds Hugging Face's)
    assert lines[0] == "None" or ours not in lines[0]  # Hugging Face's `kernels`, if installed, never ours
    assert lines[1] == "None"
    assert lines[2] == "localmoe.kernels localmoe.tui"


# -- sampling defaults from the checkpoint, flags over them, stop strings ----------------------------------------
@pytest.fixture(scope="module")
def sampling_model(src_dir, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE with a generation_config.json that samples (as the bundled model's does)."""
    folder = tmp_path_factory.mktemp("gencfg") / "sampling"
    shutil.copytree(src_dir / "qwen3_moe", folder)
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.9,
                "top_k": 20,
                "top_p": 0.95,
                "repetition_penalty": 1.3,
                "eos_token_id": 3,
            }
        )
    )
    return str(folder)


def _ids(capsys, *argv):
    code, out, err = run(capsys, "run", *argv, "--json", "--max-new-tokens", "10", "--sparsity", "0")
    assert code == 0, err
    return json.loads(out)


SAMPLING_CASES = [  # (id, flags, the settings the reply must equal (over GenerationSettings' defaults))
    ("model-defaults", ["--seed", "5"], dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.3, seed=5)),
    ("temperature-0-is-greedy", ["--temperature", "0"], dict(top_k=20, top_p=0.95, repetition_penalty=1.3)),
    ("penalty-off", ["--temperature", "0", "--repeat-penalty", "1"], dict()),
    (
        "flag-overrides-one",
        ["--seed", "5", "--top-k", "3"],
        dict(temperature=0.9, top_k=3, top_p=0.95, repetition_penalty=1.3, seed=5),
    ),
]


@pytest.mark.parametrize(("flags", "want"), [c[1:] for c in SAMPLING_CASES], ids=[c[0] for c in SAMPLING_CASES])
def test_run_sampling_defaults_and_flags(sampling_model, capsys, flags, want):
    from localmoe.engine.engine import Engine
    from localmoe.events import GenerationSettings

    got = _ids(capsys, sampling_model, "hi", *flags)["token_ids"]
    e = Engine.load(sampling_model, device="cpu", sparsity=0.0)
    ids = e.encode_chat([{"role": "user", "content": "hi"}])
    assert got == [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=10, **want))]


def test_run_stop_strings(sampling_model, capsys):
    whole = _ids(capsys, sampling_model, "hi", "--temperature", "0")
    text = whole["text"]
    assert len(text) >= 6
    cut = _ids(capsys, sampling_model, "hi", "--temperature", "0", "--stop", "zzz", "--stop", text[3:5])
    assert cut["text"] == text[: text.index(text[3:5])] and cut["stats"]["finish_reason"] == "stop"
    assert cut["token_ids"] == whole["token_ids"][: len(cut["token_ids"])] and len(cut["token_ids"]) <= 5


# -- calibrate, hub, chat's loader ------------------------------------------------------------------------------
def test_calibrate_says_where_thresholds_went(capsys, monkeypatch, tmp_path):
    code, out, err = run(capsys, "calibrate", MODEL, "--sparsity", "0.5", "--tokens", "64")
    assert code == 0 and "thresholds saved to " in out and out.rstrip().endswith(".json")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder cannot be made
    code, out, err = run(capsys, "calibrate", MODEL, "--sparsity", "0.5", "--tokens", "64")
    assert code == 0 and "the thresholds were not saved" in out and "saved to" not in out
    assert "localmoe: note: could not save thresholds" in err


@pytest.mark.parametrize(
    ("names", "complete"),
    [
        (["model.safetensors"], True),
        (["model-00002.safetensors"], False),
        (["../outside.safetensors"], True),
        (["/etc/passwd"], True),
        (["sub/model.safetensors"], True),
        ([7], True),
    ],
    ids=["present", "missing-shard", "parent-dir", "absolute", "subfolder", "not-a-string"],
)
def test_complete_snapshot_index_names(tmp_path, names, complete):
    """Every shard a sharded index names must be present; a name that is no plain file name is not looked up (the
    snapshot counts as complete and the loader refuses the index by name)."""
    from localmoe.models.hub import complete_snapshot

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"t{i}": n for i, n in enumerate(names)}})
    )
    assert complete_snapshot(tmp_path) is complete


def test_chat_loader_takes_another_model(monkeypatch, capsys):
    """`chat`'s loader callback: load(progress) gives the model named on the command line, load(progress, model=X)
    another (`/model X`), each with the sampling flags over its own generation config; the flags reach run_chat."""
    import localmoe.tui.app as app

    seen = {}

    def fake_run_chat(load, **kwargs):
        seen.update(kwargs, first=load(lambda *a: None), other=load(lambda *a: None, model=repo_id("olmoe")))
        return 0

    monkeypatch.setattr(app, "run_chat", fake_run_chat)
    assert main(["chat", MODEL, "--sparsity", "0", "--top-k", "7", "--stop", "END", "--no-think"]) == 0
    assert seen["first"].model_name == MODEL and seen["other"].model_name == repo_id("olmoe")
    for e in (seen["first"], seen["other"]):
        d = e.default_settings()
        assert (d.top_k, d.stop, d.temperature) == (7, ("END",), 0.0)
    assert seen["settings"].top_k == 7 and seen["think"] is False
