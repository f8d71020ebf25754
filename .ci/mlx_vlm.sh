#!/usr/bin/env bash
# Unpack the independent MLX oracle (mlx-vlm 0.7.10) as .ci/run does - never installed: its
# package __init__ pulls heavy dependencies the tests do not need (tests/support/mlx_vlm_fixture.py) -
# and print its root for MLX_VLM_ROOT.
set -euo pipefail
cd "$(dirname "$0")/.."
vlm=".ci/cache/mlx_vlm_0710"
if [ ! -d "$vlm/mlx_vlm" ]; then
  python -m pip download --quiet --disable-pip-version-check --no-deps mlx-vlm==0.7.10 -d .ci/cache >&2
  python -m zipfile -e .ci/cache/mlx_vlm-0.7.10-py3-none-any.whl "$vlm"
fi
echo "$PWD/$vlm"
