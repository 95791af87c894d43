// Prints the CUDA plans' launch budget per kernel instantiation, one line each:
//   <kernel> <bucket> <threads per block> <dynamic shared memory bytes>
// for tests/cuda_gates.py, which holds the ptxas report of each kernel against it.
#include <cstdio>

#include "src/cuda/layout.hpp"

int main() {
  using namespace flashattn::cuda;
  int bucket = 0;
  for (const ForwardTile& t : kForwardTiles) std::printf("forward_kernel %d %d %d\n", bucket++, t.threads(), t.smem_bytes());
  bucket = 0;
  for (const BackwardTile& t : kBackwardTiles) std::printf("backward_kernel %d %d %d\n", bucket++, t.threads(), t.smem_bytes());
  return 0;
}
