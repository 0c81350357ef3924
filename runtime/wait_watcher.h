// Point-to-point waits cannot poll the store for another rank's failure the way collectives do
// (Gloo gives up a receive whose wait times out), so a rank blocked in one would learn of a
// failure only when its peer's process ends, or at the timeout. A WaitWatcher polls the store on
// a thread of its own while such waits block, and aborts them when a failure is published.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace zeroshard {

class WaitWatcher {
 public:
  // store: a connection of the watcher's own; abort_key: set by the first rank that fails.
  WaitWatcher(c10::intrusive_ptr<c10d::Store> store, std::string abort_key,
              std::chrono::milliseconds interval);
  ~WaitWatcher();
  WaitWatcher(const WaitWatcher&) = delete;
  WaitWatcher& operator=(const WaitWatcher&) = delete;

  struct Entry {
    c10::intrusive_ptr<c10d::Work> work;
    bool aborted = false;
  };

  // Watches `work` for as long as the Watch lives (the blocking wait's scope).
  class Watch {
   public:
    Watch(WaitWatcher* owner, std::list<Entry>::iterator entry) : owner_(owner), entry_(entry) {}
    ~Watch();
    // Whether the watcher aborted the wait: Gloo's aborted wait() may return as if the transfer
    // had finished, so the waiter asks.
    bool aborted() const;
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    WaitWatcher* owner_;
    std::list<Entry>::iterator entry_;
  };
  std::unique_ptr<Watch> watch(c10::intrusive_ptr<c10d::Work> work);

 private:
  void run();

  c10::intrusive_ptr<c10d::Store> store_;
  std::string abort_key_;
  std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::list<Entry> watched_;  // guarded by mutex_; each entry removed by its Watch
  bool stopping_ = false;                              // guarded by mutex_
  std::thread thread_;
};

}  // namespace zeroshard
