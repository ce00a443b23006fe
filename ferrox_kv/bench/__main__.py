"""``python -m ferrox_kv.bench``: the same as ``ferrox-kv bench``."""
import sys

from ferrox_kv.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
