// Whether the server takes new work, shared by readiness, the health service
// and ModelInfer: not once draining has begun, nor while the backend reports
// an error (a sticky device error turns the server NOT_SERVING rather than
// killing it). Thread-safe; read on every call, so it is never stale.
//
// It also counts open ModelStreamInfer calls, so that a drain can keep the
// server answering (ready=false, NOT_SERVING, UNAVAILABLE) while clients
// finish their streams, instead of refusing connections at once; and it keeps
// the time the last call arrived, so that the drain can wait until clients,
// refused, have stopped sending: gRPC's Server::Shutdown cancels (CANCELLED,
// which a client cannot tell from "maybe computed") every call it has
// received but not yet handed to the service, and every call that arrives
// before its GOAWAY reaches the client.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/core/backend.h"

namespace layerserve {

class ServingState {
 public:
  // `backend` must outlive this object.
  explicit ServingState(const Backend* backend) : backend_(backend) {}

  void BeginDrain() {
    drain_start_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
    draining_.store(true, std::memory_order_release);
  }

  // OK when ready; UNAVAILABLE with the reason otherwise.
  absl::Status Readiness() const {
    if (draining()) return absl::UnavailableError("the server is shutting down");
    return BackendReadiness();
  }

  // Whether BeginDrain has been called. A draining server still takes the
  // steps of its open sessions (server/core/drain.h).
  bool draining() const { return draining_.load(std::memory_order_acquire); }

  // Readiness without the drain: OK unless the backend reports an error.
  absl::Status BackendReadiness() const {
    const absl::Status health = backend_->Health();
    if (!health.ok()) {
      return absl::UnavailableError(
          std::string("the backend is unhealthy: ").append(health.ToString()));
    }
    return absl::OkStatus();
  }

  // Called as each call (any method) reaches the service. Lock-free: it runs
  // on every call.
  void CallArrived() {
    last_call_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  }
  // Blocks until no call has arrived for `quiet` since the drain began (or
  // since the last call, if later), or until `deadline`; true if the server
  // went quiet. Counting from the drain's start too matters: a server idle
  // before the signal would otherwise stop gRPC at once, cancelling a call
  // that arrives just after the signal instead of refusing it. For the
  // shutdown path only, never a gRPC reaction.
  bool AwaitQuiet(absl::Duration quiet, absl::Time deadline) const {
    while (true) {
      const int64_t since_ns = std::max(last_call_ns_.load(std::memory_order_relaxed),
                                        drain_start_ns_.load(std::memory_order_relaxed));
      const absl::Time quiet_at = absl::FromUnixNanos(since_ns) + quiet;
      const absl::Time now = absl::Now();
      if (now >= quiet_at) return true;
      if (now >= deadline) return false;
      absl::SleepFor(std::min(quiet_at, deadline) - now);
    }
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
  std::atomic<int64_t> last_call_ns_{0};    // absl::GetCurrentTimeNanos()
  std::atomic<int64_t> drain_start_ns_{0};  // likewise; 0 until BeginDrain
  absl::Mutex streams_mu_;
  int64_t open_streams_ ABSL_GUARDED_BY(streams_mu_) = 0;
};

}  // namespace layerserve
