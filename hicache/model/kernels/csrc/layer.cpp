// A Llama layer's parts before and after attention as one call each (hicache/model/kernels/fused_layer.py
// builds their operands; native.py builds this file beside the kernels it calls):
//
//   layer_head(hidden [T, D], input_norm [D], eps, qkv, format, groups, heads (nq, nkv, d), cos, sin [T, d],
//              qkv_bias? [groups, (nq + 2 nkv) d], q_norm? [d], k_norm? [d])
//       -> (q [T, groups nq, d], kv [T, 2 groups nkv d]): x = rms_norm(hidden); qkv(x) (+ qkv_bias) as
//       [T, groups, q | k | v heads, d]; each q and k head RMS-normed (where q_norm, k_norm: Qwen3's QK-norm);
//       q and k rotated; kv packed k then v (KVLayout.mha's row)
//   layer_tail(hidden [T, D], attn [T, A], o_proj, post_norm [D], eps, gate_up, groups, down, formats)
//       -> hidden + down(silu_mul(gate_up(rms_norm(h)))) where h = hidden + o_proj(attn)
//
// o_proj and down are row-parallel groups summed (int4/int8_linear_sum), qkv and gate_up column groups (one
// fused call viewed [T, groups, outputs], or one call a group stacked), each a list of its weights' operands
// in the order the kernels take them (int4: codes, scale, offset; int8: codes, scale), `format(s)` the bits
// of each. Every part is the registered op llama.py / tp_groups.py / ops.py would call, in the same order,
// the copies and residual adds torch's: the bits of the Python layer, without the Python between its ops.
//
//   LayerStack: a model's layers' operands, bound once (`add`, a layer's head's then tail's operands);
//   run(hidden, cos, sin, first, dst, k, v, where, then replay_attention's recorded calls and scale)
//       -> the hidden rows after layers first .. end, each layer_head, replay_attention over its pool layer
//       (dst[l], k[l], v[l]: that layer's views, where its rows) and layer_tail: the forward pass's layers
//       after the one that ran the key-block plan in Python (LlamaModel.forward), in one call.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

#define HICACHE_STRING(x) #x
#define HICACHE_NAME(library, op) HICACHE_STRING(library) "::" op

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Linear8 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Sum4 = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, at::TensorList);
using Sum8 = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using Rows = at::Tensor(const at::Tensor&);
using RopeQKV = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                    int64_t);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

int64_t operands_of(int64_t format) {
  TORCH_CHECK(format == 4 || format == 8, "layer_tail: formats are 4 or 8 bits");
  return format == 4 ? 3 : 2;
}

// Weight `w` of a projection's operands in `format`.
at::Tensor linear(const at::Tensor& x, at::TensorList operands, int64_t w, int64_t format) {
  static const auto int4 = op<Linear>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "int4_linear"));
  static const auto int8 = op<Linear8>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "int8_linear"));
  const int64_t at = w * operands_of(format);
  return format == 4 ? int4.call(x, operands[at], operands[at + 1], operands[at + 2])
                     : int8.call(x, operands[at], operands[at + 1]);
}

// Column groups [T, groups, outputs a group] (ColumnGroups): one fused call, or one call a group stacked.
at::Tensor column_groups(const at::Tensor& x, at::TensorList operands, int64_t format, int64_t groups) {
  const int64_t calls = static_cast<int64_t>(operands.size()) / operands_of(format);
  if (calls == 1) return linear(x, operands, 0, format).view({x.size(0), groups, -1});
  std::vector<at::Tensor> outs;
  for (int64_t g = 0; g < calls; ++g) outs.push_back(linear(x, operands, g, format));
  return at::stack(outs, 1);
}

// The row groups' pairwise float32 sum, in x's dtype (RowGroups at TP 1).
at::Tensor linear_sum(const at::Tensor& x, at::TensorList operands, int64_t format) {
  static const auto int4 = op<Sum4>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "int4_linear_sum"));
  static const auto int8 = op<Sum8>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "int8_linear_sum"));
  const int64_t per = operands_of(format), groups = static_cast<int64_t>(operands.size()) / per;
  std::vector<at::Tensor> parts[3];
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < per; ++i) parts[i].push_back(operands[g * per + i]);
  const at::Tensor sum = format == 4 ? int4.call(x, parts[0], parts[1], parts[2]) : int8.call(x, parts[0], parts[1]);
  return sum.to(x.scalar_type());
}

// Each head's rows [T, groups, heads, d] RMS-normed by `weight` [d], as ops.rms_norm normalizes a strided view.
at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  static const auto norm = op<Norm>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "rms_norm"));
  return norm.call(heads.reshape({-1, heads.size(-1)}).contiguous(), weight, eps).view(heads.sizes());
}

std::tuple<at::Tensor, at::Tensor> layer_head(const at::Tensor& hidden, const at::Tensor& input_norm, double eps,
                                              at::TensorList qkv, int64_t format, int64_t groups, at::IntArrayRef heads,
                                              const at::Tensor& cos, const at::Tensor& sin,
                                              const c10::optional<at::Tensor>& qkv_bias,
                                              const c10::optional<at::Tensor>& q_norm,
                                              const c10::optional<at::Tensor>& k_norm) {
  static const auto norm = op<Norm>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "rms_norm"));
  static const auto rope_qkv = op<RopeQKV>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "rope_qkv"));
  TORCH_CHECK(heads.size() == 3, "layer_head: heads are (query heads a group, KV heads a group, head size)");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "layer_head: QK-norm has a q and a k weight");
  const int64_t tokens = hidden.size(0), nq = heads[0], nkv = heads[1], d = heads[2];
  const at::Tensor x = norm.call(hidden.contiguous(), input_norm, eps);  // a no-op on the usual contiguous rows
  at::Tensor columns = column_groups(x, qkv, format, groups);  // [T, groups, q | k | v columns]
  if (qkv_bias.has_value()) columns = columns + *qkv_bias;
  columns = columns.view({tokens, groups, nq + 2 * nkv, d});
  if (q_norm.has_value()) {
    const auto parts = columns.split_with_sizes({nq, nkv, nkv}, 2);
    columns = at::cat({head_norm(parts[0], *q_norm, eps), head_norm(parts[1], *k_norm, eps), parts[2]}, 2);
  }
  return rope_qkv.call(columns, cos, sin, nq, nkv);  // q, and k rotated then v: the packed KV row
}

at::Tensor layer_tail(const at::Tensor& hidden, const at::Tensor& attn, at::TensorList o_proj,
                      const at::Tensor& post_norm, double eps, at::TensorList gate_up, int64_t groups,
                      at::TensorList down, at::IntArrayRef formats) {
  static const auto norm = op<Norm>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "rms_norm"));
  static const auto silu_mul = op<Rows>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "silu_mul"));
  TORCH_CHECK(formats.size() == 3, "layer_tail: the formats of o_proj, gate_up and down");
  const at::Tensor h = hidden + linear_sum(attn, o_proj, formats[0]);
  const at::Tensor x = norm.call(h, post_norm, eps);
  return h + linear_sum(silu_mul.call(column_groups(x, gate_up, formats[1], groups)), down, formats[2]);
}

using Replay = at::Tensor(const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, at::TensorList, at::TensorList, at::IntArrayRef, at::TensorList,
                          at::TensorList, at::TensorList, at::TensorList, bool, double);
using Tensors = std::vector<at::Tensor>;
using Ints = std::vector<int64_t>;

struct LayerStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor input_norm;
    double input_eps;
    Tensors qkv;
    int64_t qkv_format, qkv_groups;
    Ints heads;
    c10::optional<at::Tensor> qkv_bias, q_norm, k_norm;
    Tensors o_proj;
    at::Tensor post_norm;
    double post_eps;
    Tensors gate_up;
    int64_t gate_up_groups;
    Tensors down;
    Ints formats;
  };
  std::vector<Layer> layers;

  void add(at::Tensor input_norm, double input_eps, Tensors qkv, int64_t qkv_format, int64_t qkv_groups, Ints heads,
           c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
           Tensors o_proj, at::Tensor post_norm, double post_eps, Tensors gate_up, int64_t gate_up_groups,
           Tensors down, Ints formats) {
    layers.push_back({std::move(input_norm), input_eps, std::move(qkv), qkv_format, qkv_groups, std::move(heads),
                      std::move(qkv_bias), std::move(q_norm), std::move(k_norm), std::move(o_proj),
                      std::move(post_norm), post_eps, std::move(gate_up), gate_up_groups, std::move(down),
                      std::move(formats)});
  }

  at::Tensor run(at::Tensor hidden, at::Tensor cos, at::Tensor sin, int64_t first, Tensors dst, Tensors k, Tensors v,
                 Tensors where, Tensors rows, Tensors keys, Ints reads, Tensors seen, Tensors live, Tensors pick,
                 Tensors dest, bool single, double scale) {
    static const auto replay = op<Replay>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "replay_attention"));
    const auto count = static_cast<int64_t>(layers.size());
    TORCH_CHECK(first >= 0 && first <= count, "LayerStack.run: first layer outside the stack");
    for (const Tensors* views : {&dst, &k, &v, &where})
      TORCH_CHECK(static_cast<int64_t>(views->size()) == count, "LayerStack.run: dst, k, v and where per layer");
    for (int64_t l = first; l < count; ++l) {
      const Layer& w = layers[l];
      const auto [q, kv] = layer_head(hidden, w.input_norm, w.input_eps, w.qkv, w.qkv_format, w.qkv_groups, w.heads,
                                      cos, sin, w.qkv_bias, w.q_norm, w.k_norm);
      const at::Tensor attn = replay.call(q, kv, dst[l], where[l], k[l], v[l], rows, keys, reads, seen, live, pick,
                                          dest, single, scale);
      hidden = layer_tail(hidden, attn.reshape({q.size(0), -1}), w.o_proj, w.post_norm, w.post_eps, w.gate_up,
                          w.gate_up_groups, w.down, w.formats);
    }
    return hidden;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(HICACHE_QGEMM_LIBRARY, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("run", &LayerStack::run);
  m.def("layer_head(Tensor hidden, Tensor input_norm, float eps, Tensor[] qkv, int format, int groups, int[] heads, "
        "Tensor cos, Tensor sin, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm) -> (Tensor, Tensor)",
        &layer_head);
  m.def("layer_tail(Tensor hidden, Tensor attn, Tensor[] o_proj, Tensor post_norm, float eps, Tensor[] gate_up, "
        "int groups, Tensor[] down, int[] formats) -> Tensor",
        &layer_tail);
}
