// The pure half of "no silent hangs": the text a rank publishes about the collective it is in, and
// the messages that name every rank's collective on a timeout, a failure or a mismatch.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// What one rank says about a collective: its per-rank sequence number and description
// ("all_reduce(gradient bucket 3, 1024 x Float, 4096 B)").
struct CollectiveStatus {
  uint64_t seq = 0;
  std::string description;
  bool operator==(const CollectiveStatus& o) const { return seq == o.seq && description == o.description; }
};

// "<seq>\n<description>"; decode returns nullopt for text that is not in that form.
std::string encode_status(const CollectiveStatus& status);
std::optional<CollectiveStatus> decode_status(const std::string& text);

// What a failing rank learned about one rank from the store.
struct PeerState {
  enum class Source {
    reported,      // the rank failed too and reported the collective it is in
    last_started,  // no failure report (dead, or busy elsewhere): the last collective it started
    none,          // nothing published at all
  };
  Source source = Source::none;
  CollectiveStatus status;
};

// "rank 0 is in #57 all_reduce(...); rank 1 last started #56 all_gather(...) (no report: dead?);
// rank 2: no report (dead?)". Ranks in the same state are grouped ("ranks 0-2,5 are in #57 ...").
std::string format_peer_states(const std::vector<PeerState>& peers);

// Agreement check: every rank must be issuing the same collective. Empty when they agree, else
// "collective mismatch at #12: rank 0 all_reduce(gradient bucket 3, ...), rank 1 all_reduce(...)"
// (each rank's own #seq is shown where the ranks' sequence numbers differ).
std::string find_mismatch(const std::vector<CollectiveStatus>& per_rank, uint64_t local_seq);

// "0-3,5,7-8" for sorted distinct ranks.
std::string format_rank_list(const std::vector<int>& ranks);

}  // namespace zeroshard
