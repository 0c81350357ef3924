// The start of a run: every rank takes rank 0's values (as DeepSpeed broadcasts the model at
// start), so replicas and the master copies seeded from them agree everywhere. The one place this
// happens: the engine passes its buffers and frozen parameters, ZeroOptimizer its trainable fp32
// values. zero.Init's chunks took rank 0's values when they were partitioned and are not passed.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "runtime/comm.h"

namespace zeroshard {

// Overwrites each tensor in place with rank 0's values, a bucket of consecutive tensors of one
// dtype at a time (at most `bucket_numel` elements, or one larger tensor): one broadcast per
// bucket, and no flat copy of the whole model, which would raise the set-up peak by its size.
// `label` names the tensors in hang reports: "initial parameters, bucket 3", with `names`
// "initial buffers, bucket 3 (first: wte.weight)", or for a named tensor alone "initial
// wte.weight"; bucket_numel 0 sends every tensor alone. Nothing happens at world size 1.
void broadcast_from_rank0(Comm& comm, const std::vector<at::Tensor>& tensors,
                          const std::vector<std::string>& names, const std::string& label,
                          int64_t bucket_numel = 25000000);

}  // namespace zeroshard
