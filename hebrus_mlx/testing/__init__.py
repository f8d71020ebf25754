"""Oracles tests, benchmarks and qualify share: the pure-Python streaming engine, the oracle drafter,
the synthetic source and the MSL emulator with the kernels run through it; `processes` starts the CLI as a
child process the same way everywhere; `tiny_configs` holds the tiny model configs tests, tools and
benchmarks build from, `bare_packages` imports parts of mlx-vlm without its package `__init__`s. No
product module imports this package (tests/test_layering.py); the one exception is `hebrus-mlx qualify`'s opt-in emulation check
(`qualify.check_kernels_emulated`), which runs the shipped kernel sources through the emulator.
Test-only helpers and fixtures live in tests/support/."""
