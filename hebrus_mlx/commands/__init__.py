"""The verbs' command lines: one module per `hebrus-mlx` verb (cli.VERBS), over the library."""
