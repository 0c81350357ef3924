// See comm_monitor.h. Store traffic per collective: one set of "<seq>\n<description>" (TCPStore's
// set is a single send with no reply: about 2 us on loopback, measured). Everything else here runs
// only in debug mode or after something already went wrong.
#include "runtime/comm_monitor.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "runtime/collective_report.h"
#include "runtime/error.h"
#include "runtime/fatal_report.h"

namespace zeroshard {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often a rank blocked on a collective or a store key looks for another rank's abort.
constexpr milliseconds kPollInterval{200};
// How long a failing rank waits for the others' reports (ranks blocked in a collective see the
// abort within kPollInterval), and for the ranks that reported to read before it exits: the
// store lives in one rank's process, usually rank 0's.
constexpr milliseconds kReportGrace{3000};

bool debug_from_env() {
  const char* raw = std::getenv("ZEROSHARD_DEBUG_COLLECTIVES");
  if (raw == nullptr) return false;
  std::string v(raw);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v.empty() || v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw ConfigError(detail::cat("ZEROSHARD_DEBUG_COLLECTIVES: got \"", raw,
                                "\", expected 1 (check every collective) or 0"));
}

std::string seconds_text(milliseconds t) {
  if (t.count() % 1000 == 0) return detail::cat(t.count() / 1000, " s");
  return detail::cat(double(t.count()) / 1000.0, " s");
}

// A backend message's first line, without torch's "Exception raised from ..." trace.
std::string first_line(const std::string& text) {
  std::string line = text.substr(0, text.find('\n'));
  if (line.size() > 400) line = line.substr(0, 400) + "...";
  return line;
}

std::string to_string(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

}  // namespace

CommMonitor::CommMonitor(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                         milliseconds timeout, std::optional<bool> check_agreement)
    : rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      check_agreement_(check_agreement ? *check_agreement : debug_from_env()) {
  if (store) {
    // Our own connection, so our traffic never interleaves with torch's on a shared client.
    try {
      store_ = store->clone();
    } catch (const std::exception&) {
      store_ = store;
    }
    // The i-th communicator built on each rank gets the same id, without exchanging a message.
    const int64_t id = store_->add(detail::cat("zeroshard/comms/", rank_), 1);
    prefix_ = detail::cat("zeroshard/", id, "/");
    last_key_ = key("last", rank_);
  }
  if (check_agreement_ && !store_) {
    throw ConfigError(
        "ZEROSHARD_DEBUG_COLLECTIVES=1: the agreement check exchanges each rank's next collective "
        "through the process group's store, and this communicator has none; pass store= to Comm "
        "(the engine passes torch.distributed's default store)");
  }
  fatal_reporter_ = add_fatal_reporter([this](const std::string& cause) { report_fatal(cause); });
}

CommMonitor::~CommMonitor() { remove_fatal_reporter(fatal_reporter_); }

std::string CommMonitor::key(const std::string& what, int rank) const {
  return rank < 0 ? prefix_ + what : detail::cat(prefix_, what, "/", rank);
}

void CommMonitor::starting(uint64_t seq, const std::string& description, bool whole_group) {
  recorder_.started(seq, description);
  if (!store_) return;
  try {
    store_->set(last_key_, encode_status({seq, description}));
  } catch (const std::exception& e) {
    fail(seq, description, CommFailure::backend, detail::cat("store: ", e.what()));
  }
  if (check_agreement_ && whole_group) check_agreement(seq, description);
}

std::unique_ptr<WaitWatcher::Watch> CommMonitor::watch_blocking(c10::intrusive_ptr<c10d::Work> work) {
  if (!store_) return nullptr;
  std::lock_guard<std::mutex> lock(watcher_mutex_);
  if (!watcher_) {
    c10::intrusive_ptr<c10d::Store> own;
    try {
      own = store_->clone();  // the watcher's thread gets a connection of its own
    } catch (const std::exception&) {
      return nullptr;  // no watcher: the wait ends at the peer's end or at the timeout
    }
    watcher_ = std::make_unique<WaitWatcher>(own, key("abort", -1), kPollInterval);
  }
  return watcher_->watch(std::move(work));
}

bool CommMonitor::abort_requested() {
  if (!store_) return abort_source_ && abort_source_->abort_requested();
  try {
    return store_->check({key("abort", -1)});
  } catch (const std::exception&) {
    return false;  // the store is gone; the collective's own timeout still ends the wait
  }
}

bool CommMonitor::wait_for_keys(const std::vector<std::string>& keys, milliseconds limit,
                                bool poll_abort) {
  const auto deadline = Clock::now() + limit;
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    const milliseconds slice = poll_abort ? std::min(left, kPollInterval) : left;
    const auto start = Clock::now();
    try {
      store_->wait(keys, slice);
      return true;
    } catch (const std::exception&) {
      // A store that is gone fails at once; a missing key fails after the slice.
      if (Clock::now() - start < slice / 2) throw;
    }
    if (poll_abort && abort_requested()) return false;
  }
}

void CommMonitor::check_agreement(uint64_t seq, const std::string& description) {
  const uint64_t n = ++checked_;
  const std::string sig = detail::cat("sig/", n);
  std::vector<std::string> keys;
  for (int r = 0; r < world_size_; ++r) keys.push_back(key(sig, r));
  std::vector<CollectiveStatus> per_rank(world_size_);
  try {
    store_->set(keys[rank_], encode_status({seq, description}));
    if (!wait_for_keys(keys, timeout_, true)) {
      fail(seq, description, abort_requested() ? CommFailure::aborted : CommFailure::timeout,
           "waiting for every rank to announce its next collective (ZEROSHARD_DEBUG_COLLECTIVES)");
    }
    for (int r = 0; r < world_size_; ++r) {
      per_rank[r] = decode_status(to_string(store_->get(keys[r]))).value_or(CollectiveStatus{});
    }
    // Every rank announced #n, so every rank has read #n-1's keys: this rank's can go.
    if (n > 1) store_->deleteKey(key(detail::cat("sig/", n - 1), rank_));
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    fail(seq, description, CommFailure::backend, detail::cat("store: ", e.what()));
  }
  const std::string mismatch = find_mismatch(per_rank, seq);
  if (!mismatch.empty()) {
    recorder_.finished(seq, false);
    throw CommError(detail::cat(mismatch, " (seen by rank ", rank_, "; its recent collectives: ",
                                recorder_.summary(), ")"));
  }
}

void CommMonitor::fail(uint64_t seq, const std::string& description, CommFailure kind,
                       const std::string& cause) {
  throw CommError(failure_message(seq, description, kind, cause));
}

void CommMonitor::report_fatal(const std::string& cause) {
  std::optional<FlightRecorder::Entry> current;
  // The oldest in flight: the backend runs a group's collectives in the order they were issued.
  for (const auto& e : recorder_.recent()) {
    if (e.state == FlightRecorder::State::in_flight) {
      current = e;
      break;
    }
  }
  if (!current) return;  // not this communicator's collective
  const std::string message = failure_message(
      current->seq, current->description, CommFailure::backend,
      "the backend ended this process from its own thread: " + first_line(cause));
  std::fprintf(stderr,
               "[zeroshard] rank %d: fatal: %s Ranks that issue different collectives, or the "
               "same one with different sizes, fail this way; ZEROSHARD_DEBUG_COLLECTIVES=1 "
               "names the first difference.\n",
               rank_, message.c_str());
}

std::string CommMonitor::failure_message(uint64_t seq, const std::string& description,
                                         CommFailure kind, const std::string& cause) {
  // The backend's thread is ending this process and reporting for it (report_fatal): wait for
  // the abort rather than return an error that the process may not live to act on.
  while (another_thread_is_terminating()) std::this_thread::sleep_for(milliseconds(100));
  recorder_.finished(seq, false);
  const std::string where = detail::cat(" on rank ", rank_, " in #", seq, " ", description);
  std::string headline;
  switch (kind) {
    case CommFailure::timeout: headline = detail::cat("collective timeout after ", seconds_text(timeout_), where); break;
    case CommFailure::backend: headline = "collective failed" + where; break;
    case CommFailure::aborted: headline = "collective aborted" + where; break;
  }
  std::string ranks_text;
  if (!store_) {
    ranks_text = detail::cat("rank ", rank_, " is in #", seq, " ", description,
                             " (the other ranks are unknown: this communicator has no store)");
    if (kind == CommFailure::aborted) headline += " because a rank failed (the world communicator's store says so)";
  } else {
    std::vector<PeerState> peers(world_size_);
    try {
      store_->set(key("report", rank_), encode_status({seq, description}));
      const std::string abort_key = key("abort", -1);
      if (kind != CommFailure::aborted) {
        store_->compareSet(abort_key, "", std::to_string(rank_));  // the first failing rank wins
      } else if (store_->check({abort_key})) {
        headline += detail::cat(" because rank ", to_string(store_->get(abort_key)), " failed");
      }
      std::vector<std::string> reports;
      for (int r = 0; r < world_size_; ++r) reports.push_back(key("report", r));
      wait_for_keys(reports, kReportGrace, false);
      int reported = 0;
      for (int r = 0; r < world_size_; ++r) {
        PeerState& p = peers[r];
        std::optional<CollectiveStatus> s;
        if (store_->check({reports[r]})) {
          s = decode_status(to_string(store_->get(reports[r])));
          p.source = PeerState::Source::reported;
          ++reported;
        } else if (store_->check({key("last", r)})) {
          s = decode_status(to_string(store_->get(key("last", r))));
          p.source = PeerState::Source::last_started;
        }
        if (s) p.status = *s;
        else p.source = PeerState::Source::none;
      }
      ranks_text = format_peer_states(peers);
      // Keep the store (and so this process) alive until every rank that reported has read.
      // This may run more than once per monitor (the pipeline engine reports a stage's error
      // after the communicator's own), and a rank counts once: counted twice, it would let the
      // store's rank end before another rank had read.
      const std::string read_key = key("read", -1);
      if (!read_counted_.exchange(true)) store_->add(read_key, 1);
      const auto deadline = Clock::now() + kReportGrace;
      while (store_->add(read_key, 0) < reported && Clock::now() < deadline) {
        std::this_thread::sleep_for(milliseconds(20));
      }
    } catch (const std::exception& e) {
      if (ranks_text.empty()) ranks_text = format_peer_states(peers);
      ranks_text += detail::cat(" (store unreachable: ", first_line(e.what()), ")");
    }
  }
  std::string message = detail::cat(headline, ": ", ranks_text, ". Recent on rank ", rank_, ": ",
                                    recorder_.summary(), ".");
  if (!cause.empty()) message += " Cause: " + first_line(cause);
  return message;
}

}  // namespace zeroshard
