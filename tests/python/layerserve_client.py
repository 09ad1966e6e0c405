"""tritonclient helpers shared by the compatibility tests: build FP32/BF16
inputs the way a client application would and decode outputs. (The
Prometheus endpoint is read through tests/support/layerserve_process.py.)

BF16 went through two tritonclient APIs: releases before r26.06 take float32
arrays for a "BF16" input (truncating them), later ones require
ml_dtypes.bfloat16 arrays. Inputs here are first rounded to values bfloat16
represents exactly, so both APIs send the same bits, and outputs are decoded
from the raw response bytes, so the checks do not depend on either.
"""

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from llama_numpy import bf16_bits_to_f32, round_to_bf16

RPC_TIMEOUT_S = 60


def client_bf16_dtype():
    """ml_dtypes.bfloat16 if this tritonclient maps it to "BF16", else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    try:
        return ml_dtypes.bfloat16 if np_to_triton_dtype(np.dtype(ml_dtypes.bfloat16)) == "BF16" else None
    except Exception:  # an older tritonclient that does not know the type
        return None


def make_input(name, values, datatype):
    """An InferInput of `values` (any float array) as "FP32" or "BF16"."""
    values = np.asarray(values, dtype=np.float32)
    tensor = grpcclient.InferInput(name, list(values.shape), datatype)
    if datatype == "FP32":
        tensor.set_data_from_numpy(values)
    elif datatype == "BF16":
        exact = round_to_bf16(values)
        bf16 = client_bf16_dtype()
        tensor.set_data_from_numpy(exact.astype(bf16) if bf16 is not None else exact)
    else:
        raise ValueError(f"unsupported datatype {datatype}")
    return tensor


def output_as_f32(result, name):
    """(float32 array, datatype) of output `name`, decoded from the raw bytes."""
    response = result.get_response()
    for index, output in enumerate(response.outputs):
        if output.name != name:
            continue
        raw = response.raw_output_contents[index]
        shape = list(output.shape)
        if output.datatype == "FP32":
            values = np.frombuffer(raw, dtype="<f4")
        elif output.datatype == "BF16":
            values = bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
        else:
            raise AssertionError(f"unexpected output datatype {output.datatype}")
        assert values.size == int(np.prod(shape)), (
            f"output {name}: {values.size} elements for shape {shape}")
        return values.reshape(shape).astype(np.float32), output.datatype
    names = [o.name for o in response.outputs]
    raise AssertionError(f"no output named {name!r} in the response (outputs: {names})")


def infer(client, model, input_name, output_name, values, datatype, request_id="", **kwargs):
    """One ModelInfer call; returns (float32 output, output datatype, result).
    kwargs go to client.infer (sequence_id=, sequence_start=, parameters=, ...)."""
    result = client.infer(
        model, [make_input(input_name, values, datatype)],
        outputs=[grpcclient.InferRequestedOutput(output_name)],
        request_id=request_id, client_timeout=RPC_TIMEOUT_S, **kwargs)
    out, datatype_out = output_as_f32(result, output_name)
    return out, datatype_out, result


def io_names(client, model):
    """(input name, output name) from the model's metadata."""
    metadata = client.get_model_metadata(model, client_timeout=RPC_TIMEOUT_S)
    assert len(metadata.inputs) == 1 and len(metadata.outputs) == 1, metadata
    return metadata.inputs[0].name, metadata.outputs[0].name

