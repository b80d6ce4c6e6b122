"""The gate: baseline files (their format and JSON Schema), tolerances and their precedence, the checks of a
report against its baseline and limits, the project's gate as pytest reads its config, and baseline diffs."""
