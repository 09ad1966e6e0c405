// A ModelInfer call that the client cancels a while after sending it,
// through the generated stub (the client library has no cancel): how the
// tests check that the server answers a cancelled call, and drops it from
// its queue instead of computing it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <optional>
#include <utility>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc_service.grpc.pb.h"

namespace layerserve::integration {

// Sends `request` (deadline 60 s), cancels it after `delay` and waits for its
// status up to `wait`. Nullopt if it never completed by then; the call is
// still waited for, since its context must outlive it.
inline std::optional<grpc::Status> InferCancelledAfter(inference::GRPCInferenceService::Stub& stub,
                                                       const inference::ModelInferRequest& request,
                                                       absl::Duration delay, absl::Duration wait) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  inference::ModelInferResponse response;
  grpc::Status status;
  absl::Notification done;
  stub.async()->ModelInfer(&context, &request, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  absl::SleepFor(delay);
  context.TryCancel();
  if (!done.WaitForNotificationWithTimeout(wait)) {
    done.WaitForNotification();
    return std::nullopt;
  }
  return status;
}

}  // namespace layerserve::integration
