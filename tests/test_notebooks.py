"""The notebooks run, on small settings, and are committed without outputs.

Each notebook's code cells run as one script in a fresh process of this Python
(.venv, or .venv-cuda under `make test-gpu`), in a temporary directory. As with
papermill, the code cell tagged "parameters" holds what a reader may change;
the test puts a cell with the small settings of SMOKE right after it, so the
same code runs with fewer steps. The notebooks use no IPython magics, so they
run as plain Python.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Small settings per notebook: a few steps, two tile sizes, one memory limit.
SMOKE = {
    "01_quickstart.ipynb": {"STEPS": 3, "SAMPLE_TOKENS": 8},
    "02_custom_model.ipynb": {"TRAIN_STEPS": 3, "TILE_SIZES": [256, 1024], "TIMED_STEPS": 1},
    "03_beyond_ram.ipynb": {"LIMITS_MB": [12], "STEPS": 2},
    "04_finetune_hf.ipynb": {"STEPS": 3, "NEW_TOKENS": 8, "HF_DIR": str(ROOT / "tests" / "data" / "hf_tiny_gpt2")},
    "05_llama.ipynb": {"STEPS": 3, "NEW_TOKENS": 4, "HF_DIR": str(ROOT / "tests" / "data" / "hf_tiny_llama")},
    "06_lora.ipynb": {"STEPS": 3, "NEW_TOKENS": 4, "HF_DIR": str(ROOT / "tests" / "data" / "hf_tiny_llama")},
    "07_chat_finetune.ipynb": {"STEPS": 60, "NEW_TOKENS": 12,
                               "HF_DIR": str(ROOT / "tests" / "data" / "hf_tiny_llama")},
}


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def parameters_cell(path: Path) -> int:
    """Index (among code cells) of the one cell tagged "parameters"."""
    tagged = [i for i, c in enumerate(code_cells(path)) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} code cells tagged 'parameters', expected one"
    return tagged[0]


def assigned_names(source: str) -> set[str]:
    return {t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def notebook_script(path: Path, overrides: dict, header: str = "") -> str:
    """The notebook's code cells as one script, `overrides` assigned right after the parameters cell."""
    cells = code_cells(path)
    params_at = parameters_cell(path)
    parts = ["import matplotlib\nmatplotlib.use('Agg')\n" + header]
    for i, cell in enumerate(cells):
        parts.append("".join(cell["source"]))
        if i == params_at:
            parts.append("# small settings from tests/test_notebooks.py\n"
                         + "".join(f"{name} = {value!r}\n" for name, value in overrides.items()))
    return "\n\n".join(parts) + "\n"


def test_every_notebook_has_small_settings():
    assert sorted(SMOKE) == [p.name for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        names = assigned_names("".join(code_cells(path)[parameters_cell(path)]["source"]))
        unknown = set(SMOKE[path.name]) - names
        assert not unknown, f"{path.name}: the parameters cell does not set {sorted(unknown)}"


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS:
        for cell in code_cells(path):
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
                f"{path.name} holds outputs: clear them before committing")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    script = tmp_path / f"{path.stem}.py"
    script.write_text(notebook_script(path, SMOKE.get(path.name, {})))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{path.name} failed\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n" \
                                   f"{result.stderr[-5000:]}"
