"""PyTorch's training step on the same model, for bench/train_step.py's PyTorch column.

    .venv-torch/bin/python bench/torch_step.py --hf-config '{"model_type": "gpt2", ...}' --batch 4 --seq 256
                                               [--steps 10] [--dtype float32|bfloat16]

Runs in the PyTorch environment `make bench-torch` makes (torch's CPU build and transformers, never a
dependency of jnntile): Hugging Face's `GPT2LMHeadModel` / `LlamaForCausalLM` built from the config.json
content jnntile's config writes (`to_hf_dict`), eager mode, `torch.optim.AdamW` with its fused CPU kernel
(foreach where fused is unavailable), global-norm clipping, one thread per core. bfloat16 runs under CPU
autocast (bfloat16 products, float32 weights and optimizer), as Flax's and jnntile's mixed precision do.
Prints one JSON object: {"tokens_per_s": ..., "threads": ..., "torch": version, "optimizer": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers

LEARNING_RATE = 1e-4
MAX_NORM = 1.0


def model_of(hf_config: dict):
    config = transformers.AutoConfig.for_model(**hf_config)
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0  # GPT-2's dropout; jnntile's runs have none
    return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def optimizer_of(params):
    try:
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True), "AdamW fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=True), "AdamW foreach"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-config", required=True, help="config.json content, as JSON")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after two warm-up steps")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    hf_config = json.loads(args.hf_config)
    model = model_of(hf_config)
    model.train()
    optimizer, optimizer_name = optimizer_of(model.parameters())
    generator = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, hf_config["vocab_size"], (args.batch, args.seq), generator=generator)
                    for _ in range(2))

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            logits = model(input_ids=idx).logits
            # jnntile's loss: the targets as given (the batch holds inputs and targets already shifted).
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    print(json.dumps({"tokens_per_s": args.batch * args.seq / statistics.median(times), "threads": threads,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "optimizer": optimizer_name}))


if __name__ == "__main__":
    main()
