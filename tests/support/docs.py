"""The README, the guides in ``docs/`` and ``DEVELOP.md`` as the tests read
them: their code blocks, their prose reflowed, their commands; and the
commands of ``.ci/run`` as a user types them."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# every page whose code the tests run or whose commands they check
PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "DEVELOP.md")


def text(page):
    return (ROOT / page).read_text()


def code_blocks(page, lang="python"):
    """The ``lang`` code blocks of ``page``, in order (indented ones too)."""
    return re.findall(rf"^[ \t]*```{lang}\n(.*?)^[ \t]*```", text(page), re.S | re.M)


def block(page, marker, lang="python"):
    """The one ``lang`` block of ``page`` that contains ``marker``."""
    found = [b for b in code_blocks(page, lang) if marker in b]
    assert len(found) == 1, f"{page}: {len(found)} {lang} blocks contain {marker!r}"
    return found[0]


def run_block(page, marker):
    """Run the python block of ``page`` that contains ``marker``, as a
    reader would paste it."""
    exec(compile(block(page, marker), page, "exec"), {"__name__": "docs"})


def prose(page):
    """``page`` with its line breaks reflowed (commands in backticks span lines)."""
    return " ".join(text(page).split())


def bash_lines(page):
    """Every line of the bash blocks of ``page``, its spaces collapsed."""
    return [" ".join(line.split()) for b in code_blocks(page, "bash") for line in b.splitlines()]


def ci_lines():
    """The commands of .ci/run, continuation lines joined and each variable set
    from a one-line ``$(...)`` written out, as a user types them."""
    run = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    subst = dict(re.findall(r"^([A-Z_]+)=(\$\(.*\))$", run, re.M))
    out = []
    for line in run.splitlines():
        for name, value in subst.items():
            line = re.sub(r"\$%s\b" % name, lambda m: value, line)
        out.append(" ".join(line.split()))
    return out
