"""One module per group of the bench. Each defines ``GROUP`` (a
``common.Group``: its slug, title, runner and targets) and imports only the
modules below it (``common``, ``harness``, ``targets``, ``llama``); the
runner lists them (``runner.GROUP_MODULES``)."""
