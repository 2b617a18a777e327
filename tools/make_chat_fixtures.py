"""Give the Llama and Qwen2 fixtures chat templates, and write what `transformers` renders with them.

The test suite does not run this script; it reads what it wrote:

  tests/data/hf_tiny_llama/           tokenizer.json gains Llama 3's header and end-of-turn tokens
                                      (<|start_header_id|>, <|end_header_id|>, <|eot_id|>) and
                                      tokenizer_config.json Llama 3 Instruct's chat template (with <s> as its
                                      <|begin_of_text|>)
  tests/data/hf_tiny_qwen2/           tokenizer.json gains ChatML's <|im_start|> and <|im_end|>, and
                                      tokenizer_config.json Qwen2 Instruct's chat template
  tests/data/chat_expected.json       per fixture: the template, a training variant of it, and for each
                                      conversation the ids and assistant masks transformers gives

The new special tokens take the ids of the fixture tokenizers' last merges (removed with their merges), so the
vocabularies keep their 320 ids and the models' embeddings still cover every id. The templates as the models
ship have no {% generation %} tags, which transformers' return_assistant_tokens_mask needs; as TRL does for
assistant-only training, the masks come from a training variant of each template that wraps an assistant
turn's content and its end-of-turn token in {% generation %} ... {% endgeneration %}. The ids are those of the
template as shipped (checked equal to the variant's).

Needs transformers (no torch), which the project venv does not have; run it after tools/make_hf_fixtures.py:

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install transformers jinja2 tokenizers
  /tmp/hfvenv/bin/python tools/make_chat_fixtures.py
"""

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_TRAINING_TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ message['content'] | trim + "
    "'<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_TRAINING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FIXTURES = {
    "llama": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], LLAMA3_TEMPLATE, LLAMA3_TRAINING_TEMPLATE),
    "qwen2": (["<|im_start|>", "<|im_end|>"], QWEN2_TEMPLATE, QWEN2_TRAINING_TEMPLATE),
}
CONVERSATIONS = [
    ([{"role": "user", "content": "What are tiles?"},
      {"role": "assistant", "content": "Pieces of a tensor, run as tasks."},
      {"role": "user", "content": "And StarPU?"},
      {"role": "assistant", "content": "It runs the tasks on every core.\n"}], False),
    ([{"role": "system", "content": "You answer in one line."},
      {"role": "user", "content": "def main():\n    print('hello, tiles')"},
      {"role": "assistant", "content": "It prints hello, naïve tiles."}], False),
    ([{"role": "system", "content": "You answer in one line."},
      {"role": "user", "content": "A model larger than memory?"}], True),
]


def add_special_tokens(directory: Path, tokens: list[str]) -> None:
    """Gives `tokens` the ids of the last len(tokens) merges' results, which are removed (no later merge uses
    them), as added special tokens. Run again, it finds them there and changes nothing."""
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    if any(added["content"] in tokens for added in tokenizer["added_tokens"]):
        return
    vocab, merges = tokenizer["model"]["vocab"], tokenizer["model"]["merges"]
    for token, merge in zip(tokens, merges[-len(tokens):]):
        merged = "".join(merge.split(" ") if isinstance(merge, str) else merge)
        token_id = vocab.pop(merged)
        assert token_id >= len(vocab) - len(tokens), f"{merged} is not among the last ids"
        tokenizer["added_tokens"].append({"id": token_id, "content": token, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": True})
    del merges[-len(tokens):]
    path.write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    expected = {}
    for name, (tokens, template, training_template) in FIXTURES.items():
        directory = DATA_DIR / f"hf_tiny_{name}"
        add_special_tokens(directory, tokens)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
        assert tokenizer.chat_template == template
        cases = []
        for messages, add_generation_prompt in CONVERSATIONS:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=add_generation_prompt)["input_ids"]
            masked = tokenizer.apply_chat_template(messages, chat_template=training_template, tokenize=True,
                                                   return_dict=True, return_assistant_tokens_mask=True,
                                                   add_generation_prompt=add_generation_prompt)
            assert list(masked["input_ids"]) == list(ids), f"{name}: the training template renders other ids"
            cases.append({"messages": messages, "add_generation_prompt": add_generation_prompt,
                          "text": tokenizer.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=add_generation_prompt),
                          "ids": list(ids), "assistant_masks": list(masked["assistant_masks"])})
        expected[name] = {"template": template, "training_template": training_template, "cases": cases}
    (DATA_DIR / "chat_expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
