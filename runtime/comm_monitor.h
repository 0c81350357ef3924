// Watches one communicator's collectives so that none hangs silently: records each in a flight
// recorder, publishes "rank r is starting #seq <description>" to the process group's store, checks
// in debug mode that every rank issues the same collective, and on a failure or timeout gathers
// every rank's state from the store into one error.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <cstdint>
#include <optional>
#include <string>

#include "runtime/flight_recorder.h"
#include "runtime/wait_watcher.h"

namespace zeroshard {

enum class CommFailure {
  timeout,  // did not finish within the timeout
  backend,  // the backend reported an error (a peer died, sizes differ, its own timeout)
  aborted,  // another rank failed and asked everyone to stop
};

class CommMonitor {
 public:
  // store may be null: errors then name only this rank. check_agreement: nullopt reads
  // ZEROSHARD_DEBUG_COLLECTIVES from the environment.
  CommMonitor(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
              std::chrono::milliseconds timeout, std::optional<bool> check_agreement);
  ~CommMonitor();
  CommMonitor(const CommMonitor&) = delete;
  CommMonitor& operator=(const CommMonitor&) = delete;

  int rank() const { return rank_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool has_store() const { return static_cast<bool>(store_); }
  bool checks_agreement() const { return check_agreement_; }
  const FlightRecorder& recorder() const { return recorder_; }

  // Called before a collective is handed to the backend. Records and publishes it (one store
  // set); in debug mode, for collectives over the whole group (not send/recv), waits until every
  // rank has published its next collective and throws CommError naming them all if they differ.
  void starting(uint64_t seq, const std::string& description, bool whole_group);
  void finished(uint64_t seq) { recorder_.finished(seq, true); }

  // One store look-up: has another rank failed? Polled while a collective is in flight. A
  // monitor without a store asks its abort source (set_abort_source), when it has one.
  bool abort_requested();
  // Whether abort_requested() can ever be true: a store, or an abort source.
  bool can_poll_abort() const { return store_ || abort_source_; }
  // A sub-group's communicator, which has no store, learns of a failure through the world's:
  // its blocked collectives end when `source` (the world communicator's monitor) sees an abort.
  void set_abort_source(std::shared_ptr<CommMonitor> source) { abort_source_ = std::move(source); }
  // While the returned object lives, `work` (a blocking point-to-point wait, which cannot poll)
  // is aborted when another rank fails; null without a store.
  std::unique_ptr<WaitWatcher::Watch> watch_blocking(c10::intrusive_ptr<c10d::Work> work);

  // Reports this rank's failure, waits briefly for the other ranks' reports, and throws one
  // CommError naming every rank's collective. cause: the backend's message, if any.
  [[noreturn]] void fail(uint64_t seq, const std::string& description, CommFailure kind,
                         const std::string& cause);

  // The process is ending in std::terminate (see runtime/fatal_report.h), typically because the
  // backend's own thread threw: reports like fail() for the collective in flight, so the other
  // ranks' errors name this one, and prints the all-rank message to stderr.
  void report_fatal(const std::string& cause);

 private:
  std::string key(const std::string& what, int rank) const;
  // fail()'s work without the throw: publishes this rank's report, gathers the others' and
  // returns the message.
  std::string failure_message(uint64_t seq, const std::string& description, CommFailure kind,
                              const std::string& cause);
  void check_agreement(uint64_t seq, const std::string& description);
  // Waits until the store holds every key, polling for an abort; false on timeout.
  bool wait_for_keys(const std::vector<std::string>& keys, std::chrono::milliseconds limit,
                     bool poll_abort);

  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<CommMonitor> abort_source_;  // without a store: whose aborts end this one's waits
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  bool check_agreement_;
  std::string prefix_;     // "zeroshard/<comm id>/": the i-th communicator on every rank shares it
  std::string last_key_;   // this rank's "last started" key
  uint64_t checked_ = 0;   // whole-group collectives checked so far (debug mode)
  FlightRecorder recorder_;
  int fatal_reporter_ = -1;  // this monitor's entry in the terminate handler's list
  std::atomic<bool> read_counted_{false};  // this rank is counted among the reports' readers
  std::mutex watcher_mutex_;
  std::unique_ptr<WaitWatcher> watcher_;  // made at the first blocking point-to-point wait
};

}  // namespace zeroshard
