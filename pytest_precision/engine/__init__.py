"""The engine that runs models: variants and backend flags, building each run's model, capture hooks,
batches and positions, run isolation (RNG, flags, modes), arrangements, the isolated pass, the runner, the
reference (run, kept, saved, loaded) and `compare`, which reads top-down in `engine.compare`."""
