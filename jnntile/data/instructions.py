"""The built-in instruction dataset: prompt/completion examples from the Python standard library's functions,
present wherever Python is, so that a fine-tune whose effect on answers is visible needs no download.

Each public top-level function with a docstring and a short body (at most `MAX_BODY_LINES` lines after the
docstring) of the standard library's sources (`text.stdlib_source_files`, in their sorted order) is one example:
the prompt is its `def` line(s) and docstring, as they are written, the completion the rest of its body. At most
`MAX_EXAMPLES` examples, taken evenly across the library.
"""

from __future__ import annotations

import ast
import platform
from typing import Iterator

from jnntile.data.text import stdlib_root, stdlib_source_files

MAX_BODY_LINES = 12
MAX_EXAMPLES = 2000


def _functions(source: str) -> Iterator[tuple[int, str, str]]:
    """(line, prompt, completion) of each suitable top-level function in `source`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file for another Python version, or with NUL bytes
        return
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if (not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_")
                or ast.get_docstring(node) is None or len(node.body) < 2):
            continue
        docstring, first = node.body[0], node.body[1]
        if docstring.end_lineno >= first.lineno or not 1 <= node.end_lineno - first.lineno + 1 <= MAX_BODY_LINES:
            continue
        prompt = "".join(lines[node.lineno - 1 : docstring.end_lineno])
        completion = "".join(lines[first.lineno - 1 : node.end_lineno])
        yield node.lineno, prompt, completion


def builtin_instruction_examples(max_examples: int = MAX_EXAMPLES) -> list[tuple[str, str, dict]]:
    """(where, "prompt/completion", {"prompt", "completion"}) for each example, as read_examples gives them."""
    root = stdlib_root()
    found = []
    for path in stdlib_source_files():
        source = path.read_text(encoding="utf-8", errors="replace")
        for line, prompt, completion in _functions(source):
            found.append((f"{path.relative_to(root)} line {line}", "prompt/completion",
                          {"prompt": prompt, "completion": completion}))
    stride = max(1, len(found) / max_examples)
    return [found[int(index * stride)] for index in range(min(max_examples, len(found)))]


def builtin_instructions_description(count: int) -> str:
    return (f"{count} functions of the Python {platform.python_version()} standard library under {stdlib_root()} "
            "(prompt: the def line and docstring; completion: the body)")
