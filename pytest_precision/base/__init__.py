"""The bottom layer: what every other layer shares and nothing here needs from them.

Errors, the record types (TensorError, Record, RunInfo, ReportData) and metric names, dtype names, file
names Windows reserves, and the one atomic-write helper every file goes through. No torch at import time.
"""
