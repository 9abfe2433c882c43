"""Prompt reuse across a chat's turns (localmoe/decode/prefix.py): the history the cache holds is not prefilled again,
and
nothing a user sees changes: the same tokens as prefilling every prompt whole."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, repo_id

from localmoe.decode.prefix import PromptReuse, piece_cuts, prefill
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings

GREEDY = GenerationSettings(max_new_tokens=8)


def reply(engine, messages, settings=GREEDY):
    return [ev.token_id for ev in engine.chat(messages, settings)]


def conversation(engine):
    """Three turns, each prompt the one before plus the reply and a new message, as the chat app sends them."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a mixture of experts?"}]
    turns = []
    for follow in ("and sparsity?", "thanks"):
        ids = reply(engine, msgs)
        turns.append((ids, engine.stats.prompt_tokens, engine.stats.reused_prompt_tokens))
        msgs = msgs + [
            {"role": "assistant", "content": engine.tokenizer.decode(ids, skip_special_tokens=True)},
            {"role": "user", "content": follow},
        ]
    ids = reply(engine, msgs)
    turns.append((ids, engine.stats.prompt_tokens, engine.stats.reused_prompt_tokens))
    return turns


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_turns_reuse_the_history_and_reply_the_same(family):
    e = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    e.eos_ids = set()  # full-length replies: every turn's prompt grows
    with_reuse = conversation(e)
    e.reuse_prompts = False
    e._forget_prompt()
    without = conversation(e)
    assert [t[0] for t in with_reuse] == [t[0] for t in without]
    assert [t[1] for t in with_reuse] == [t[1] for t in without]
    assert with_reuse[0][2] == 0 and all(t[2] == 0 for t in without)
    for (_, prompt, reused), (_, before, _) in zip(with_reuse[1:], with_reuse):
        assert reused == before  # the whole prompt of the turn before (ChatML: renders after it)


def test_regenerate_and_edit_history(hub_cache):
    """Asking again reuses the history; a conversation whose earlier message changed is prefilled whole."""
    e = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    msgs = [{"role": "user", "content": "first question"}]
    first = reply(e, msgs)
    msgs2 = msgs + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second"}]
    a = reply(e, msgs2)
    assert e.stats.reused_prompt_tokens > 0
    again = reply(e, msgs2)  # regenerate: the same prompt, rewound to its end, nothing prefilled
    assert again == a and e.stats.reused_prompt_tokens == e.stats.prompt_tokens
    edited = [{"role": "user", "content": "First question"}] + msgs2[1:]
    b = reply(e, edited)
    assert e.stats.reused_prompt_tokens == 0
    e.reuse_prompts = False
    assert reply(e, edited) == b and reply(e, msgs) == first


def test_sampled_and_cancelled_turns_reuse_correctly(hub_cache):
    """A cancelled reply (its decode steps moved the recurrent state past the history) and seeded sampling."""
    e = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    msgs = [{"role": "user", "content": "tell me a long story"}]
    stream = e.chat(msgs, GenerationSettings(max_new_tokens=400))
    next(stream)
    e.cancel()
    list(stream)
    assert e.stats.finish_reason == "cancelled"
    msgs2 = msgs + [{"role": "assistant", "content": "once"}, {"role": "user", "content": "go on"}]
    s = GenerationSettings(max_new_tokens=10, temperature=1.0, seed=11)
    got = reply(e, msgs2, s)
    assert e.stats.reused_prompt_tokens > 0
    fresh = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0)
    fresh.eos_ids = set()
    assert reply(fresh, msgs2, s) == got


def test_sparsity_change_prefills_whole(hub_cache):
    e = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    msgs = [{"role": "user", "content": "hello there"}]
    reply(e, msgs)
    msgs2 = msgs + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    e.set_sparsity(0.5)
    reply(e, msgs2)
    assert e.stats.reused_prompt_tokens == 0


def tensor_addresses(cache):
    out = []
    for layer in cache.layers:
        for v in vars(layer).values():
            for t in v.values() if isinstance(v, dict) else [v]:
                if isinstance(t, torch.Tensor):
                    out.append(t.data_ptr())
    return out


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "gpt_oss"])
def test_static_cache_rewinds_in_place(family):
    """The CUDA-graph decoder's StaticCache (here on the CPU): rewound in place (same tensors) to the saved history,
    then the rest prefilled, gives the logits of prefilling the whole prompt into a fresh cache."""
    from transformers import StaticCache

    e = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    model, kw = e.model, e._cache_kw

    def forward(piece, start, cache):
        pos = torch.arange(start, start + piece.shape[1])
        out = model(input_ids=piece, cache_position=pos, use_cache=True, **{kw: cache}, **e._logits_kw)
        return cache, out.logits[0, -1]

    torch.manual_seed(0)
    history = torch.randint(5, 90, (1, 23))
    turn1 = torch.cat([history, torch.randint(5, 90, (1, 4))], 1)
    turn2 = torch.cat([history, torch.randint(5, 90, (1, 9))], 1)
    cache = StaticCache(config=e.loaded.config, max_cache_len=64)
    reuse = PromptReuse()
    _, _, L = prefill(forward, cache, turn1, stable=23, chunk=10, reuse=reuse)
    assert L == 0 and reuse.tokens == tuple(history[0].tolist())
    for p in range(27, 31):  # decode steps past the history, as a reply would
        forward(torch.randint(5, 90, (1, 1)), p, cache)
    addresses = tensor_addresses(cache)
    _, got, L = prefill(forward, cache, turn2, stable=32, chunk=10, reuse=reuse)  # kept at its end, with logits
    assert L == 23 and reuse.reused == 23
    assert tensor_addresses(cache) == addresses
    _, want, _ = prefill(
        forward, StaticCache(config=e.loaded.config, max_cache_len=64), turn2, stable=0, chunk=10, reuse=None
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    forward(torch.randint(5, 90, (1, 1)), 32, cache)
    _, again, L = prefill(forward, cache, turn2, stable=32, chunk=10, reuse=reuse)  # the same prompt: nothing to run
    assert L == 32
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    turn3 = torch.cat([turn2, torch.randint(5, 90, (1, 5))], 1)
    _, got, L = prefill(forward, cache, turn3, stable=0, chunk=10, reuse=reuse)
    _, want, _ = prefill(
        forward, StaticCache(config=e.loaded.config, max_cache_len=64), turn3, stable=0, chunk=10, reuse=None
    )
    assert L == 32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a prompt that does not start with the history: reset, prefilled whole, the copy forgotten
    other = torch.randint(5, 90, (1, 30))
    _, got, L = prefill(forward, cache, other, stable=0, chunk=10, reuse=reuse)
    assert L == 0 and reuse.tokens == ()
    _, want, _ = prefill(
        forward, StaticCache(config=e.loaded.config, max_cache_len=64), other, stable=0, chunk=10, reuse=None
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unknown_cache_layers_are_never_rewound():
    class SlidingLayerish:
        pass

    class Cache:
        layers = [SlidingLayerish()]

    reuse = PromptReuse()
    reuse.save(Cache(), [1, 2, 3])
    assert reuse.tokens == () and reuse.reusable(Cache(), [1, 2, 3, 4]) == 0


THINKING = (  # the generation header opens a thinking block that past replies are rendered without (Qwen3-style)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_thinking_template_reuses_the_history_without_the_header(family):
    e = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    e.tokenizer.chat_template = THINKING
    e.eos_ids = set()
    with_reuse = conversation(e)
    e.reuse_prompts = False
    e._forget_prompt()
    assert [t[0] for t in conversation(e)] == [t[0] for t in with_reuse]
    one = [{"role": "user", "content": "x"}]
    header = len(e.encode_chat(one)) - len(
        e.tokenizer(
            e.tokenizer.apply_chat_template(one, add_generation_prompt=False, tokenize=False), add_special_tokens=False
        )["input_ids"]
    )
    for (_, prompt, reused), (_, before, _) in zip(with_reuse[1:], with_reuse):
        assert reused == before - header - 1  # the turn before's prompt less its header (and the last history token)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_prepare_next_turn_adds_the_reply(family):
    """After a reply (as the chat app does while the user types) the cache takes the reply in, so the next turn
    prefills only its new message; tokens equal prefilling whole; the turn's own prompt still regenerates from cache."""
    e = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    msgs = [{"role": "user", "content": "what is a mixture of experts?"}]
    first = reply(e, msgs)
    p1 = e.stats.prompt_tokens
    msgs = msgs + [{"role": "assistant", "content": e.tokenizer.decode(first, skip_special_tokens=True)}]
    assert e.prepare_next_turn(msgs) > 0
    assert reply(e, msgs[:1]) == first and e.stats.reused_prompt_tokens == p1  # regenerate: from the prompt's end
    added = e.prepare_next_turn(msgs)  # the new reply (here the same) taken in again
    assert added > 0
    turn2 = msgs + [{"role": "user", "content": "and sparsity?"}]
    got = reply(e, turn2)
    assert e.stats.reused_prompt_tokens == p1 + added
    assert e.stats.prompt_tokens - e.stats.reused_prompt_tokens < len("and sparsity?") + 16  # message + headers
    e.reuse_prompts = False
    e._forget_prompt()
    assert reply(e, turn2) == got
    assert e.prepare_next_turn(msgs) == 0  # reuse off: nothing prepared


def test_prompt_pieces_are_the_fewest_of_equal_length():
    """A long prompt goes in the fewest pieces of at most `chunk` tokens, of equal lengths: an offloaded model's piece
    moves every absent expert however short it is, so no short ragged tail piece."""
    assert piece_cuts(0, 2100, 2048) == [0, 1050, 2100]
    assert piece_cuts(0, 8192, 2048) == [0, 2048, 4096, 6144, 8192]
    assert piece_cuts(3, 30, 7) == [3, 9, 16, 23, 30]
    assert piece_cuts(0, 5, 2048) == [0, 5] and piece_cuts(5, 5, 7) == [5]
