"""`localmoe eval`: a finite table whose dense row equals a direct perplexity computation; the lm-eval adapter runs
a small local task (JSONL + task YAML in tests/data, no downloads)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import repo_id

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.measure.evaluate import direct_perplexity, evaluate

DATA = Path(__file__).with_name("data")


def test_eval_table_and_dense_row(tmp_path):
    engine = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    text = tmp_path / "t.txt"
    text.write_text("Mixture-of-experts models route each token to a few experts. " * 30)
    report = evaluate(engine, [0.0, 0.5, 0.9], text=text, tokens=1200, window=256)
    assert [r.sparsity for r in report.rows] == [0.0, 0.5, 0.9]
    for r in report.rows:
        assert all(math.isfinite(v) for v in (r.perplexity, r.ratio_to_dense, r.top1_agreement, r.sparsity_realized))
    ids = engine.tokenizer(text.read_text(), add_special_tokens=False)["input_ids"][:1200]
    assert report.rows[0].perplexity == pytest.approx(direct_perplexity(engine.model, ids, 256), rel=1e-5)
    assert abs(report.rows[2].sparsity_realized - 0.9) < 0.05
    assert report.rows[1].top1_agreement < 1.0 or report.rows[1].ratio_to_dense != 1.0
    assert engine.sparsity == 0.0  # restored


def test_eval_command_json(capsys):
    code = main(["eval", repo_id("olmoe"), "--sparsity", "0,0.7", "--tokens", "800", "--json", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    obj = json.loads(out.strip().splitlines()[-1])
    assert [r["sparsity"] for r in obj["rows"]] == [0.0, 0.7]
    assert "best_sparsity_within_5pct" in obj


def test_eval_takes_a_list_of_expert_formats(capsys):
    """`--experts full,int4,nf4`: each format loaded and measured in turn, one JSON object each (or one table each
    under a heading); the 4-bit formats change the perplexity a little, not much."""
    argv = ["eval", repo_id("olmoe"), "--sparsity", "0", "--tokens", "300", "--device", "cpu"]
    code = main([*argv, "--experts", "full,int4,nf4,int4", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    objs = json.loads(out.strip().splitlines()[-1])
    assert [o["experts"] for o in objs] == ["full", "int4", "nf4"]  # repeats dropped, order kept
    ppl = [o["rows"][0]["perplexity"] for o in objs]
    assert ppl[1] != ppl[0] and all(abs(p / ppl[0] - 1) < 0.1 for p in ppl)
    assert main([*argv, "--experts", "full,int4"]) == 0
    text = capsys.readouterr().out
    assert "== --experts full" in text and "== --experts int4" in text
    assert main([*argv, "--experts", "full,int8"]) == 2
    assert "choose from full, int4, nf4, mxfp4 (comma-separated), got 'int8'" in capsys.readouterr().err


TASK_YAML = """task: localmoe_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_adapter_local_task(capsys, tmp_path):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "localmoe_tiny_choice.yaml").write_text(
        TASK_YAML.format(data=DATA / "lmeval" / "localmoe_tiny_choice.jsonl")
    )
    code = main(
        [
            "eval",
            repo_id("qwen3_moe"),
            "--tasks",
            "localmoe_tiny_choice",
            "--sparsity",
            "0,0.5",
            "--include-path",
            str(tasks),
            "--json",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    obj = json.loads(out.strip().splitlines()[-1])
    for s in ("0", "0.5"):
        acc = obj["results"][s]["localmoe_tiny_choice"]["acc,none"]
        assert 0.0 <= acc <= 1.0
