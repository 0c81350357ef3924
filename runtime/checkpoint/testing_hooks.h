// Test-only knobs of the checkpoint storage layer, so tests can reach the paths a real disk
// reaches rarely: a crash between two renames, ENOSPC during a write rather than at reservation.
// Process-global and off by default; nothing outside tests/ sets them.
#pragma once
#include <functional>
#include <string>

namespace zeroshard::checkpoint::testing {

struct Hooks {
  // OutputFile skips its fallocate reservation, so a full disk shows at write() instead.
  bool skip_reserve = false;
  // commit() replaces an existing tag by move-aside + rename, as on a filesystem without
  // renameat2(RENAME_EXCHANGE).
  bool no_rename_exchange = false;
  // Called with the name of each step of a commit (see atomic_dir.h), e.g. to _exit() there.
  std::function<void(const std::string& point)> at_point;
};

Hooks& hooks();
// Calls hooks().at_point(point) when one is set.
void reached(const std::string& point);

}  // namespace zeroshard::checkpoint::testing
