// Device <-> host copies; see copy_stream.h.
#include "runtime/copy_stream.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "runtime/error.h"
#include "runtime/trace.h"

namespace zeroshard {

CopyStream::CopyStream(c10::Device device) : device_(device) {
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    side_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  }
}

CopyFence CopyStream::copy(at::Tensor dst, const at::Tensor& src) {
  ZS_CHECK(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous(),
           "CopyStream::copy: ", dst.numel(), " and ", src.numel(), " elements, contiguous both");
  // On the host path the copy itself; on a side stream only its issue (the device runs it later).
  trace::Scope traced("copy", [&] {
    return std::make_pair(std::string(dst.device() == src.device() ? "copy" : (dst.is_cpu() ? "copy down" : "copy up")),
                          detail::cat("\"bytes\": ", src.nbytes()));
  });
  if (!side_) {
    dst.view(-1).copy_(src.view(-1));
    return nullptr;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  // The copy stream waits for what the compute stream queued: src may be written by it.
  c10::Event ready(device_.type());
  ready.record(impl.getStream(device_));
  ready.block(*side_);
  {
    c10::StreamGuard on_side(*side_);
    dst.view(-1).copy_(src.view(-1), /*non_blocking=*/true);
  }
  auto done = std::make_shared<c10::Event>(device_.type());
  done->record(*side_);
  return done;
}

CopyFence CopyStream::mark_compute() const {
  if (!side_) return nullptr;
  c10::impl::VirtualGuardImpl impl(device_.type());
  auto mark = std::make_shared<c10::Event>(device_.type());
  mark->record(impl.getStream(device_));
  return mark;
}

void CopyStream::wait_host(const CopyFence& fence) {
  if (fence) fence->synchronize();
}

void CopyStream::on_copy_stream(const std::function<void()>& issue) const {
  if (!side_) {
    issue();
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  // why: what `issue` writes may be memory the compute stream's queued kernels still read.
  c10::Event ready(device_.type());
  ready.record(impl.getStream(device_));
  ready.block(*side_);
  c10::StreamGuard on_side(*side_);
  issue();
}

void CopyStream::keep_for_compute(const at::Tensor& t) const {
  if (!side_) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(device_));
}

void CopyStream::wait_device(const CopyFence& fence) const {
  if (!fence) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  fence->block(impl.getStream(device_));
}

}  // namespace zeroshard
