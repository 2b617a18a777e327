"""Generate the Hugging Face fixtures under tests/data/ with `transformers`.

The test suite does not run this script; it reads what it wrote:

  tests/data/hf_tiny_gpt2/            a tied GPT2LMHeadModel with O(1) activations (save_pretrained)
  tests/data/hf_tiny_gpt2_expected.npz
                                      idx, targets, targets_masked (B=2, T=16), HF logits, loss, loss_masked
  tests/data/hf_tiny_llama/           LlamaForCausalLM: grouped-query attention (4 query heads, 2 key/value
                                      heads), untied head, Llama 3.1's rope_scaling (with a short original
                                      context, so every frequency band is scaled), a SentencePiece-style
                                      tokenizer.json (Metaspace, byte fallback), as Llama 2 ships
  tests/data/hf_tiny_qwen2/           Qwen2ForCausalLM: q/k/v biases, tied head, a byte-level BPE
                                      tokenizer.json, as Llama 3, SmolLM and Qwen2 ship
  tests/data/hf_tiny_<name>_expected.npz
                                      idx, targets (B=2, T=16, some ignored), HF logits, the loss, and the
                                      gradient of the loss for every parameter ("grad:<HF name>")

Needs torch and transformers, which the project venv does not have; use a venv outside the repository:

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy tokenizers
  /tmp/hfvenv/bin/python tools/make_hf_fixtures.py

The output is deterministic for a given torch version (fixed seed, CPU, float32).
Run tools/make_chat_fixtures.py after it: it gives the Llama and Qwen2 tokenizers their chat templates and
special tokens.
"""

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"
SEED = 1234
B, T = 2, 16
VOCAB = 320
IGNORE_INDEX = -100
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager",
             bos_token_id=1, eos_token_id=2)
TEXT = ["Tiles are cut from tensors; StarPU runs the tasks on every core.",
        "A model larger than memory trains when its tiles move between RAM and disk.",
        "def main():\n    print('hello, tiles')\n"] * 20


def byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|pad|>", "<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXT, trainer)
    return tokenizer


def sentencepiece_bpe() -> Tokenizer:
    """Llama 2's layout: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF> (ordinary tokens that byte
    fallback spells unknown characters with), then the pieces."""
    pieces = Tokenizer(models.BPE(unk_token="<unk>"))
    pieces.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    pieces.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=VOCAB - 256, special_tokens=["<unk>", "<s>", "</s>"],
                                                         show_progress=False))
    trained = json.loads(pieces.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                     fuse_unk=True))
    tokenizer.normalizer = pieces.normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path, bos: str, eos: str) -> None:
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos).save_pretrained(directory)


def perturb(model) -> None:
    """O(1) activations and non-trivial values everywhere: the default init makes logits nearly flat
    and would hide mistakes in biases and norms."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))


def write(name: str, model, tokens: torch.Tensor) -> None:
    directory = DATA_DIR / f"hf_tiny_{name}"
    model.save_pretrained(directory, safe_serialization=True)
    idx, targets = tokens[:, :T], tokens[:, 1:].clone()
    targets[0, :3] = IGNORE_INDEX  # a prompt left out of the loss
    logits = model(idx).logits  # (B, T, V); no labels: Hugging Face would shift them itself
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = {f"grad:{n}": p.grad.numpy().astype(np.float32) for n, p in model.named_parameters()}
    np.savez_compressed(DATA_DIR / f"hf_tiny_{name}_expected.npz", idx=idx.numpy().astype(np.int32),
                        targets=targets.numpy().astype(np.int32), logits=logits.detach().numpy().astype(np.float32),
                        loss=np.float32(loss.item()), **grads)


def gpt2() -> None:
    """tests/data/hf_tiny_gpt2/ and hf_tiny_gpt2_expected.npz: a tied GPT2LMHeadModel, its logits and losses."""
    torch.manual_seed(SEED)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", tie_word_embeddings=True,
                        bos_token_id=95, eos_token_id=95,  # HF's 50256 is outside this vocabulary
                        attn_implementation="eager")
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if ".ln_" in name or name.startswith("ln_f."):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(DATA_DIR / "hf_tiny_gpt2", safe_serialization=True)
    tokens = torch.randint(0, config.vocab_size, (B, T + 1))
    idx, targets = tokens[:, :T], tokens[:, 1:]
    targets_masked = targets.clone()
    targets_masked[0, :5] = IGNORE_INDEX  # a prompt left out of the loss
    targets_masked[1, -3:] = IGNORE_INDEX  # padding
    with torch.no_grad():
        logits = model(idx).logits
        flat = logits.reshape(-1, config.vocab_size)
        loss = F.cross_entropy(flat, targets.reshape(-1))
        loss_masked = F.cross_entropy(flat, targets_masked.reshape(-1), ignore_index=IGNORE_INDEX)
    np.savez(DATA_DIR / "hf_tiny_gpt2_expected.npz", idx=idx.numpy().astype(np.int32),
             targets=targets.numpy().astype(np.int32), targets_masked=targets_masked.numpy().astype(np.int32),
             logits=logits.numpy().astype(np.float32), loss=np.float32(loss.item()),
             loss_masked=np.float32(loss_masked.item()))


def main():
    gpt2()
    torch.manual_seed(SEED)
    rope_scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16}
    llama = LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=False, rope_theta=10000.0,
                                         rope_scaling=rope_scaling))
    perturb(llama)
    write("llama", llama, torch.randint(0, VOCAB, (B, T + 1)))
    save_tokenizer(sentencepiece_bpe(), DATA_DIR / "hf_tiny_llama", "<s>", "</s>")

    qwen2 = Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=True, rope_theta=1000000.0))
    perturb(qwen2)
    write("qwen2", qwen2, torch.randint(0, VOCAB, (B, T + 1)))
    save_tokenizer(byte_level_bpe(), DATA_DIR / "hf_tiny_qwen2", "<|begin|>", "<|end|>")


if __name__ == "__main__":
    main()
