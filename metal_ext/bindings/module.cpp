// hebrus_mlx._ext: the runtime module. Test hooks are not in it: they live in
// hebrus_mlx._testing (metal_ext/testing/), which only the tests import.
#include "bindings.h"

NB_MODULE(_ext, m) {
  using namespace hebrus::bind;
  m.doc() = "hebrus-mlx streaming engine (C++ MLX extension)";
  register_errors(m);
  auto engine = register_engine(m);
  register_trace(m, engine);
  register_ops(m);
  register_sweep(m);
  register_gpu_events(m);
  register_hash(m);
}
