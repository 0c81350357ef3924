// See collective_report.h.
#include "runtime/collective_report.h"

#include <algorithm>
#include <charconv>

#include "runtime/error.h"

namespace zeroshard {

std::string encode_status(const CollectiveStatus& status) {
  return detail::cat(status.seq, "\n", status.description);
}

std::optional<CollectiveStatus> decode_status(const std::string& text) {
  const auto nl = text.find('\n');
  if (nl == std::string::npos || nl == 0) return std::nullopt;
  CollectiveStatus s;
  const char* end = text.data() + nl;
  auto [ptr, ec] = std::from_chars(text.data(), end, s.seq);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  s.description = text.substr(nl + 1);
  return s;
}

std::string format_rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) out += detail::cat("-", ranks[j]);
    i = j + 1;
  }
  return out;
}

namespace {

// Groups ranks by a key (first-seen order) so a large world reads as a few lines.
template <typename T>
std::vector<std::pair<T, std::vector<int>>> group_ranks(const std::vector<T>& per_rank) {
  std::vector<std::pair<T, std::vector<int>>> groups;
  for (int r = 0; r < int(per_rank.size()); ++r) {
    auto it = groups.begin();
    for (; it != groups.end(); ++it) {
      if (it->first == per_rank[r]) break;
    }
    if (it == groups.end()) {
      groups.push_back({per_rank[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  return groups;
}

std::string ranks_word(const std::vector<int>& ranks) {
  return detail::cat(ranks.size() == 1 ? "rank " : "ranks ", format_rank_list(ranks));
}

struct PeerKey {
  PeerState::Source source;
  CollectiveStatus status;
  bool operator==(const PeerKey& o) const {
    return source == o.source && (source == PeerState::Source::none || status == o.status);
  }
};

}  // namespace

std::string format_peer_states(const std::vector<PeerState>& peers) {
  std::vector<PeerKey> keys;
  keys.reserve(peers.size());
  for (const PeerState& p : peers) keys.push_back({p.source, p.status});
  std::string out;
  for (const auto& [key, ranks] : group_ranks(keys)) {
    if (!out.empty()) out += "; ";
    const bool one = ranks.size() == 1;
    switch (key.source) {
      case PeerState::Source::reported:
        out += detail::cat(ranks_word(ranks), one ? " is in #" : " are in #", key.status.seq, " ",
                           key.status.description);
        break;
      case PeerState::Source::last_started:
        out += detail::cat(ranks_word(ranks), " last started #", key.status.seq, " ",
                           key.status.description, " (no report: dead?)");
        break;
      case PeerState::Source::none:
        out += detail::cat(ranks_word(ranks), ": no report (dead?)");
        break;
    }
  }
  return out;
}

std::string find_mismatch(const std::vector<CollectiveStatus>& per_rank, uint64_t local_seq) {
  std::vector<std::string> descriptions;
  bool same_seq = true;
  for (const CollectiveStatus& s : per_rank) {
    descriptions.push_back(s.description);
    same_seq = same_seq && s.seq == per_rank.front().seq;
  }
  const auto groups = group_ranks(descriptions);
  if (groups.size() <= 1) return {};
  std::string out = detail::cat("collective mismatch at #", local_seq, ": ");
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ranks = groups[g].second;
    if (g > 0) out += ", ";
    out += ranks_word(ranks) + " ";
    // Sequence numbers can differ inside a group too; name them only when they differ at all.
    if (!same_seq) {
      std::vector<uint64_t> seqs;
      for (int r : ranks) seqs.push_back(per_rank[r].seq);
      const bool one_seq = std::equal(seqs.begin() + 1, seqs.end(), seqs.begin());
      out += one_seq ? detail::cat("#", seqs.front(), " ") : std::string("#(various) ");
    }
    out += groups[g].first;
  }
  return out;
}

}  // namespace zeroshard
