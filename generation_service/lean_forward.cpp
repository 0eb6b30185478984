// The whole Llama decoder pass in one call: what lean_llama.py's forward_batch computes, without ~40 Python-level
// tensor ops per layer.
//
// Why: at one to a few dozen rows per pass a 135M-parameter step is dominated by per-op overhead, not arithmetic
// (on a 2-core Zen 5: q4_1 step 17.6 ms, of which its linears are 6.9 ms; the rest is dispatch of small ops and
// Python). Here each layer is five block_linear calls plus loops over the rows for the norms, RoPE, the KV write,
// attention and SiLU; nothing is allocated per op except the linears' outputs.
//
// Math, per row, as lean_llama.py (and transformers' LlamaForCausalLM) does it in fp32:
//   rms(x) = w * (x * 1 / sqrt(mean(x^2) + eps));  rope(t) = t * cos + rotate_half(t) * sin
//   attention: query head h reads kv head h / G; scores * scale + mask (additive; none = causal over the new rows),
//   softmax in fp32; out = probs @ values;  mlp = down(silu(gate) * up).
// Attention of short segments (q * S small) runs in loops here; longer ones use ATen's matmul (blocked GEMM), as
// the Python path does.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace {

// Attention of a segment runs in the loops below when q * S * heads is at most this (else ATen's matmul).
constexpr int64_t kLoopAttentionWork = 1 << 12;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = 8; w >= 1; w /= 2)  // pairwise halving: vectorizes, unlike a scalar chain of 16 adds
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  float s = acc[0];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp over an array, in a form the compiler vectorizes (std::exp stays a scalar call): x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite split of ln2), exp(r) by its Taylor series to r^8 (relative error < 1e-8, below
// float's 6e-8), times 2^n built in the exponent bits. Inputs below -87 (masked positions) give 0.
void exp_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = (v - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
    float p = 1.0f / 40320;
    p = p * r + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[i] = x[i] < -87.0f ? 0.0f : p * scale;
  }
}

void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    const float ms = dot(xr, xr, H) / (float)H;
    const float inv = 1.0f / std::sqrt(ms + eps);
    float* o = out + r * H;
    for (int64_t j = 0; j < H; ++j) o[j] = w[j] * (xr[j] * inv);
  }
}

// In place on `heads` vectors of D at t (stride D), position p: t * cos + rotate_half(t) * sin.
void rope(float* t, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  float tmp[512];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = t + h * D;
    std::copy(v, v + D, tmp);
    for (int64_t j = 0; j < half; ++j) v[j] = tmp[j] * cos[j] + (-tmp[j + half]) * sin[j];
    for (int64_t j = half; j < D; ++j) v[j] = tmp[j] * cos[j] + tmp[j - half] * sin[j];
  }
}

struct Segment {
  int64_t start, q, past;
  torch::Tensor k, v;  // [layers, kv_heads, capacity, D], rows contiguous
  torch::Tensor mask;  // additive float32 [q, past + q], or undefined (causal over the new rows)
};

class LeanForward {
 public:
  LeanForward(torch::Tensor embed, std::vector<torch::Tensor> ln1, std::vector<torch::Tensor> wqkv,
              std::vector<torch::Tensor> wo, std::vector<torch::Tensor> ln2, std::vector<torch::Tensor> wgu,
              std::vector<torch::Tensor> wd, torch::Tensor norm, torch::Tensor head, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, bool bf16_amx)
      : embed_(embed.contiguous()), ln1_(ln1), wqkv_(wqkv), wo_(wo), ln2_(ln2), wgu_(wgu), wd_(wd),
        norm_(norm.contiguous()), head_(head.contiguous()), H_(heads), Hkv_(kv_heads), D_(head_dim),
        eps_((float)eps), scale_(1.0f / std::sqrt((float)head_dim)), amx_(bf16_amx) {
    TORCH_CHECK(!amx_ || amx_available(), "bf16_amx: AMX tiles are not available here");
    TORCH_CHECK(embed_.scalar_type() == torch::kFloat32 && embed_.dim() == 2, "embed must be float32 [V, hidden]");
    const size_t L = ln1.size();
    TORCH_CHECK(wqkv.size() == L && wo.size() == L && ln2.size() == L && wgu.size() == L && wd.size() == L,
                "every layer needs ln1, wqkv, wo, ln2, wgu, wd");
    TORCH_CHECK(H_ % Hkv_ == 0 && D_ <= 512 && D_ % 2 == 0, "unsupported head layout");
    hidden_ = embed_.size(1);
    for (size_t i = 0; i < L; ++i) {
      ln1_[i] = ln1_[i].contiguous();
      ln2_[i] = ln2_[i].contiguous();
    }
  }

  // ids, positions: int64 [N]; cos, sin: float32 [P, D] tables (P > max position); per segment its row count, past
  // length, cache k/v and mask (an empty tensor for none) and logits rows (0 = all). -> (logits [sum q', V],
  // final normed hidden rows [sum q', hidden]).
  std::vector<torch::Tensor> forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const std::vector<int64_t>& rows,
                                     const std::vector<int64_t>& past, const std::vector<torch::Tensor>& ks,
                                     const std::vector<torch::Tensor>& vs, const std::vector<torch::Tensor>& masks,
                                     const std::vector<int64_t>& logits_rows) {
    torch::NoGradGuard no_grad;
    const int64_t N = ids.size(0), Hd = hidden_, D = D_, H = H_, Hkv = Hkv_;
    const int64_t wq = (H + 2 * Hkv) * D;
    TORCH_CHECK(positions.size(0) == N && cos.scalar_type() == torch::kFloat32 && cos.size(1) == D,
                "positions / rope tables do not match");
    std::vector<Segment> segs;
    int64_t start = 0;
    for (size_t j = 0; j < rows.size(); ++j) {
      Segment s{start, rows[j], past[j], ks[j], vs[j], masks[j].numel() ? masks[j].contiguous() : torch::Tensor()};
      TORCH_CHECK(s.k.scalar_type() == torch::kFloat32 && s.k.dim() == 4 && s.k.stride(3) == 1 &&
                      s.k.stride(2) == D && s.v.stride(3) == 1 && s.v.stride(2) == D,
                  "cache must be float32 [layers, kv_heads, capacity, D] with contiguous rows");
      TORCH_CHECK(s.past + s.q <= s.k.size(2), "cache capacity exceeded");
      TORCH_CHECK(!s.mask.defined() || (s.mask.size(0) == s.q && s.mask.size(1) == s.past + s.q &&
                                        s.mask.scalar_type() == torch::kFloat32),
                  "mask must be float32 [q, past + q]");
      segs.push_back(s);
      start += rows[j];
    }
    TORCH_CHECK(start == N, "segment rows do not add up to the ids");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();

    torch::Tensor x = embed_.index_select(0, ids).contiguous();  // [N, hidden]
    torch::Tensor h = torch::empty_like(x);
    torch::Tensor o = torch::empty({N, H * D}, x.options());
    float* xp = x.data_ptr<float>();
    for (size_t i = 0; i < ln1_.size(); ++i) {
      rms_norm(xp, ln1_[i].data_ptr<float>(), h.data_ptr<float>(), N, Hd, eps_);
      torch::Tensor qkv = block_linear(h, wqkv_[i], amx_);  // [N, (H + 2 Hkv) D]
      float* qp = qkv.data_ptr<float>();
      for (int64_t n = 0; n < N; ++n)
        rope(qp + n * wq, H + Hkv, D, cp + pos[n] * D, sp + pos[n] * D);  // q and k heads are adjacent
      attend_all(i, segs, qp, wq, o.data_ptr<float>());
      add_into(x, block_linear(o, wo_[i], amx_));
      rms_norm(xp, ln2_[i].data_ptr<float>(), h.data_ptr<float>(), N, Hd, eps_);
      torch::Tensor gu = block_linear(h, wgu_[i], amx_);  // [N, 2 I]
      const int64_t I = gu.size(1) / 2;
      torch::Tensor act = torch::empty({N, I}, x.options());
      const float* g = gu.data_ptr<float>();
      float* a = act.data_ptr<float>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < I; ++j) {
          const float gv = g[n * 2 * I + j];
          a[n * I + j] = gv / (1.0f + std::exp(-gv)) * g[n * 2 * I + I + j];
        }
      add_into(x, block_linear(act, wd_[i], amx_));
    }
    // The rows whose logits are asked for, normed.
    std::vector<int64_t> keep;
    for (size_t j = 0; j < segs.size(); ++j) {
      const int64_t from = logits_rows[j] ? segs[j].q - logits_rows[j] : 0;
      for (int64_t r = from; r < segs[j].q; ++r) keep.push_back(segs[j].start + r);
    }
    torch::Tensor sel = (int64_t)keep.size() == N ? x : x.index_select(0, torch::tensor(keep, ids.options()));
    torch::Tensor fin = torch::empty_like(sel);
    rms_norm(sel.data_ptr<float>(), norm_.data_ptr<float>(), fin.data_ptr<float>(), sel.size(0), Hd, eps_);
    return {block_linear(fin, head_, amx_), fin};
  }

 private:
  static void add_into(torch::Tensor& x, const torch::Tensor& y) {
    float* a = x.data_ptr<float>();
    const float* b = y.data_ptr<float>();
    const int64_t n = x.numel();
    for (int64_t j = 0; j < n; ++j) a[j] += b[j];
  }

  // Layer i's keys/values of segment s's new rows into its cache.
  void write_kv(size_t i, const Segment& s, const float* qkv, int64_t wq) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_;
    float* kc = s.k.data_ptr<float>() + i * s.k.stride(0);
    float* vc = s.v.data_ptr<float>() + i * s.v.stride(0);
    for (int64_t r = 0; r < s.q; ++r) {
      const float* row = qkv + (s.start + r) * wq;
      for (int64_t h = 0; h < Hkv; ++h) {
        std::copy(row + (H + h) * D, row + (H + h + 1) * D, kc + h * s.k.stride(1) + (s.past + r) * D);
        std::copy(row + (H + Hkv + h) * D, row + (H + Hkv + h + 1) * D, vc + h * s.v.stride(1) + (s.past + r) * D);
      }
    }
  }

  // Layer i's attention of every segment -> o [N, H D]. Short segments: one job per (row, kv head), spread over
  // the threads; each job's G query heads read each key and value row once. A row's result does not depend on the
  // other rows of the pass (the same loop order for every row). Long segments: ATen's blocked matmul.
  void attend_all(size_t i, const std::vector<Segment>& segs, const float* qkv, int64_t wq, float* o) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_, G = H / Hkv;
    std::vector<std::pair<int64_t, int64_t>> jobs;  // (segment, row)
    int64_t work = 0;
    for (size_t j = 0; j < segs.size(); ++j) {
      write_kv(i, segs[j], qkv, wq);
      const int64_t S = segs[j].past + segs[j].q;
      // With bf16 activations (amx_) the next linear rounds every row to bf16, which turns the last-bit differences
      // between the loop and the matmul into visible ones; so decode rows (an AR step, a draft tree) always take
      // the loops, and a row gets the same bits in any pass. Prompt chunks (causal, several rows) may take the matmul.
      const bool decode_rows = segs[j].mask.defined() || segs[j].q == 1;
      if (segs[j].q * S * H > kLoopAttentionWork && !(amx_ && decode_rows)) {
        attend_matmul(i, segs[j], qkv, wq, o);
        continue;
      }
      for (int64_t r = 0; r < segs[j].q; ++r) jobs.emplace_back((int64_t)j, r);
      work += segs[j].q * S;
    }
    if (jobs.empty()) return;
    const int64_t n = (int64_t)jobs.size() * Hkv;
    // A job is ~S * D * G * 2 multiply-adds; keep a thread's share above ~64K of them.
    const int64_t grain = std::max<int64_t>(1, (int64_t)jobs.size() * Hkv * 65536 / std::max<int64_t>(1, work * D * G * 2));
    at::parallel_for(0, n, grain, [&](int64_t a, int64_t b) {
      std::vector<float> p;
      std::vector<float> acc(G * D);
      for (int64_t job = a; job < b; ++job) {
        const Segment& s = segs[jobs[job / Hkv].first];
        const int64_t r = jobs[job / Hkv].second, h = job % Hkv, S = s.past + s.q;
        const int64_t seen = s.mask.defined() ? S : s.past + r + 1;  // causal without a mask
        const float* mask = s.mask.defined() ? s.mask.data_ptr<float>() + r * S : nullptr;
        const float* kh = s.k.data_ptr<float>() + i * s.k.stride(0) + h * s.k.stride(1);
        const float* vh = s.v.data_ptr<float>() + i * s.v.stride(0) + h * s.v.stride(1);
        const float* q0 = qkv + (s.start + r) * wq + h * G * D;  // query heads h G .. h G + G - 1
        p.resize(G * seen);
        for (int64_t t = 0; t < seen; ++t) {
          const float* kt = kh + t * D;
          for (int64_t g = 0; g < G; ++g) p[g * seen + t] = dot(q0 + g * D, kt, D) * scale_ + (mask ? mask[t] : 0.0f);
        }
        for (int64_t g = 0; g < G; ++g) {
          float* pg = p.data() + g * seen;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < seen; ++t) mx = std::max(mx, pg[t]);
          for (int64_t t = 0; t < seen; ++t) pg[t] -= mx;
          exp_inplace(pg, seen);
          float sum = 0;
          for (int64_t t = 0; t < seen; ++t) sum += pg[t];
          const float inv = 1.0f / sum;
          for (int64_t t = 0; t < seen; ++t) pg[t] *= inv;
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < seen; ++t) {
          const float* vt = vh + t * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = p[g * seen + t];
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += w * vt[d];
          }
        }
        std::copy(acc.begin(), acc.end(), o + (s.start + r) * H * D + h * G * D);
      }
    });
  }

  // [Hkv, G q, D] x [Hkv, D, S] through ATen's blocked matmul (keys/values already written).
  void attend_matmul(size_t i, const Segment& s, const float* qkv, int64_t wq, float* o) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_, G = H / Hkv, q = s.q, S = s.past + s.q;
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor qg = torch::empty({Hkv, G * q, D}, opts);
    float* qgp = qg.data_ptr<float>();
    for (int64_t hq = 0; hq < H; ++hq)
      for (int64_t r = 0; r < q; ++r) {
        const float* src = qkv + (s.start + r) * wq + hq * D;
        std::copy(src, src + D, qgp + (hq * q + r) * D);
      }
    torch::Tensor keys = s.k.select(0, (int64_t)i).narrow(1, 0, S);  // [Hkv, S, D]
    torch::Tensor values = s.v.select(0, (int64_t)i).narrow(1, 0, S);
    torch::Tensor scores = torch::matmul(qg, keys.transpose(1, 2)).mul_(scale_);  // [Hkv, G q, S]
    torch::Tensor m = s.mask;
    if (!m.defined()) {
      m = torch::zeros({q, S}, opts);
      m.narrow(1, s.past, q).copy_(torch::full({q, q}, -std::numeric_limits<float>::infinity(), opts).triu(1));
    }
    scores.view({Hkv, G, q, S}).add_(m);
    torch::Tensor out = torch::matmul(torch::softmax(scores, -1), values);  // [Hkv, G q, D]
    const float* op = out.data_ptr<float>();
    for (int64_t hq = 0; hq < H; ++hq)
      for (int64_t r = 0; r < q; ++r) {
        const float* src = op + (hq * q + r) * D;
        std::copy(src, src + D, o + (s.start + r) * H * D + hq * D);
      }
  }

  torch::Tensor embed_;
  std::vector<torch::Tensor> ln1_, wqkv_, wo_, ln2_, wgu_, wd_;
  torch::Tensor norm_, head_;
  int64_t H_, Hkv_, D_, hidden_ = 0;
  float eps_, scale_;
  bool amx_;  // linears with bf16 activations on AMX tiles (the q4_1_bf16 format)
};

}  // namespace

void bind_lean_forward(pybind11::module_& m) {
  pybind11::class_<LeanForward>(m, "LeanForward")
      .def(pybind11::init<torch::Tensor, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                          double, bool>(),
           pybind11::arg("embed"), pybind11::arg("ln1"), pybind11::arg("wqkv"), pybind11::arg("wo"),
           pybind11::arg("ln2"), pybind11::arg("wgu"), pybind11::arg("wd"), pybind11::arg("norm"),
           pybind11::arg("head"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("bf16_amx") = false)
      .def("forward", &LeanForward::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
