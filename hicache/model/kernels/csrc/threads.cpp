// Which threads the library's parallel regions run on (hicache/model/kernels/native.py builds this file
// beside qgemm.cpp and attention.cpp). at::parallel_for is a header template whose OpenMP pragma is
// compiled into each caller: a library built without -fopenmp runs every region on the calling thread
// alone, silently (both kernels did until the flag was added). Tests ask this op instead of timing.
//
//   parallel_threads(units) -> the number of distinct threads that ran one of `units` units of work
//                              split by at::parallel_for with a grain of one unit

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

int64_t parallel_threads(int64_t units) {
  std::vector<int64_t> ran_by(std::max<int64_t>(units, 0), -1);
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) ran_by[u] = at::get_thread_num();
  });
  std::sort(ran_by.begin(), ran_by.end());
  return std::unique(ran_by.begin(), ran_by.end()) - ran_by.begin();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(HICACHE_QGEMM_LIBRARY, m) { m.def("parallel_threads(int units) -> int", &parallel_threads); }
