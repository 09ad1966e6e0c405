// ModelInferRequest -> InferRequest -> ModelInferResponse (see
// request_convert.h).
#include "server/grpc/request_convert.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
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

absl::Status CheckNoSequenceParameters(const inference::ModelInferRequest& request) {
  // Triton's sequence batcher spelling (tritonclient's sequence_id=,
  // sequence_start=, sequence_end=): it sends them only for a sequence, so any
  // of them set means the client expects state this server does not keep.
  for (const char* name : {"sequence_id", "sequence_start", "sequence_end"}) {
    const auto it = request.parameters().find(name);
    if (it == request.parameters().end()) continue;
    const inference::InferParameter& p = it->second;
    const bool unset =
        (p.parameter_choice_case() == inference::InferParameter::kInt64Param &&
         p.int64_param() == 0) ||
        (p.parameter_choice_case() == inference::InferParameter::kStringParam &&
         p.string_param().empty()) ||
        (p.parameter_choice_case() == inference::InferParameter::kBoolParam && !p.bool_param());
    if (unset) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "request parameter '", name,
        "' is set, but this server keeps no sequence state yet: every request is computed on "
        "its own, with positions 0..T-1; send the whole sequence without sequence parameters"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<InferRequest>> MakeInferRequest(
    const inference::ModelInferRequest& request, const ModelLimits& limits,
    std::optional<SteadyTime> transport_deadline, SteadyTime now) {
  LS_ASSIGN_OR_RETURN(const ValidatedInput input,
                      ValidateRequest(DescribeRequest(request), limits));
  LS_RETURN_IF_ERROR(CheckNoSequenceParameters(request));
  LS_ASSIGN_OR_RETURN(const std::optional<SteadyTime> timeout_deadline,
                      TimeoutParameterDeadline(request, now));
  auto infer = std::make_unique<InferRequest>();
  infer->id = request.id();
  infer->dtype = input.dtype;
  infer->batch = input.batch;
  infer->seq_len = input.seq_len;
  infer->hidden = input.hidden;
  infer->input = request.raw_input_contents(0);
  infer->deadline = EarlierDeadline(transport_deadline, timeout_deadline);
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
