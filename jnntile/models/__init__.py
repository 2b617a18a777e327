"""Model families, one package each (`gpt2/`): config, the model on jnntile's modules, Hugging Face
files, and a pure-JAX reference that only tests and benchmarks use as an oracle."""

# The logical axes a model cuts into tiles, each with a tile_<axis> field on its config (None: automatic).
# tile_heads counts heads per tile; tile_hidden is the MLP's hidden axis.
TILE_AXES = ("batch", "seq", "embd", "heads", "hidden", "vocab")
