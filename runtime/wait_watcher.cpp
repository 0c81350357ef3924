// See wait_watcher.h. The thread exists from a communicator's first watched wait on; it then wakes
// every interval for the communicator's life and reads the store only while a wait is watched.
// watch() does not wake it: a pipeline watches every send and receive wait, and a wake-up for each
// took the compute thread's core as often.
#include "runtime/wait_watcher.h"

#include "runtime/error.h"

namespace zeroshard {

WaitWatcher::WaitWatcher(c10::intrusive_ptr<c10d::Store> store, std::string abort_key,
                         std::chrono::milliseconds interval)
    : store_(std::move(store)), abort_key_(std::move(abort_key)), interval_(interval) {
  ZS_CHECK(interval_.count() > 0, "WaitWatcher: interval must be positive, got ", interval_.count(),
           " ms (the thread would spin)");
  thread_ = std::thread([this] { run(); });
}

WaitWatcher::~WaitWatcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::unique_ptr<WaitWatcher::Watch> WaitWatcher::watch(c10::intrusive_ptr<c10d::Work> work) {
  std::list<Entry>::iterator entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entry = watched_.insert(watched_.end(), Entry{std::move(work)});
  }
  // No wake-up: the thread looks at the list on its next tick (see the top of this file).
  return std::make_unique<Watch>(this, entry);
}

WaitWatcher::Watch::~Watch() {
  std::lock_guard<std::mutex> lock(owner_->mutex_);
  owner_->watched_.erase(entry_);
}

bool WaitWatcher::Watch::aborted() const {
  std::lock_guard<std::mutex> lock(owner_->mutex_);
  return entry_->aborted;
}

void WaitWatcher::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, interval_, [&] { return stopping_; });
    if (stopping_ || watched_.empty()) continue;
    lock.unlock();
    bool failed = false;
    try {
      failed = store_->check({abort_key_});
    } catch (const std::exception&) {
      // The store is gone (its rank ended): the wait's own error or timeout ends it.
    }
    lock.lock();
    if (failed) {
      // abort() ends each blocked wait() (Gloo's may return as if it finished: the waiter asks aborted()).
      for (Entry& e : watched_) {
        if (!e.aborted) e.work->abort();
        e.aborted = true;
      }
    }
  }
}

}  // namespace zeroshard
