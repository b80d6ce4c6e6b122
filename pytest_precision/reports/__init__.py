"""Reports: PrecisionReport (the result of a comparison), its text tables, compare_logprobs, and the
environment a run records (versions, device, ISA, commit) to tell when numbers may move."""
