// The kernel of blocked_stream.hpp: one thread that spins until the host
// writes the flag.
#include "blocked_stream.hpp"

namespace zero::test {
namespace {

__global__ void spin_kernel(const volatile int* flag) {
  while (*flag == 0) __nanosleep(1000);
}

}  // namespace

void spin_until(const volatile int* flag, cudaStream_t s) {
  spin_kernel<<<1, 1, 0, s>>>(flag);
  ZERO_CUDA_CHECK(cudaGetLastError());
}

}  // namespace zero::test
