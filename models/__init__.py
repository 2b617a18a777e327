"""Model definitions: GPT-2 configuration, a pure-JAX reference GPT-2 and
Hugging Face checkpoint interop. Nothing here imports `jnntile`."""
