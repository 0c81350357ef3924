// See comm_stats.h.
#include "runtime/comm_stats.h"

#include <algorithm>
#include <cstdio>

#include "runtime/log.h"
#include "runtime/memory.h"

namespace zeroshard {

namespace {

double bus_factor(const std::string& op, int n) {
  if (n <= 1) return 1.0;
  // A row keyed by "op(what)" (debug) keeps the kind's factor.
  const std::string kind = op.substr(0, op.find('('));
  if (kind == "all_reduce" || kind == "all_reduce_max") return 2.0 * (n - 1) / n;
  if (kind == "all_gather" || kind == "reduce_scatter") return double(n - 1) / n;
  return 1.0;
}

}  // namespace

double CommStatsRow::algbw_gbps() const {
  return total_ms > 0 ? double(bytes) * double(count) * 8.0 / (total_ms * 1e6) : 0.0;
}

double CommStatsRow::busbw_gbps() const { return algbw_gbps() * bus_factor(op, world_size); }

CommStats& CommStats::global() {
  static CommStats* stats = new CommStats();  // never destroyed: collectives may finish at exit
  return *stats;
}

void CommStats::configure(CommLoggerOptions options, int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  options_ = std::move(options);
  enabled_.store(options_.enabled, std::memory_order_relaxed);
  rank_ = rank;
}

void CommStats::record(const std::string& op, const std::string& what, int64_t bytes,
                       int world_size, double latency_ms) {
  char line[256] = "";  // the verbose line, logged once the lock is let go (the sink takes the GIL)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!options_.enabled) return;
    if (!options_.prof_all &&
        std::find(options_.prof_ops.begin(), options_.prof_ops.end(), op) == options_.prof_ops.end())
      return;
    const std::string key = options_.debug ? op + "(" + what + ")" : op;
    CommStatsRow& row = rows_[{key, bytes}];
    if (row.count == 0) {
      row.op = key;
      row.bytes = bytes;
      row.world_size = world_size;
      row.min_ms = latency_ms;
      row.max_ms = latency_ms;
    }
    row.count += 1;
    row.total_ms += latency_ms;
    row.min_ms = std::min(row.min_ms, latency_ms);
    row.max_ms = std::max(row.max_ms, latency_ms);
    if (options_.verbose && rank_ == 0) {
      CommStatsRow one = row;
      one.count = 1;
      one.total_ms = latency_ms;
      std::snprintf(line, sizeof line, "comm op: %s | time (ms): %.3f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                    key.c_str(), latency_ms, format_bytes(bytes).c_str(), one.algbw_gbps(),
                    one.busbw_gbps());
    }
  }
  if (line[0] != '\0') info(line);
}

std::vector<CommStatsRow> CommStats::rows() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CommStatsRow> out;
  for (const auto& entry : rows_) out.push_back(entry.second);
  return out;
}

void CommStats::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  rows_.clear();
}

}  // namespace zeroshard
