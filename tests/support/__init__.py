"""What the tests share beside their fixtures (``tests/conftest.py``).

``tests/`` is not a package: conftest puts ``tests/`` on ``sys.path``, so a
test imports these as ``from support.numerics import stored`` while
``ferrox_kv`` itself still comes from the installed package.

- ``numerics``: deterministic rows, hostile array-likes, and what a cache of
  each storage dtype gives back;
- ``pools``: prefix-cache pools, published sequences and the counts a
  refused operation must leave as they were (``ferrox_kv.store``);
- ``redis_server``: real redis-server processes and a three-node cluster;
- ``threads``: one runner that starts threads together (the bench's);
- ``models``: tiny random transformers models and their prompts;
- ``serve``: the tiny model directory and a real server process;
- ``docs``: the code blocks and commands of the README, ``docs/`` and
  ``DEVELOP.md``, and the commands of ``.ci/run``.
"""
