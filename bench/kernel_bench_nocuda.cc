// kernel_bench in builds without CUDA (--config=nocuda): there is nothing to time.
#include <cstdio>

int main() {
  std::fprintf(stderr, "kernel_bench: built without CUDA (--config=nocuda); build with CUDA\n");
  return 1;
}
