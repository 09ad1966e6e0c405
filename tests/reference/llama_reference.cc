// Float64 reference decoder layer (see llama_reference.h). Straight loops, no
// tricks: each function is meant to be checked by reading it.
#include "tests/reference/llama_reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace reference {
namespace {

constexpr double kPi = 3.14159265358979323846;

size_t Idx(int64_t row, int64_t cols, int64_t col) { return static_cast<size_t>(row * cols + col); }

}  // namespace

std::vector<double> RopeInvFreq(const Config& config) {
  const int64_t half = config.head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(config.rope_theta,
                           -static_cast<double>(2 * i) / static_cast<double>(config.head_dim));
  }
  if (!config.llama3) return inv_freq;
  // Llama 3.1: wavelengths longer than original_max / low_freq_factor are
  // stretched by `factor`, shorter than original_max / high_freq_factor kept,
  // and the band between interpolated linearly in original_max / wavelength.
  const double old_len = config.llama3_original_max_positions;
  const double low = config.llama3_low_freq_factor;
  const double high = config.llama3_high_freq_factor;
  const double factor = config.llama3_factor;
  for (double& f : inv_freq) {
    const double wavelen = 2 * kPi / f;
    if (wavelen < old_len / high) continue;
    if (wavelen > old_len / low) {
      f = f / factor;
      continue;
    }
    const double smooth = (old_len / wavelen - low) / (high - low);
    f = (1 - smooth) * f / factor + smooth * f;
  }
  return inv_freq;
}

std::vector<double> RmsNorm(const std::vector<double>& x, int64_t rows, int64_t cols,
                            const std::vector<double>& weight, double eps) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double sum_sq = 0;
    for (int64_t c = 0; c < cols; ++c) sum_sq += x[Idx(r, cols, c)] * x[Idx(r, cols, c)];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) {
      out[Idx(r, cols, c)] = x[Idx(r, cols, c)] * inv_rms * weight[static_cast<size_t>(c)];
    }
  }
  return out;
}

std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<double>& w, int64_t out,
                           const std::vector<double>& bias) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = bias.empty() ? 0.0 : bias[static_cast<size_t>(o)];
      for (int64_t i = 0; i < in; ++i) acc += x[Idx(r, in, i)] * w[Idx(o, in, i)];
      y[Idx(r, out, o)] = acc;
    }
  }
  return y;
}

void Rope(std::vector<double>& x, int64_t heads, int64_t head_dim,
          const std::vector<int32_t>& cu_seqlens, const std::vector<double>& inv_freq) {
  const int64_t width = heads * head_dim;
  const int64_t half = head_dim / 2;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
      const double pos = static_cast<double>(t - cu_seqlens[s]);
      for (int64_t h = 0; h < heads; ++h) {
        double* v = &x[Idx(t, width, h * head_dim)];
        // rotate_half pairs element i with element i + half.
        for (int64_t i = 0; i < half; ++i) {
          const double angle = pos * inv_freq[static_cast<size_t>(i)];
          const double a = v[i];
          const double b = v[i + half];
          v[i] = a * std::cos(angle) - b * std::sin(angle);
          v[i + half] = b * std::cos(angle) + a * std::sin(angle);
        }
      }
    }
  }
}

std::vector<double> Attention(const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, const std::vector<int32_t>& cu_seqlens,
                              int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t window) {
  const int64_t q_width = heads * head_dim;
  const int64_t kv_width = kv_heads * head_dim;
  const int64_t group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> out(q.size(), 0.0);
  std::vector<double> scores;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t start = cu_seqlens[s];
    const int64_t end = cu_seqlens[s + 1];
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = start; i < end; ++i) {
        // Query i attends to keys first..i of its own sequence: all of them,
        // or the last `window`.
        const int64_t first = window > 0 ? std::max(start, i - window + 1) : start;
        scores.assign(static_cast<size_t>(i - first + 1), 0.0);
        double max_score = -INFINITY;
        for (int64_t j = first; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < head_dim; ++d) {
            dot += q[Idx(i, q_width, h * head_dim + d)] * k[Idx(j, kv_width, kvh * head_dim + d)];
          }
          scores[static_cast<size_t>(j - first)] = dot * scale;
          max_score = std::max(max_score, dot * scale);
        }
        double denom = 0;
        for (double& sc : scores) {
          sc = std::exp(sc - max_score);
          denom += sc;
        }
        for (int64_t j = first; j <= i; ++j) {
          const double p = scores[static_cast<size_t>(j - first)] / denom;
          for (int64_t d = 0; d < head_dim; ++d) {
            out[Idx(i, q_width, h * head_dim + d)] += p * v[Idx(j, kv_width, kvh * head_dim + d)];
          }
        }
      }
    }
  }
  return out;
}

std::vector<double> SiluMul(const std::vector<double>& gate, const std::vector<double>& up) {
  std::vector<double> out(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    out[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
  }
  return out;
}

std::vector<Routing> RouteTopK(const std::vector<double>& logits, int64_t rows, int64_t experts,
                               int64_t top_k, bool normalize) {
  std::vector<Routing> out(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const double* l = logits.data() + r * experts;
    const double max_logit = *std::max_element(l, l + experts);
    std::vector<double> p(static_cast<size_t>(experts));
    double sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(l[e] - max_logit);
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    Routing& routing = out[static_cast<size_t>(r)];
    double chosen = 0;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[order[j]];
    if (!normalize) chosen = 1;
    for (int64_t j = 0; j < top_k; ++j) {
      routing.experts.push_back(order[j]);
      routing.weights.push_back(p[order[j]] / chosen);
    }
    routing.margin = top_k < experts ? p[order[top_k - 1]] - p[order[top_k]]
                                     : std::numeric_limits<double>::infinity();
  }
  return out;
}

double RoundToE4M3(double v) {
  if (std::isnan(v)) return v;
  double a = std::fabs(v);
  if (a >= 464) {
    a = 448;  // from the midpoint between 448 and 480 (NaN in e4m3fn) on
  } else {
    // Normals have 3 mantissa bits below their leading one; subnormals share
    // the smallest normal's exponent, -6, so their step is 2^-9.
    int e = 0;
    std::frexp(a, &e);  // a = f * 2^e with f in [0.5, 1): the leading one is 2^(e-1)
    const double step = std::ldexp(1.0, std::max(e - 1, -6) - 3);
    a = std::nearbyint(a / step) * step;  // ties to even in the default rounding mode
  }
  return std::copysign(a, v);
}

std::vector<double> QuantizeInput(const std::vector<double>& x, int64_t rows, int64_t cols,
                                  const InputQuant& q) {
  if (!q.enabled) return x;
  std::vector<double> out(x);
  const int64_t group = q.group > 0 ? q.group : cols;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < cols; g += group) {
      const int64_t end = std::min(cols, g + group);
      double scale = q.static_scale;
      if (!(scale > 0)) {
        double amax = 0;
        for (int64_t i = g; i < end; ++i) amax = std::max(amax, std::fabs(x[r * cols + i]));
        if (amax == 0) continue;
        // In float32, as the formats' quantizers compute it (torch): an
        // input that lies exactly on an e4m3 tie in exact arithmetic (common
        // with BF16 data, whose factors cancel in x / s) then meets the same
        // rounding of the scale as in a float32 backend.
        scale = static_cast<float>(static_cast<float>(amax) / 448.0f);
      }
      for (int64_t i = g; i < end; ++i) {
        out[r * cols + i] = RoundToE4M3(x[r * cols + i] / scale) * scale;
      }
    }
  }
  return out;
}

std::vector<double> ExpertMlps(const std::vector<double>& m, int64_t rows, const Config& config,
                               const Layer& layer) {
  const int64_t hidden = config.hidden;
  const int64_t inter = config.intermediate;
  const std::vector<double> logits = Linear(m, rows, hidden, layer.router, config.experts, {});
  const std::vector<Routing> routing =
      RouteTopK(logits, rows, config.experts, config.top_k, config.normalize_top_k);
  std::vector<double> out(static_cast<size_t>(rows * hidden), 0.0);
  const std::vector<double> mq = QuantizeInput(m, rows, hidden, layer.experts_gate_up_input);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> row(mq.begin() + r * hidden, mq.begin() + (r + 1) * hidden);
    const Routing& route = routing[static_cast<size_t>(r)];
    for (size_t j = 0; j < route.experts.size(); ++j) {
      const int64_t e = route.experts[j];
      const auto gate_begin = layer.experts_gate_up.begin() + e * 2 * inter * hidden;
      const std::vector<double> wgate(gate_begin, gate_begin + inter * hidden);
      const std::vector<double> wup(gate_begin + inter * hidden, gate_begin + 2 * inter * hidden);
      const auto down_begin = layer.experts_down.begin() + e * hidden * inter;
      const std::vector<double> wdown(down_begin, down_begin + hidden * inter);
      const std::vector<double> act = QuantizeInput(
          SiluMul(Linear(row, 1, hidden, wgate, inter, {}), Linear(row, 1, hidden, wup, inter, {})),
          1, inter, layer.experts_down_input);
      const std::vector<double> y = Linear(act, 1, inter, wdown, hidden, {});
      for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] += route.weights[j] * y[i];
    }
  }
  if (config.shared_intermediate > 0) {
    const int64_t shared = config.shared_intermediate;
    const std::vector<double> ms = QuantizeInput(m, rows, hidden, layer.shared_gate_up_input);
    const std::vector<double> act =
        QuantizeInput(SiluMul(Linear(ms, rows, hidden, layer.shared_wgate, shared, {}),
                              Linear(ms, rows, hidden, layer.shared_wup, shared, {})),
                      rows, shared, layer.shared_down_input);
    const std::vector<double> y = Linear(act, rows, shared, layer.shared_wdown, hidden, {});
    const std::vector<double> g = Linear(QuantizeInput(m, rows, hidden, layer.shared_gate_input),
                                         rows, hidden, layer.shared_gate, 1, {});
    for (int64_t r = 0; r < rows; ++r) {
      const double scale = 1.0 / (1.0 + std::exp(-g[r]));
      for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] += scale * y[r * hidden + i];
    }
  }
  return out;
}

namespace {

// The attention half of a layer: h = x + attention(RMSNorm(x)) Wo^T.
std::vector<double> AttentionBlock(const std::vector<double>& x,
                                   const std::vector<int32_t>& cu_seqlens, const Config& config,
                                   const Layer& layer) {
  const int64_t tokens = cu_seqlens.empty() ? 0 : cu_seqlens.back();
  const int64_t hidden = config.hidden;
  const int64_t q_width = config.heads * config.head_dim;
  const int64_t kv_width = config.kv_heads * config.head_dim;

  const std::vector<double> n =
      QuantizeInput(RmsNorm(x, tokens, hidden, layer.input_norm, config.rms_norm_eps), tokens,
                    hidden, layer.qkv_input);
  std::vector<double> q = Linear(n, tokens, hidden, layer.wq, q_width, layer.bq);
  std::vector<double> k = Linear(n, tokens, hidden, layer.wk, kv_width, layer.bk);
  std::vector<double> v = Linear(n, tokens, hidden, layer.wv, kv_width, layer.bv);
  const std::vector<double> inv_freq = RopeInvFreq(config);
  if (config.qk_norm) {
    // Each head is a row of head_dim values.
    q = RmsNorm(q, tokens * config.heads, config.head_dim, layer.q_norm, config.rms_norm_eps);
    k = RmsNorm(k, tokens * config.kv_heads, config.head_dim, layer.k_norm, config.rms_norm_eps);
  }
  Rope(q, config.heads, config.head_dim, cu_seqlens, inv_freq);
  Rope(k, config.kv_heads, config.head_dim, cu_seqlens, inv_freq);
  if (config.kv_cache_fp8) {
    // Each head's row of a token, quantized on its own.
    const InputQuant per_row{.enabled = true};
    k = QuantizeInput(k, tokens * config.kv_heads, config.head_dim, per_row);
    v = QuantizeInput(v, tokens * config.kv_heads, config.head_dim, per_row);
  }
  const std::vector<double> a = Attention(q, k, v, cu_seqlens, config.heads, config.kv_heads,
                                          config.head_dim, config.sliding_window);
  const std::vector<double> o = Linear(QuantizeInput(a, tokens, q_width, layer.o_input), tokens,
                                       q_width, layer.wo, hidden, {});

  std::vector<double> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = x[i] + o[i];
  return h;
}

}  // namespace

std::vector<double> RoutingMargins(const std::vector<double>& x,
                                   const std::vector<int32_t>& cu_seqlens, const Config& config,
                                   const Layer& layer) {
  const int64_t tokens = cu_seqlens.empty() ? 0 : cu_seqlens.back();
  const std::vector<double> h = AttentionBlock(x, cu_seqlens, config, layer);
  const std::vector<double> m =
      RmsNorm(h, tokens, config.hidden, layer.post_norm, config.rms_norm_eps);
  const std::vector<double> logits =
      Linear(m, tokens, config.hidden, layer.router, config.experts, {});
  std::vector<double> margins;
  for (const Routing& r : RouteTopK(logits, tokens, config.experts, config.top_k)) {
    margins.push_back(r.margin);
  }
  return margins;
}

std::vector<double> DecoderLayer(const std::vector<double>& x,
                                 const std::vector<int32_t>& cu_seqlens, const Config& config,
                                 const Layer& layer) {
  const int64_t tokens = cu_seqlens.empty() ? 0 : cu_seqlens.back();
  const int64_t hidden = config.hidden;
  std::vector<double> h = AttentionBlock(x, cu_seqlens, config, layer);
  const std::vector<double> m = RmsNorm(h, tokens, hidden, layer.post_norm, config.rms_norm_eps);
  if (config.experts > 0) {
    const std::vector<double> moe = ExpertMlps(m, tokens, config, layer);
    for (size_t i = 0; i < x.size(); ++i) h[i] += moe[i];
    return h;
  }
  const std::vector<double> mq = QuantizeInput(m, tokens, hidden, layer.gate_up_input);
  const std::vector<double> gate = Linear(mq, tokens, hidden, layer.wgate, config.intermediate, {});
  const std::vector<double> up = Linear(mq, tokens, hidden, layer.wup, config.intermediate, {});
  const std::vector<double> act =
      QuantizeInput(SiluMul(gate, up), tokens, config.intermediate, layer.down_input);
  const std::vector<double> down =
      Linear(act, tokens, config.intermediate, layer.wdown, hidden, {});

  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = h[i] + down[i];
  return out;
}

}  // namespace reference
