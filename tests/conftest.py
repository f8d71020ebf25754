import families  # noqa: F401  (registers the test checkpoints' family descriptors)
