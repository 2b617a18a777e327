"""Generate the Hugging Face GPT-2 fixture used by tests/test_gpt2_reference.py.

The test suite does not run this script; it only reads its outputs:

  tests/data/hf_tiny_gpt2/              save_pretrained() of a tiny random
                                        GPT2LMHeadModel (config.json, model.safetensors)
  tests/data/hf_tiny_gpt2_expected.npz  idx, targets, targets_masked (B=2, T=16),
                                        HF logits, HF loss and HF loss_masked

Re-running it needs torch and transformers, which the project venv does not
have; use a separate virtualenv outside the repository:

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
  /tmp/hfvenv/bin/python tests/data/make_hf_fixture.py

The output is deterministic for a given torch version (fixed seed, CPU, fp32).
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

DATA_DIR = Path(__file__).resolve().parent
SEED = 1234
B, T = 2, 16
IGNORE_INDEX = -100


def main():
    torch.manual_seed(SEED)
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        activation_function="gelu_new", tie_word_embeddings=True,
        bos_token_id=95, eos_token_id=95,  # HF's 50256 is outside this vocabulary
        attn_implementation="eager",  # plain softmax attention, as the reference
    )
    model = GPT2LMHeadModel(config).eval()
    # GPT-2's own init (std 0.02, zero biases, unit LayerNorm) makes logits
    # nearly flat and hides mistakes in biases and LayerNorm; use O(1)
    # activations and non-trivial values for every parameter instead.
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if ".ln_" in name or name.startswith("ln_f."):
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(DATA_DIR / "hf_tiny_gpt2", safe_serialization=True)

    # One stream of T+1 tokens per row; targets are idx shifted by one, passed
    # explicitly, so the loss below is exactly models.gpt2_reference.loss.
    tokens = torch.randint(0, config.vocab_size, (B, T + 1))
    idx, targets = tokens[:, :T], tokens[:, 1:]
    targets_masked = targets.clone()
    targets_masked[0, :5] = IGNORE_INDEX  # e.g. a prompt excluded from the loss
    targets_masked[1, -3:] = IGNORE_INDEX  # e.g. padding

    with torch.no_grad():
        logits = model(idx).logits  # (B,T,V), no labels: HF would shift them itself
        flat = logits.reshape(-1, config.vocab_size)
        loss = F.cross_entropy(flat, targets.reshape(-1))
        loss_masked = F.cross_entropy(flat, targets_masked.reshape(-1), ignore_index=IGNORE_INDEX)

    np.savez(
        DATA_DIR / "hf_tiny_gpt2_expected.npz",
        idx=idx.numpy().astype(np.int32),
        targets=targets.numpy().astype(np.int32),
        targets_masked=targets_masked.numpy().astype(np.int32),
        logits=logits.numpy().astype(np.float32),
        loss=np.float32(loss.item()),
        loss_masked=np.float32(loss_masked.item()),
    )


if __name__ == "__main__":
    main()
