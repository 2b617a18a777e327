"""Generate the PEFT (Hugging Face `peft`) LoRA adapter fixtures under tests/data/ for the base models that
tools/make_hf_fixtures.py wrote.

The test suite does not run this script; it reads what it wrote:

  tests/data/peft_tiny_llama/         a LoRA adapter (r=4, lora_alpha=8) for tests/data/hf_tiny_llama on
                                      q/k/v/o_proj and gate/up/down_proj, as PEFT's save_pretrained writes it:
                                      adapter_config.json and adapter_model.safetensors only. In every layer
                                      k_proj and v_proj carry q_proj's lora_A, and up_proj carries gate_proj's
                                      (jnntile fuses those projections and shares one A); the B's differ
  tests/data/peft_tiny_gpt2/          a LoRA adapter (r=4, lora_alpha=8, fan_in_fan_out) for
                                      tests/data/hf_tiny_gpt2 on c_attn, c_proj (attention and MLP) and c_fc
  tests/data/peft_tiny_llama_qv/      a LoRA adapter for tests/data/hf_tiny_llama on q_proj and v_proj alone, with
                                      independent random A and B (r=4, lora_alpha=8; rank_pattern gives layer
                                      1's v_proj r=2, alpha_pattern layer 0's q_proj lora_alpha 4; use_rslora)
  tests/data/peft_tiny_llama_all/     a LoRA adapter (r=4, lora_alpha=8) for tests/data/hf_tiny_llama on
                                      target_modules "all-linear", independent random A and B everywhere
  tests/data/peft_tiny_<name>_expected.npz
                                      idx, targets (those of hf_tiny_<name>_expected.npz: the ones its "loss"
                                      used), the PEFT model's logits and loss (cross-entropy of the logits
                                      against the targets as given, not shifted, ignore_index=-100), the
                                      gradient of that loss for every LoRA weight ("grad:<name in
                                      adapter_model.safetensors>"), and merged_logits: the logits of
                                      merge_and_unload()'s model

Both adapters name the base by its fixture directory ("hf_tiny_llama", "hf_tiny_gpt2"), not by a path.

Needs torch, transformers and peft, which the project venv does not have; use a venv outside the repository:

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy tokenizers peft
  /tmp/hfvenv/bin/python tools/make_lora_fixtures.py

The output is deterministic for a given torch and peft version (fixed seed, CPU, float32).
"""

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import GPT2LMHeadModel, LlamaForCausalLM

DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"
SEED = 4321
IGNORE_INDEX = -100
RANK, ALPHA = 4, 8
A_STD, B_STD = 0.1, 0.05  # large enough that the adapter moves the logits visibly
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]
SHARED_A = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # Llama: module -> the one whose A it takes


def saved_name(param_name: str) -> str:
    """A parameter's name in adapter_model.safetensors: PEFT drops the adapter name."""
    return param_name.replace(".default.", ".")


def randomize(model, share_a: bool) -> None:
    """Seeded normal lora_A and lora_B (PEFT starts B at zero, which would make the adapter a no-op)."""
    params = dict(model.named_parameters())
    lora = sorted(n for n in params if ".lora_A." in n or ".lora_B." in n)
    with torch.no_grad():
        for n in lora:
            params[n].copy_((A_STD if ".lora_A." in n else B_STD) * torch.randn_like(params[n]))
        if share_a:
            for n in lora:
                for module, source in SHARED_A.items():
                    if f".{module}.lora_A." in n:
                        params[n].copy_(params[n.replace(f".{module}.", f".{source}.")])


def build(name: str, cls, targets, fan_in_fan_out: bool, share_a: bool = False, adapter: str | None = None,
          **options) -> None:
    """The adapter fixture `peft_tiny_<adapter>` (default: `name`) of base hf_tiny_<name>; `options` go to
    LoraConfig."""
    base_name = f"hf_tiny_{name}"
    adapter = adapter or name
    torch.manual_seed(SEED)
    base = cls.from_pretrained(DATA_DIR / base_name, dtype=torch.float32).eval()
    expected = np.load(DATA_DIR / f"{base_name}_expected.npz")
    idx = torch.from_numpy(expected["idx"].astype(np.int64))
    tgt = torch.from_numpy(expected["targets"].astype(np.int64))
    with torch.no_grad():
        base_logits = base(idx).logits
    print(f"{name}: base logits vs {base_name}_expected.npz: "
          f"max |diff| = {(base_logits - torch.from_numpy(expected['logits'])).abs().max().item():.3g}")

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                        fan_in_fan_out=fan_in_fan_out, bias="none", **options)
    model = get_peft_model(base, config)
    randomize(model, share_a=share_a)
    model.peft_config["default"].base_model_name_or_path = base_name

    out_dir = DATA_DIR / f"peft_tiny_{adapter}"
    model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)  # no Hub look-up
    (out_dir / "README.md").unlink(missing_ok=True)
    config_path = out_dir / "adapter_config.json"  # PEFT writes target_modules in set order: sort them
    saved_config = json.loads(config_path.read_text())
    if isinstance(saved_config["target_modules"], list):
        saved_config["target_modules"] = sorted(saved_config["target_modules"])
    config_path.write_text(json.dumps(saved_config, indent=2, sort_keys=True))
    leftovers = sorted(p.name for p in out_dir.iterdir()
                       if p.name not in ("adapter_config.json", "adapter_model.safetensors"))
    assert not leftovers, leftovers

    logits = model(idx).logits  # (B, T, V); no labels: Hugging Face would shift them itself
    vocab = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, vocab), tgt.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = {f"grad:{saved_name(n)}": p.grad.numpy().astype(np.float32)
             for n, p in model.named_parameters() if p.requires_grad}
    with safe_open(out_dir / "adapter_model.safetensors", "pt") as f:
        saved = set(f.keys())
    assert saved == {k[len("grad:"):] for k in grads}, (sorted(saved), sorted(grads))

    with torch.no_grad():
        merged_logits = model.merge_and_unload()(idx).logits
    print(f"{adapter}: adapter vs base logits: max |diff| = {(logits - base_logits).abs().max().item():.4f}; "
          f"merged vs adapter: {(merged_logits - logits).abs().max().item():.3g}; loss {loss.item():.5f}")
    np.savez_compressed(DATA_DIR / f"peft_tiny_{adapter}_expected.npz", idx=expected["idx"],
                        targets=expected["targets"], logits=logits.detach().numpy().astype(np.float32),
                        loss=np.float32(loss.item()), merged_logits=merged_logits.numpy().astype(np.float32),
                        **grads)


def main():
    build("llama", LlamaForCausalLM, LLAMA_TARGETS, fan_in_fan_out=False, share_a=True)
    build("gpt2", GPT2LMHeadModel, GPT2_TARGETS, fan_in_fan_out=True)
    build("llama", LlamaForCausalLM, ["q_proj", "v_proj"], fan_in_fan_out=False, adapter="llama_qv",
          rank_pattern={"layers.1.self_attn.v_proj": 2}, alpha_pattern={"layers.0.self_attn.q_proj": 4},
          use_rslora=True)
    build("llama", LlamaForCausalLM, "all-linear", fan_in_fan_out=False, adapter="llama_all")


if __name__ == "__main__":
    main()
