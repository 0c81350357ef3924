// One parameter group's storage, flattened into contiguous buffers: the model-dtype parameters
// (the module's parameters become views into it, or at stage 3 this rank's chunks of them) and the
// gradients (param.grad become views too). The owned range's fp32 master values and optimizer
// state are the group's OptimizerShard (optimizer_shard.h). Stage strategies decide which range a
// rank owns.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/memory.h"
#include "runtime/shard.h"

namespace zeroshard {

// A tensor's full shape when the caller passes only this rank's ZeRO-3 chunk of it (built under
// zero.Init); nullopt when the tensor is whole.
using ChunkedShape = std::optional<std::vector<int64_t>>;

// How a group is laid out and what each rank keeps; the stage strategy decides.
struct GroupSpec {
  at::ScalarType model_dtype = at::kFloat;
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t alignment_numel = kAlignmentNumel;
  bool shard_state = false;       // stages 1-3: master weights and optimizer state are sharded
  bool full_grads = true;         // stages 0-1: full flat gradients; else only the owned shard
  bool partition_params = false;  // stage 3: only this rank's chunks of each parameter are kept
  // false: frozen parameters (stage 3 partitions them too): chunks only, no gradients (and no
  // optimizer shard).
  bool trainable = true;
  // Stage 3 with offload_param: the chunks live in host memory (pinned with pin_host) and are
  // copied to the device by each gather.
  bool params_on_host = false;
  bool pin_host = false;
  // offload_param.device "nvme" (with params_on_host): the chunks' host memory is reserved, not
  // committed; ParamSwap (param_swap.h) brings chunks in from disk, gives their pages back with
  // drop_param_pages() and accounts what is resident, so this group accounts no parameters.
  bool params_on_nvme = false;
  // zero.Init: empty, or one entry per tensor: the full shape of a tensor passed in as this
  // rank's chunk, nullopt for one passed whole (created outside zero.Init).
  std::vector<ChunkedShape> prechunked_shapes;
};

class FlatGroup {
 public:
  // `params` are the group's tensors (trainable ones in fp32, frozen ones in any floating dtype);
  // the buffers are created in spec.model_dtype on the params' device. `owned()` is the range of the buffer whose optimizer state lives on this rank: a
  // slice of the padded flat buffer (stages 0-2), or this rank's whole chunk shard (stage 3, see
  // ChunkLayout).
  FlatGroup(const std::vector<at::Tensor>& params, const GroupSpec& spec, MemoryAccount& memory);
  ~FlatGroup();
  FlatGroup(const FlatGroup&) = delete;
  FlatGroup& operator=(const FlatGroup&) = delete;

  const FlatLayout& layout() const { return layout_; }
  bool partitioned() const { return partitioned_; }
  bool trainable() const { return trainable_; }
  const ChunkLayout& chunk_layout() const { return chunks_; }
  int64_t num_tensors() const { return int64_t(shapes_.size()); }
  const std::vector<int64_t>& shape(int64_t i) const { return shapes_[size_t(i)]; }
  ShardRange owned() const { return owned_; }
  at::Tensor params() const { return params_; }
  // The parameters of the owned range (a slice at stages 0-2, the whole chunk shard at stage 3).
  at::Tensor owned_params() const { return params_.narrow(0, owned_.begin, owned_.numel()); }
  // The full flat gradient buffer (full_grads), or the owned shard's gradients (stage 2).
  at::Tensor grads() const { return grads_; }
  bool full_grads() const { return full_grads_; }
  // Gradients of the owned range as one tensor (stages 0-2).
  at::Tensor owned_grads() const;
  // The device the model computes on, in the model dtype (where gathered parameters and
  // gradients live, whatever params_on_host says about the chunks).
  at::TensorOptions device_options() const { return device_options_; }
  bool params_on_host() const { return params_on_host_; }
  bool params_on_nvme() const { return params_on_nvme_; }
  // params_on_nvme: the pages of the chunk store that lie wholly in [begin, begin + numel) go
  // back to the system (they read as zeros until written again).
  void drop_param_pages(int64_t begin, int64_t numel);

  // Stage 3 keeps the owned gradients in segments that tile the shard (the gradient buckets'
  // ranges), each allocated when backward first writes it and freed by zero_grads(): the shard
  // grows during backward and is gone between steps, as FSDP2's gradients are after
  // zero_grad(set_to_none=True), instead of being held from set-up. Until a reducer sets the
  // segments (offsets into the owned range, the first 0), the whole shard is one segment.
  void segment_grads(std::vector<int64_t> segment_begins);
  // The segment that starts at `begin` and has `numel` elements, allocated on first use:
  // zero-filled when `zeroed`, else left for the caller to overwrite entirely.
  at::Tensor grad_segment(int64_t begin, int64_t numel, bool zeroed);
  // Whether the segment that starts at `begin` holds gradients written since zero_grads().
  bool holds_grad_segment(int64_t begin) const;
  // The owned gradients as (offset in the owned range, tensor) pieces that tile it: one piece
  // for stages 0-2, every segment for stage 3 (zero-filled where backward wrote none).
  std::vector<std::pair<int64_t, at::Tensor>> grad_pieces();
  // Gradients start again from zero: stage 3 frees its segments, the others zero their buffer.
  void zero_grads();
  // Views of the flat buffers shaped like the original tensors, for param.data / param.grad
  // (grad views only with full_grads).
  std::vector<at::Tensor> param_views() const;
  std::vector<at::Tensor> grad_views() const;
  // Takes tensor i's full values (edited by the user) into the parameters, whole (stages 0-2) or
  // this rank's chunk (stage 3). The owner of the group's OptimizerShard updates its master too.
  void write_tensor(int64_t i, const at::Tensor& full);
  // The elements of tensor i that this rank owns, with buffer_begin relative to the owned range:
  // where its flat range meets the owned slice (stages 0-2), or its chunk (stage 3); nullopt
  // when it owns none.
  std::optional<Intersection> owned_piece(int64_t i) const;
  // The owned gradients [begin, begin + numel) as a view: a slice (stages 0-2), or the part of
  // the stage-3 segment that holds them, which backward has written (checked).
  at::Tensor owned_grad_view(int64_t begin, int64_t numel) const;
  // Copies the owned range's gradients [begin, begin + numel) into `out`: zeros where stage 3
  // holds no segment, which this does not allocate.
  void copy_owned_grads(int64_t begin, int64_t numel, at::Tensor out) const;

 private:
  std::vector<at::Tensor> views(const at::Tensor& flat) const;
  MemoryCategory params_category() const;
  // Index of the segment that starts at `begin` and has `numel` elements (checked).
  size_t segment_index(int64_t begin, int64_t numel) const;
  int64_t segment_end(size_t i) const;

  FlatLayout layout_;
  ChunkLayout chunks_;
  std::vector<std::vector<int64_t>> shapes_;
  ShardRange owned_;
  int64_t rank_;
  bool full_grads_;
  bool partitioned_;
  bool trainable_;
  bool params_on_host_;
  bool params_on_nvme_;
  at::Tensor params_;
  at::Tensor grads_;                      // stages 0-2
  at::TensorOptions device_options_;
  std::vector<int64_t> segment_begins_;   // stage 3
  std::vector<at::Tensor> segments_;
  MemoryAccount& memory_;
  int64_t accounted_[2] = {0, 0};  // parameters, gradients
};

}  // namespace zeroshard
