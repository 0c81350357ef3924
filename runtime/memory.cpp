// Model-state byte accounting; see memory.h.
#include "runtime/memory.h"

#include "runtime/trace.h"

#include <algorithm>
#include <cstdio>

#include "runtime/error.h"

namespace zeroshard {

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters: return "parameters";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::master_weights: return "master_weights";
    case MemoryCategory::optimizer_state: return "optimizer_state";
    case MemoryCategory::gathered_parameters: return "gathered_parameters";
    case MemoryCategory::comm_buffers: return "comm_buffers";
    case MemoryCategory::host_parameters: return "host_parameters";
    case MemoryCategory::host_master_weights: return "host_master_weights";
    case MemoryCategory::host_optimizer_state: return "host_optimizer_state";
    case MemoryCategory::host_buffers: return "host_buffers";
    case MemoryCategory::count: break;
  }
  return "unknown";
}

bool on_host(MemoryCategory c) { return c >= MemoryCategory::host_parameters && c < MemoryCategory::count; }

MemoryCategory host_category(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters: return MemoryCategory::host_parameters;
    case MemoryCategory::master_weights: return MemoryCategory::host_master_weights;
    case MemoryCategory::optimizer_state: return MemoryCategory::host_optimizer_state;
    default:
      ZS_CHECK(on_host(c), "host_category: ", memory_category_name(c), " has no host counterpart");
      return c;
  }
}

void MemoryAccount::add(MemoryCategory c, int64_t bytes) {
  ZS_CHECK(bytes >= 0, "MemoryAccount::add: negative bytes ", bytes);
  current_[idx(c)] += bytes;
  peak_[idx(c)] = std::max(peak_[idx(c)], current_[idx(c)]);
  peak_total_ = std::max(peak_total_, total_bytes());
  if (trace::on()) trace_sample();
}

void MemoryAccount::release(MemoryCategory c, int64_t bytes) {
  ZS_CHECK(bytes >= 0 && bytes <= current_[idx(c)], "MemoryAccount::release: releasing ", bytes,
           " bytes of ", memory_category_name(c), " but only ", current_[idx(c)], " are held");
  current_[idx(c)] -= bytes;
  if (trace::on()) trace_sample();
}

void MemoryAccount::trace_sample() const {
  std::string args;
  for (size_t i = 0; i < current_.size(); ++i) {
    args += detail::cat(i ? ", " : "", "\"", memory_category_name(MemoryCategory(i)), "\": ", current_[i]);
  }
  trace::counter("model state bytes", std::move(args));
}

int64_t MemoryAccount::total_bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < current_.size(); ++i) total += on_host(MemoryCategory(i)) ? 0 : current_[i];
  return total;
}

int64_t MemoryAccount::host_total_bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < current_.size(); ++i) total += on_host(MemoryCategory(i)) ? current_[i] : 0;
  return total;
}

void MemoryAccount::reset_peaks() {
  peak_ = current_;
  peak_total_ = total_bytes();
}

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = double(bytes);
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2fGB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.2fMB", b / 1e6);
  else if (b >= 1e3) std::snprintf(buf, sizeof buf, "%.1fKB", b / 1e3);
  else std::snprintf(buf, sizeof buf, "%lldB", static_cast<long long>(bytes));
  return buf;
}

std::string MemoryAccount::summary() const {
  std::string out;
  bool host_started = false;
  for (size_t i = 0; i < size_t(MemoryCategory::count); ++i) {
    // Categories that only some stages use are left out while empty.
    if (current_[i] == 0 && i >= size_t(MemoryCategory::gathered_parameters)) continue;
    if (on_host(MemoryCategory(i)) && !host_started) {
      out += " | host";
      host_started = true;
    }
    if (!out.empty()) out += ' ';
    // After "| host" the host categories drop their prefix: "| host master_weights=...".
    const char* name = memory_category_name(MemoryCategory(i));
    out += on_host(MemoryCategory(i)) ? name + 5 : name;
    out += '=';
    out += format_bytes(current_[i]);
  }
  return out;
}

}  // namespace zeroshard
