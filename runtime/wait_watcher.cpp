// See wait_watcher.h. The thread ticks every interval and polls the store only when a wait is
// watched, so a run without blocked point-to-point waits pays one mostly idle thread per
// communicator that has a store (made at its first watched wait).
#include "runtime/wait_watcher.h"

namespace zeroshard {

WaitWatcher::WaitWatcher(c10::intrusive_ptr<c10d::Store> store, std::string abort_key,
                         std::chrono::milliseconds interval)
    : store_(std::move(store)), abort_key_(std::move(abort_key)), interval_(interval) {
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
  // No wake-up: the thread looks at the list on its next tick. A pipeline watches every blocking
  // receive, and waking the thread for each took the compute thread's core from it as often.
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
