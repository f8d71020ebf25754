#!/usr/bin/env bash
# The GPU lane: hebrus-mlx on MLX's CUDA backend, on a Linux machine with an NVIDIA GPU and no
# internet, in <= 10 minutes (docs/GPU_LANE.md). It is not Metal.
#
#   bash benchmarks/gpu_lane_prepare.sh [--split-mib N]   # first, where there is internet
#   bash benchmarks/gpu_lane.sh [--out DIR] [--backend cuda|cpu] [-- DRIVER ARGS]
#
# 1. joins the prepared wheel parts if only parts are there, checks every wheel's SHA-256;
# 2. installs them offline into a private target folder that shadows the machine's own packages
#    (its torch, numpy, ... stay): mlx 0.32.4 + mlx-cuda-13 (or -12) 0.32.4, mlx-lm, transformers;
# 3. builds metal_ext against that MLX (python setup.py build_ext --inplace, no build isolation:
#    the CUDA build's CMake config needs the CUDA toolkit and cuDNN, which are pointed at here);
# 4. runs benchmarks/gpu_lane.py (parity vs transformers in fp32 and bf16, resident tok/s vs
#    mlx-vlm 0.7.10, streamed-vs-resident identity at a 5% cache, peak memory) under a time limit,
#    writing gpu_lane.json + gpu_lane.md to --out (default $OUT, else benchmarks/out/gpu_lane).
# --backend cpu: the same steps with the mlx-cpu wheel (prepare it with --cuda cpu), a dry run of
# the script on a machine without a GPU. Exits non-zero when any step or lane section failed.
set -euo pipefail
cd "$(dirname "$0")/.."

lane=.ci/cache/gpu_lane
out="${OUT:-benchmarks/out/gpu_lane}"
backend=cuda
limit=480  # seconds for the driver: install + build + driver stay inside 10 minutes
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --lane) lane="$2"; shift 2 ;;
    --limit) limit="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "gpu_lane.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$lane"
lane=$(cd "$lane" && pwd)
start=$SECONDS
step() { echo "gpu_lane.sh: [$((SECONDS - start)) s] $*" >&2; }
py=python3
mkdir -p "$out"

# 1. the wheels
wheels="$lane/wheels"
if [ ! -f "$wheels/SHA256SUMS" ] && ls "$lane"/parts/wheels.tar.part* > /dev/null 2>&1; then
  step "joining $(ls "$lane"/parts/wheels.tar.part* | wc -l) wheel parts"
  ( cd "$lane/parts" && sha256sum -c --quiet PARTS.SHA256SUMS )
  cat "$lane"/parts/wheels.tar.part* | tar -C "$lane" -xf -
fi
if [ ! -f "$wheels/SHA256SUMS" ]; then
  echo "gpu_lane.sh: error: no wheels in $wheels: run benchmarks/gpu_lane_prepare.sh first" >&2
  exit 2
fi
( cd "$wheels" && sha256sum -c --quiet SHA256SUMS )
case "$backend" in
  cuda) mlxb=$(ls "$wheels"/mlx_cuda_1[23]-0.32.4-*.whl | head -1) ;;
  cpu) mlxb=$(ls "$wheels"/mlx_cpu-0.32.4-*.whl | head -1) ;;
  *) echo "gpu_lane.sh: error: --backend: cuda or cpu, got $backend" >&2; exit 2 ;;
esac

# 2. offline install into a private target (the machine's own packages stay underneath)
site="$lane/site"
step "installing $(basename "$mlxb") and the pinned wheels into $site (offline)"
rm -rf "$site"
$py -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile --target "$site" \
  "$wheels"/mlx-0.32.4-*.whl "$mlxb" "$wheels"/mlx_lm-0.32.2-*.whl "$wheels"/transformers-5.24.0-*.whl \
  "$wheels"/tokenizers-*.whl "$wheels"/nanobind-*.whl
export PYTHONPATH="$site:$PWD"
vlm="$lane/mlx_vlm_0710"
[ -d "$vlm/mlx_vlm" ] || $py -m zipfile -e "$wheels"/mlx_vlm-0.7.10-py3-none-any.whl "$vlm"
export MLX_VLM_ROOT="$vlm"
$py -c "import mlx.core as mx, sys; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available()); sys.exit(0 if '$backend' == 'cpu' or mx.cuda.is_available() else 'MLX sees no CUDA device')"

# 3. the extension, against this MLX
cmake_args=()
if [ "$backend" = cuda ]; then
  command -v nvcc > /dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  cudnn=$($py -c "import nvidia.cudnn as c; print(list(c.__path__)[0])" 2> /dev/null || true)
  if [ -n "$cudnn" ]; then
    cmake_args+=("-DCUDNN_INCLUDE_PATH=$cudnn/include" "-DCUDNN_LIBRARY_PATH=$cudnn/lib")
  fi
fi
step "building metal_ext against $($py -m mlx --cmake-dir) ${cmake_args[*]:-}"
CMAKE_ARGS="${cmake_args[*]:-}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  $py setup.py --quiet build_ext --inplace --build-temp "$lane/build" > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log" >&2; echo "gpu_lane.sh: error: the extension did not build" >&2; exit 1; }
$py -c "import mlx.core, hebrus_mlx._ext as e; print('extension built; sha256', e.sha256_backend())"

# 4. the lane
device=gpu
[ "$backend" = cpu ] && device=cpu
step "running benchmarks/gpu_lane.py --device $device (limit $limit s)"
rc=0
PYTHONUNBUFFERED=1 timeout "$limit" $py benchmarks/gpu_lane.py --device "$device" --out "$out" "$@" || rc=$?
step "done (driver exit $rc); results in $out/gpu_lane.json and $out/gpu_lane.md"
exit "$rc"
