// The pure text of "no silent hangs": the status codec, rank lists, failure and mismatch messages.
#include <catch2/catch.hpp>

#include "runtime/collective_report.h"

using namespace zeroshard;
using Source = PeerState::Source;

TEST_CASE("a status survives the store's text form") {
  const CollectiveStatus s{57, "all_reduce(gradient bucket 3, 1024 x Float, 4096 B)"};
  CHECK(encode_status(s) == "57\nall_reduce(gradient bucket 3, 1024 x Float, 4096 B)");
  CHECK(decode_status(encode_status(s)) == s);
  CHECK(decode_status("0\n") == CollectiveStatus{0, ""});
  CHECK(decode_status("12\nbarrier(a\nb)") == CollectiveStatus{12, "barrier(a\nb)"});
}

TEST_CASE("malformed status text decodes to nothing") {
  for (const char* bad : {"", "57", "\nall_reduce", "x7\nall_reduce", "-1\nop", "5 \nop"}) {
    INFO(bad);
    CHECK_FALSE(decode_status(bad).has_value());
  }
}

TEST_CASE("rank lists collapse runs") {
  CHECK(format_rank_list({}) == "");
  CHECK(format_rank_list({3}) == "3");
  CHECK(format_rank_list({0, 1}) == "0-1");
  CHECK(format_rank_list({0, 1, 2, 3, 5, 7, 8}) == "0-3,5,7-8");
}

TEST_CASE("the failure text names every rank's collective, dead ones included") {
  std::vector<PeerState> peers(3);
  peers[0] = {Source::reported, {57, "all_reduce(gradient bucket 3, 1024 x Float, 4096 B)"}};
  peers[1] = {Source::last_started, {56, "all_gather(updated parameters, 2048 x Float, 8192 B)"}};
  peers[2] = {Source::none, {}};
  CHECK(format_peer_states(peers) ==
        "rank 0 is in #57 all_reduce(gradient bucket 3, 1024 x Float, 4096 B); "
        "rank 1 last started #56 all_gather(updated parameters, 2048 x Float, 8192 B) (no report: dead?); "
        "rank 2: no report (dead?)");
}

TEST_CASE("ranks in the same state are grouped, in order of first appearance") {
  const CollectiveStatus a{9, "all_reduce(x, 1 x Float, 4 B)"}, b{8, "broadcast(y, root 0, 1 x Float, 4 B)"};
  std::vector<PeerState> peers{{Source::reported, a}, {Source::reported, b}, {Source::reported, a},
                               {Source::reported, a}, {Source::none, {}},     {Source::none, {3, "ignored"}}};
  CHECK(format_peer_states(peers) ==
        "ranks 0,2-3 are in #9 all_reduce(x, 1 x Float, 4 B); rank 1 is in #8 broadcast(y, root 0, 1 x Float, 4 B); "
        "ranks 4-5: no report (dead?)");
}

TEST_CASE("agreeing ranks give no mismatch") {
  const CollectiveStatus s{4, "all_reduce(gradient norm, 1 x Float, 4 B)"};
  CHECK(find_mismatch({s}, 4).empty());
  CHECK(find_mismatch({s, s, s, s}, 4).empty());
}

TEST_CASE("a mismatch names each rank's collective") {
  const std::vector<CollectiveStatus> two{{12, "all_reduce(gradient bucket 3, 1024 x Float, 4096 B)"},
                                          {12, "all_reduce(gradient bucket 2, 512 x Float, 2048 B)"}};
  CHECK(find_mismatch(two, 12) ==
        "collective mismatch at #12: rank 0 all_reduce(gradient bucket 3, 1024 x Float, 4096 B), "
        "rank 1 all_reduce(gradient bucket 2, 512 x Float, 2048 B)");
  const std::vector<CollectiveStatus> four{{7, "a"}, {7, "b"}, {7, "a"}, {7, "a"}};
  CHECK(find_mismatch(four, 7) == "collective mismatch at #7: ranks 0,2-3 a, rank 1 b");
}

TEST_CASE("a mismatch shows sequence numbers where they differ") {
  const std::vector<CollectiveStatus> s{{12, "a"}, {11, "b"}, {12, "a"}};
  CHECK(find_mismatch(s, 12) == "collective mismatch at #12: ranks 0,2 #12 a, rank 1 #11 b");
  const std::vector<CollectiveStatus> t{{12, "a"}, {11, "a"}, {10, "b"}};
  CHECK(find_mismatch(t, 12) == "collective mismatch at #12: ranks 0-1 #(various) a, rank 2 #10 b");
}
