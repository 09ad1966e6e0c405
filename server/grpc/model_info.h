// What the server says about itself and its model: the answers to
// ServerMetadata, ModelMetadata, ModelConfig and ModelStatistics, built from
// the ServedModel and the StatsRecorder. Pure functions, so the exact
// messages clients (perf_analyzer above all) read are easy to test.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "grpc_service.pb.h"
#include "model_config.pb.h"
#include "server/core/stats.h"
#include "server/grpc/served_model.h"

namespace layerserve {

// OK if `name` is the served model and `version` is empty or its version;
// NOT_FOUND naming what is served otherwise.
absl::Status CheckModel(const ServedModel& model, std::string_view name, std::string_view version);

void FillServerMetadata(std::string_view server_version,
                        inference::ServerMetadataResponse* response);
void FillModelMetadata(const ServedModel& model, inference::ModelMetadataResponse* response);
void FillModelConfig(const ServedModel& model, inference::ModelConfig* config);
// RepositoryIndex: the served model, "READY" while `readiness` is OK, else
// "UNAVAILABLE" with its message as the reason; with `ready_only`, only if
// ready.
void FillRepositoryIndex(const ServedModel& model, const absl::Status& readiness, bool ready_only,
                         inference::RepositoryIndexResponse* response);
void FillModelStatistics(const ServedModel& model, const ModelStatsSnapshot& stats,
                         inference::ModelStatistics* out);

}  // namespace layerserve
