"""The files a session or a run writes beside the gate: summary.md, error-vs-depth plots, and the reading of
session report files."""
