"""Incremental decoding: the key/value cache ops, the Decoder against the pure-JAX reference, `jnntile.generate`.

* cache_write / cached_attention against softmax attention over the whole
  sequence, fed in chunks whose tiles do not line up with the cache's.
* Greedy decoding of several prompts of different lengths, as one batch, equals
  the reference's greedy decoding of each prompt alone, for tilings that split
  the sequence, the heads and the embedding; the cache path's logits equal a
  full forward's; sampling is reproducible and a prompt's continuation does not
  depend on the other prompts; a memory limit with swap changes nothing.
* `python -m jnntile.generate` end to end from a training checkpoint and from
  the Hugging Face fixture; bad input gives a clear error.
"""

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import BFLOAT16_TOL, causal_attention_reference, rel_err
from flax import nnx

import jnntile
from jnntile import data as data_mod
from jnntile import generate as generate_mod
from jnntile import train as train_mod
from jnntile.models import decoding
from jnntile.models import gpt2
from jnntile.models.gpt2 import reference as ref
from jnntile.models.gpt2.config import GPT2Config
from jnntile.models.families import load_hf
from jnntile.ops import attention
from jnntile.ops import values as values_ops
from jnntile.core.tensor import pack

FIXTURE = Path(__file__).parent / "data" / "hf_tiny_gpt2"
ROOT = Path(__file__).resolve().parent.parent

# ---- the cache ops ------------------------------------------------------------------------

B, T, H, D = 2, 12, 3, 8
# (qkv tiles (tb, tq, 1, th, D), cache tile on the sequence, the chunks fed in turn)
CACHE_TILINGS = {
    "one_chunk": ((B, T, 1, H, D), T, [T]),
    "token_by_token": ((B, 1, 1, H, D), 4, [1] * T),
    "unaligned": ((1, 2, 1, 2, D), 5, [5, 1, 1, 3, 2]),  # H = 2 + 1, chunks across cache tiles
    "batch_heads": ((B, 3, 1, 2, D), 4, [3, 3, 3, 3]),
}


def _feed(qkv, tiles, cache_tile, chunks, jit):
    """Writes qkv chunk by chunk into a fresh cache and attends; returns the outputs and the cache."""
    b, t, _, h, d = qkv.shape
    cache = attention.kv_cache(b, t, h, d, (tiles[0], cache_tile, 1, tiles[3], d))

    def chunk_step(x, cache, pos):
        cache = attention.cache_write(x, cache, pos)
        return cache, jnntile.to_array(attention.cached_attention(x, cache, pos))

    step = jax.jit(chunk_step) if jit else chunk_step
    outs, pos = [], 0
    for n in chunks:
        cache, out = step(jnntile.from_array(qkv[:, pos:pos + n], tiles), cache, np.int32(pos))
        outs.append(np.asarray(out))
        pos += n
    return np.concatenate(outs, axis=1), cache


@pytest.mark.usefixtures("placement")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", CACHE_TILINGS)
def test_cached_attention_matches_attention_over_the_sequence(tiling, jit):
    qkv = (2.0 * np.random.default_rng(0).standard_normal((B, T, 3, H, D))).astype(np.float32)
    out, cache = _feed(qkv, *CACHE_TILINGS[tiling], jit=jit)
    assert rel_err(out, causal_attention_reference(qkv)) <= 1e-5
    values = cache.numpy()
    np.testing.assert_array_equal(values[:, :, 0], qkv[:, :, 1])
    np.testing.assert_array_equal(values[:, :, 1], qkv[:, :, 2])


@pytest.mark.usefixtures("placement")
@pytest.mark.parametrize("tiling", ["token_by_token", "unaligned"])
def test_cached_grouped_query_attention(tiling):
    # Two query heads per key/value head: the cache holds the keys and values once per group.
    qkv = (2.0 * np.random.default_rng(6).standard_normal((B, T, 4, H, D))).astype(np.float32)
    out, cache = _feed(qkv, *CACHE_TILINGS[tiling], jit=True)
    assert out.shape == (B, T, 2, H, D)
    assert rel_err(out, causal_attention_reference(qkv)) <= 1e-5
    values = cache.numpy()
    np.testing.assert_array_equal(values[:, :, 0], qkv[:, :, 2])
    np.testing.assert_array_equal(values[:, :, 1], qkv[:, :, 3])


@pytest.mark.usefixtures("placement")
def test_cached_attention_with_rows_longer_than_a_warp():
    qkv = np.random.default_rng(3).standard_normal((2, 70, 3, 3, 40)).astype(np.float32)
    out, _ = _feed(qkv, (2, 36, 1, 2, 40), 40, [33, 1, 36], jit=True)
    assert rel_err(out, causal_attention_reference(qkv)) <= 1e-5


@pytest.mark.usefixtures("placement")
def test_invalidated_cache_is_written_again_from_position_zero():
    rng = np.random.default_rng(1)
    first, second = ((2.0 * rng.standard_normal((B, T, 3, H, D))).astype(np.float32) for _ in range(2))
    tiles, cache_tile, chunks = CACHE_TILINGS["unaligned"]
    _, cache = _feed(first, tiles, cache_tile, chunks, jit=False)
    cache = values_ops.invalidate(cache)
    pos = 0
    for n in chunks:
        x = jnntile.from_array(second[:, pos:pos + n], tiles)
        cache = attention.cache_write(x, cache, pos)
        out = attention.cached_attention(x, cache, pos)
        pos += n
    assert rel_err(out.numpy(), causal_attention_reference(second)[:, T - chunks[-1]:]) <= 1e-5


def test_cache_bad_inputs():
    qkv = jnntile.from_array(np.zeros((B, 4, 3, H, D), np.float32), (1, 2, 1, H, D))
    with pytest.raises(ValueError, match=r"must be \(tb, tc, 1, th, 8\)"):
        attention.kv_cache(B, T, H, D, (1, 4, 2, H, D))
    with pytest.raises(ValueError, match=r"\(B, T_max, 2, H, D\) = \(2, T_max, 2, 3, 8\)"):
        attention.cache_write(qkv, attention.kv_cache(B, T, 2, D, (1, 4, 1, 2, D)), 0)
    with pytest.raises(ValueError, match=r"share qkv's batch and head tiles .* use \(1, 4, 1, 3, 8\)"):
        attention.cache_write(qkv, attention.kv_cache(B, T, H, D, (2, 4, 1, H, D)), 0)
    cache = attention.kv_cache(B, T, H, D, (1, 4, 1, H, D))
    with pytest.raises(ValueError, match=r"positions 10 .. 13 lie outside the cache's 12 positions"):
        attention.cache_write(qkv, cache, 10)
    with pytest.raises(TypeError, match="integer scalar"):
        attention.cached_attention(qkv, cache, 1.5)
    submitted = jnntile.runtime.stats()["tasks_submitted"]
    with pytest.raises(Exception, match=r"the cache holds nothing at some of the positions 0 \.\. 3"):
        jax.block_until_ready(attention.cached_attention(qkv, cache, 0).token)
    with pytest.raises(Exception, match="position 2 continues a cache tile whose earlier positions hold nothing"):
        jax.block_until_ready(attention.cache_write(qkv, cache, 2).token)
    with pytest.raises(Exception, match="lie outside the cache's 12 positions"):
        jax.block_until_ready(jax.jit(attention.cache_write)(qkv, cache, np.int32(9)).token)
    assert jnntile.runtime.stats()["tasks_submitted"] == submitted


# ---- the decoder ----------------------------------------------------------------------------

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=96, n_positions=32)
PROMPT_LENGTHS = (7, 12, 5)
NEW_TOKENS = 8
MAX_LEN = max(PROMPT_LENGTHS) + NEW_TOKENS - 1
TILINGS = {
    "one tile": dict(tile_batch=3, tile_seq=MAX_LEN, tile_embd=32, tile_heads=4, tile_hidden=128, tile_vocab=96),
    "many tiles": dict(tile_batch=1, tile_seq=4, tile_embd=8, tile_heads=1, tile_hidden=32, tile_vocab=24),
    "uneven tiles": dict(tile_batch=2, tile_seq=5, tile_embd=12, tile_heads=3, tile_hidden=40, tile_vocab=40),
}


@pytest.fixture(scope="module")
def weights():
    """Weights of O(1) scale: GPT-2's own init gives nearly flat logits, whose argmax a rounding could flip."""
    rng = np.random.default_rng(0)
    params = {}
    for name, shape in CONFIG.param_shapes().items():
        base = 1.0 if name.endswith("weight") and (".ln_" in name or name.startswith("ln_f.")) else 0.0
        params[name] = (base + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    return params


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


_reference_forward = jax.jit(ref.forward, static_argnums=1)


def reference_greedy(params, config, prompt, new_tokens):
    """Greedy decoding of one prompt by full forwards of the reference; checks that no argmax is a near tie.

    The tokens sit at the start of a window of n_positions (one compilation);
    causal attention keeps the unused tail from affecting them.
    """
    tokens = list(prompt)
    for _ in range(new_tokens):
        window = np.zeros((1, config.n_positions), np.int32)
        window[0, :len(tokens)] = tokens
        logits = np.asarray(_reference_forward(params, config, window))[0, len(tokens) - 1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near tie in the reference: the test would depend on rounding"
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def expected_greedy(weights, prompts):
    return [reference_greedy(weights, CONFIG, p, NEW_TOKENS) for p in prompts]


def _decoder(weights, tiling, batch_size=len(PROMPT_LENGTHS), **kwargs):
    model = gpt2.GPT2(dataclasses.replace(CONFIG, **tiling), batch_size=batch_size, seq_len=MAX_LEN)
    model.load_hf_params(weights)
    return decoding.Decoder(model, batch_size=batch_size, max_len=MAX_LEN, **kwargs)


@pytest.mark.usefixtures("placement")
@pytest.mark.parametrize("prefill_chunk", [2, 32], ids=["chunks", "no chunk"])
@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
def test_greedy_decoding_matches_reference(weights, prompts, expected_greedy, tiling, prefill_chunk):
    decoder = _decoder(weights, tiling, prefill_chunk=prefill_chunk)
    assert decoder.prefill_length(PROMPT_LENGTHS) == (4 if prefill_chunk == 2 else 0)
    for _ in range(2):  # the second run reuses the compiled programs and the (invalidated) caches
        assert decoder.generate(prompts, NEW_TOKENS, temperature=0) == expected_greedy
    assert decoder._step._cache_size() == 1
    assert decoder._prefill._cache_size() == (1 if prefill_chunk == 2 else 0)


@pytest.mark.usefixtures("placement")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_path_logits_equal_full_forward(weights, dtype):
    """Decoding with the key/value cache gives the logits of the full forward: to float32 rounding, and with
    dtype="bfloat16" (bfloat16 activations and weight copies, a float32 cache) to bfloat16 rounding."""
    decoder = _decoder(weights, dict(TILINGS["uneven tiles"], dtype=dtype), prefill_chunk=3)
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (3, MAX_LEN)).astype(np.int32)
    state, caches = pack(nnx.state(decoder.model)), decoder.cache.layers
    caches = decoder._prefill(state, caches, tokens[:, :3], np.int32(0))
    logits = []
    for pos in range(3, MAX_LEN):
        caches, step_logits = decoder._step(state, caches, tokens[:, pos:pos + 1], np.int32(pos))
        logits.append(np.asarray(step_logits))
    full, _ = decoder.model(decoder.model.token_tensor(tokens))
    assert full.dtype == dtype
    assert rel_err(np.stack(logits, axis=1), full.numpy()[:, 3:]) < (1e-5 if dtype == "float32" else BFLOAT16_TOL)


@pytest.mark.usefixtures("placement")
def test_sampling_is_reproducible_and_independent_of_the_other_prompts(weights, prompts):
    decoder = _decoder(weights, TILINGS["many tiles"], prefill_chunk=2)
    sampled = decoder.generate(prompts, NEW_TOKENS, temperature=0.8, top_k=20, seed=5)
    assert decoder.generate(prompts, NEW_TOKENS, temperature=0.8, top_k=20, seed=5) == sampled
    assert decoder.generate(prompts, NEW_TOKENS, temperature=0.8, top_k=20, seed=6) != sampled
    other = [prompts[0], prompts[1][:3], prompts[2]]  # the middle prompt replaced by a shorter one
    again = decoder.generate(other, NEW_TOKENS, temperature=0.8, top_k=20, seed=5)
    assert again[0] == sampled[0] and again[2] == sampled[2]


@pytest.mark.usefixtures("placement")
def test_decoding_stops_at_a_stop_token(weights, prompts, expected_greedy):
    """A continuation ends with the first stop token it samples (kept, last); the others go on unchanged, and
    decoding ends once every continuation has ended."""
    stop = expected_greedy[0][2]
    decoder = _decoder(weights, TILINGS["uneven tiles"], prefill_chunk=2)
    steps = []
    got = decoder.generate(prompts, NEW_TOKENS, temperature=0, stop={stop}, progress=steps.append)
    assert got == [e[:e.index(stop) + 1] if stop in e else e for e in expected_greedy]
    assert got[0] == expected_greedy[0][:3]
    everyone_stops = {e[0] for e in expected_greedy}
    got = decoder.generate(prompts, NEW_TOKENS, temperature=0, stop=everyone_stops, progress=steps.append)
    assert got == [e[:1] for e in expected_greedy]
    assert max(steps[-1:]) == max(PROMPT_LENGTHS)  # no step after the last sequence's first sample


def test_sample_respects_temperature_and_top_k():
    logits = np.array([0.0, 3.0, 1.0, 2.5, -1.0], np.float32)
    generator = np.random.default_rng(0)
    assert decoding.sample(logits, 0.0, None, generator) == 1
    draws = {decoding.sample(logits, 1.0, 2, generator) for _ in range(200)}
    assert draws == {1, 3}
    draws = [decoding.sample(logits, 0.05, None, generator) for _ in range(50)]
    assert set(draws) == {1}


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_sample_at_a_tiny_temperature_is_the_most_likely_token(temperature):
    logits = np.array([0.0, 3.0, 3.0 - 1e-6, 2.5, -1.0], np.float32)
    generator = np.random.default_rng(0)
    assert {decoding.sample(logits, temperature, top_k, generator) for top_k in (None, 2) for _ in range(20)} == {1}
    assert decoding.sample(np.array([2.0, 2.0], np.float32), temperature, None, generator) in (0, 1)  # a tie


def test_decoder_bad_inputs(weights, prompts):
    decoder = _decoder(weights, TILINGS["many tiles"])
    with pytest.raises(ValueError, match="2 prompts; this decoder was built for batch_size=3"):
        decoder.generate(prompts[:2], 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([prompts[0], [], prompts[2]], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([prompts[0], [CONFIG.vocab_size], prompts[2]], 4)
    with pytest.raises(ValueError, match=f"more than this decoder's max_len={MAX_LEN}: generate at most 8 tokens"):
        decoder.generate(prompts, 9)
    with pytest.raises(ValueError, match="temperature=-1"):
        decoder.generate(prompts, 4, temperature=-1)
    with pytest.raises(ValueError, match="longer than the 32 positions the model has"):
        decoding.Decoder(decoder.model, batch_size=3, max_len=33)


def test_generation_under_a_memory_limit_with_swap_matches(tmp_path):
    """Weights of 11 MB, and every step's tiles, under a limit of 6 MB with swap: the same tokens."""
    config = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=4096, n_positions=32, tile_batch=1,
                        tile_seq=8, tile_embd=128, tile_heads=2, tile_hidden=256, tile_vocab=1024)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (3, 6)]
    previous = jnntile.runtime.config()

    def run(**settings):
        jnntile.runtime.stop()
        jnntile.release_traced()
        # CPU workers only: with a GPU the tiles would stay in its memory, and RAM and swap go unused.
        jnntile.runtime.start(cuda_workers=0, placement="cpu", **settings)
        model = gpt2.GPT2(config, batch_size=2, seq_len=16, seed=3)
        decoder = decoding.Decoder(model, batch_size=2, max_len=16, prefill_chunk=2)
        tokens = decoder.generate(prompts, 8, temperature=0)
        jnntile.runtime.wait_all()
        return tokens, jnntile.runtime.stats()

    try:
        unlimited, _ = run(memory_limit_mb=1024, swap_dir=None)
        limited, stats = run(memory_limit_mb=6, swap_dir=str(tmp_path), swap_size_mb=64, watchdog_s=60)
    finally:
        jnntile.runtime.stop()
        jnntile.release_traced()
        jnntile.runtime.configure(**dataclasses.asdict(previous))
    assert limited == unlimited
    assert stats["bytes_moved"].get("RAM->DISK", 0) > 0


# ---- the command line -----------------------------------------------------------------------

def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jnntile.generate", *args, "--quiet"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def _char_tokenizer(path: Path) -> Path:
    """A tokenizer of one token per character for the fixture's 96-token vocabulary (printable ASCII, newline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path))
    return path


def test_cli_from_the_hugging_face_fixture(tmp_path):
    tokenizer = _char_tokenizer(tmp_path / "chars.json")
    prompts = ["Tiles", "StarPU runs tasks"]
    result = _run_cli("--hf", str(FIXTURE), "--tokenizer", str(tokenizer), "--prompt", prompts[0], "--prompt",
                      prompts[1], "--max-new-tokens", "6", "--temperature", "0", "--tile-embd", "8",
                      "--tile-seq", "4")
    assert result.returncode == 0, result.stderr
    config, params = load_hf(FIXTURE)
    to_ids = {c: i for i, c in enumerate([chr(i) for i in range(32, 127)] + ["\n"])}
    chars = {i: c for c, i in to_ids.items()}
    texts = [p + "".join(chars[t] for t in reference_greedy(params, config, [to_ids[c] for c in p], 6))
             for p in prompts]
    assert result.stdout == f"--- sample 0 ---\n{texts[0]}\n--- sample 1 ---\n{texts[1]}\n"
    assert "tokens/s" in result.stderr


def test_cli_from_a_training_checkpoint(tmp_path):
    text = tmp_path / "text.txt"
    words = ["alpha", "beta", "gamma", "delta", "tiles", "tasks", "memory", "disk"]
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(300)))
    data_mod.prepare_dataset(text, tmp_path / "data", vocab_size=300, progress=False)
    assert train_mod.main(["--data", str(tmp_path / "data" / "train.bin"), "--out", str(tmp_path / "run"),
                           "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "2", "--seq-len",
                           "16", "--steps", "3", "--eval-interval", "0", "--samples", "0", "--quiet"]) == 0
    result = _run_cli("--checkpoint", str(tmp_path / "run"), "--prompt", "alpha beta", "--max-new-tokens", "5",
                      "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("alpha beta") and result.stdout.count("\n") >= 1
    assert "ckpt-0000003" in result.stderr

    # With the state of the checkpoint `latest` names lost, the newest complete one is used, and said.
    older = tmp_path / "run" / "ckpt-0000002"
    shutil.copytree(tmp_path / "run" / "ckpt-0000003", older)
    (tmp_path / "run" / "ckpt-0000003" / "state.json").unlink()
    result = _run_cli("--checkpoint", str(tmp_path / "run"), "--prompt", "alpha", "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert f"using the newest complete checkpoint, {older}" in result.stderr


def test_lora_of_a_training_out_directory_is_its_latest_checkpoint(dataset, tmp_path):
    llama = FIXTURE.parent / "hf_tiny_llama"
    assert train_mod.main(["--data", str(dataset), "--out", str(tmp_path / "run"), "--init-from-hf", str(llama),
                           "--allow-tokenizer-mismatch", "--lora-rank", "2", "--lr", "1e-2", "--batch-size", "2",
                           "--seq-len", "16", "--steps", "2", "--eval-interval", "0", "--samples", "0", "--quiet"]) == 0
    texts = {}
    for source in ("run", "run/ckpt-0000002"):
        texts[source] = generate_mod.generate(generate_mod.parse_args([
            "--hf", str(llama), "--lora", str(tmp_path / source), "--prompt", "alpha beta", "--max-new-tokens", "4",
            "--temperature", "0", "--quiet"]))
    assert texts["run"] == texts["run/ckpt-0000002"]


LLAMA = FIXTURE.parent / "hf_tiny_llama"


def _chat_prompts(*argv):
    args = generate_mod.parse_args(["--hf", str(LLAMA), *argv])
    return generate_mod.encode_prompts(args, LLAMA, generate_mod.load_tokenizer(args, LLAMA))


def test_chat_prompt_is_the_conversation_rendered_with_the_generation_prompt():
    tokenizer = data_mod.Tokenizer.from_file(str(LLAMA / "tokenizer.json"))
    template = data_mod.load_chat_template(LLAMA)
    prompts = _chat_prompts("--chat", "What is a tile?", "--chat", "Hi", "--system", "Answer briefly.")
    for message, ids in zip(["What is a tile?", "Hi"], prompts.ids):
        conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": message}]
        assert ids == template.encode(tokenizer, conversation, add_generation_prompt=True)[0]
        text, _ = template.render(conversation, add_generation_prompt=True)
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids
        assert "<|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>" in text
        assert text.endswith(f"{message}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # The template's end of turn (written after an assistant's turn) and the eos_token </s> end a reply.
    assert prompts.stop == {tokenizer.token_to_id("<|eot_id|>"), tokenizer.token_to_id("</s>")}
    without_system = template.encode(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)[0]
    assert _chat_prompts("--chat", "Hi").ids == [without_system]


def test_chat_template_flag_replaces_the_models(tmp_path):
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                          "{% if add_generation_prompt %}assistant:{% endif %}")
    prompts = _chat_prompts("--chat", "Hi", "--chat-template", str(tmp_path / "plain.jinja"))
    tokenizer = data_mod.Tokenizer.from_file(str(LLAMA / "tokenizer.json"))
    assert prompts.ids == [tokenizer.encode("user: Hi\nassistant:", add_special_tokens=False).ids]
    assert prompts.stop == {tokenizer.token_to_id("</s>")}  # it writes no special token after a turn


@pytest.mark.parametrize("lora", [False, True], ids=["base", "adapters"])
def test_chat_prints_the_reply_up_to_the_end_of_turn(monkeypatch, capsys, lora):
    """The sampler is made to write two tokens and the end of turn: only the two tokens are printed."""
    tokenizer = data_mod.Tokenizer.from_file(str(LLAMA / "tokenizer.json"))
    reply = tokenizer.encode("ok", add_special_tokens=False).ids + [tokenizer.token_to_id("<|eot_id|>")]
    written = []

    def scripted(logits, temperature, top_k, generator):
        written.append(reply[len(written) % len(reply)])
        return written[-1]

    monkeypatch.setattr(decoding, "sample", scripted)
    adapters = ["--lora", str(FIXTURE.parent / "peft_tiny_llama")] if lora else []
    assert generate_mod.main(["--hf", str(LLAMA), *adapters, "--chat", "Hi", "--max-new-tokens", "10",
                              "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out == "ok\n"
    assert len(written) == len(reply)  # decoding ended at the end of turn, not after 10 tokens
    assert f"{len(reply)} new tokens (1 x at most 10)" in err


@pytest.mark.parametrize("argv, message", [
    (["--chat", "Hi", "--prompt", "Hi"], "argument --prompt: not allowed with argument --chat"),
    (["--prompt", "Hi", "--system", "Be brief."],
     "--system and --chat-template apply to conversations: give --chat MESSAGE, not --prompt"),
    (["--chat", "Hi", "--chat-template", "MISSING"], "--chat-template MISSING: cannot read the chat template"),
    (["--chat", "Hi", "--tokenizer", "CHARS"], "has none (chat_template.jinja, or tokenizer_config.json's "
                                                "chat_template): give one with --chat-template FILE"),
])
def test_chat_bad_input(argv, message, capsys, tmp_path):
    model = str(FIXTURE if "CHARS" in argv else LLAMA)  # the GPT-2 fixture has no tokenizer and no template
    replace = {"MISSING": str(tmp_path / "missing.jinja"), "CHARS": str(_char_tokenizer(tmp_path / "chars.json"))}
    message = message.replace("MISSING", replace["MISSING"])
    try:
        code = generate_mod.main(["--hf", model, *[replace.get(a, a) for a in argv]])
    except SystemExit as e:  # argparse
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--hf", str(FIXTURE)], "one of the arguments --prompt --chat is required"),
    (["--hf", str(FIXTURE), "--prompt", "hi", "--max-new-tokens", "40"],
     "need 41 positions, beyond the model's 32: use --max-new-tokens 31 or less"),
    (["--hf", str(FIXTURE), "--prompt", "", "--max-new-tokens", "4"], "gives no tokens"),
    (["--hf", str(FIXTURE), "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens=0 must be positive"),
    (["--hf", str(FIXTURE), "--prompt", "hi", "--temperature", "nan"], "--temperature=nan must be 0 (greedy)"),
    (["--hf", "GARBAGE_CONFIG", "--prompt", "hi"], "config.json does not parse as JSON"),
    (["--checkpoint", str(FIXTURE), "--prompt", "hi"], "is not a jnntile checkpoint"),
    (["--checkpoint", "INCOMPLETE_OUT", "--prompt", "hi"],
     "holds no complete checkpoint: INCOMPLETE_OUT/ckpt-0000003/state.json is missing"),
    (["--hf", "NAN_WEIGHTS", "--prompt", "hi", "--max-new-tokens", "4"],
     "'transformer.h.0.attn.c_proj.weight' (F32, shape (32, 32)) of NAN_WEIGHTS/model.safetensors holds NaN"),
    (["--hf", str(FIXTURE), "--prompt", "hi"], "no tokenizer in"),
    (["--hf", str(FIXTURE), "--prompt", "hi", "--max-new-tokens", "4", "--tokenizer", "TOKENIZER_300"],
     "outside the model's vocabulary of 96"),
])
def test_cli_bad_input(argv, message, capsys, tmp_path):
    if "GARBAGE_CONFIG" in argv:
        garbage = tmp_path / "garbage"
        shutil.copytree(FIXTURE, garbage)
        (garbage / "config.json").write_text("<html>not a config</html>")
        argv = [str(garbage) if a == "GARBAGE_CONFIG" else a for a in argv]
    if "INCOMPLETE_OUT" in argv:  # a training --out whose only checkpoint lost its state.json
        incomplete = tmp_path / "run"
        shutil.copytree(FIXTURE, incomplete / "ckpt-0000003")
        (incomplete / "latest").write_text("ckpt-0000003")
        argv = [str(incomplete) if a == "INCOMPLETE_OUT" else a for a in argv]
        message = message.replace("INCOMPLETE_OUT", str(incomplete))
    if "NAN_WEIGHTS" in argv:  # a Hugging Face file written by a run that diverged
        nan_weights = tmp_path / "nan"
        shutil.copytree(FIXTURE, nan_weights)
        tensors = safetensors.numpy.load_file(nan_weights / "model.safetensors")
        tensors["transformer.h.0.attn.c_proj.weight"][5, 7] = np.nan
        safetensors.numpy.save_file(tensors, nan_weights / "model.safetensors", metadata={"format": "pt"})
        argv = [str(nan_weights) if a == "NAN_WEIGHTS" else a for a in argv]
        message = message.replace("NAN_WEIGHTS", str(nan_weights))
    if "TOKENIZER_300" in argv:  # byte-level BPE: ids up to 300 for a model of 96
        from tokenizers import ByteLevelBPETokenizer

        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train_from_iterator(["hi there"] * 10, vocab_size=300, show_progress=False)
        tokenizer.save(str(tmp_path / "bpe.json"))
        argv = [str(tmp_path / "bpe.json") if a == "TOKENIZER_300" else a for a in argv]
    elif "--max-new-tokens" in argv:
        argv = [*argv, "--tokenizer", str(_char_tokenizer(tmp_path / "chars.json"))]
    try:
        code = generate_mod.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_cli_ctrl_c_prints_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(decoding.Decoder, "generate", interrupted)
    code = generate_mod.main(["--hf", str(FIXTURE), "--tokenizer", str(_char_tokenizer(tmp_path / "chars.json")),
                              "--prompt", "Tiles", "--max-new-tokens", "4", "--quiet"])
    assert code == 130
    assert capsys.readouterr().err.endswith("\ninterrupted\n")


def test_cli_sigterm_removes_the_swap_files(tmp_path):
    swap = tmp_path / "swap"
    proc = subprocess.Popen([sys.executable, "-m", "jnntile.generate", "--hf", str(FIXTURE), "--tokenizer",
                             str(_char_tokenizer(tmp_path / "chars.json")), "--prompt", "Tiles", "--max-new-tokens",
                             "28", "--memory-limit-mb", "64", "--swap-dir", str(swap), "--swap-size-mb", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stderr:  # the model is loaded: the swap directory is in use
        if "StarPU:" in line:
            break
    assert list(swap.glob("jnntile-swap-*"))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert list(swap.iterdir()) == []


def _wide_vocabulary(path: Path, vocab: int) -> Path:
    """The fixture with a vocabulary of `vocab` (the new token rows random): its head tiles are large."""
    shutil.copytree(FIXTURE, path)
    config = json.loads((FIXTURE / "config.json").read_text())
    tensors = safetensors.numpy.load_file(FIXTURE / "model.safetensors")
    extra = 0.02 * np.random.default_rng(0).standard_normal((vocab - config["vocab_size"], config["n_embd"]),
                                                            np.float32)
    tensors["transformer.wte.weight"] = np.concatenate([tensors["transformer.wte.weight"], extra])
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(config, vocab_size=vocab)))
    return path


def test_cli_shrinks_automatic_tiles_to_the_memory_limit_and_refuses_given_ones_beyond_it(tmp_path):
    weights = _wide_vocabulary(tmp_path / "wide", 32768)
    common = ["--hf", str(weights), "--tokenizer", str(_char_tokenizer(tmp_path / "chars.json")), "--prompt", "Tiles",
              "--max-new-tokens", "4", "--temperature", "0", "--memory-limit-mb", "2", "--swap-dir",
              str(tmp_path / "swap"), "--swap-size-mb", "64"]
    result = _run_cli(*common)
    assert result.returncode == 0, result.stderr
    assert "automatic tiles shrunk (vocab 8192 -> 4096) so that every task fits the memory limits" in result.stderr
    assert result.stdout.startswith("Tiles")
    result = _run_cli(*common, "--tile-vocab", "32768")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(r"error: cannot generate with these tiles: a single task \(.*wte.weight tile \(32768, 32\)\) needs "
                     r".* more than the memory limit of 2 MB; give smaller tiles \(--tile-vocab \d+\) or raise "
                     "--memory-limit-mb", result.stderr), result.stderr


def test_cli_refuses_weights_and_cache_beyond_limit_and_swap():
    config = GPT2Config(n_layer=48, n_head=25, n_embd=1600)  # gpt2-xl
    with pytest.raises(ValueError, match=r"exceed the memory limit of 4000 MB plus 1000 MB of swap: raise"):
        generate_mod._check_memory(config, 4, 1024, 4000, 1000)
    generate_mod._check_memory(config, 4, 1024, 4000, 8000)  # 5.8 GB of weights, 2.3 GB of cache
