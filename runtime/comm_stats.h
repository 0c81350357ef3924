// The comms logger (DeepSpeed's comms_logger block): per collective kind and message size, how
// many ran, how long each took from issue to completion, and the bandwidth that gives. Comm feeds
// it as each collective's wait() sees it finish; zeroshard/observe/comms.py prints the table.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

struct CommLoggerOptions {
  bool enabled = false;
  bool verbose = false;               // one line per collective as it finishes (rank 0)
  bool prof_all = true;               // every kind; false: only prof_ops
  bool debug = false;                 // rows keyed by what the collective moved, not just its kind
  std::vector<std::string> prof_ops;  // kinds to log when prof_all is false ("all_reduce", ...)
};

struct CommStatsRow {
  std::string op;          // "all_reduce", ...; with debug, "all_reduce(gradient bucket 3)"
  int64_t bytes = 0;       // the message: the whole buffer (all_gather's output, reduce_scatter's input)
  int world_size = 1;
  int64_t count = 0;
  double total_ms = 0, min_ms = 0, max_ms = 0;
  // nccl-tests' definitions, in Gbit/s: algbw = bytes / time; busbw scales it by what each
  // link carries (all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, others 1).
  double algbw_gbps() const;
  double busbw_gbps() const;
};

class CommStats {
 public:
  static CommStats& global();  // one per process, as the collectives it counts

  void configure(CommLoggerOptions options, int rank);
  const CommLoggerOptions& options() const { return options_; }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }  // read on every collective
  // op: the kind; what: the caller's description (rows by it with debug).
  void record(const std::string& op, const std::string& what, int64_t bytes, int world_size,
              double latency_ms);
  std::vector<CommStatsRow> rows() const;  // by kind, then message size
  void reset();

 private:
  mutable std::mutex mutex_;
  CommLoggerOptions options_;
  std::atomic<bool> enabled_{false};  // options_.enabled, readable without the lock
  int rank_ = 0;
  std::map<std::pair<std::string, int64_t>, CommStatsRow> rows_;
};

}  // namespace zeroshard
