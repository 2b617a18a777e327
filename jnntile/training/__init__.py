"""Training: the step (step), Optax transformations on tiles (optim), LoRA adapters (lora) and checkpoints
(checkpoint)."""
