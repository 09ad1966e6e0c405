// ModelInferRequest -> InferRequest -> ModelInferResponse (see
// request_convert.h).
#include "server/grpc/request_convert.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"

namespace layerserve {

RequestDescription DescribeRequest(const inference::ModelInferRequest& request) {
  RequestDescription description;
  description.inputs.reserve(request.inputs_size());
  for (const auto& input : request.inputs()) {
    InputDescription in;
    in.name = input.name();
    in.datatype = input.datatype();
    in.shape.assign(input.shape().begin(), input.shape().end());
    in.has_typed_contents = input.has_contents();
    description.inputs.push_back(std::move(in));
  }
  description.raw_sizes.reserve(request.raw_input_contents_size());
  for (const std::string& raw : request.raw_input_contents()) {
    description.raw_sizes.push_back(raw.size());
  }
  description.requested_outputs.reserve(request.outputs_size());
  for (const auto& output : request.outputs()) {
    description.requested_outputs.push_back(output.name());
  }
  return description;
}

namespace {

// Longer waits than this mean "practically never"; clamping keeps absurd
// values from overflowing the steady clock's nanosecond count.
constexpr std::chrono::hours kMaxWait(24 * 365 * 100);

}  // namespace

absl::StatusOr<std::optional<SteadyTime>> TimeoutParameterDeadline(
    const inference::ModelInferRequest& request, SteadyTime now) {
  const auto it = request.parameters().find("timeout");
  if (it == request.parameters().end()) return std::nullopt;
  if (it->second.parameter_choice_case() != inference::InferParameter::kInt64Param) {
    return absl::InvalidArgumentError(
        "request parameter 'timeout' must be an int64_param (microseconds)");
  }
  const int64_t timeout_us = it->second.int64_param();
  if (timeout_us < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request parameter 'timeout' is ", timeout_us, " us; it must be >= 0"));
  }
  if (timeout_us == 0) return std::nullopt;
  const std::chrono::microseconds timeout(timeout_us);
  return now + std::min<std::chrono::microseconds>(timeout, kMaxWait);
}

std::optional<SteadyTime> SteadyDeadline(gpr_timespec deadline, gpr_timespec now,
                                         SteadyTime steady_now) {
  // gpr_inf_future has tv_sec INT64_MAX whatever its clock type.
  if (deadline.tv_sec == gpr_inf_future(deadline.clock_type).tv_sec) return std::nullopt;
  if (gpr_time_cmp(deadline, now) <= 0) return steady_now;
  // gpr_timespec counts whole seconds in 64 bits, so the difference cannot
  // overflow for any deadline gRPC can hold; only the move to nanoseconds
  // could, and the clamp comes first.
  const gpr_timespec remaining = gpr_time_sub(deadline, now);
  const std::chrono::seconds whole(remaining.tv_sec);
  if (whole >= kMaxWait) return steady_now + kMaxWait;
  return steady_now + std::chrono::duration_cast<SteadyTime::duration>(
                          whole + std::chrono::nanoseconds(remaining.tv_nsec));
}

std::optional<SteadyTime> EarlierDeadline(std::optional<SteadyTime> a,
                                          std::optional<SteadyTime> b) {
  if (!a) return b;
  if (!b) return a;
  return std::min(*a, *b);
}

namespace {

using ParameterMap = google::protobuf::Map<std::string, inference::InferParameter>;

// The name of a parameter's type as the protocol spells it, for messages.
absl::string_view ParameterTypeName(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return "bool_param";
    case inference::InferParameter::kInt64Param:
      return "int64_param";
    case inference::InferParameter::kStringParam:
      return "string_param";
    case inference::InferParameter::kDoubleParam:
      return "double_param";
    case inference::InferParameter::kUint64Param:
      return "uint64_param";
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return "no value";
}

absl::Status WrongType(absl::string_view name, const inference::InferParameter& p,
                       absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("request parameter '", name, "' must be ",
                                                 expected, "; got ", ParameterTypeName(p)));
}

// A bool parameter: false when absent.
absl::StatusOr<bool> BoolParameter(const ParameterMap& parameters, absl::string_view name) {
  const auto it = parameters.find(std::string(name));
  if (it == parameters.end()) return false;
  if (it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
    return WrongType(name, it->second, "a bool_param");
  }
  return it->second.bool_param();
}

// sequence_id, or nullopt for none (absent, 0 or "").
absl::StatusOr<std::optional<SessionId>> SequenceIdParameter(const ParameterMap& parameters) {
  const auto it = parameters.find("sequence_id");
  if (it == parameters.end()) return std::nullopt;
  const inference::InferParameter& p = it->second;
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (p.int64_param() == 0) return std::nullopt;
      return SessionId(p.int64_param());
    case inference::InferParameter::kUint64Param:
      if (p.uint64_param() == 0) return std::nullopt;
      // Two's complement, as Triton's int64 -> uint64 correlation id.
      return SessionId(static_cast<int64_t>(p.uint64_param()));
    case inference::InferParameter::kStringParam:
      if (p.string_param().empty()) return std::nullopt;
      if (p.string_param().size() > kMaxSequenceIdBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("request parameter 'sequence_id' is a string of ", p.string_param().size(),
                         " bytes; string sequence ids may have at most ", kMaxSequenceIdBytes));
      }
      return SessionId(p.string_param());
    default:
      return WrongType("sequence_id", p, "an int64_param, uint64_param or string_param");
  }
}

// sequence_position, or nullopt when absent.
absl::StatusOr<std::optional<int64_t>> SequencePositionParameter(const ParameterMap& parameters) {
  const auto it = parameters.find("sequence_position");
  if (it == parameters.end()) return std::nullopt;
  const inference::InferParameter& p = it->second;
  if (p.parameter_choice_case() == inference::InferParameter::kUint64Param) {
    if (p.uint64_param() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("request parameter 'sequence_position' is ",
                                                     p.uint64_param(), "; it must be <= 2^63-1"));
    }
    return static_cast<int64_t>(p.uint64_param());
  }
  if (p.parameter_choice_case() != inference::InferParameter::kInt64Param) {
    return WrongType("sequence_position", p, "an int64_param (or uint64_param)");
  }
  if (p.int64_param() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("request parameter 'sequence_position' is ",
                                                   p.int64_param(), "; it must be >= 0"));
  }
  return p.int64_param();
}

}  // namespace

absl::StatusOr<std::optional<SessionParams>> ParseSessionParameters(
    const inference::ModelInferRequest& request) {
  const ParameterMap& parameters = request.parameters();
  // Every parameter is checked, so a wrong type is reported whether or not
  // the request names a sequence.
  LS_ASSIGN_OR_RETURN(std::optional<SessionId> id, SequenceIdParameter(parameters));
  LS_ASSIGN_OR_RETURN(const bool start, BoolParameter(parameters, "sequence_start"));
  LS_ASSIGN_OR_RETURN(const bool end, BoolParameter(parameters, "sequence_end"));
  LS_ASSIGN_OR_RETURN(const std::optional<int64_t> position, SequencePositionParameter(parameters));
  if (!id) {
    // tritonclient sends none of them without an id; a client that sends a
    // true flag or a position alone expects state, and computing the request
    // as if it stood alone would be a silently wrong answer.
    const char* stray = start      ? "sequence_start"
                        : end      ? "sequence_end"
                        : position ? "sequence_position"
                                   : nullptr;
    if (stray == nullptr) return std::nullopt;
    return absl::InvalidArgumentError(absl::StrCat(
        "request parameter '", stray,
        "' is set without a sequence_id (absent, 0 or \"\" mean no sequence); name the session "
        "with sequence_id, or drop the sequence parameters for a stateless request"));
  }
  SessionParams session;
  session.id = *std::move(id);
  session.start = start;
  session.end = end;
  session.position = position;
  return session;
}

absl::Status CheckSessionsServed(const ServedModel& model, const SessionId& id) {
  if (model.sessions) return absl::OkStatus();
  const std::string why = model.sessions_off_reason.empty()
                              ? absl::StrCat("the ", model.backend, " backend keeps no KV cache")
                              : model.sessions_off_reason;
  return absl::FailedPreconditionError(absl::StrCat(
      "request names sequence_id ", id.ToString(), ", but model '", model.name,
      "' is served without sessions (", why,
      "); requests without sequence parameters work (each is computed on its own, positions "
      "0..T-1)"));
}

ModelLimits LimitsOf(const ServedModel& model) {
  return {.hidden_size = model.config.hidden_size,
          .max_tokens_per_request = model.max_batch_tokens};
}

absl::StatusOr<std::unique_ptr<InferRequest>> MakeInferRequest(
    const inference::ModelInferRequest& request, const ServedModel& model,
    const ModelLimits& limits, std::optional<SteadyTime> transport_deadline, SteadyTime now) {
  LS_ASSIGN_OR_RETURN(const ValidatedInput input,
                      ValidateRequest(DescribeRequest(request), limits));
  LS_ASSIGN_OR_RETURN(std::optional<SessionParams> session, ParseSessionParameters(request));
  LS_ASSIGN_OR_RETURN(const std::optional<SteadyTime> timeout_deadline,
                      TimeoutParameterDeadline(request, now));
  if (session) LS_RETURN_IF_ERROR(CheckSessionsServed(model, session->id));
  auto infer = std::make_unique<InferRequest>();
  infer->id = request.id();
  infer->dtype = input.dtype;
  infer->batch = input.batch;
  infer->seq_len = input.seq_len;
  infer->hidden = input.hidden;
  infer->input = request.raw_input_contents(0);
  infer->deadline = EarlierDeadline(transport_deadline, timeout_deadline);
  infer->session = std::move(session);
  return infer;
}

absl::Status FillInferResponse(const ServedModel& model, InferRequest& done,
                               inference::ModelInferResponse* response) {
  if (done.output.size() != done.input.size()) {
    return absl::InternalError(absl::StrCat("the backend produced ", done.output.size(),
                                            " output bytes for ", done.input.size(),
                                            " input bytes"));
  }
  response->set_model_name(model.name);
  response->set_model_version(model.version);
  response->set_id(done.id);
  auto* output = response->add_outputs();
  output->set_name(std::string(kOutputName));
  output->set_datatype(std::string(DTypeProtocolName(done.dtype)));
  output->add_shape(done.batch);
  output->add_shape(done.seq_len);
  output->add_shape(done.hidden);
  response->add_raw_output_contents(std::move(done.output));
  return absl::OkStatus();
}

}  // namespace layerserve
