"""Prints the given distributions that this Python cannot import (for `make cuda`)."""

import importlib.util
import sys

# Distribution name -> module name, where they differ.
MODULES = {"scikit-build-core": "scikit_build_core", "jax": "jaxlib"}

missing = [name for name in sys.argv[1:] if importlib.util.find_spec(MODULES.get(name, name)) is None]
print(" ".join(missing))
