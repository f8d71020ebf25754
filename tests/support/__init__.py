"""Test-only helpers and fixtures, in one place: checkpoints and artifacts built for tests
(`artifact_fixture`, `convert_fixture`, `mtp_fixture`, `parity_fixtures` with `fixtures/parity`),
stores and engines (`stream_store`, `fault_injection`), the scripted server, reference loops and
captures (`chunked_greedy`, `spec_loop`, `demo_reference`, `qsa_oracle`, `fixtures/text`) and the
child-process scripts some tests run. Tests import it as `support` (pytest puts tests/ on the path);
benchmarks that reuse a fixture put tests/ on the path first. What benchmarks or users need without
the test tree lives in hebrus_mlx/testing/."""
