"""What the deployment tests that start several CPU layerserve processes
share (test_proxy_limits, test_session_routing, test_scale_out): the flags of
a small server on one core, and a tiny Llama checkpoint to serve, written by
tests/python/llama_numpy.py (conftest.py puts it on sys.path)."""

from llama_numpy import make_checkpoint

# One compute thread, a 16 MiB KV cache, few gRPC threads and a 5 s drain;
# each test adds its own --drain-sessions-timeout-s.
SMALL_SERVER_FLAGS = ["--backend=cpu", "--cpu-threads=1", "--kv-cache-memory=16MiB",
                      "--grpc-threads=2", "--reply-threads=1", "--drain-timeout-s=5"]

# Two float32 layers of hidden 64, with grouped-query attention.
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-5,
                  rope_theta=10000.0, torch_dtype="float32")


def write_tiny_llama(work, seed):
    """work/tiny-llama: TINY_LLAMA with float32 weights drawn from `seed`."""
    model_dir = work / "tiny-llama"
    make_checkpoint(model_dir, TINY_LLAMA, "F32", seed=seed)
    return model_dir
