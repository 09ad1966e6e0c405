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
#include <cstddef>
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

// Longest string sequence_id accepted, in bytes: the session table keeps the
// id as its key (and remembers expired ones), so a client must not be able to
// make it store arbitrarily large keys.
inline constexpr size_t kMaxSequenceIdBytes = 256;

// The session parameters of `request` (Triton's sequence batcher spelling,
// docs/sessions.md), or nullopt for a stateless request:
//   sequence_id        int64_param or string_param (what tritonclient sends for
//                      an int and a str id), or uint64_param (Triton's
//                      correlation ids are uint64: it is reinterpreted as
//                      int64, so uint64 2^64-1 and int64 -1 name the same
//                      session, as they do in Triton). 0 and "" mean "no
//                      sequence", as in Triton. A string id and an integer
//                      id never name the same session ("7" is not 7).
//   sequence_start     bool_param: open the session (or reset it).
//   sequence_end       bool_param: free it after this request.
//   sequence_position  layerserve's extension, int64_param (or uint64_param)
//                      >= 0: where the request's first token sits; smaller
//                      than the session's length rolls it back.
// INVALID_ARGUMENT, naming the parameter, for a parameter of another type, a
// string id longer than kMaxSequenceIdBytes, a negative or out-of-range
// position, and a true sequence_start / sequence_end or any sequence_position
// without a sequence_id (false flags without an id are accepted: they ask for
// nothing). Other parameters are not looked at.
absl::StatusOr<std::optional<SessionParams>> ParseSessionParameters(
    const inference::ModelInferRequest& request);

// OK when `model` serves sessions. FAILED_PRECONDITION otherwise, naming the
// model's backend and saying that stateless requests (no sequence_id) work:
// the request is well formed, but this server was not started with what it
// needs (a backend with a KV cache), which is what FAILED_PRECONDITION means;
// UNIMPLEMENTED would tell the client that no server of this kind ever could.
absl::Status CheckSessionsServed(const ServedModel& model, const SessionId& id);

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

// The limits ValidateRequest checks a request of `model` against.
ModelLimits LimitsOf(const ServedModel& model);

// Validates `request` against `limits` (LimitsOf(model), passed in so the
// caller builds it once) and builds the core request: id, dtype, shape, an
// `input` view into raw_input_contents[0], and `session` from the sequence
// parameters (ParseSessionParameters; a session request for a model without
// sessions is FAILED_PRECONDITION, CheckSessionsServed). The deadline is the
// earlier of `transport_deadline` and the "timeout" parameter. on_done and
// is_cancelled are left for the caller to set. Errors come in this order:
// the tensor, the sequence parameters, the timeout (all INVALID_ARGUMENT),
// then sessions not served (FAILED_PRECONDITION).
absl::StatusOr<std::unique_ptr<InferRequest>> MakeInferRequest(
    const inference::ModelInferRequest& request, const ServedModel& model,
    const ModelLimits& limits, std::optional<SteadyTime> transport_deadline, SteadyTime now);

// Fills `response` for a request the core completed successfully: model name
// and version, the echoed id, one output `hidden_states` with the input's
// datatype and shape, and its bytes moved out of `done.output` into
// raw_output_contents. INTERNAL if the output does not have the input's size
// (a backend bug must not reach clients as a malformed tensor).
absl::Status FillInferResponse(const ServedModel& model, InferRequest& done,
                               inference::ModelInferResponse* response);

}  // namespace layerserve
