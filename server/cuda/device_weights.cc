// Weight upload (see device_weights.h): each layer's tensors are converted on
// the host into one contiguous image laid out as the device buffer will be,
// then copied with one cudaMemcpy per layer.
#include "server/cuda/device_weights.h"

#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "base/status_macros.h"
#include "layerserve/kernels/layer_ops.h"
#include "server/cuda/fp8_weights.h"

namespace layerserve::cuda {
namespace {

DType CoreDType(kernels::DType t) { return t == kernels::DType::kF16 ? DType::kF16 : DType::kBF16; }

// Writes `tensors`, concatenated and converted to `dtype`, at `dst`.
void ConvertInto(std::initializer_list<const HostTensor*> tensors, DType dtype,
                 unsigned char* dst) {
  std::vector<float> scratch;
  for (const HostTensor* t : tensors) {
    const size_t n = static_cast<size_t>(t->NumElements());
    if (t->dtype == dtype) {
      std::memcpy(dst, t->data.data(), t->data.size());
    } else {
      scratch.resize(n);
      ConvertToFloat(t->dtype, t->data.data(), n, scratch.data());
      ConvertFromFloat(scratch.data(), n, dtype, dst);
    }
    dst += n * DTypeSize(dtype);
  }
}

// Reorders `mlps` stacked gate/up weights at `rows`, each [gate (width rows)
// | up (width rows)] of `row_bytes` per row, into the interleaved order the
// fused gate (kernels::GateUpRow) reads.
void InterleaveGateUp(unsigned char* rows, int64_t mlps, int64_t width, size_t row_bytes) {
  const size_t mlp_bytes = static_cast<size_t>(2 * width) * row_bytes;
  std::vector<unsigned char> stacked(mlp_bytes);
  for (int64_t e = 0; e < mlps; ++e) {
    unsigned char* mlp = rows + static_cast<size_t>(e) * mlp_bytes;
    std::memcpy(stacked.data(), mlp, mlp_bytes);
    for (int64_t i = 0; i < width; ++i) {
      for (const bool up : {false, true}) {
        std::memcpy(mlp + static_cast<size_t>(kernels::GateUpRow(i, up)) * row_bytes,
                    stacked.data() + static_cast<size_t>((up ? width : 0) + i) * row_bytes,
                    row_bytes);
      }
    }
  }
}

}  // namespace

kernels::DType ActivationDTypeFor(const ModelSpan& model) {
  // The experts' grouped GEMMs are the project's own bf16 kernels.
  if (model.config.IsMixtureOfExperts()) return kernels::DType::kBF16;
  if (!model.layers.empty() && model.layers.front().q_proj.dtype == DType::kF16) {
    return kernels::DType::kF16;
  }
  return kernels::DType::kBF16;
}

absl::StatusOr<DeviceWeights> DeviceWeights::Upload(const ModelSpan& model, kernels::DType dtype) {
  if (dtype == kernels::DType::kF32) {
    return absl::InvalidArgumentError("cuda backend: weights must be bf16 or fp16 on the device");
  }
  const LlamaConfig& c = model.config;
  const bool moe = c.IsMixtureOfExperts();
  const LayerShape shape = LayerShape::FromConfig(c, dtype);
  if (shape.intermediate % kernels::kGateUpBlock != 0 ||
      shape.shared_intermediate % kernels::kGateUpBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: intermediate_size ", shape.intermediate, " and shared expert size ",
        shape.shared_intermediate, " must be multiples of ", kernels::kGateUpBlock));
  }
  const size_t e = static_cast<size_t>(kernels::DTypeBytes(dtype));
  const DType host_dtype = CoreDType(dtype);

  // FP8 checkpoints: the scaling the GEMM runs their FP8 linears with.
  std::optional<kernels::Fp8Scaling> fp8_scaling;
  if (c.fp8) {
    LS_ASSIGN_OR_RETURN(fp8_scaling, CudaFp8Scaling(*c.fp8));
  }

  DeviceWeights out;
  std::vector<unsigned char> image;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerWeights& w = model.layers[i];
    const int64_t layer_index = model.first_layer + static_cast<int64_t>(i);
    LS_RETURN_IF_ERROR(CheckLayerWeights(w, c, layer_index));
    // An FP8 shared_expert_gate is kept dequantized in float32 (one row), its
    // input the shared gate/up's quantized one (LayerDeviceWeights).
    const bool shared_gate_fp8 =
        c.HasSharedExpert() && w.shared_expert_gate.dtype == DType::kF8E4M3;
    const size_t shared_gate_bytes = shared_gate_fp8 ? sizeof(float) : e;
    // The FP8 linears' device images (empty for a linear the checkpoint left
    // unquantized).
    // A mixture of experts' gate_up and down are its experts', stacked.
    struct Fp8Images {
      std::optional<Fp8LinearImage> qkv, o, gate_up, down, shared_gate_up, shared_down;
    } f8;
    const auto fp8_image = [&](std::initializer_list<const HostTensor*> parts, bool gate_up,
                               std::string_view what,
                               std::optional<Fp8LinearImage>* dst) -> absl::Status {
      if ((*parts.begin())->dtype != DType::kF8E4M3) return absl::OkStatus();
      LS_ASSIGN_OR_RETURN(
          *dst, MakeFp8LinearImage(parts, *fp8_scaling, gate_up,
                                   absl::StrCat("layer ", layer_index, " ", std::string(what))));
      return absl::OkStatus();
    };
    if (fp8_scaling) {
      LS_RETURN_IF_ERROR(
          fp8_image({&w.q_proj, &w.k_proj, &w.v_proj}, false, "q/k/v_proj", &f8.qkv));
      LS_RETURN_IF_ERROR(fp8_image({&w.o_proj}, false, "o_proj", &f8.o));
      if (moe) {
        const auto experts_image = [&](const HostTensor& t, bool gate_up, std::string_view what,
                                       std::optional<Fp8LinearImage>* dst) -> absl::Status {
          if (t.dtype != DType::kF8E4M3) return absl::OkStatus();
          LS_ASSIGN_OR_RETURN(*dst, MakeFp8ExpertsImage(t, *fp8_scaling, gate_up,
                                                        absl::StrCat("layer ", layer_index, " ",
                                                                     std::string(what))));
          return absl::OkStatus();
        };
        LS_RETURN_IF_ERROR(
            experts_image(w.experts_gate_up, true, "experts' gate/up_proj", &f8.gate_up));
        LS_RETURN_IF_ERROR(experts_image(w.experts_down, false, "experts' down_proj", &f8.down));
        if (c.HasSharedExpert()) {
          LS_RETURN_IF_ERROR(fp8_image({&w.shared_gate_proj, &w.shared_up_proj}, true,
                                       "shared expert's gate/up_proj", &f8.shared_gate_up));
          LS_RETURN_IF_ERROR(fp8_image({&w.shared_down_proj}, false, "shared expert's down_proj",
                                       &f8.shared_down));
        }
      } else {
        LS_RETURN_IF_ERROR(
            fp8_image({&w.gate_proj, &w.up_proj}, true, "gate/up_proj", &f8.gate_up));
        LS_RETURN_IF_ERROR(fp8_image({&w.down_proj}, false, "down_proj", &f8.down));
      }
    }
    // A linear's weight bytes: its codes, or its elements in the activation
    // dtype; and its scales.
    const auto weight_bytes = [&](const std::optional<Fp8LinearImage>& f, int64_t elements) {
      return f ? f->codes.size() : static_cast<size_t>(elements) * e;
    };
    const auto scale_bytes = [](const std::optional<Fp8LinearImage>& f) {
      return f ? f->scale_floats() * sizeof(float) : size_t{0};
    };
    // The same Take sequence sizes the layer's buffer, places tensors in the
    // host image and yields the device views.
    struct Offsets {
      void* input_norm;
      void* w_qkv;
      void* b_qkv;
      void* w_o;
      void* post_norm;
      void* w_gate_up;
      void* w_down;
      void* router;
      void* w_shared_gate_up;
      void* w_shared_down;
      void* shared_gate;
      void* q_norm;
      void* k_norm;
      void* qkv_scale;
      void* o_scale;
      void* gate_up_scale;
      void* down_scale;
      void* shared_gate_up_scale;
      void* shared_down_scale;
    };
    const auto carve = [&](BumpLayout& layout) {
      Offsets o;
      o.input_norm = layout.Take(static_cast<size_t>(shape.hidden) * e);
      o.w_qkv = layout.Take(weight_bytes(f8.qkv, shape.qkv_weight_elements()));
      o.b_qkv =
          c.attention_bias ? layout.Take(static_cast<size_t>(shape.qkv_width()) * e) : nullptr;
      o.w_o = layout.Take(weight_bytes(f8.o, shape.o_weight_elements()));
      o.post_norm = layout.Take(static_cast<size_t>(shape.hidden) * e);
      o.w_gate_up = layout.Take(weight_bytes(f8.gate_up, shape.gate_up_weight_elements()));
      o.w_down = layout.Take(weight_bytes(f8.down, shape.down_weight_elements()));
      o.router =
          moe ? layout.Take(static_cast<size_t>(shape.router_weight_elements()) * e) : nullptr;
      const int64_t shared = shape.shared_intermediate * shape.hidden;
      const bool has_shared = shared > 0;
      o.w_shared_gate_up =
          has_shared ? layout.Take(weight_bytes(f8.shared_gate_up, 2 * shared)) : nullptr;
      o.w_shared_down = has_shared ? layout.Take(weight_bytes(f8.shared_down, shared)) : nullptr;
      o.shared_gate =
          has_shared ? layout.Take(static_cast<size_t>(shape.hidden) * shared_gate_bytes) : nullptr;
      const size_t head = static_cast<size_t>(shape.head_dim) * e;
      o.q_norm = shape.qk_norm ? layout.Take(head) : nullptr;
      o.k_norm = shape.qk_norm ? layout.Take(head) : nullptr;
      o.qkv_scale = f8.qkv ? layout.Take(scale_bytes(f8.qkv)) : nullptr;
      o.o_scale = f8.o ? layout.Take(scale_bytes(f8.o)) : nullptr;
      o.gate_up_scale = f8.gate_up ? layout.Take(scale_bytes(f8.gate_up)) : nullptr;
      o.down_scale = f8.down ? layout.Take(scale_bytes(f8.down)) : nullptr;
      o.shared_gate_up_scale =
          f8.shared_gate_up ? layout.Take(scale_bytes(f8.shared_gate_up)) : nullptr;
      o.shared_down_scale = f8.shared_down ? layout.Take(scale_bytes(f8.shared_down)) : nullptr;
      return o;
    };
    BumpLayout sizing(nullptr);
    carve(sizing);
    image.assign(sizing.bytes(), 0);
    BumpLayout host_layout(image.data());
    const Offsets h = carve(host_layout);
    const auto at = [](void* p) { return static_cast<unsigned char*>(p); };
    // An FP8 linear's codes and scales, or its weight converted.
    const auto place = [&](const std::optional<Fp8LinearImage>& f, void* weight, void* scales,
                           std::initializer_list<const HostTensor*> parts) {
      if (!f) {
        ConvertInto(parts, host_dtype, at(weight));
        return;
      }
      std::memcpy(weight, f->codes.data(), f->codes.size());
      std::memcpy(scales, f->scales.data(), f->scales.size() * sizeof(float));
      std::memcpy(static_cast<float*>(scales) + f->scales_128_at(), f->scales_128.data(),
                  f->scales_128.size() * sizeof(float));
    };
    ConvertInto({&w.input_layernorm}, host_dtype, at(h.input_norm));
    place(f8.qkv, h.w_qkv, h.qkv_scale, {&w.q_proj, &w.k_proj, &w.v_proj});
    if (c.attention_bias) ConvertInto({&w.q_bias, &w.k_bias, &w.v_bias}, host_dtype, at(h.b_qkv));
    place(f8.o, h.w_o, h.o_scale, {&w.o_proj});
    ConvertInto({&w.post_attention_layernorm}, host_dtype, at(h.post_norm));
    if (moe) {
      place(f8.gate_up, h.w_gate_up, h.gate_up_scale, {&w.experts_gate_up});
      place(f8.down, h.w_down, h.down_scale, {&w.experts_down});
      ConvertInto({&w.router}, host_dtype, at(h.router));
    } else {
      place(f8.gate_up, h.w_gate_up, h.gate_up_scale, {&w.gate_proj, &w.up_proj});
      place(f8.down, h.w_down, h.down_scale, {&w.down_proj});
    }
    // (An FP8 gate/up is interleaved already, by its own block.)
    if (!f8.gate_up) {
      InterleaveGateUp(at(h.w_gate_up), shape.mlps(), shape.intermediate,
                       static_cast<size_t>(shape.hidden) * e);
    }
    if (shape.shared_intermediate > 0) {
      place(f8.shared_gate_up, h.w_shared_gate_up, h.shared_gate_up_scale,
            {&w.shared_gate_proj, &w.shared_up_proj});
      if (!f8.shared_gate_up) {
        InterleaveGateUp(at(h.w_shared_gate_up), 1, shape.shared_intermediate,
                         static_cast<size_t>(shape.hidden) * e);
      }
      place(f8.shared_down, h.w_shared_down, h.shared_down_scale, {&w.shared_down_proj});
      if (shared_gate_fp8) {
        const std::vector<float> gate =
            w.shared_expert_gate.ToFloat();  // dequantized, exact in float32
        std::memcpy(h.shared_gate, gate.data(), gate.size() * sizeof(float));
      } else {
        ConvertInto({&w.shared_expert_gate}, host_dtype, at(h.shared_gate));
      }
    }
    if (shape.qk_norm) {
      ConvertInto({&w.q_norm}, host_dtype, at(h.q_norm));
      ConvertInto({&w.k_norm}, host_dtype, at(h.k_norm));
    }

    LS_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(image.size()));
    LS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(buffer.data(), image.data(), image.size(), cudaMemcpyHostToDevice));
    BumpLayout device_layout(buffer.data());
    const Offsets d = carve(device_layout);
    LayerDeviceWeights view{d.input_norm,    d.w_qkv,       d.b_qkv,
                            d.w_o,           d.post_norm,   d.w_gate_up,
                            d.w_down,        d.router,      d.w_shared_gate_up,
                            d.w_shared_down, d.shared_gate, d.q_norm,
                            d.k_norm};
    const auto linear = [&](const std::optional<Fp8LinearImage>& f, void* scales) {
      if (!f) return Fp8Linear{};
      const auto* w_scale = static_cast<const float*>(scales);
      return Fp8Linear{*fp8_scaling, w_scale, f->input_scale,
                       f->scales_128.empty() ? nullptr : w_scale + f->scales_128_at()};
    };
    view.qkv_fp8 = linear(f8.qkv, d.qkv_scale);
    view.o_fp8 = linear(f8.o, d.o_scale);
    view.gate_up_fp8 = linear(f8.gate_up, d.gate_up_scale);
    view.down_fp8 = linear(f8.down, d.down_scale);
    view.shared_gate_up_fp8 = linear(f8.shared_gate_up, d.shared_gate_up_scale);
    view.shared_down_fp8 = linear(f8.shared_down, d.shared_down_scale);
    view.shared_gate_fp8 = shared_gate_fp8;
    out.views_.push_back(view);
    const int64_t shared = shape.shared_intermediate * shape.hidden;
    out.bytes_ +=
        e * static_cast<size_t>(2 * shape.hidden + (c.attention_bias ? shape.qkv_width() : 0) +
                                shape.router_weight_elements() + shape.head_norm_elements()) +
        (shared > 0 ? static_cast<size_t>(shape.hidden) * shared_gate_bytes : 0) +
        weight_bytes(f8.shared_gate_up, 2 * shared) + weight_bytes(f8.shared_down, shared) +
        scale_bytes(f8.shared_gate_up) + scale_bytes(f8.shared_down) +
        weight_bytes(f8.qkv, shape.qkv_weight_elements()) +
        weight_bytes(f8.o, shape.o_weight_elements()) +
        weight_bytes(f8.gate_up, shape.gate_up_weight_elements()) +
        weight_bytes(f8.down, shape.down_weight_elements()) + scale_bytes(f8.qkv) +
        scale_bytes(f8.o) + scale_bytes(f8.gate_up) + scale_bytes(f8.down);
    out.buffers_.push_back(std::move(buffer));
  }

  const std::vector<float> inv_freq = RopeInvFreq(c);
  LS_ASSIGN_OR_RETURN(out.inv_freq_, DeviceBuffer::Allocate(inv_freq.size() * sizeof(float)));
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.inv_freq_.data(), inv_freq.data(),
                                     inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  return out;
}

absl::Status CheckExpertsCanRun(const LlamaConfig& c, const cudaDeviceProp& props) {
  if (props.major != 9 || props.minor != 0 || !kernels::GemmBuiltWithSm90a()) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: mixture-of-experts layers (", c.model_type,
        ") run on the project's grouped GEMM, which needs a compute capability 9.0 GPU (H100, "
        "H200) and an sm_90a build; this is ",
        props.name, " (sm_", props.major, props.minor, "), ",
        kernels::GemmBuiltWithSm90a() ? "built with" : "built without",
        " sm_90a. --backend=cpu serves them"));
  }
  if (c.num_experts > kernels::kMaxGemmGroups || c.hidden_size % 8 != 0 ||
      c.intermediate_size % 8 != 0) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: mixture of experts with ", c.num_experts, " experts, hidden ", c.hidden_size,
        ", intermediate ", c.intermediate_size, " is not supported (at most ",
        kernels::kMaxGemmGroups, " experts; sizes multiples of 8)"));
  }
  return absl::OkStatus();
}

absl::Status CheckFp8CanRun(const LlamaConfig& c, const cudaDeviceProp& props) {
  if (!c.fp8) return absl::OkStatus();
  if (props.major != 9 || props.minor != 0 || !kernels::GemmBuiltWithSm90a()) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: FP8 checkpoints (", c.fp8->Describe(),
        ") run on the project's FP8 GEMM, which needs a compute capability 9.0 GPU (H100, H200) "
        "and an sm_90a build; this is ",
        props.name, " (sm_", props.major, props.minor, "), ",
        kernels::GemmBuiltWithSm90a() ? "built with" : "built without",
        " sm_90a. --backend=cpu serves them"));
  }
  return absl::OkStatus();
}

}  // namespace layerserve::cuda
