// Metadata, configuration and statistics messages (see model_info.h).
#include "server/grpc/model_info.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/echo.h"
#include "server/core/validation.h"

namespace layerserve {
namespace {

constexpr std::string_view kServerName = "layerserve";
constexpr std::string_view kPlatform = "layerserve";

// Protocol extensions this server implements; "statistics" is what makes
// perf_analyzer call ModelStatistics around each measurement window.
constexpr std::string_view kExtensions[] = {"model_configuration", "statistics"};

// The activation tensor is [batch, tokens, hidden]: B and T vary per request.
void AddActivationShape(const ServedModel& model, google::protobuf::RepeatedField<int64_t>* dims) {
  dims->Add(-1);
  dims->Add(-1);
  dims->Add(model.config.hidden_size);
}

// Sessions, as Triton's sequence batcher describes itself. The oldest
// strategy is the nearest to what the batcher does: every open session may
// have a step queued (max_candidate_sequences = --max-sessions), and a batch
// forms from the oldest queued requests after at most the batcher's delay.
// It has no preferred batch sizes (batches are formed by tokens).
void FillSequenceBatching(const ServedModel& model, inference::ModelSequenceBatching* batching) {
  // Triton reads 0 as "the default, 1 s"; sessions that never expire are
  // told as the largest value instead, which is what "never" means to a
  // client comparing its pauses with it.
  batching->set_max_sequence_idle_microseconds(
      model.session_idle_timeout_us > 0 ? static_cast<uint64_t>(model.session_idle_timeout_us)
                                        : std::numeric_limits<uint64_t>::max());
  auto* oldest = batching->mutable_oldest();
  oldest->set_max_candidate_sequences(static_cast<int32_t>(
      std::clamp<int64_t>(model.max_sessions, 0, std::numeric_limits<int32_t>::max())));
  oldest->set_max_queue_delay_microseconds(static_cast<uint64_t>(model.max_queue_delay_us));
  // Steps of one session run in order (the session table admits one at a
  // time); across sessions replies come as batches finish.
  oldest->set_preserve_ordering(false);
}

void SetDuration(const DurationStat& in, inference::StatisticDuration* out) {
  out->set_count(in.count);
  out->set_ns(in.ns);
}

}  // namespace

absl::Status CheckModel(const ServedModel& model, std::string_view name, std::string_view version) {
  // Names come from the client and are echoed in part only (base/echo.h).
  if (name != model.name) {
    return absl::NotFoundError(absl::StrCat("unknown model '", EchoForMessage(name),
                                            "'; this server serves '", model.name, "'"));
  }
  if (!version.empty() && version != model.version) {
    return absl::NotFoundError(absl::StrCat("model '", EchoForMessage(name), "' has no version '",
                                            EchoForMessage(version), "'; it serves version '",
                                            model.version, "'"));
  }
  return absl::OkStatus();
}

void FillServerMetadata(std::string_view server_version,
                        inference::ServerMetadataResponse* response) {
  response->set_name(std::string(kServerName));
  response->set_version(std::string(server_version));
  for (std::string_view extension : kExtensions) response->add_extensions(std::string(extension));
}

void FillModelMetadata(const ServedModel& model, inference::ModelMetadataResponse* response) {
  response->set_name(model.name);
  response->add_versions(model.version);
  response->set_platform(std::string(kPlatform));
  // BF16 is advertised because it is what Llama checkpoints and clients
  // exchange; the server also accepts FP16 and FP32 and always answers in the
  // request's datatype. Metadata has room for only one datatype per tensor.
  for (auto* tensor : {response->add_inputs(), response->add_outputs()}) {
    tensor->set_name(std::string(kInputName));
    tensor->set_datatype("BF16");
    AddActivationShape(model, tensor->mutable_shape());
  }
}

void FillRepositoryIndex(const ServedModel& model, const absl::Status& readiness, bool ready_only,
                         inference::RepositoryIndexResponse* response) {
  if (ready_only && !readiness.ok()) return;
  inference::RepositoryIndexResponse::ModelIndex* index = response->add_models();
  index->set_name(model.name);
  index->set_version(model.version);
  index->set_state(readiness.ok() ? "READY" : "UNAVAILABLE");
  if (!readiness.ok()) index->set_reason(std::string(readiness.message()));
}

void FillModelConfig(const ServedModel& model, inference::ModelConfig* config) {
  config->set_name(model.name);
  config->set_platform(std::string(kPlatform));
  config->set_backend(std::string(kPlatform));
  // 0: no implicit batch dimension. B is an explicit dimension of the shape,
  // and the server batches at token level across requests with different B
  // and T, which Triton's implicit batching (requests stacked along an extra
  // leading dimension with identical remaining dims) cannot describe. With 0,
  // perf_analyzer keeps all three dimensions and takes them from --shape.
  config->set_max_batch_size(0);

  auto* input = config->add_input();
  input->set_name(std::string(kInputName));
  input->set_data_type(inference::TYPE_BF16);
  AddActivationShape(model, input->mutable_dims());
  auto* output = config->add_output();
  output->set_name(std::string(kOutputName));
  output->set_data_type(inference::TYPE_BF16);
  AddActivationShape(model, output->mutable_dims());

  if (model.sessions) {
    FillSequenceBatching(model, config->mutable_sequence_batching());
  } else {
    // Present: the dynamic scheduler. The token-level batcher has no
    // preferred batch sizes; its delay and queue bound are the server's
    // flags, and the "timeout" request parameter is honoured.
    auto* batching = config->mutable_dynamic_batching();
    batching->set_max_queue_delay_microseconds(static_cast<uint64_t>(model.max_queue_delay_us));
    auto* queue = batching->mutable_default_queue_policy();
    queue->set_timeout_action(inference::ModelQueuePolicy::REJECT);
    queue->set_allow_timeout_override(true);
    queue->set_max_queue_size(static_cast<uint32_t>(model.max_queue_size));
  }

  // One response per request, also on ModelStreamInfer.
  config->mutable_model_transaction_policy()->set_decoupled(false);

  auto& parameters = *config->mutable_parameters();
  parameters["model_type"].set_string_value(model.config.model_type);
  parameters["layers"].set_string_value(
      absl::StrCat(model.first_layer, ":", model.first_layer + model.num_layers));
  parameters["hidden_size"].set_string_value(absl::StrCat(model.config.hidden_size));
  parameters["max_batch_tokens"].set_string_value(absl::StrCat(model.max_batch_tokens));
  parameters["compute_backend"].set_string_value(model.backend);
  if (model.sessions) {
    parameters["kv_block_tokens"].set_string_value(absl::StrCat(model.kv_block_tokens));
    parameters["kv_blocks"].set_string_value(absl::StrCat(model.kv_blocks));
    parameters["kv_cache_dtype"].set_string_value(
        std::string(KvCacheDTypeName(model.kv_cache_dtype)));
    parameters["max_sessions"].set_string_value(absl::StrCat(model.max_sessions));
    // 0: no bound beyond the KV cache's blocks.
    parameters["max_session_tokens"].set_string_value(absl::StrCat(model.max_session_tokens));
    // 0: sessions never expire (max_sequence_idle_microseconds cannot say
    // it: Triton reads its 0 as a 1 s default).
    parameters["session_idle_timeout_us"].set_string_value(
        absl::StrCat(model.session_idle_timeout_us));
    // What dynamic_batching's queue policy says when there are no sessions
    // (the oneof leaves it no room here); the delay is in oldest.
    parameters["max_queue_size"].set_string_value(absl::StrCat(model.max_queue_size));
  }
}

void FillModelStatistics(const ServedModel& model, const ModelStatsSnapshot& stats,
                         inference::ModelStatistics* out) {
  out->set_name(model.name);
  out->set_version(model.version);
  out->set_last_inference(stats.last_inference_ms);
  out->set_inference_count(stats.inference_count);
  out->set_execution_count(stats.execution_count);
  auto* infer = out->mutable_inference_stats();
  SetDuration(stats.success, infer->mutable_success());
  SetDuration(stats.fail, infer->mutable_fail());
  SetDuration(stats.queue, infer->mutable_queue());
  SetDuration(stats.compute_input, infer->mutable_compute_input());
  SetDuration(stats.compute_infer, infer->mutable_compute_infer());
  SetDuration(stats.compute_output, infer->mutable_compute_output());
  for (const auto& [batch_size, compute] : stats.batch_compute_infer) {
    auto* batch = out->add_batch_stats();
    batch->set_batch_size(batch_size);
    SetDuration(compute, batch->mutable_compute_infer());
  }
}

}  // namespace layerserve
