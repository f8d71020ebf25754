// hebrus_mlx._hash: SHA-256 and XXH3-128 without MLX, so the artifact layer
// (which admission imports, AFN-004) can write and check fast digests.
#include "bindings.h"

NB_MODULE(_hash, m) {
  m.doc() = "hebrus-mlx record digests (SHA-256, XXH3-128)";
  hebrus::bind::register_hash(m);
}
