"""Sampling settings: the repetition penalty (transformers' semantics, eager and in the argmax kernel the CUDA graph
runs), the checkpoint's generation config as the defaults, and stop strings (detokenize.StopStrings, in the engine).

Choices where the issue was silent: the penalty is a seen-token mask (transformers penalises each distinct token
once, however often it came); its division is IEEE float32 on both paths (the kernel's div_rn, torch's tensor
division) so eager and graph steps agree bit for bit; stop strings act on the reply's raw text (the reasoning block
included), and the tokens that completed a stop string keep their ids in the events, with no text.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import repo_id

from localmoe.engine.detokenize import StopStrings
from localmoe.engine.engine import Engine
from localmoe.engine.sampling import Seen, generation_defaults, penalize, sample
from localmoe.events import GenerationSettings
from localmoe.kernels.argmax import argmax_next, argmax_next_ref

pytestmark = pytest.mark.filterwarnings("ignore")


# -- transformers' semantics, eager ------------------------------------------------------------------------------
PENALTY_CASES = [  # (id, family, penalty, prompt)
    ("qwen3-moe-1.3", "qwen3_moe", 1.3, "abcabc the the"),
    ("qwen3-moe-below-1", "qwen3_moe", 0.7, "abcabc the the"),
    ("qwen3.5-moe-1.5", "qwen3_5_moe", 1.5, "the cat the cat"),
    ("olmoe-2.0", "olmoe", 2.0, "xyz"),
    ("mixtral-1.1", "mixtral", 1.1, "hello hello"),
]


@pytest.mark.parametrize(
    ("family", "penalty", "prompt"), [c[1:] for c in PENALTY_CASES], ids=[c[0] for c in PENALTY_CASES]
)
def test_penalty_tokens_equal_transformers_generate(hub_cache, family, penalty, prompt):
    """Greedy with a repetition penalty on the CPU: the tokens of transformers' generate with the same
    repetition_penalty (float32, dense; both stop at EOS), and different from greedy without it."""
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    e = Engine.load(repo_id(family), device="cpu", dtype="float32", sparsity=0.0)
    ids = e.encode_raw(prompt)
    n = 24
    got = [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=n, repetition_penalty=penalty))]
    plain = [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=n))]
    ref_model = AutoModelForCausalLM.from_pretrained(
        snapshot_download(repo_id(family), local_files_only=True), dtype=torch.float32
    )
    x = torch.tensor([ids])
    out = ref_model.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, repetition_penalty=penalty
    )[0, len(ids) :].tolist()
    out = out[: out.index(3)] if 3 in out else out  # the tiny checkpoints' EOS
    assert got == out and len(got) >= 8
    assert got != plain  # the penalty changed something here


def test_penalty_pipelined_and_sampled(hub_cache):
    """The seen mask is updated in step order when steps are launched ahead; seeded sampling with a penalty repeats."""
    e = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    ids = e.encode_raw("pipelined penalty")
    runs = {}
    for depth in (0, 2):
        e.pipeline_depth = depth
        greedy = [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=12, repetition_penalty=1.4))]
        s = GenerationSettings(max_new_tokens=12, temperature=1.0, top_k=30, seed=11, repetition_penalty=1.4)
        runs[depth] = (greedy, [ev.token_id for ev in e.generate(ids, s)])
    assert runs[0] == runs[2]


def test_penalize_matches_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 1000, generator=gen) * 4
    ids = torch.randint(0, 1000, (1, 300), generator=gen)
    for p in (0.5, 1.1, 1.3, 3.0):
        seen = Seen(1000, torch.device("cpu"))
        seen.start(ids[0].tolist(), p)
        ref = RepetitionPenaltyLogitsProcessor(p)(ids, scores.clone())[0]
        assert torch.equal(penalize(scores[0], seen), ref), p


def test_seen_ignores_ids_outside_the_logits():
    seen = Seen(10, torch.device("cpu"))
    seen.start([-1, 3, 10, 99, 3], 1.2)
    assert seen.mask.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    token = sample(torch.tensor([0.0, 1, 2, 5, 4.5, 0, 0, 0, 0, 0]), GenerationSettings(), None, seen)
    assert int(token) == 4 and seen.mask[4] == 1  # 5 / 1.2 < 4.5: the seen token loses, the chosen one is marked
    seen.start([], 1.0)
    assert not seen.active and seen.mask.sum() == 0


# -- the argmax kernel with the penalty (the CUDA graph's greedy step), against its reference ---------------------
KERNEL_CASES = [  # (id, V, block, dtype, penalty, share of tokens seen)
    ("fp32-1.3", 5000, 512, torch.float32, 1.3, 0.3),
    ("bf16-1.1", 4099, 256, torch.bfloat16, 1.1, 0.5),
    ("below-1", 3001, 1024, torch.float32, 0.6, 0.4),
    ("all-seen", 777, 128, torch.float32, 2.0, 1.0),
    ("off", 4096, 512, torch.float32, 1.0, 0.5),
]


@pytest.mark.parametrize(
    ("V", "block", "dtype", "penalty", "share"), [c[1:] for c in KERNEL_CASES], ids=[c[0] for c in KERNEL_CASES]
)
def test_argmax_kernel_penalty(V, block, dtype, penalty, share):
    """Six launches chained as the graph chains them: each chosen token equals the reference's and the eager path's
    (penalize + argmax), the seen masks stay equal (marked only when the penalty is on)."""
    from kernel_cases import DEV

    gen = torch.Generator().manual_seed(V)
    mask = (torch.rand(V, generator=gen) < share).to(torch.uint8)
    chosen = []
    got_mask, ref_mask = mask.clone().to(DEV), mask.clone()
    pen = torch.tensor([penalty], dtype=torch.float32, device=DEV)
    ids = torch.zeros(1, dtype=torch.long, device=DEV)
    for step in range(6):
        x = (torch.randn(V, generator=gen) * 3).to(dtype)
        seen = Seen(V, torch.device("cpu"))
        seen.value, seen.penalty[0], seen.mask = penalty, penalty, ref_mask.clone()
        eager = torch.argmax(penalize(x, seen))
        argmax_next(x.to(DEV), ids=ids, seen=got_mask, penalty=pen, block=block)
        ref = argmax_next_ref(x, seen=ref_mask, penalty=pen.cpu())
        assert int(ids) == int(ref) == int(eager), step
        assert torch.equal(got_mask.cpu(), ref_mask), step
        chosen.append(int(ref))
    if penalty == 1.0:  # off: nothing marked
        assert torch.equal(ref_mask, mask)
    else:
        assert torch.equal(ref_mask, mask.index_fill(0, torch.tensor(chosen), 1))


def test_argmax_kernel_penalty_checks():
    from kernel_cases import DEV

    x = torch.randn(100, device=DEV)
    seen, pen = torch.zeros(100, dtype=torch.uint8, device=DEV), torch.ones(1, device=DEV)
    with pytest.raises(ValueError, match="seen and penalty go together"):
        argmax_next(x, seen=seen)
    with pytest.raises(ValueError, match="seen must be a contiguous uint8 \\[100\\]"):
        argmax_next(x, seen=seen[:99], penalty=pen)
    with pytest.raises(ValueError, match="seen must be"):
        argmax_next(x, seen=seen.bool(), penalty=pen)
    with pytest.raises(ValueError, match="penalty must be one float32"):
        argmax_next(x, seen=seen, penalty=pen.double())


# -- the checkpoint's generation config -------------------------------------------------------------------------
DEFAULT = GenerationSettings()
GENCONFIG_CASES = [  # (id, generation_config.json text or None for no file, expected fields, notices)
    ("no-file", None, {}, 0),
    ("not-json", "{nope", {}, 0),
    ("not-an-object", "[1, 2]", {}, 0),
    ("greedy-no-do-sample", {"temperature": 0.7, "top_k": 40}, {"temperature": 0.0, "top_k": 40}, 0),
    (
        "do-sample-false",
        {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.2},
        {"temperature": 0.0, "repetition_penalty": 1.2},
        0,
    ),
    (
        "sampling",
        {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1},
        {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1},
        0,
    ),
    ("sampling-no-temperature", {"do_sample": True, "top_p": 0.8}, {"temperature": 1.0, "top_p": 0.8}, 0),
    ("sampling-temperature-0", {"do_sample": True, "temperature": 0}, {"temperature": 0.0}, 0),
    ("nulls", {"do_sample": True, "temperature": None, "top_k": None}, {"temperature": 1.0}, 0),
    (
        "out-of-range",
        {"do_sample": True, "temperature": -1, "top_p": 1.5, "top_k": 2.5, "repetition_penalty": 0},
        {"temperature": 1.0},
        4,
    ),
    ("wrong-types", {"do_sample": "yes", "temperature": "hot", "top_k": True}, {"temperature": 0.0}, 2),
    ("top-k-float-integer", {"do_sample": True, "top_k": 20.0}, {"temperature": 1.0, "top_k": 20}, 0),
]


@pytest.mark.parametrize(
    ("content", "want", "notices"), [c[1:] for c in GENCONFIG_CASES], ids=[c[0] for c in GENCONFIG_CASES]
)
def test_generation_defaults(tmp_path, content, want, notices):
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    said = []
    got = generation_defaults(tmp_path, said.append)
    expected = {
        **{k: getattr(DEFAULT, k) for k in ("temperature", "top_k", "top_p", "repetition_penalty")},
        "temperature": 0.0,
        **want,
    }
    assert {k: getattr(got, k) for k in expected} == expected
    assert isinstance(got.top_k, int) and len(said) == notices


def test_bundled_model_samples_by_default():
    """localmoe-tiny's generation_config.json (temperature 0.7, top_k 40, top_p 0.9, repetition_penalty 1.1) is what
    default_settings() gives, and what `run` uses unless a flag says otherwise."""
    e = Engine.load("localmoe-tiny", device="cpu", sparsity=0.0)
    d = e.default_settings()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty) == (0.7, 40, 0.9, 1.1)
    assert e.override_defaults(temperature=0.0).temperature == 0.0 and e.default_settings().top_k == 40


# -- stop strings -----------------------------------------------------------------------------------------------
STOP_CASES = [  # (id, pieces streamed, stops, what comes out before the end, stopped, held at the end)
    ("none", ["ab", "cd"], (), "abcd", False, ""),
    ("in-one-piece", ["hello STOP there"], ("STOP",), "hello ", True, ""),
    ("across-pieces", ["hel", "lo S", "T", "OP x"], ("STOP",), "hello ", True, ""),
    ("false-start", ["a S", "T", "x"], ("STOP",), "a STx", False, ""),
    ("held-at-end", ["a ST"], ("STOP",), "a ", False, "ST"),
    ("earliest-of-two", ["xx", "yy", "zz"], ("yz", "xy"), "x", True, ""),
    ("overlapping-prefix", ["aab"], ("ab",), "a", True, ""),
    ("newline-stop", ["line one\n", "\nUser: more"], ("\n\nUser:",), "line one", True, ""),
    ("empty-stop-ignored", ["abc"], ("",), "abc", False, ""),
    ("unicode", ["naïve ", "café"], ("fé",), "naïve ca", True, ""),
]


@pytest.mark.parametrize(
    ("pieces", "stops", "out", "stopped", "held"), [c[1:] for c in STOP_CASES], ids=[c[0] for c in STOP_CASES]
)
def test_stop_strings(pieces, stops, out, stopped, held):
    s = StopStrings(stops)
    got = "".join(s.push(p) for p in pieces)
    assert (got, s.stopped) == (out, stopped)
    assert s.flush() == held
    assert s.push("more") == ("" if stopped else "more")


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """A checkpoint whose greedy reply is "ab;" over and over (tiny_models.save_repeating_checkpoint)."""
    import tiny_models

    folder = tiny_models.save_repeating_checkpoint(tmp_path_factory.mktemp("stop") / "rep", "ab;")
    e = Engine.load(str(folder), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    return e


ENGINE_STOP_CASES = [  # (id, stops, text, tokens, finish)
    ("inside-a-token", (";",), "ab", 1, "stop"),
    ("spanning-tokens", (";ab;a",), "ab", 3, "stop"),
    ("second-occurrence", ("b;ab;ab;ab",), "a", 4, "stop"),
    ("never", ("zzz",), "ab;" * 6, 6, "length"),
    ("prefix-held-to-the-end", (";ab;ab;ab;ab;ab;x",), "ab;" * 6, 6, "length"),
]


@pytest.mark.parametrize(
    ("stops", "text", "tokens", "finish"), [c[1:] for c in ENGINE_STOP_CASES], ids=[c[0] for c in ENGINE_STOP_CASES]
)
def test_engine_stop_strings(repeating, stops, text, tokens, finish):
    """The reply's text ends before the stop string (the stop text never emitted), finish_reason "stop"; the
    tokens up to the one completing it are in the events (each index at least once); text held as a possible stop
    comes back when the reply ends otherwise."""
    evs = list(repeating.generate(repeating.encode_raw("x"), GenerationSettings(max_new_tokens=6, stop=stops)))
    assert "".join(ev.text for ev in evs) == text
    assert sorted({ev.index for ev in evs}) == list(range(tokens))
    assert repeating.stats.finish_reason == finish and repeating.stats.generated_tokens == tokens
