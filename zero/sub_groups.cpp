// Sub-group planning; see sub_groups.h.
#include "zero/sub_groups.h"

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

const char* residency_name(Residency r) {
  return r == Residency::host ? "host" : r == Residency::nvme ? "nvme" : "device";
}

std::vector<std::vector<SubGroup>> plan_sub_groups(const std::vector<std::vector<int64_t>>& piece_begins,
                                                   const std::vector<int64_t>& owned_numels,
                                                   int64_t sub_group_size, double host_ratio,
                                                   Residency offloaded) {
  ZS_CHECK(piece_begins.size() == owned_numels.size(), "plan_sub_groups: ", piece_begins.size(),
           " piece lists for ", owned_numels.size(), " groups");
  ZS_CHECK(host_ratio >= 0.0 && host_ratio <= 1.0, "plan_sub_groups: host_ratio ", host_ratio);
  // sub_group_size 0 would make every piece its own sub-group, which is what 1 does too.
  const int64_t limit = std::max<int64_t>(sub_group_size, 1);
  std::vector<std::vector<SubGroup>> out(owned_numels.size());
  int64_t count = 0;
  for (size_t g = 0; g < owned_numels.size(); ++g) {
    const int64_t numel = owned_numels[g];
    if (numel == 0) continue;
    // Cut points: the owned range's start, then each piece start that would overfill.
    std::vector<int64_t> starts{0};
    const auto& begins = piece_begins[g];
    for (size_t i = 0; i < begins.size(); ++i) {
      ZS_CHECK(begins[i] >= 0 && begins[i] < numel && (i == 0 || begins[i] > begins[i - 1]),
               "plan_sub_groups: piece starts must ascend within the owned range");
      // The piece that starts here ends at the next start (or the range's end): a sub-group
      // that holds something already closes rather than grow past the limit with it.
      const int64_t end = i + 1 < begins.size() ? begins[i + 1] : numel;
      if (begins[i] > starts.back() && end - starts.back() > limit) starts.push_back(begins[i]);
    }
    for (size_t s = 0; s < starts.size(); ++s) {
      const int64_t end = s + 1 < starts.size() ? starts[s + 1] : numel;
      out[g].push_back({starts[s], end - starts[s], Residency::device});
    }
    count += int64_t(out[g].size());
  }
  // DeepSpeed's rule: sub-group i is offloaded when i >= int((1 - ratio) * count).
  const int64_t first_host = int64_t((1.0 - host_ratio) * double(count));
  int64_t i = 0;
  for (auto& group : out) {
    for (auto& sg : group) sg.residency = i++ >= first_host ? offloaded : Residency::device;
  }
  return out;
}

int64_t host_split(const std::vector<SubGroup>& sub_groups, int64_t owned_numel) {
  for (const SubGroup& sg : sub_groups) {
    if (sg.residency != Residency::device) return sg.begin;
  }
  return owned_numel;
}

}  // namespace zeroshard
