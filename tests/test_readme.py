"""The README's examples run as written."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _block(marker):
    text = open(README).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if marker in b)


def test_readme_threaded_pool_example_runs(capsys):
    exec(compile(_block("push_layers(layers"), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "served" in out and "refused" in out


def test_readme_transformers_example_runs_and_reuses_the_prompt(capsys):
    pytest.importorskip("transformers")
    exec(compile(_block("FerroxCache(model.config"), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    first, second = out[0], out[1]
    assert first.startswith("turn 0: reused 0 positions") and second.startswith(
        "turn 1: reused 32 positions")
    assert first.split("new tokens")[1] == second.split("new tokens")[1]    # the same ids
    assert out[2] == "1 prefix hit, 0 blocks in use"
