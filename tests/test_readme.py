"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a python example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})



def test_readme_says_what_verify_holds_the_llama_to() -> None:
    """`graphsafe verify --model llama` compares each replay with a model built fresh from
    the checkpoint (its report's `oracle:` line), as for DeepSeek V4; Hugging Face's
    logits are compared by the tests, which the README names for that claim."""
    text = " ".join(README.read_text().split())
    llama = text[text.index("`--model llama`") : text.index("`--pp 2`")]
    assert "built fresh from each checkpoint" in llama
    assert "held to Hugging Face" not in llama  # what it said, and verify never did
    assert "tests/test_llama.py" in llama
    named = README.parent / "tests" / "test_llama.py"
    assert "def test_logits_equal_transformers(" in named.read_text()
