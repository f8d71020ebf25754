#!/usr/bin/env bash
# Companion of benchmarks/gpu_lane.sh: on a machine WITH internet, download every wheel the lane
# installs on a GPU machine that has none, into an ignored folder (.ci/cache/gpu_lane/wheels).
#
#   bash benchmarks/gpu_lane_prepare.sh [--cuda 13|12] [--python 3.12] [--dest DIR] [--split-mib N]
#
# --cuda: MLX's backend wheel, mlx-cuda-13 (default; CUDA 13 runtime libraries, which a
#   PyTorch cu13x image already has) or mlx-cuda-12 (`mlx[cuda]`; needs the nvidia-*-cu12
#   libraries too, several hundred MB, which this script does not fetch: install them with pip
#   where the GPU machine has a registry, or add them to the folder yourself), or cpu (mlx-cpu:
#   for gpu_lane.sh --backend cpu, the dry run on a machine without a GPU).
# --python: the GPU machine's Python (the cp tag of the mlx wheel).
# --split-mib N: also cut the wheels into a tar of N-MiB parts under DEST/parts (for a transfer
#   that limits the size of one copy); gpu_lane.sh joins and checks them.
# What the GPU machine is expected to have already: torch, numpy, safetensors, huggingface-hub,
# jinja2, tqdm, pyyaml, regex, sentencepiece, protobuf, typer, packaging, cmake, a C++ compiler,
# the CUDA toolkit (nvcc and headers) and cuDNN 9 (headers and libraries).
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=13 py=3.12 dest=.ci/cache/gpu_lane split=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --dest) dest="$2"; shift 2 ;;
    --split-mib) split="$2"; shift 2 ;;
    *) echo "gpu_lane_prepare.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$cuda" in
  12|13) backend="mlx-cuda-$cuda==0.32.4" ;;
  cpu) backend="mlx-cpu==0.32.4" ;;  # gpu_lane.sh --backend cpu: the dry run without a GPU
  *) echo "gpu_lane_prepare.sh: error: --cuda: 12, 13 or cpu, got $cuda" >&2; exit 2 ;;
esac

wheels="$dest/wheels"
mkdir -p "$wheels"
plat=(--only-binary=:all: --implementation cp --python-version "$py"
      --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip_dl() { python3 -m pip download --quiet --disable-pip-version-check --no-deps "$@"; }

# The pins of pyproject.toml, for the GPU machine's Python and MLX's CUDA backend.
pip_dl "${plat[@]}" -d "$wheels" "mlx==0.32.4" "$backend" "mlx-lm==0.32.2" \
  "transformers==5.24.0" "tokenizers>=0.23.1,<0.24" "nanobind>=3.0,<4"
# The independent MLX peer: unpacked by the lane, never installed (as .ci/run does).
pip_dl -d "$wheels" "mlx-vlm==0.7.10"
( cd "$wheels" && sha256sum -- *.whl > SHA256SUMS )
echo "wheels in $wheels ($(du -sh "$wheels" | cut -f1)):"
sed 's/^/  /' "$wheels/SHA256SUMS"

if [ "$split" != 0 ]; then
  parts="$dest/parts"
  rm -rf "$parts" && mkdir -p "$parts"
  tar -C "$dest" -cf - wheels | split -d -a 2 -b "${split}M" - "$parts/wheels.tar.part"
  ( cd "$parts" && sha256sum -- wheels.tar.part* > PARTS.SHA256SUMS )
  echo "$(ls "$parts"/wheels.tar.part* | wc -l) parts of <= $split MiB in $parts (gpu_lane.sh joins them)"
fi
