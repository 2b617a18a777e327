"""Check that a LoRA adapter directory loads in Hugging Face `peft` and gives the expected logits.

  check_peft_load.py BASE_DIR ADAPTER_DIR EXPECTED_LOGITS.npy IDX.npy

loads the transformers model in BASE_DIR (float32, CPU), applies PeftModel.from_pretrained(base, ADAPTER_DIR),
computes the logits for the token ids in IDX.npy (B, T) and prints the largest absolute difference to
EXPECTED_LOGITS.npy (B, T, V). Exits 1 if it is above 1e-4 (or the shapes differ). Use it to check that the
adapters jnntile writes load in PEFT. Needs torch, transformers and peft (see tools/make_lora_fixtures.py):

  /tmp/hfvenv/bin/python tools/check_peft_load.py tests/data/hf_tiny_llama ADAPTER_DIR logits.npy idx.npy
"""

import sys

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

TOLERANCE = 1e-4


def main(argv: list) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    base_dir, adapter_dir, expected_path, idx_path = argv
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    idx = torch.from_numpy(np.load(idx_path).astype(np.int64))
    expected = np.load(expected_path)
    with torch.no_grad():
        logits = model(idx).logits.numpy()
    if logits.shape != expected.shape:
        print(f"shape mismatch: PEFT logits {logits.shape}, expected {expected.shape}")
        return 1
    diff = float(np.abs(logits - expected).max())
    print(f"max |PEFT logits - expected| = {diff:.3g}")
    return 0 if diff <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
