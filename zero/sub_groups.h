// Sub-groups: the pieces of a rank's owned range that the optimizer steps one at a time, and
// where each one's master weights and optimizer state live (DeepSpeed's sub_group_size and
// offload_optimizer.ratio). Pure functions of the layout, tested for every case in one process.
#pragma once
#include <cstdint>
#include <vector>

namespace zeroshard {

// Where a sub-group's master weights and optimizer state live: on the parameters' device (the
// update runs there), in host memory (offload_optimizer.device "cpu"), or in a file on NVMe
// ("nvme": read into a host buffer for the update, which runs on the host, and written back).
enum class Residency { device, host, nvme };

const char* residency_name(Residency r);

struct SubGroup {
  int64_t begin = 0;   // in the owned range
  int64_t numel = 0;
  Residency residency = Residency::device;
};

// Splits each group's owned range [0, owned_numels[g]) into sub-groups of whole tensor pieces:
// `piece_begins[g]` are where the owned pieces of the group's tensors start (ascending). A
// sub-group closes before the piece that would take it past `sub_group_size` elements (a piece
// larger than that is a sub-group alone); padding after a piece stays with it. Then, as
// DeepSpeed's partial offload does, the last sub-groups over all groups in order are offloaded
// (residency `offloaded`: host or nvme): all but the first int((1 - host_ratio) * count). An
// empty owned range has none.
std::vector<std::vector<SubGroup>> plan_sub_groups(const std::vector<std::vector<int64_t>>& piece_begins,
                                                   const std::vector<int64_t>& owned_numels,
                                                   int64_t sub_group_size, double host_ratio,
                                                   Residency offloaded = Residency::host);

// Where `sub_groups` (one group's, from plan_sub_groups) change residency: the device-resident
// ones come first, so a group is [0, split) on the device and [split, numel) offloaded.
int64_t host_split(const std::vector<SubGroup>& sub_groups, int64_t owned_numel);

}  // namespace zeroshard
