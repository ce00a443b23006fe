"""``python -m ferrox_kv.serve MODEL_DIR ...``: the same as ``ferrox-kv serve``."""
import sys

from ferrox_kv.serve.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m ferrox_kv.serve"))
