"""The command line, `pytest-precision`: show, diff and run (its outputs, variants files and progress)."""
