"""The numbers: per-tensor error metrics and range statistics, log-probability statistics, and the
cross-engine error decomposition. Pure functions of tensors; they know nothing of models or files."""
