"""The Engine at batch 1: sampling settings, stopping, cancellation from another thread, stats."""

from __future__ import annotations

import threading

import pytest
import tiny_models
import torch
from conftest import repo_id

from localmoe.engine.engine import Engine
from localmoe.engine.sampling import sample
from localmoe.events import GenerationSettings


@pytest.fixture(scope="module")
def engine(hub_cache):
    return Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)


def ids_of(engine, settings, prompt="abc"):
    return [ev.token_id for ev in engine.generate(engine.encode_raw(prompt), settings)]


def test_greedy_is_deterministic_and_max_new_tokens(engine):
    s = GenerationSettings(max_new_tokens=7)
    a, b = ids_of(engine, s), ids_of(engine, s)
    assert a == b and len(a) <= 7
    assert engine.stats.generated_tokens == len(a) and engine.stats.prompt_tokens == 3
    assert engine.stats.finish_reason in {"length", "stop"}


def test_seeded_sampling_reproducible(engine):
    s = GenerationSettings(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    assert ids_of(engine, s) == ids_of(engine, s)
    other = GenerationSettings(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=8)
    assert ids_of(engine, s) != ids_of(engine, other)


def test_top_k_one_is_greedy(engine):
    greedy = ids_of(engine, GenerationSettings(max_new_tokens=8))
    assert ids_of(engine, GenerationSettings(max_new_tokens=8, temperature=0.7, top_k=1, seed=3)) == greedy


def test_sampler_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert int(sample(logits, GenerationSettings(), None)) == 1
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, GenerationSettings(temperature=1.0, top_p=0.5), gen)) for _ in range(50)}
    assert draws <= {1, 2} and 1 in draws
    draws = {int(sample(logits, GenerationSettings(temperature=5.0, top_k=2), gen)) for _ in range(200)}
    assert draws == {1, 2}


def test_stops_on_eos(engine):
    engine.eos_ids = set(range(engine.loaded.config.vocab_size))  # every token is EOS: nothing is emitted
    try:
        assert ids_of(engine, GenerationSettings(max_new_tokens=5)) == []
        assert engine.stats.finish_reason == "stop"
    finally:
        engine.eos_ids = engine._eos_ids()


def test_cancel_from_another_thread(engine):
    got = []
    stream = engine.generate(engine.encode_raw("abc"), GenerationSettings(max_new_tokens=400))
    first = next(stream)
    got.append(first)
    t = threading.Thread(target=engine.cancel)
    t.start()
    t.join()
    got.extend(stream)
    assert len(got) <= 2  # stops within a token
    assert engine.stats.finish_reason == "cancelled"


def test_empty_prompt_is_usage_error(engine):
    from localmoe.errors import UsageError

    with pytest.raises(UsageError):
        list(engine.generate([], GenerationSettings()))


def test_chat_template_with_system(engine):
    ids = engine.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_streamed_text_equals_decoding_all_ids():
    engine = Engine.load("localmoe-tiny", device="cpu")
    events = list(
        engine.chat(
            [{"role": "user", "content": "naïve café — 日本語: what is a str?"}],
            GenerationSettings(max_new_tokens=60, temperature=1.0, seed=3),
        )
    )
    full = engine.tokenizer.decode([ev.token_id for ev in events], skip_special_tokens=True)
    assert "".join(ev.text for ev in events) == full


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_chunked_prefill_equals_one_piece(family):
    """Long prompts are prefilled in chunks into the cache (DeltaNet conv/recurrent state and KV carried across
    chunks): the same greedy tokens as one forward over the whole prompt, ragged last chunk included."""
    e = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    ids = e.encode_raw("chunked prefill keeps every state across the pieces of a long prompt")
    s = GenerationSettings(max_new_tokens=10)
    whole = [ev.token_id for ev in e.generate(ids, s)]
    assert len(ids) > 3 * 7
    e.prefill_chunk = 7
    assert [ev.token_id for ev in e.generate(ids, s)] == whole


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_pipelined_decode_equals_step_by_step(family):
    """Launching steps N+1.. before streaming token N (the CUDA default: 2 ahead) changes nothing a user sees: same
    greedy and seeded-sampled tokens, exact max_new_tokens, EOS and cancel (here on the CPU's eager step, same loop)."""
    e = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    ids = e.encode_raw("pipelined decoding")
    runs = {}
    for depth in (0, 1, 2, 3):
        e.pipeline_depth = depth
        greedy = [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=9))]
        sampled = [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=9, temperature=1.0, seed=5))]
        assert len(greedy) == len(sampled) == 9 and e.stats.finish_reason == "length"
        runs[depth] = (greedy, sampled)
    assert runs[0] == runs[1] == runs[2] == runs[3]
    e.pipeline_depth = 2
    stop_at = runs[2][0][4]
    e.eos_ids = {stop_at}
    first = runs[2][0].index(stop_at)
    assert [ev.token_id for ev in e.generate(ids, GenerationSettings(max_new_tokens=9))] == runs[2][0][:first]
    assert e.stats.finish_reason == "stop"
    e.eos_ids = set()
    stream = e.generate(ids, GenerationSettings(max_new_tokens=400))
    got = [next(stream)]
    e.cancel()
    got.extend(stream)
    assert len(got) == 1 and e.stats.finish_reason == "cancelled"


UNDECODABLE = [  # (id, how the engine is given the text)
    ("raw-undecodable-byte", lambda e: e.encode_raw("caf\udce9")),
    ("raw-lone-surrogate", lambda e: e.encode_raw("a\ud800b")),
    ("chat-user", lambda e: e.encode_chat([{"role": "user", "content": "\udcff"}])),
    (
        "chat-system",
        lambda e: e.encode_chat([{"role": "system", "content": "\udcff"}, {"role": "user", "content": "hi"}]),
    ),
]


@pytest.mark.parametrize("encode", [c[1] for c in UNDECODABLE], ids=[c[0] for c in UNDECODABLE])
def test_undecodable_text_is_a_usage_error(engine, encode):
    """Lone surrogates (bytes the locale could not decode) are a UsageError, not the tokenizer's TypeError."""
    from localmoe.errors import UsageError

    with pytest.raises(UsageError, match="not valid text"):
        encode(engine)


def test_timings_in_stats(engine):
    """load_s (the load, kept in every reply's stats), ttft_s (generate call to first token) and wall_s (to the end)."""
    assert engine.load_s > 0 and engine.stats.load_s == engine.load_s
    stream = engine.generate(engine.encode_raw("abc"), GenerationSettings(max_new_tokens=6))
    next(stream)
    live = engine.stats
    assert live.ttft_s > 0 and live.wall_s >= live.ttft_s and live.finish_reason == ""
    list(stream)
    st = engine.stats
    assert st.load_s == engine.load_s and 0 < st.ttft_s <= st.wall_s and st.finish_reason in {"length", "stop"}
    assert st.as_json()["wall_s"] == st.wall_s


def _copy_without(src, dst, *names, config=None):
    import json
    import shutil

    shutil.copytree(src, dst)
    for n in names:
        (dst / n).unlink(missing_ok=True)
    if config:
        data = json.loads((dst / "config.json").read_text())
        data.update(config)
        (dst / "config.json").write_text(json.dumps(data))
    return dst


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BEFORE_TOKENIZER = [  # (id, files removed, config changes, the loader's message)
    ("no-tokenizer", TOKENIZER_FILES, None, "no tokenizer in "),
    ("bad-config-and-no-tokenizer", TOKENIZER_FILES, {"hidden_size": -1}, "hidden_size is -1"),
    ("unsupported-and-no-tokenizer", TOKENIZER_FILES, {"model_type": "gpt_oss"}, "GPT-OSS is not yet supported"),
]


@pytest.mark.parametrize(
    ("removed", "config", "says"), [c[1:] for c in BEFORE_TOKENIZER], ids=[c[0] for c in BEFORE_TOKENIZER]
)
def test_config_and_tokenizer_checked_before_the_tokenizer_loads(src_dir, tmp_path, monkeypatch, removed, config, says):
    """The loader's own messages (read_config, check_tokenizer) come before transformers builds a tokenizer."""
    from localmoe.errors import UsageError

    if config and config.get("model_type") == "gpt_oss":  # every family runs: GPT-OSS marked unsupported here
        tiny_models.mark_unsupported(monkeypatch)

    folder = _copy_without(src_dir / "qwen3_moe", tmp_path / "ckpt", *removed, config=config)
    with pytest.raises(UsageError, match=says.replace("(", "\\(")):
        Engine.load(str(folder), device="cpu", sparsity=0.0)


def test_reasoning_content_is_checked(engine):
    from localmoe.errors import UsageError

    with pytest.raises(UsageError, match="the assistant message's reasoning is not valid text"):
        engine.encode_chat(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning_content": "\udcff"}]
        )


def test_notes_and_plan_line(hub_cache):
    """The plan line is the load's first note; it reaches on_notice only with show_plan (run on a terminal)."""
    notes = []
    e = Engine.load(repo_id("olmoe"), device="cpu", sparsity=0.0, on_notice=notes.append, show_plan=True)
    assert notes[0] == e.plan_line == e.notes[0] and "on the CPU" in e.plan_line
    quiet = Engine.load(repo_id("olmoe"), device="cpu", sparsity=0.0, on_notice=notes.append)
    assert quiet.notes[0] == quiet.plan_line and notes.count(e.plan_line) == 1
