"""Fine-tuning datasets: formats, chat templates against transformers, loss masks, packed batches, --show."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import plain_llama_tokenizer

from jnntile import data

DATA_DIR = Path(__file__).parent / "data"
LLAMA_DIR = DATA_DIR / "hf_tiny_llama"
QWEN2_DIR = DATA_DIR / "hf_tiny_qwen2"
EXPECTED = json.loads((DATA_DIR / "chat_expected.json").read_text())


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture
def plain_tokenizer(tmp_path):
    """The Llama fixture's tokenizer without a chat template."""
    return plain_llama_tokenizer(tmp_path / "plain")


def _prepare(tmp_path, records, tokenizer=QWEN2_DIR, *extra, name="ex.jsonl", capsys=None):
    source = _jsonl(tmp_path / name, records)
    out = tmp_path / "out"
    data.main([str(source), "--out", str(out), "--tokenizer", str(tokenizer), *extra])
    return out


CHATS = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                       {"role": "assistant", "content": f"Answer {i}."}]} for i in range(6)]


# ---- templates rendered as transformers renders them ---------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", ["template", "training_template"])
def test_templates_render_the_ids_and_assistant_masks_transformers_gives(name, variant):
    # tools/make_chat_fixtures.py: transformers' apply_chat_template with the fixture's template (as the models
    # ship it, without {% generation %}), masks from a training variant with {% generation %} tags (as TRL).
    expected = EXPECTED[name]
    directory = DATA_DIR / f"hf_tiny_{name}"
    tokenizer = data.Tokenizer.from_file(str(directory / "tokenizer.json"))
    template = data.load_chat_template(directory)
    assert template.source == expected["template"] and not template.has_generation_tags
    if variant == "training_template":
        template = data.ChatTemplate(expected[variant], "training", template.special_tokens)
        assert template.has_generation_tags
    for case in expected["cases"]:  # multi-turn; a system prompt; a generation prompt
        text, _ = template.render(case["messages"], case["add_generation_prompt"])
        ids, mask = template.encode(tokenizer, case["messages"], case["add_generation_prompt"])
        assert text == case["text"]
        assert ids == case["ids"]
        assert mask == case["assistant_masks"]


def test_chat_dataset_holds_the_template_s_ids_and_masks(tmp_path):
    case = EXPECTED["qwen2"]["cases"][0]
    out = _prepare(tmp_path, [{"messages": case["messages"]}] * 4)
    dataset = data.open_dataset(out)
    assert isinstance(dataset, data.ExampleDataset) and dataset.examples() == 3
    ids, mask = dataset.example(0)
    assert ids.tolist() == case["ids"]
    assert mask.tolist() == case["assistant_masks"]  # the end-of-turn <|im_end|> is trained, its newline not
    assert mask[ids.tolist().index(319)] == 0  # <|im_end|> after the system and user turns is not
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "examples" and meta["formats"] == {"messages": 4}
    assert meta["chat_template"] == EXPECTED["qwen2"]["template"]
    assert meta["tokenizer_sha256"] == data.tokenizer_fingerprint(dataset.tokenizer)


def test_a_template_file_overrides_the_tokenizer_s(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
                        "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}"
                        "{% endfor %}")
    out = _prepare(tmp_path, CHATS, QWEN2_DIR, "--chat-template", str(template))
    dataset = data.ExampleDataset(out)
    ids, mask = dataset.example(0)
    assert dataset.decode(ids) == "user: Question 0?\nassistant: Answer 0.<|end|>"
    assert dataset.decode(ids[mask == 1]) == "Answer 0.<|end|>"


def test_conversations_need_a_chat_template(tmp_path, plain_tokenizer):
    with pytest.raises(SystemExit, match=r"ex.jsonl line 1 is a conversation.*no chat template.*--chat-template FILE"):
        _prepare(tmp_path, CHATS, plain_tokenizer)
    assert not (tmp_path / "out").exists()


# ---- formats -----------------------------------------------------------------------------------------------


def test_prompt_completion_without_a_template_is_the_prompt_then_the_completion(tmp_path, plain_tokenizer):
    records = [{"prompt": f"Say {i}:", "completion": f" {i} tiles"} for i in range(4)]
    dataset = data.ExampleDataset(_prepare(tmp_path, records, plain_tokenizer))
    tokenizer = dataset.tokenizer
    ids, mask = dataset.example(0)
    prompt = tokenizer.encode("Say 0:").ids
    completion = tokenizer.encode(" 0 tiles", add_special_tokens=False).ids + [tokenizer.token_to_id("</s>")]
    assert ids.tolist() == prompt + completion
    assert mask.tolist() == [0] * len(prompt) + [1] * len(completion)


def test_prompt_completion_and_alpaca_use_the_template_as_user_and_assistant_turns(tmp_path):
    alpaca = [{"instruction": "Add.", "input": "1 and 2", "output": "3"}, {"instruction": "Name one.", "output": "A"}]
    dataset = data.ExampleDataset(_prepare(tmp_path, alpaca * 2))
    template = data.load_chat_template(QWEN2_DIR)
    expected = template.encode(dataset.tokenizer, [{"role": "user", "content": "Add.\n\n1 and 2"},
                                                   {"role": "assistant", "content": "3"}])
    assert [part.tolist() for part in dataset.example(0)] == [expected[0], expected[1]]
    assert dataset.decode(dataset.example(1)[0][dataset.example(1)[1] == 1]) == "A<|im_end|>"


def test_text_examples_train_every_token_and_json_arrays_and_folders_are_read(tmp_path):
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    _jsonl(folder / "a.jsonl", [{"text": "Tiles move."}, {"text": "StarPU runs."}])
    (folder / "sub" / "b.json").write_text(json.dumps([{"text": "Disk swap."}, {"text": "RAM."}]))
    out = tmp_path / "out"
    data.main([str(folder), "--out", str(out), "--tokenizer", str(QWEN2_DIR), "--val-fraction", "0.25"])
    train, val = data.ExampleDataset(out), data.ExampleDataset(out / "val.bin")
    assert (train.examples(), val.examples()) == (3, 1)
    texts = [train.decode(train.example(i)[0]) for i in range(3)] + [val.decode(val.example(0)[0])]
    assert texts == ["Tiles move.<|end|>", "StarPU runs.<|end|>", "Disk swap.<|end|>", "RAM.<|end|>"]
    ids, mask = train.example(0)
    assert mask.tolist() == [0] + [1] * (len(ids) - 1)  # the first token has nothing before it to predict it from


def test_a_mixed_file_is_refused_naming_the_line(tmp_path):
    records = [CHATS[0], {"prompt": "a", "completion": "b"}]
    with pytest.raises(SystemExit, match=r"ex.jsonl line 2 is a 'prompt/completion' example, but .*ex.jsonl line 1 "
                                         r"is 'messages'"):
        _prepare(tmp_path, records)


def test_unknown_keys_are_refused_naming_the_line_and_the_keys_expected(tmp_path):
    records = [CHATS[0], {"question": "a", "answer": "b"}]
    with pytest.raises(SystemExit, match=r"ex.jsonl line 2: its keys \['answer', 'question'\] match no format; "
                                         r"expected .*'messages' \(messages\).*'prompt' and 'completion'.*"
                                         r"'instruction' and 'output' \(alpaca\).*'text'"):
        _prepare(tmp_path, records)


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "robot", "content": "x"}]}, r"line 1: message 1 is .*robot.*'system' \| 'user'"),
    ({"prompt": 3, "completion": "x"}, r"line 1: 'prompt' is a JSON int, not a string"),
])
def test_bad_values_are_refused_naming_the_line(tmp_path, record, message):
    with pytest.raises(SystemExit, match=message):
        _prepare(tmp_path, [record])


def test_examples_without_a_target_are_dropped_and_counted(tmp_path, capsys):
    records = CHATS + [{"messages": [{"role": "user", "content": "Anyone?"}]}]
    out = _prepare(tmp_path, records)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dropped_no_target"] == 1 and meta["train_examples"] + meta["val_examples"] == 6
    assert "1 dropped (no token to train on)" in capsys.readouterr().out


def test_train_on_prompt_trains_every_token(tmp_path):
    dataset = data.ExampleDataset(_prepare(tmp_path, CHATS, QWEN2_DIR, "--train-on-prompt"))
    ids, mask = dataset.example(0)
    assert mask.tolist() == [0] + [1] * (len(ids) - 1)
    assert json.loads((dataset.path.parent / "meta.json").read_text())["train_on_prompt"] is True


def test_example_flags_are_refused_for_text(tmp_path):
    source = tmp_path / "notes.txt"
    source.write_text("Tiles move.")
    with pytest.raises(SystemExit, match="notes.txt is text.*--chat-template and --train-on-prompt apply to examples"):
        data.main([str(source), "--out", str(tmp_path / "out"), "--train-on-prompt"])


def test_examples_need_a_model_s_tokenizer(tmp_path):
    with pytest.raises(SystemExit, match="holds examples .*--tokenizer MODEL_DIR"):
        data.main([str(_jsonl(tmp_path / "a.jsonl", CHATS)), "--out", str(tmp_path / "out")])


# ---- batches -----------------------------------------------------------------------------------------------


@pytest.fixture
def lengths_dataset(tmp_path):
    """Examples of 3, 5, 4, 7 and 2 tokens (text: every token but the first trained), ids 10 * example + position."""
    lengths = [3, 5, 4, 7, 2]
    out = _prepare(tmp_path, [{"text": "x"}] * 6)  # the files are replaced below, meta.json and the tokenizer kept
    ids = np.concatenate([10 * i + np.arange(n) for i, n in enumerate(lengths)]).astype(np.uint16)
    mask = np.concatenate([[0] + [1] * (n - 1) for n in lengths]).astype(np.uint8)
    mask[[4, 5]] = 0  # example 1 trains its tokens 3 and 4 only
    ids.tofile(out / "train.bin")
    mask.tofile(out / "train.mask.bin")
    np.save(out / "train.examples.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return data.ExampleDataset(out)


def test_packed_batches_keep_examples_apart(lengths_dataset):
    batch = lengths_dataset.batch(0, batch_size=2, seq_len=8)
    # Greedy packing in file order: row 0 takes examples 0 and 1 (3 + 5), row 1 examples 2 (4; 7 would not fit).
    assert batch.idx.tolist() == [[0, 1, 2, 10, 11, 12, 13, 14], [20, 21, 22, 23, 0, 0, 0, 0]]
    assert batch.segments.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 0, 0, 0]]
    # Targets: the next token of the same example where it is trained; never across examples or into padding.
    assert batch.targets.tolist() == [[1, 2, -100, -100, -100, 13, 14, -100], [21, 22, 23, -100, -100, -100, -100,
                                                                               -100]]
    assert all(array.dtype == np.int32 for array in (batch.idx, batch.targets, batch.segments, batch.positions))
    after = lengths_dataset.batch(1, batch_size=2, seq_len=8)  # rows 2 and 3: example 3 (7), then 4 (2)
    assert after.segments.tolist() == [[1] * 7 + [0], [1, 1] + [0] * 6]
    wrapped = lengths_dataset.batch(2, batch_size=2, seq_len=8)  # 4 rows an epoch: epoch 2 starts again
    assert np.array_equal(wrapped.idx, batch.idx)


def test_padding_mode_gives_each_example_its_row(lengths_dataset):
    batch = lengths_dataset.batch(0, batch_size=2, seq_len=8, packing=False)
    assert batch.idx.tolist() == [[0, 1, 2, 0, 0, 0, 0, 0], [10, 11, 12, 13, 14, 0, 0, 0]]
    assert (batch.targets[batch.segments == 0] == -100).all()


def test_long_examples_are_cut_or_refused(lengths_dataset):
    batch = lengths_dataset.batch(1, batch_size=2, seq_len=4)  # rows: [0], [1 cut to 4], [2], [3 cut], [4]
    assert batch.idx.tolist() == [[20, 21, 22, 23], [30, 31, 32, 33]]
    assert batch.targets.tolist() == [[21, 22, 23, -100], [31, 32, 33, -100]]
    stats = lengths_dataset.stats(seq_len=4)
    assert stats["truncated"] == 2 and stats["rows"] == 5 and stats["tokens"] == 3 + 4 + 4 + 4 + 2
    assert stats["targets"] == 2 + 1 + 3 + 3 + 1  # example 1 trains its tokens 3 (kept) and 4 (cut)
    assert stats["no_target_after_truncation"] == 0
    assert stats["padding_fraction"] == pytest.approx(1 - 17 / 20)
    with pytest.raises(ValueError, match=r"example 1 of .*train.bin has 5 tokens, more than --seq-len 4 \(2 examples "
                                         r"do\); raise --seq-len, or leave out --no-truncate"):
        lengths_dataset.batch(0, batch_size=1, seq_len=4, truncate=False)


def test_random_order_is_a_function_of_seed_and_step(lengths_dataset):
    first = lengths_dataset.batch(3, batch_size=2, seq_len=8, order="random", seed=5)
    again = data.ExampleDataset(lengths_dataset.path).batch(3, batch_size=2, seq_len=8, order="random", seed=5)
    assert all(np.array_equal(getattr(first, name), getattr(again, name))
               for name in ("idx", "targets", "segments", "positions"))
    epochs = [lengths_dataset.batch(step, batch_size=1, seq_len=8, order="random", seed=5) for step in range(12)]
    seen = [int(example) for batch in epochs for example in batch.idx[0][batch.positions[0] == 0][
        batch.segments[0][batch.positions[0] == 0] > 0] // 10]
    assert sorted(seen[:5]) == [0, 1, 2, 3, 4] and seen[:5] != [0, 1, 2, 3, 4]  # an epoch: each once, shuffled
    assert sorted(seen[5:10]) == [0, 1, 2, 3, 4] and seen[5:10] != seen[:5]
    other = [lengths_dataset.batch(step, batch_size=1, seq_len=8, order="random", seed=6) for step in range(4)]
    assert any(not np.array_equal(a.idx, b.idx) for a, b in zip(epochs, other))


def test_a_text_dataset_is_refused_by_token_dataset_only_for_examples(tmp_path):
    out = _prepare(tmp_path, CHATS)
    with pytest.raises(ValueError, match="holds fine-tuning examples .*data.open_dataset or data.ExampleDataset"):
        data.TokenDataset(out)
    assert isinstance(data.open_dataset(out / "val.bin"), data.ExampleDataset)
    assert isinstance(data.open_dataset(out).validation(), data.ExampleDataset)


# ---- --show and the built-in instructions ------------------------------------------------------------------


def test_show_marks_the_trained_tokens_and_json_lists_every_example(tmp_path, capsys):
    out = _prepare(tmp_path, CHATS)
    capsys.readouterr()
    data.main(["--show", str(out)])
    shown = capsys.readouterr().out
    assert "5 training examples" in shown and "--- example 0:" in shown and "--- example 3:" not in shown
    assert "<|im_start|>assistant\n[[Answer 0.<|im_end|>]]\n" in shown
    data.main(["--show", str(out), "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    dataset = data.ExampleDataset(out)
    assert len(lines) == 5
    assert [(line["ids"], line["loss_mask"]) for line in lines] == [
        tuple(part.tolist() for part in dataset.example(i)) for i in range(5)]
    data.main(["--show", str(out), "--json", "--example", "2"])
    assert json.loads(capsys.readouterr().out)["ids"] == lines[2]["ids"]
    with pytest.raises(SystemExit, match=r"--example 5: the dataset's training split has examples 0..4"):
        data.main(["--show", str(out), "--example", "5"])


def test_builtin_instructions_are_standard_library_functions(tmp_path, capsys):
    out = tmp_path / "instructions"
    data.main(["--builtin-instructions", "--tokenizer", str(QWEN2_DIR), "--out", str(out)])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["formats"]["prompt/completion"] > 100 and "standard library" in meta["source"]
    dataset = data.ExampleDataset(out)
    ids, mask = dataset.example(0)
    prompt, completion = dataset.decode(ids[mask == 0]), dataset.decode(ids[mask == 1])
    assert "<|im_start|>user\ndef " in prompt and '"""' in prompt
    # The body, indented, and the end of the turn; the newline before it shares a token with its indentation.
    assert completion.endswith("<|im_end|>") and completion.lstrip("\n").startswith("    ")
