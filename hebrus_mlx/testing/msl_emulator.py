"""Run the Metal kernel sources this package passes to `mx.fast.metal_kernel` as C++ on the CPU.

What it is: a shim that compiles the *same source strings* (body + header, the signature MLX would
generate from the input/output names, the template arguments of the call) with g++, and runs them
one std::thread per GPU thread, one threadgroup at a time, over numpy buffers:
- address-space qualifiers (`device`, `constant`, `thread`) are erased; `threadgroup` becomes a
  function-static (threadgroups run one after another, so it is shared by exactly one group);
- `threadgroup_barrier` is a std::barrier over the threadgroup's threads;
- `simd_sum` / `simd_max` / `simd_min` / `simd_shuffle_xor` / `simd_broadcast` go through a
  per-SIMD-group (32 lanes) barrier and shared scratch;
- `uint3`/`uint2`/`uint`, the MLX attribute names (thread_position_in_grid, ...), and the metal math
  functions the kernels use.

What it checks: indexing, reductions, barriers and masking against a float64 oracle. What it does
NOT check: Apple's compiler, its fast-math and rounding, `half`/`bfloat` arithmetic (mapped to
float), memory-model subtleties beyond full barriers, occupancy or speed. Kernels must stay inside
this subset (arrays only, grid a multiple of the threadgroup, threadgroup memory only as declared
arrays). As MLX does, an input `x` whose name appears in the source as `x_shape`, `x_strides` or
`x_ndim` gets those arguments (int shape, int64 strides in elements, int ndim), and with
`row_contiguous=False` inputs are passed as the views they are (their strides), as MLX passes them
with `ensure_row_contiguous=False`. Needs a C++20 compiler (`g++`/`clang++`, or $CXX).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SIMD_WIDTH = 32


class EmulatorUnavailable(RuntimeError):
    """No C++20 compiler to build the emulated kernel."""


_CTYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "float",  # emulated in float: the harness does not model half rounding
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "uint",
    np.dtype(np.int64): "long",
    np.dtype(np.uint64): "ulong",
    np.dtype(np.int8): "int8_t",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.bool_): "bool",
}

PRELUDE = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef float half;  // not modelled: see the module docstring

template <typename T> struct vec2 { T x, y; vec2(T a = 0, T b = 0) : x(a), y(b) {} };
template <typename T> struct vec3 { T x, y, z; vec3(T a = 0, T b = 0, T c = 0) : x(a), y(b), z(c) {} };
template <typename T> struct vec4 { T x, y, z, w; vec4(T a = 0, T b = 0, T c = 0, T d = 0) : x(a), y(b), z(c), w(d) {} };
typedef vec2<uint> uint2; typedef vec3<uint> uint3; typedef vec4<uint> uint4;
typedef vec2<int> int2; typedef vec3<int> int3; typedef vec4<int> int4;
typedef vec2<float> float2; typedef vec3<float> float3; typedef vec4<float> float4;

#define device
#define constant
#define thread
#define threadgroup static
#define METAL_FUNC inline

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

struct EmuThread {
  std::barrier<>* group;
  std::barrier<>* simd;
  unsigned char* scratch;  // SIMD_WIDTH * 8 bytes shared by the SIMD group
  uint lane;
  uint width;  // active lanes in this SIMD group
};
static thread_local EmuThread emu;

inline void threadgroup_barrier(mem_flags) { emu.group->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { emu.simd->arrive_and_wait(); }

template <typename T> inline void emu_put(T v) { std::memcpy(emu.scratch + 8 * emu.lane, &v, sizeof(T)); }
template <typename T> inline T emu_get(uint lane) { T v; std::memcpy(&v, emu.scratch + 8 * lane, sizeof(T)); return v; }

template <typename T> inline T simd_sum(T v) {
  emu_put(v); emu.simd->arrive_and_wait();
  T acc = 0; for (uint i = 0; i < emu.width; ++i) acc += emu_get<T>(i);
  emu.simd->arrive_and_wait(); return acc;
}
template <typename T> inline T simd_max(T v) {
  emu_put(v); emu.simd->arrive_and_wait();
  T acc = emu_get<T>(0); for (uint i = 1; i < emu.width; ++i) acc = std::max(acc, emu_get<T>(i));
  emu.simd->arrive_and_wait(); return acc;
}
template <typename T> inline T simd_min(T v) {
  emu_put(v); emu.simd->arrive_and_wait();
  T acc = emu_get<T>(0); for (uint i = 1; i < emu.width; ++i) acc = std::min(acc, emu_get<T>(i));
  emu.simd->arrive_and_wait(); return acc;
}
template <typename T> inline T simd_shuffle_xor(T v, ushort mask) {
  emu_put(v); emu.simd->arrive_and_wait();
  T r = emu_get<T>((emu.lane ^ mask) % emu.width);
  emu.simd->arrive_and_wait(); return r;
}
template <typename T> inline T simd_broadcast(T v, ushort lane) {
  emu_put(v); emu.simd->arrive_and_wait();
  T r = emu_get<T>(lane); emu.simd->arrive_and_wait(); return r;
}
template <typename T> inline T simd_shuffle(T v, ushort lane) { return simd_broadcast(v, lane); }

namespace metal {
using std::abs; using std::ceil; using std::cos; using std::exp; using std::exp2; using std::floor;
using std::fmax; using std::fmin; using std::isinf; using std::isnan; using std::log; using std::pow;
using std::sin; using std::sqrt; using std::tanh;
template <typename T, typename U> inline T max(T a, U b) { return a > T(b) ? a : T(b); }
template <typename T, typename U> inline T min(T a, U b) { return a < T(b) ? a : T(b); }
template <typename T> inline T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }
template <typename T> inline T select(T a, T b, bool c) { return c ? b : a; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float precise_divide(float a, float b) { return a / b; }
namespace fast { using std::exp; using std::log; using std::sqrt; inline float rsqrt(float x) { return 1.0f / std::sqrt(x); } }
namespace precise { using std::exp; using std::log; using std::sqrt; inline float rsqrt(float x) { return 1.0f / std::sqrt(x); } }
template <typename T> struct numeric_limits : std::numeric_limits<T> {};
}  // namespace metal
using namespace metal;
"""

RUNNER = r"""
extern "C" void emu_run(void** bufs, uint gx, uint gy, uint gz, uint tx, uint ty, uint tz) {
  const uint n = tx * ty * tz;
  const uint groups_x = gx / tx, groups_y = gy / ty, groups_z = gz / tz;
  const uint n_simd = (n + __SIMD__ - 1) / __SIMD__;
  for (uint gzi = 0; gzi < groups_z; ++gzi)
  for (uint gyi = 0; gyi < groups_y; ++gyi)
  for (uint gxi = 0; gxi < groups_x; ++gxi) {
    std::barrier<> group(n);
    std::vector<std::unique_ptr<std::barrier<>>> simd;
    for (uint s = 0; s < n_simd; ++s)
      simd.emplace_back(new std::barrier<>(std::min<uint>(__SIMD__, n - s * __SIMD__)));
    std::vector<unsigned char> scratch(n_simd * __SIMD__ * 8);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (uint i = 0; i < n; ++i) {
      threads.emplace_back([&, i]() {
        uint s = i / __SIMD__;
        emu = EmuThread{&group, simd[s].get(), scratch.data() + s * __SIMD__ * 8, i % __SIMD__,
                        std::min<uint>(__SIMD__, n - s * __SIMD__)};
        uint3 tpt(i % tx, (i / tx) % ty, i / (tx * ty));
        uint3 tgp(gxi, gyi, gzi);
        uint3 tpg(gxi * tx + tpt.x, gyi * ty + tpt.y, gzi * tz + tpt.z);
        __CALL__;
      });
    }
    for (auto& t : threads) t.join();
  }
}
"""

ATTRIBUTES = (
    "uint3 thread_position_in_grid, uint3 thread_position_in_threadgroup, uint3 threadgroup_position_in_grid, "
    "uint3 threads_per_threadgroup, uint3 threadgroups_per_grid, uint3 threads_per_grid, "
    "uint thread_index_in_threadgroup, uint thread_index_in_simdgroup, uint simdgroup_index_in_threadgroup, "
    "uint threads_per_simdgroup"
)
ATTRIBUTE_ARGS = (
    "tpg, tpt, tgp, uint3(tx, ty, tz), uint3(groups_x, groups_y, groups_z), uint3(gx, gy, gz), "
    "i, i % __SIMD__, i / __SIMD__, __SIMD__"
)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise EmulatorUnavailable("no C++ compiler (g++/clang++ or $CXX) to build the emulated kernel")
    return cxx


def _template_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    name = str(value).replace("mlx.core.", "")  # an mx dtype, as passed to metal_kernel, or a numpy one
    if name == "bfloat16":
        return "float"  # not modelled: see the module docstring
    return _CTYPES[np.dtype(name)]


def _shape_args(name: str, source: str):
    """The (suffix, C parameter type, how the runner passes it) MLX adds after input `name`, in
    MLX's order, for the ones the source uses."""
    kinds = (("shape", "const constant int*", "(int*)"), ("strides", "const constant int64_t*", "(int64_t*)"))
    out = [(k, t, cast) for k, t, cast in kinds if f"{name}_{k}" in source]
    if f"{name}_ndim" in source:
        out.append(("ndim", "const constant int&", "*(int*)"))
    return out


def build_source(
    name: str,
    source: str,
    header: str,
    input_names: Sequence[str],
    input_dtypes,
    output_names: Sequence[str],
    output_dtypes,
    template: Sequence[tuple] = (),
) -> str:
    # Signature and call in MLX's order: each input then the shape arguments its name asks for,
    # then the outputs. Buffers: inputs, outputs, then the shape arguments.
    n_in, n_bufs = len(input_names), len(input_names) + len(output_names)
    params, args, extra = [], [], 0
    for i, (n, d) in enumerate(zip(input_names, input_dtypes)):
        params.append(f"const device {_CTYPES[np.dtype(d)]}* {n}")
        args.append(f"({_CTYPES[np.dtype(d)]}*)bufs[{i}]")
        for kind, ctype, cast in _shape_args(n, source):
            params.append(f"{ctype} {n}_{kind}")
            args.append(f"{cast}bufs[{n_bufs + extra}]")
            extra += 1
    for i, (n, d) in enumerate(zip(output_names, output_dtypes)):
        params.append(f"device {_CTYPES[np.dtype(d)]}* {n}")
        args.append(f"({_CTYPES[np.dtype(d)]}*)bufs[{n_in + i}]")
    tparams = ", ".join(
        f"{'typename' if not isinstance(v, (int, bool)) else ('bool' if isinstance(v, bool) else 'int')} {k}"
        for k, v in template
    )
    targs = ", ".join(_template_value(v) for _, v in template)
    fn = f"emu_{name}"
    call = f"{fn}{'<' + targs + '>' if template else ''}({', '.join(args + [ATTRIBUTE_ARGS])})"
    sig = ", ".join(params + [ATTRIBUTES])
    kernel = (f"template <{tparams}>\n" if template else "") + f"void {fn}({sig}) {{\n{source}\n}}\n"
    runner = RUNNER.replace("__CALL__", call)
    undef = "#undef device\n#undef constant\n#undef thread\n#undef threadgroup\n"
    return (PRELUDE + header + "\n" + kernel + undef + runner).replace("__SIMD__", str(SIMD_WIDTH))


_LIBS: dict[str, ctypes.CDLL] = {}


def _library(code: str) -> ctypes.CDLL:
    key = hashlib.sha256(code.encode()).hexdigest()[:24]
    if key in _LIBS:
        return _LIBS[key]
    cache = Path(os.environ.get("HEBRUS_EMU_CACHE", Path(tempfile.gettempdir()) / "hebrus-msl-emu"))
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"{key}.so"
    if not lib.exists():
        src = cache / f"{key}.cpp"
        src.write_text(code)
        tmp = cache / f"{key}.{os.getpid()}.so"
        proc = subprocess.run(
            [_compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", str(src), "-o", str(tmp)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"emulated kernel failed to compile:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    _LIBS[key] = ctypes.CDLL(str(lib))
    return _LIBS[key]


def run(
    name: str,
    source: str,
    inputs: dict,
    outputs: dict,
    grid,
    threadgroup,
    template=(),
    header: str = "",
    init_value: float = 0,
    row_contiguous: bool = True,
):
    """Run `source` as MLX would with these inputs (name -> numpy array) and outputs
    (name -> (shape, dtype)); returns the output arrays in order.

    grid / threadgroup are MLX's (x, y, z) thread counts; grid must be a multiple of threadgroup.
    row_contiguous: MLX's ensure_row_contiguous (True: inputs are copied row-contiguous first).
    """
    grid, threadgroup = tuple(grid), tuple(threadgroup)
    if any(g % t for g, t in zip(grid, threadgroup)):
        raise ValueError(f"grid {grid} must be a multiple of threadgroup {threadgroup} in the emulator")
    arrays = [np.ascontiguousarray(a) if row_contiguous else np.asarray(a) for a in inputs.values()]
    outs = [np.full(shape, init_value, dtype=dtype) for shape, dtype in outputs.values()]
    in_types = [a.dtype for a in arrays]
    out_types = [o.dtype for o in outs]
    for a in arrays + outs:
        if a.dtype not in _CTYPES:
            raise TypeError(f"emulator has no C type for {a.dtype}")
    # float16 buffers are widened to float32 for the emulated kernel and narrowed back.
    arrays = [a.astype(np.float32) if a.dtype == np.float16 else a for a in arrays]
    bufs = [a.astype(np.float32) if a.dtype == np.float16 else a for a in outs]
    code = build_source(name, source, header, list(inputs), in_types, list(outputs), out_types, template)
    lib = _library(code)
    extra = []
    for n, a in zip(inputs, arrays):
        for kind, _, _ in _shape_args(n, source):
            if kind == "shape":
                extra.append(np.array(a.shape, np.int32))
            elif kind == "strides":
                extra.append(np.array([st // a.itemsize for st in a.strides], np.int64))
            else:
                extra.append(np.array([a.ndim], np.int32))
    ptrs = (ctypes.c_void_p * (len(arrays) + len(bufs) + len(extra)))(*[a.ctypes.data for a in arrays + bufs + extra])
    lib.emu_run(ptrs, *[ctypes.c_uint(v) for v in grid], *[ctypes.c_uint(v) for v in threadgroup])
    return [b.astype(o.dtype) if b.dtype != o.dtype else b for b, o in zip(bufs, outs)]
