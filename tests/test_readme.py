"""The README's usage example runs as written."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.mark.skipif(not os.path.exists(README), reason="README not beside the tests")
def test_readme_threaded_pool_example_runs():
    text = open(README).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "push_layers(layers" in b)
    exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
