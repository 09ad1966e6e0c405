// The generated async inference service as this server registers it:
// ModelInfer and ModelStreamInfer raw (their messages arrive as bytes and
// the calls parse them, so a message that does not parse is the client's
// error, INVALID_ARGUMENT and counted, where gRPC's own parsing would answer
// INTERNAL or, on a stream, end it as if the client had half-closed; issue 40,
// finding 2), the other RPCs typed.
#pragma once

#include "grpc_service.grpc.pb.h"

namespace layerserve {

using InferenceAsyncService = inference::GRPCInferenceService::WithRawMethod_ModelStreamInfer<
    inference::GRPCInferenceService::WithRawMethod_ModelInfer<
        inference::GRPCInferenceService::AsyncService>>;

}  // namespace layerserve
