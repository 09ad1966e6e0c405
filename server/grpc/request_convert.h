// Conversions between the wire messages of ModelInfer and the core's
// transport-agnostic InferRequest.
//
// Validation itself lives in the core (server/core/validation.h): this file
// copies the few fields it needs into a RequestDescription, and after the core
// accepts it builds an InferRequest whose `input` is a view into the request
// message. Whoever calls MakeInferRequest keeps that message alive until the
// request's on_done has run.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "grpc/support/time.h"
#include "grpc_service.pb.h"
#include "server/core/clock.h"
#include "server/core/request.h"
#include "server/core/validation.h"
#include "server/grpc/served_model.h"

namespace layerserve {

// Views into `request` (valid while it is).
RequestDescription DescribeRequest(const inference::ModelInferRequest& request);

// The "timeout" request parameter (Triton's convention: int64 microseconds;
// 0 or absent means none) as a deadline relative to `now`. INVALID_ARGUMENT if
// it has another type or is negative.
absl::StatusOr<std::optional<SteadyTime>> TimeoutParameterDeadline(
    const inference::ModelInferRequest& request, SteadyTime now);

// INVALID_ARGUMENT when the request carries Triton's sequence parameters
// (a non-zero or non-empty sequence_id, or sequence_start/sequence_end true):
// the server keeps no per-sequence state yet, and computing such a request as
// if it stood alone would be a silently wrong answer. Other parameters than
// these and "timeout" are ignored (README: Protocol).
absl::Status CheckNoSequenceParameters(const inference::ModelInferRequest& request);

// A transport deadline (the call's gpr_timespec, ServerContext::raw_deadline;
// gpr_inf_future means none) moved onto the steady clock the batcher uses,
// given `now` on the deadline's clock and the steady clock's now. Deadlines
// more than a century away saturate to a century: a legal grpc-timeout
// reaches 2562047H (2^63 ns, grpc-java's largest), past the year 2262 where
// gRPC's own ServerContext::deadline() overflows system_clock's nanoseconds
// and reports the far future as the past.
std::optional<SteadyTime> SteadyDeadline(gpr_timespec deadline, gpr_timespec now,
                                         SteadyTime steady_now);

// The earlier of two optional deadlines.
std::optional<SteadyTime> EarlierDeadline(std::optional<SteadyTime> a, std::optional<SteadyTime> b);

// Validates `request` against the model's limits and builds the core request:
// id, dtype, shape and an `input` view into raw_input_contents[0]. The
// deadline is the earlier of `transport_deadline` and the "timeout"
// parameter; sequence parameters are refused (CheckNoSequenceParameters). on_done and is_cancelled
// are left for the caller to set.
absl::StatusOr<std::unique_ptr<InferRequest>> MakeInferRequest(
    const inference::ModelInferRequest& request, const ModelLimits& limits,
    std::optional<SteadyTime> transport_deadline, SteadyTime now);

// Fills `response` for a request the core completed successfully: model name
// and version, the echoed id, one output `hidden_states` with the input's
// datatype and shape, and its bytes moved out of `done.output` into
// raw_output_contents. INTERNAL if the output does not have the input's size
// (a backend bug must not reach clients as a malformed tensor).
absl::Status FillInferResponse(const ServedModel& model, InferRequest& done,
                               inference::ModelInferResponse* response);

}  // namespace layerserve
