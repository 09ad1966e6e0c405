// Running a Batch on a Backend to completion, for the backends' tests: the
// CPU and CUDA backend tests (and the CUDA-vs-CPU comparisons) share it.
#pragma once

#include <chrono>
#include <future>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "server/core/backend.h"

namespace layerserve::test_support {

// Starts `batch` on `backend`; the future becomes ready when `done` runs.
inline std::future<absl::Status> Start(Backend& backend, std::shared_ptr<Batch> batch) {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> result = promise->get_future();
  backend.Execute(std::move(batch),
                  [promise](absl::Status s) { promise->set_value(std::move(s)); });
  return result;
}

// The batch's status, or DEADLINE_EXCEEDED if it has not completed within
// 120 s (a hung backend fails its test instead of hanging it).
inline absl::Status Wait(std::future<absl::Status>& f) {
  if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    return absl::DeadlineExceededError("batch did not complete within 120 s");
  }
  return f.get();
}

inline absl::Status RunSync(Backend& backend, std::shared_ptr<Batch> batch) {
  std::future<absl::Status> f = Start(backend, std::move(batch));
  return Wait(f);
}

}  // namespace layerserve::test_support
