"""Bad input to the CLI, one row per case: the command exits 2 (1 for runtime failures) with one line on stderr,
`localmoe: error: <what> <fix>`, naming the problem, and no traceback; nothing is written to stdout.

Choices where the issue was silent: numeric flags reject NaN and infinities (and absurd sizes: --vram above
65536 GiB, --context above 2**24 tokens); --seed takes [0, 2**64 - 1], the unsigned range torch's generators
accept; stdin (and PROMPT or --system from argv) that is not UTF-8 is refused, naming the first bad byte and its
offset, rather than decoded with replacement characters; `--raw --system` is refused (--raw has no chat template to
place a system prompt in, nor a thinking switch to set: `--raw --think`); a blank --system is refused like a blank
prompt, and so is an empty --stop; --repeat-penalty takes (0, 10]; text files given as flags are checked (readable,
UTF-8, not empty) before the model loads.
"""

from __future__ import annotations

import io
import sys

import pytest
from conftest import repo_id

from localmoe.cli.main import main

M = repo_id("qwen3_moe")  # a tiny cached checkpoint, 512 positions
RUN = ["run", M, "hi"]
NO_PROMPT = ["run", M]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


# (id, argv, stdin: bytes piped in / "tty" / None, exit code, a piece of the one error line)
CASES = [
    # --vram
    ("vram-nan", RUN + ["--vram", "nan"], None, 2, "--vram must be a finite number, got nan"),
    ("vram-inf", RUN + ["--vram", "inf"], None, 2, "--vram must be a finite number, got inf"),
    ("vram-zero", RUN + ["--vram", "0"], None, 2, "--vram must be > 0.0"),
    ("vram-negative", RUN + ["--vram", "-1"], None, 2, "--vram must be > 0.0"),
    ("vram-huge", RUN + ["--vram", "1e300"], None, 2, "<= 65536.0, got 1e300"),
    ("vram-word", RUN + ["--vram", "lots"], None, 2, "expected float, got 'lots'"),
    # sampling
    ("temperature-nan", RUN + ["--temperature", "nan"], None, 2, "--temperature must be a finite number"),
    ("temperature-inf", RUN + ["--temperature", "inf"], None, 2, "--temperature must be a finite number"),
    ("temperature-negative", RUN + ["--temperature", "-0.5"], None, 2, "--temperature must be >= 0.0"),
    ("temperature-above-10", RUN + ["--temperature", "11"], None, 2, "<= 10.0, got 11"),
    ("top-p-nan", RUN + ["--top-p", "nan"], None, 2, "--top-p must be a finite number"),
    ("top-p-zero", RUN + ["--top-p", "0"], None, 2, "--top-p must be > 0.0"),
    ("top-p-negative", RUN + ["--top-p", "-0.5"], None, 2, "--top-p must be > 0.0"),
    ("top-p-above-1", RUN + ["--top-p", "1.5"], None, 2, "<= 1.0, got 1.5"),
    ("top-k-negative", RUN + ["--top-k", "-1"], None, 2, "--top-k must be >= 0"),
    ("top-k-fraction", RUN + ["--top-k", "2.5"], None, 2, "expected int, got '2.5'"),
    ("seed-1e23", RUN + ["--seed", str(10**23)], None, 2, "--seed must be >= 0 and <= 18446744073709551615"),
    ("seed-2-pow-64", RUN + ["--seed", str(2**64)], None, 2, "--seed must be >= 0 and <= 18446744073709551615"),
    ("seed-negative", RUN + ["--seed", "-1"], None, 2, "--seed must be >= 0"),
    ("seed-fraction", RUN + ["--seed", "1.5"], None, 2, "expected int, got '1.5'"),
    ("repeat-penalty-nan", RUN + ["--repeat-penalty", "nan"], None, 2, "--repeat-penalty must be a finite number"),
    ("repeat-penalty-zero", RUN + ["--repeat-penalty", "0"], None, 2, "--repeat-penalty must be > 0.0"),
    ("repeat-penalty-negative", RUN + ["--repeat-penalty", "-1.1"], None, 2, "--repeat-penalty must be > 0.0"),
    ("repeat-penalty-above-10", RUN + ["--repeat-penalty", "11"], None, 2, "<= 10.0, got 11"),
    ("repeat-penalty-word", RUN + ["--repeat-penalty", "high"], None, 2, "expected float, got 'high'"),
    ("stop-empty", RUN + ["--stop", "x", "--stop", ""], None, 2, "--stop is empty"),
    ("stop-undecodable", RUN + ["--stop", "\udcff"], None, 2, "--stop is not UTF-8 text (byte 0xff at offset 0)"),
    ("raw-with-think", RUN + ["--raw", "--think"], None, 2, "which is what --think sets"),
    ("max-new-tokens-zero", RUN + ["--max-new-tokens", "0"], None, 2, "--max-new-tokens must be >= 1"),
    ("max-new-tokens-negative", RUN + ["--max-new-tokens", "-3"], None, 2, "--max-new-tokens must be >= 1"),
    # --context and --sparsity
    ("context-zero", RUN + ["--context", "0"], None, 2, "--context must be >= 16"),
    ("context-negative", RUN + ["--context", "-1"], None, 2, "--context must be >= 16"),
    ("context-15", RUN + ["--context", "15"], None, 2, "--context must be >= 16"),
    ("context-1e23", RUN + ["--context", str(10**23)], None, 2, "<= 16777216"),
    ("context-above-model", RUN + ["--context", "1024", "--sparsity", "0"], None, 2, "supports (512)"),
    ("sparsity-nan", RUN + ["--sparsity", "nan"], None, 2, "must be in [0, 1)"),
    ("sparsity-inf", RUN + ["--sparsity", "inf"], None, 2, "must be in [0, 1)"),
    ("sparsity-negative", RUN + ["--sparsity", "-0.1"], None, 2, "must be in [0, 1)"),
    ("sparsity-one", RUN + ["--sparsity", "1"], None, 2, "must be in [0, 1)"),
    ("sparsity-word", RUN + ["--sparsity", "lots"], None, 2, "expected a number in [0, 1) or 'off'"),
    ("device-unknown", RUN + ["--device", "tpu"], None, 2, "invalid choice: 'tpu'"),
    ("flag-unknown", RUN + ["--bogus"], None, 2, "unrecognized arguments: --bogus"),
    ("command-unknown", ["frobnicate"], None, 2, "invalid choice: 'frobnicate'"),
    # the prompt: stdin, argv, --system, --raw
    ("stdin-latin1", NO_PROMPT, b"caf\xe9 au lait", 2, "stdin is not UTF-8 text (byte 0xe9 at offset 3)"),
    ("stdin-binary", NO_PROMPT, b"\x00\x01\xff\xfe", 2, "stdin is not UTF-8 text (byte 0xff at offset 2)"),
    ("stdin-cut-codepoint", NO_PROMPT, b"ok \xe2\x82", 2, "stdin is not UTF-8 text (byte 0xe2 at offset 3)"),
    ("stdin-dash-latin1", NO_PROMPT + ["-"], b"\xe9t\xe9", 2, "stdin is not UTF-8 text (byte 0xe9 at offset 0)"),
    ("stdin-empty", NO_PROMPT, b"", 2, "the prompt is empty"),
    ("stdin-blank", NO_PROMPT, b" \n\t\r\n", 2, "the prompt is empty"),
    ("stdin-bom-only", NO_PROMPT, b"\xef\xbb\xbf\n", 2, "the prompt is empty"),
    ("stdin-terminal", NO_PROMPT, "tty", 2, "no prompt: pass PROMPT or pipe it on stdin"),
    ("prompt-empty", ["run", M, ""], None, 2, "the prompt is empty"),
    ("prompt-blank", ["run", M, "\n\t "], None, 2, "the prompt is empty"),
    ("prompt-undecodable-argv", ["run", M, "caf\udce9"], None, 2, "PROMPT is not UTF-8 text (byte 0xe9 at offset 3)"),
    ("prompt-lone-surrogate", ["run", M, "a\ud800"], None, 2, "PROMPT is not UTF-8 text (byte 0xed at offset 1)"),
    ("prompt-too-long", ["run", M, "x" * 600, "--raw", "--sparsity", "0"], None, 2, "the prompt has 600 tokens"),
    (
        "raw-with-system",
        RUN + ["--raw", "--system", "be brief"],
        None,
        2,
        "--raw sends the prompt without the chat template",
    ),
    ("system-blank", RUN + ["--system", "  "], None, 2, "--system is empty"),
    ("system-undecodable", RUN + ["--system", "\udcff"], None, 2, "--system is not UTF-8 text (byte 0xff at offset 0)"),
    # text files
    ("calibration-text-missing", RUN + ["--calibration-text", "{missing}"], None, 2, "cannot read --calibration-text"),
    ("calibration-text-binary", RUN + ["--calibration-text", "{binary}"], None, 2, "is not UTF-8 text (byte 0x89"),
    ("calibration-text-empty", RUN + ["--calibration-text", "{empty}"], None, 2, "is empty"),
    ("calibration-text-folder", RUN + ["--calibration-text", "{folder}"], None, 2, "is a directory"),
    # eval, bench, calibrate, chat
    ("eval-tokens-zero", ["eval", M, "--tokens", "0"], None, 2, "--tokens must be >= 16"),
    ("eval-window-zero", ["eval", M, "--window", "0"], None, 2, "--window must be >= 16"),
    ("eval-limit-zero", ["eval", M, "--tasks", "arc_easy", "--limit", "0"], None, 2, "--limit must be >= 1"),
    ("eval-limit-negative", ["eval", M, "--tasks", "arc_easy", "--limit", "-2"], None, 2, "--limit must be >= 1"),
    ("eval-sparsity-nan", ["eval", M, "--sparsity", "0,nan"], None, 2, "must be in [0, 1)"),
    ("eval-sparsity-none", ["eval", M, "--sparsity", ","], None, 2, "give at least one sparsity"),
    ("eval-text-binary", ["eval", M, "--text", "{binary}"], None, 2, "--text"),
    ("bench-prompt-tokens-zero", ["bench", M, "--prompt-tokens", "0"], None, 2, "--prompt-tokens must be >= 1"),
    ("bench-decode-tokens-one", ["bench", M, "--decode-tokens", "1"], None, 2, "--decode-tokens must be >= 2"),
    ("bench-vram-nan", ["bench", M, "--vram", "nan"], None, 2, "--vram must be a finite number"),
    ("bench-context-1e23", ["bench", M, "--context", str(10**23)], None, 2, "<= 16777216"),
    ("bench-no-model", ["bench"], None, 2, "give MODEL or --shape"),
    ("calibrate-sparsity-zero", ["calibrate", M, "--sparsity", "0"], None, 2, "needs no calibration"),
    ("calibrate-sparsity-nan", ["calibrate", M, "--sparsity", "nan"], None, 2, "must be in [0, 1)"),
    (
        "calibrate-tokens-zero",
        ["calibrate", M, "--sparsity", "0.5", "--tokens", "0"],
        None,
        2,
        "--tokens must be >= 16",
    ),
    (
        "calibrate-text-binary",
        ["calibrate", M, "--sparsity", "0.5", "--text", "{binary}"],
        None,
        2,
        "is not UTF-8 text",
    ),
    ("chat-temperature-nan", ["chat", M, "--temperature", "nan"], None, 2, "--temperature must be a finite number"),
    ("chat-vram-inf", ["chat", M, "--vram", "inf"], None, 2, "--vram must be a finite number"),
    ("chat-seed-1e23", ["chat", M, "--seed", str(10**23)], None, 2, "--seed must be"),
    ("chat-system-blank", ["chat", M, "--system", " "], None, 2, "--system is empty"),
    ("chat-stop-empty", ["chat", M, "--stop", ""], None, 2, "--stop is empty"),
    ("chat-repeat-penalty-inf", ["chat", M, "--repeat-penalty", "inf"], None, 2, "--repeat-penalty must be a finite"),
    ("bench-repeat-penalty-zero", ["bench", M, "--repeat-penalty", "0"], None, 2, "--repeat-penalty must be > 0.0"),
    ("show-vram-zero", ["show", M, "--vram", "0"], None, 2, "--vram must be > 0.0"),
    ("show-experts-int8", ["show", M, "--experts", "int8"], None, 2, "invalid choice: 'int8'"),
    ("show-context-15", ["show", M, "--context", "15"], None, 2, "--context must be >= 16"),
    # flags removed in #21 (measured no better than the default): refused like any unknown flag
    ("removed-offload-miss", RUN + ["--offload-miss", "copy"], None, 2, "unrecognized arguments: --offload-miss"),
    ("removed-no-fused", ["chat", M, "--no-fused"], None, 2, "unrecognized arguments: --no-fused"),
    ("removed-compile", ["bench", M, "--compile"], None, 2, "unrecognized arguments: --compile"),
    ("removed-threshold-mode", ["eval", M, "--threshold-mode", "expert"], None, 2, "unrecognized arguments"),
]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "empty.txt").write_text(" \n")
    return {
        "{missing}": str(tmp_path / "no-such-file.txt"),
        "{binary}": str(tmp_path / "binary.txt"),
        "{empty}": str(tmp_path / "empty.txt"),
        "{folder}": str(tmp_path),
    }


@pytest.mark.parametrize("argv, stdin, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(capsys, monkeypatch, files, argv, stdin, code, needle):
    argv = [files.get(a, a) for a in argv]
    if stdin == "tty":
        monkeypatch.setattr(sys, "stdin", _Terminal(""))
    elif stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    got = main(argv)
    out, err = capsys.readouterr()
    assert got == code, err
    assert err.startswith("localmoe: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert needle in err, err
    assert "Traceback" not in err and out == ""


def test_case_ids_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)


# Good input the checks above must let through: (id, argv, stdin)
GOOD = [
    ("stdin-utf8", NO_PROMPT, "héllo ✓".encode()),
    ("stdin-bom", NO_PROMPT, b"\xef\xbb\xbfhi"),
    ("stdin-crlf", NO_PROMPT, b"hi\r\nthere"),
    ("seed-max", RUN + ["--seed", str(2**64 - 1), "--temperature", "1"], None),
    ("seed-zero", RUN + ["--seed", "0", "--temperature", "1"], None),
    ("system", RUN + ["--system", "be brief"], None),
    ("raw", RUN + ["--raw"], None),
    ("repeat-penalty", RUN + ["--repeat-penalty", "1.2"], None),
    ("repeat-penalty-below-1", RUN + ["--repeat-penalty", "0.5"], None),
    ("stops", RUN + ["--stop", "\n", "--stop", "é"], None),
    ("no-think-without-the-switch", RUN + ["--no-think"], None),
    ("temperature-zero-top-k", RUN + ["--temperature", "0", "--top-k", "5"], None),
]


@pytest.mark.parametrize("argv, stdin", [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_good_input(capsys, monkeypatch, argv, stdin):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    got = main(argv + ["--max-new-tokens", "2", "--sparsity", "0", "--quiet", "--json"])
    out, err = capsys.readouterr()
    assert got == 0 and err == "", err
