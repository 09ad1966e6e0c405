// Whether the server takes new work, shared by readiness, the health service
// and ModelInfer: not once draining has begun, nor while the backend reports
// an error (a sticky device error turns the server NOT_SERVING rather than
// killing it). Thread-safe; read on every call, so it is never stale.
//
// It also counts open ModelStreamInfer calls, so that a drain can keep the
// server answering (ready=false, NOT_SERVING, UNAVAILABLE) while clients
// finish their streams, instead of refusing connections at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/backend.h"

namespace layerserve {

class ServingState {
 public:
  // `backend` must outlive this object.
  explicit ServingState(const Backend* backend) : backend_(backend) {}

  void BeginDrain() { draining_.store(true, std::memory_order_release); }

  // OK when ready; UNAVAILABLE with the reason otherwise.
  absl::Status Readiness() const {
    if (draining_.load(std::memory_order_acquire)) {
      return absl::UnavailableError("the server is shutting down");
    }
    const absl::Status health = backend_->Health();
    if (!health.ok()) {
      return absl::UnavailableError(
          std::string("the backend is unhealthy: ").append(health.ToString()));
    }
    return absl::OkStatus();
  }

  void StreamOpened() {
    absl::MutexLock lock(&streams_mu_);
    ++open_streams_;
  }
  void StreamClosed() {
    absl::MutexLock lock(&streams_mu_);
    --open_streams_;
  }
  // Blocks until no stream is open or `deadline` passes; true if none is.
  // For the shutdown path only, never a gRPC reaction.
  bool AwaitNoStreams(absl::Time deadline) {
    absl::MutexLock lock(&streams_mu_);
    auto none_open = [this]()
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(streams_mu_) { return open_streams_ == 0; };
    return streams_mu_.AwaitWithDeadline(absl::Condition(&none_open), deadline);
  }

 private:
  const Backend* const backend_;
  std::atomic<bool> draining_{false};
  absl::Mutex streams_mu_;
  int64_t open_streams_ ABSL_GUARDED_BY(streams_mu_) = 0;
};

}  // namespace layerserve
