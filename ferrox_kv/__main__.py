"""``python -m ferrox_kv``: the ``ferrox-kv`` command (``bench``, ``info``)."""
import sys

from ferrox_kv.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m ferrox_kv"))
