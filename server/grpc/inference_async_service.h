// The generated async inference service as this server registers it: every
// RPC raw. Their messages arrive as bytes and the calls parse them, so a
// message that does not parse is the client's error, INVALID_ARGUMENT (and
// counted, for ModelInfer and ModelStreamInfer), where gRPC's own parsing
// would answer INTERNAL or, on a stream, end it as if the client had
// half-closed (issue 40, finding 2).
#pragma once

#include "grpc_service.grpc.pb.h"

namespace layerserve {

// (The generated service's nested class templates, shortened.)
using GeneratedInferenceService = inference::GRPCInferenceService;
using InferenceAsyncService = GeneratedInferenceService::WithRawMethod_ServerLive<
    GeneratedInferenceService::WithRawMethod_ServerReady<
        GeneratedInferenceService::WithRawMethod_ModelReady<
            GeneratedInferenceService::WithRawMethod_ServerMetadata<
                GeneratedInferenceService::WithRawMethod_ModelMetadata<
                    GeneratedInferenceService::WithRawMethod_ModelConfig<
                        GeneratedInferenceService::WithRawMethod_ModelStatistics<
                            GeneratedInferenceService::WithRawMethod_RepositoryIndex<
                                GeneratedInferenceService::WithRawMethod_ModelStreamInfer<
                                    GeneratedInferenceService::WithRawMethod_ModelInfer<
                                        GeneratedInferenceService::AsyncService>>>>>>>>>>;

}  // namespace layerserve
