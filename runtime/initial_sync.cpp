// Rank 0's values everywhere at start; see initial_sync.h.
#include "runtime/initial_sync.h"

#include <ATen/ATen.h>

#include "runtime/error.h"

namespace zeroshard {

void broadcast_from_rank0(Comm& comm, const std::vector<at::Tensor>& tensors,
                          const std::vector<std::string>& names, const std::string& label,
                          int64_t bucket_numel) {
  ZS_CHECK(names.empty() || names.size() == tensors.size(), "broadcast_from_rank0: ", names.size(),
           " names for ", tensors.size(), " tensors");
  if (comm.world_size() == 1) return;
  size_t first = 0;
  int64_t bucket = 0;
  while (first < tensors.size()) {
    size_t end = first;
    int64_t numel = 0;
    while (end < tensors.size() &&
           (end == first || (tensors[end].scalar_type() == tensors[first].scalar_type() &&
                             numel + tensors[end].numel() <= bucket_numel))) {
      numel += tensors[end++].numel();
    }
    // A named tensor alone is reported by its name ("initial wte.weight").
    const std::string what =
        names.empty() ? detail::cat(label, ", bucket ", bucket)
        : end == first + 1 ? detail::cat(label, " ", names[first])
                           : detail::cat(label, ", bucket ", bucket, " (first: ", names[first], ")");
    ++bucket;
    if (end == first + 1 && tensors[first].is_contiguous()) {
      comm.broadcast(tensors[first], 0, what).wait();
    } else {
      std::vector<at::Tensor> pieces;
      for (size_t i = first; i < end; ++i) pieces.push_back(tensors[i].reshape(-1));
      at::Tensor flat = at::cat(pieces);
      comm.broadcast(flat, 0, what).wait();
      int64_t offset = 0;
      for (size_t i = first; i < end; ++i) {
        at::Tensor t = tensors[i];
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
    first = end;
  }
}

}  // namespace zeroshard
