"""`python -m pytest_precision.cli`: the `pytest-precision` command."""

from pytest_precision.cli.main import main

raise SystemExit(main())
