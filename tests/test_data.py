import json
from pathlib import Path

import numpy as np
import pytest

from jnntile import data

VOCAB_SIZE = 300  # small: the test corpora are too small to learn many merges


def _sample_text(paragraphs: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "model", "tiles", "tensor", "über", "naïve", "日本語", "starpu", "jax", "42", "\t", "{}"]
    return "\n\n".join(" ".join(rng.choice(words, size=40)) for _ in range(paragraphs)) + "\n"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "corpus.md"  # a single file may have any name
    path.write_text(_sample_text(60, seed=0), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(text_file, tmp_path_factory):
    return data.prepare_dataset(
        text_file, tmp_path_factory.mktemp("out"), vocab_size=VOCAB_SIZE, val_fraction=0.2, progress=False
    )


@pytest.fixture(scope="module")
def train(prepared):
    return data.TokenDataset(prepared / "train.bin")


def test_prepare_writes_nanogpt_layout(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (prepared / name).is_file()
    assert (prepared / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert (prepared / "val.bin").stat().st_size == 2 * meta["val_tokens"]
    assert meta["tokenizer"] == "tokenizer.json"
    assert meta["val_fraction"] == 0.2
    assert meta["requested_vocab_size"] == VOCAB_SIZE
    assert 257 <= meta["vocab_size"] <= VOCAB_SIZE
    assert "corpus.md" in meta["source"]
    assert not list(prepared.glob(".*.tmp"))  # no leftover temporaries


def test_split_is_tail_of_stream(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    total = meta["train_tokens"] + meta["val_tokens"]
    assert meta["val_tokens"] == int(total * 0.2)
    # The stream ends with the end-of-text token, so val.bin (its tail) does too.
    val_tokens = np.fromfile(prepared / "val.bin", dtype=np.uint16)
    assert val_tokens[-1] == meta["end_of_text_id"]


def test_tokenizer_round_trips_text(train, text_file):
    assert train.tokens.dtype == np.uint16
    assert len(train) == json.loads((train.path.parent / "meta.json").read_text())["train_tokens"]
    text = "naïve über tensor 日本語\n\tstarpu {} 42"
    ids = train.encode(text)
    assert all(0 <= i < train.vocab_size for i in ids)
    assert train.decode(ids) == text
    # The stored stream is the encoded file followed by <|endoftext|>.
    source = text_file.read_text(encoding="utf-8")
    validation = train.validation()
    stream = np.concatenate([train.tokens, validation.tokens])
    assert train.decode(stream) == source + "<|endoftext|>"


def test_folder_is_read_recursively_with_glob(tmp_path):
    source = tmp_path / "docs"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text(_sample_text(5, seed=1))
    (source / "sub" / "b.txt").write_text(_sample_text(5, seed=2))
    (source / "skipped.md").write_text("not matched by the default glob")
    out = data.prepare_dataset(source, tmp_path / "out", vocab_size=VOCAB_SIZE, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 2
    dataset = data.TokenDataset(out)  # a directory means its train.bin
    stream = np.concatenate([dataset.tokens, dataset.validation().tokens])
    expected = "".join(path.read_text() + "<|endoftext|>" for path in (source / "a.txt", source / "sub" / "b.txt"))
    assert dataset.decode(stream) == expected
    assert meta["val_tokens"] == int(len(stream) * 0.1)

    only_md = data.prepare_dataset(source, tmp_path / "md", vocab_size=VOCAB_SIZE, glob="*.md", progress=False)
    assert json.loads((only_md / "meta.json").read_text())["documents"] == 1


def test_sequential_batches_follow_definition(train):
    batch_size, seq_len = 3, 8
    tokens = np.asarray(train.tokens, dtype=np.int32)
    whole_sequences = (len(tokens) - 1) // seq_len
    for step in (0, 1, 2, whole_sequences // batch_size + 1):  # the last wraps around
        inputs, targets = train.batch(step, batch_size, seq_len)
        assert inputs.shape == targets.shape == (batch_size, seq_len)
        assert inputs.dtype == targets.dtype == np.int32
        for j in range(batch_size):
            start = ((step * batch_size + j) % whole_sequences) * seq_len
            np.testing.assert_array_equal(inputs[j], tokens[start : start + seq_len])
            np.testing.assert_array_equal(targets[j], tokens[start + 1 : start + seq_len + 1])


def test_random_batches_are_a_function_of_seed_and_step(train):
    def draw(step, seed=0):
        return train.batch(step, 4, 16, order="random", seed=seed)

    for a, b in zip(draw(5), draw(5)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(draw(5)[0], draw(6)[0])
    assert not np.array_equal(draw(5, seed=0)[0], draw(5, seed=1)[0])
    inputs, targets = draw(7)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_nanogpt_bin_without_tokenizer(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    dataset = data.TokenDataset(path)
    assert dataset.tokenizer is None
    assert dataset.vocab_size == 100
    assert dataset.validation() is None
    assert dataset.decode([12, 7, 99]) == "[12, 7, 99]"
    inputs, targets = dataset.batch(0, 2, 5)
    np.testing.assert_array_equal(inputs, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match="tokenizer.json"):
        dataset.encode("text")


def test_bare_vocabulary_holds_the_ids_of_the_validation_file_too(tmp_path):
    """Without meta.json the model's vocabulary comes from the ids: an id only in val.bin must fit it too."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array([3, 250, 4], dtype=np.uint16).tofile(tmp_path / "val.bin")
    dataset = data.TokenDataset(tmp_path / "train.bin")
    assert dataset.vocab_size == 251
    assert dataset.validation().vocab_size == 251


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        data.prepare_dataset(tmp_path / "nowhere", tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="nowhere.bin"):
        data.TokenDataset(tmp_path / "nowhere.bin")


def test_empty_inputs(tmp_path):
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        data.prepare_dataset(empty_file, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=r"no files matching '\*\.rst'.*--glob"):
        data.prepare_dataset(tmp_path, tmp_path / "out", glob="*.rst", progress=False)
    empty_bin = tmp_path / "empty.bin"
    empty_bin.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.bin is empty"):
        data.TokenDataset(empty_bin)


def test_vocab_size_limits(text_file, tmp_path):
    with pytest.raises(ValueError, match="uint16.*65536"):
        data.prepare_dataset(text_file, tmp_path / "out", vocab_size=70_000, progress=False)
    with pytest.raises(ValueError, match="at least 257"):
        data.prepare_dataset(text_file, tmp_path / "out", vocab_size=100, progress=False)
    assert not (tmp_path / "out").exists()  # checked before any work


def test_odd_sized_bin(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"odd\.bin has 3 bytes, not a multiple of 2"):
        data.TokenDataset(path)


def test_too_short_for_one_batch(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    dataset = data.TokenDataset(path)
    with pytest.raises(ValueError, match=r"short\.bin has 20 tokens.*needs batch_size\*seq_len\+1 = 21"):
        dataset.batch(0, 4, 5)
    dataset.batch(0, 4, 5, order="random")  # random only needs seq_len+1 tokens
    with pytest.raises(ValueError, match=r"short\.bin has 20 tokens.*needs seq_len\+1 = 21"):
        dataset.batch(0, 1, 20, order="random")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "batch_size=0 must be a positive integer"),
        (dict(seq_len=-3), "seq_len=-3 must be a positive integer"),
        (dict(step=-1), "step=-1 must be a non-negative integer"),
        (dict(order="shuffled"), "order='shuffled' is not one of 'sequential', 'random'"),
    ],
)
def test_bad_batch_arguments(train, kwargs, message):
    arguments = dict(step=0, batch_size=2, seq_len=4) | kwargs
    with pytest.raises(ValueError, match=message):
        train.batch(**arguments)


def test_stdlib_selection_is_deterministic_and_excludes_tests():
    files = data.stdlib_source_files()
    assert files == data.stdlib_source_files()
    root = data.stdlib_root()
    relative = [path.relative_to(root).as_posix() for path in files]
    assert relative == sorted(relative)
    assert all(name.endswith(".py") for name in relative)
    for path in relative:
        assert not {"test", "tests", "idlelib", "site-packages"} & set(path.split("/")[:-1]), path
    assert "os.py" in relative
    capped = data.read_documents(files, max_bytes=50_000)
    assert sum(len(text.encode()) for text in capped) <= 50_000


def test_default_dataset_is_prepared_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JNNTILE_DATA_DIR", str(tmp_path / "cache"))
    assert data.default_dataset_dir() == tmp_path / "cache"
    out = data.ensure_default_dataset(VOCAB_SIZE, max_bytes=30_000, progress=False)
    assert out == tmp_path / "cache"
    meta_file = out / "meta.json"
    first = meta_file.read_text()
    assert "first 30000 bytes" in json.loads(first)["source"]
    modified = meta_file.stat().st_mtime_ns

    assert data.ensure_default_dataset(VOCAB_SIZE, max_bytes=30_000, progress=False) == out
    assert meta_file.stat().st_mtime_ns == modified  # reused, not rebuilt

    data.ensure_default_dataset(VOCAB_SIZE, max_bytes=20_000, progress=False)  # settings changed: rebuilt
    assert "first 20000 bytes" in json.loads(meta_file.read_text())["source"]

    monkeypatch.delenv("JNNTILE_DATA_DIR")
    assert data.default_dataset_dir(512).name.endswith("-v512")


def test_preparing_on_an_empty_cache_writes_nothing_to_stdout(tmp_path, monkeypatch, capfd):
    """Progress goes to stderr: stdout carries only a command's output (bench --json is parsed by line).

    The tokenizer's trainer writes its own progress bar to file descriptor 1 from Rust, which
    capsys would not see; capfd does.
    """
    monkeypatch.setenv("JNNTILE_DATA_DIR", str(tmp_path / "empty-cache"))
    data.ensure_default_dataset(VOCAB_SIZE, max_bytes=30_000, progress=True)
    captured = capfd.readouterr()
    assert captured.out == ""
    assert "tokenizing" in captured.err


def test_cli_prepares_input(text_file, tmp_path, capsys):
    data.main([str(text_file), "--out", str(tmp_path / "cli"), "--vocab-size", "280", "--val-fraction", "0.25"])
    meta = json.loads((tmp_path / "cli" / "meta.json").read_text())
    assert meta["requested_vocab_size"] == 280 and meta["val_fraction"] == 0.25
    summary = capsys.readouterr().out
    assert f"{meta['train_tokens']} train" in summary and "train.bin" in summary


def test_cli_reports_bad_input_without_traceback(tmp_path):
    with pytest.raises(SystemExit, match="error: input path .*nowhere does not exist"):
        data.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("name", ["notes.txt", "corpus.bin"])
def test_text_passed_as_token_file_says_to_tokenize_it(text_file, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(text_file.read_bytes()[:4000])  # even size: it would read as 2000 token ids
    with pytest.raises(ValueError, match=rf"{name} looks like text.*python -m jnntile.data {path} --out DIR"):
        data.TokenDataset(path)


def _copy_dataset(prepared, tmp_path) -> Path:
    out = tmp_path / "copy"
    out.mkdir()
    for name in ("train.bin", "meta.json", "tokenizer.json"):
        (out / name).write_bytes((prepared / name).read_bytes())
    return out


def test_ids_beyond_the_vocabulary_are_refused_naming_the_first_position(prepared, tmp_path):
    copy = _copy_dataset(prepared, tmp_path)
    tokens = np.fromfile(copy / "train.bin", dtype=np.uint16)
    vocab_size = json.loads((copy / "meta.json").read_text())["vocab_size"]
    tokens[[7, 11]] = vocab_size  # one past the last id: the embedding has no such row
    tokens.tofile(copy / "train.bin")
    with pytest.raises(ValueError, match=rf"train.bin holds token id {vocab_size} at position 7 .*meta.json gives "
                                         rf"a vocabulary of {vocab_size}"):
        data.TokenDataset(copy)


@pytest.mark.parametrize("content, problem", [("{not json", "does not parse as JSON"), ("[1, 2]", "not an object"),
                                               ('{"vocab_size": "many"}', "not a positive integer"),
                                               ('{"vocab_size": true}', "not a positive integer")])
def test_corrupt_meta_json_is_named(prepared, tmp_path, content, problem):
    copy = _copy_dataset(prepared, tmp_path)
    (copy / "meta.json").write_text(content)
    with pytest.raises(ValueError, match=rf"{copy / 'meta.json'}.*{problem}"):
        data.TokenDataset(copy)


def test_corrupt_tokenizer_json_is_named(prepared, tmp_path):
    copy = _copy_dataset(prepared, tmp_path)
    (copy / "tokenizer.json").write_text("garbage")
    with pytest.raises(ValueError, match=rf"{copy / 'tokenizer.json'} is not a tokenizers file"):
        data.TokenDataset(copy)


# ---- a pretrained tokenizer (--tokenizer DIR) ------------------------------------------------

LLAMA_DIR = Path(__file__).parent / "data" / "hf_tiny_llama"


def test_a_model_directory_s_tokenizer_prepares_the_text(tmp_path):
    # Llama 2's SentencePiece-derived tokenizer.json; documents end with its eos_token (tokenizer_config.json).
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = ["Tiles move between RAM and disk.", "StarPU runs the tasks; ünïcode too."]
    for i, text in enumerate(texts):
        (docs / f"{i}.txt").write_text(text)
    out = data.prepare_dataset(docs, tmp_path / "out", val_fraction=0.2, glob="*.txt", progress=False,
                               tokenizer=LLAMA_DIR)
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = data.Tokenizer.from_file(str(LLAMA_DIR / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    assert meta["vocab_size"] == tokenizer.get_vocab_size() == 320 and meta["end_of_text_id"] == eos
    assert meta["dtype"] == "uint16"
    stream = np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])
    expected = [i for text in texts for i in tokenizer.encode(text).ids + [eos]]
    assert stream.tolist() == expected
    assert data.TokenDataset(out).decode(tokenizer.encode(texts[0]).ids).endswith(texts[0])


def test_a_vocabulary_beyond_uint16_gets_uint32_token_files(tmp_path):
    # Llama 3's and Qwen2's vocabularies (128256, 151936) do not fit uint16 ids: the files hold uint32 and
    # meta.json says so.
    from tokenizers import models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    tokenizer = data.Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 69_999}))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in range(65_530, 65_560)))
    out = data.prepare_dataset(text, tmp_path / "out", val_fraction=0.1, progress=False, tokenizer=model_dir)
    assert json.loads((out / "meta.json").read_text())["dtype"] == "uint32"
    train, val = data.TokenDataset(out), data.TokenDataset(out / "val.bin")
    assert train.vocab_size == 70_000
    assert np.concatenate([train.tokens, val.tokens]).tolist() == list(range(65_530, 65_560)) + [69_999]


def test_a_directory_without_tokenizer_json_is_refused(text_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        data.prepare_dataset(text_file, tmp_path / "out", progress=False, tokenizer=tmp_path)


def test_tokenizer_fingerprint_is_recorded_and_independent_of_the_merges_format(prepared, text_file, tmp_path):
    fingerprint = json.loads((prepared / "meta.json").read_text())["tokenizer_sha256"]
    assert fingerprint == data.tokenizer_fingerprint(data.Tokenizer.from_file(str(prepared / "tokenizer.json")))
    # An older dataset: no fingerprint in meta.json, merges written as "a b" by an older `tokenizers`.
    copy = _copy_dataset(prepared, tmp_path)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["tokenizer_sha256"]
    (copy / "meta.json").write_text(json.dumps(meta))
    saved = json.loads((copy / "tokenizer.json").read_text())
    saved["model"]["merges"] = [" ".join(merge) for merge in saved["model"]["merges"]]
    (copy / "tokenizer.json").write_text(json.dumps(saved))
    assert data.TokenDataset(copy).tokenizer_fingerprint() == fingerprint
    other = data.prepare_dataset(text_file, tmp_path / "other", vocab_size=VOCAB_SIZE - 10,
                                 val_fraction=0.2, progress=False)
    assert data.TokenDataset(other).tokenizer_fingerprint() != fingerprint


# ---- where --out cannot be written, input that is not text ----------------------------------------


def test_out_that_is_a_file_is_refused_and_kept(text_file, tmp_path):
    blocker = tmp_path / "notes"
    blocker.write_text("mine")
    with pytest.raises(SystemExit, match=rf"^python -m jnntile.data: error: --out {blocker} is a file, not a directory"):
        data.main([str(text_file), "--out", str(blocker), "--vocab-size", str(VOCAB_SIZE)])
    assert blocker.read_text() == "mine"


def test_out_on_a_full_or_read_only_disk_is_an_error_that_leaves_no_file(text_file, small_tmpfs):
    import os
    import subprocess

    kept = data.prepare_dataset(text_file, small_tmpfs / "kept", vocab_size=VOCAB_SIZE, progress=False)
    before = {path.name: path.read_bytes() for path in kept.iterdir()}
    stats = os.statvfs(small_tmpfs)
    (small_tmpfs / "filler").write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - 4096))
    other = ["--vocab-size", str(VOCAB_SIZE - 10), "--val-fraction", "0.3"]
    for out in (kept, small_tmpfs / "new" / "deeper"):
        with pytest.raises(SystemExit, match=rf"error: --out {out}: cannot write the dataset there .*free space "
                                             "there, or choose another --out"):
            data.main([str(text_file), "--out", str(out), *other])
    assert sorted(path.name for path in small_tmpfs.iterdir()) == ["filler", "kept"]
    assert {path.name: path.read_bytes() for path in kept.iterdir()} == before  # no temporary, the old dataset
    (small_tmpfs / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(SystemExit, match=rf"error: --out {small_tmpfs / 'new'}: cannot write the dataset there "
                                         r"\(Read-only file system"):
        data.main([str(text_file), "--out", str(small_tmpfs / "new"), *other])


def test_input_that_is_not_text_is_refused_or_skipped_in_a_folder(text_file, tmp_path, capsys):
    source = tmp_path / "docs"
    source.mkdir()
    (source / "a.txt").write_text(_sample_text(5, seed=1))
    (source / "image.txt").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(SystemExit, match=rf"error: input file {source / 'image.txt'} is not text"):
        data.main([str(source / "image.txt"), "--out", str(tmp_path / "one")])
    assert not (tmp_path / "one").exists()
    out = data.prepare_dataset(source, tmp_path / "out", vocab_size=VOCAB_SIZE, progress=False)
    assert json.loads((out / "meta.json").read_text())["documents"] == 1
    assert f"note: skipped 1 of the 2 files matching '*.txt' in {source}, which are not text" in capsys.readouterr().err
    (source / "a.txt").unlink()
    with pytest.raises(ValueError, match=rf"none of the 1 files matching '\*.txt' in {source} is text .*--glob"):
        data.prepare_dataset(source, tmp_path / "none", progress=False)
