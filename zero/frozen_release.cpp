// When frozen parameters may be released early; see frozen_release.h.
#include "zero/frozen_release.h"

#include <ATen/ATen.h>

namespace zeroshard {

FrozenRelease::FrozenRelease(std::shared_ptr<Comm> comm, c10::Device device)
    : comm_(std::move(comm)), device_(device) {
  current_ = new_verdict(false);  // here, not in the initializer list: agreed_ is built after it
}

int64_t FrozenRelease::new_verdict(bool agreed) {
  agreed_.push_back(agreed);
  return int64_t(agreed_.size()) - 1;
}

int64_t FrozenRelease::record(bool tracked) {
  ++count_;
  digest_ = (digest_ * 3 + 1 + int64_t(tracked)) % (int64_t(1) << 61);
  return current_;
}

int64_t FrozenRelease::agree_now(bool tracked) {
  return new_verdict(compare(int64_t(tracked), 0));
}

bool FrozenRelease::may_arm(int64_t verdict, bool grad_enabled) const {
  return verdict >= 0 && agreed_.at(size_t(verdict)) && in_backward_ && !grad_enabled;
}

void FrozenRelease::begin_backward() {
  agreed_[size_t(current_)] = compare(count_, digest_);
  count_ = digest_ = 0;
  current_ = new_verdict(false);
  in_backward_ = true;
}

bool FrozenRelease::compare(int64_t count, int64_t digest) {
  // Equal on every rank exactly when max(x) == -max(-x) for both.
  at::Tensor mine = at::tensor({count, -count, digest, -digest}, at::kLong).to(device_);
  comm_->all_reduce_max(mine, "ZeRO-3: which forwards may release frozen parameters").wait();
  const at::Tensor top = mine.cpu();
  const int64_t* v = top.data_ptr<int64_t>();
  return v[0] == -v[1] && v[2] == -v[3];
}

}  // namespace zeroshard
