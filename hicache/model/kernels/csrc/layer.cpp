// A Llama layer's parts before and after attention as one call each (hicache/model/kernels/fused_layer.py
// builds their operands; native.py builds this file beside the kernels it calls):
//
//   layer_head(hidden [T, D], input_norm [D], eps, qkv, format, groups, heads (nq, nkv, d), cos, sin [T, d])
//       -> (q [T, groups nq, d], kv [T, 2 groups nkv d]): x = rms_norm(hidden); qkv(x) as [T, groups, q | k |
//       v heads, d]; q and k rotated; kv packed k then v (KVLayout.mha's row)
//   layer_tail(hidden [T, D], attn [T, A], o_proj, post_norm [D], eps, gate_up, groups, down, formats)
//       -> hidden + down(silu_mul(gate_up(rms_norm(h)))) where h = hidden + o_proj(attn)
//
// o_proj and down are row-parallel groups summed (int4/int8_linear_sum), qkv and gate_up column groups (one
// fused call viewed [T, groups, outputs], or one call a group stacked), each a list of its weights' operands
// in the order the kernels take them (int4: codes, scale, offset; int8: codes, scale), `format(s)` the bits
// of each. Every part is the registered op llama.py / tp_groups.py / ops.py would call, in the same order,
// the copies and residual adds torch's: the bits of the Python layer, without the Python between its ops.

#include <ATen/ATen.h>
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
using Rope = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

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

std::tuple<at::Tensor, at::Tensor> layer_head(const at::Tensor& hidden, const at::Tensor& input_norm, double eps,
                                              at::TensorList qkv, int64_t format, int64_t groups, at::IntArrayRef heads,
                                              const at::Tensor& cos, const at::Tensor& sin) {
  static const auto norm = op<Norm>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "rms_norm"));
  static const auto rope = op<Rope>(HICACHE_NAME(HICACHE_QGEMM_LIBRARY, "rope"));
  TORCH_CHECK(heads.size() == 3, "layer_head: heads are (query heads a group, KV heads a group, head size)");
  const int64_t tokens = hidden.size(0), nq = heads[0], nkv = heads[1], d = heads[2];
  const at::Tensor x = norm.call(hidden.contiguous(), input_norm, eps);  // a no-op on the usual contiguous rows
  at::Tensor columns = column_groups(x, qkv, format, groups).view({tokens, groups, nq + 2 * nkv, d});
  const at::Tensor qk = rope.call(columns.slice(2, 0, nq + nkv).reshape({tokens, -1, d}), cos, sin)
                            .view({tokens, groups, nq + nkv, d});
  const at::Tensor q = qk.slice(2, 0, nq).reshape({tokens, groups * nq, d});
  const at::Tensor k = qk.slice(2, nq).reshape({tokens, -1});
  const at::Tensor v = columns.slice(2, nq + nkv).reshape({tokens, -1});
  return {q, at::cat({k, v}, 1)};
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(HICACHE_QGEMM_LIBRARY, m) {
  m.def("layer_head(Tensor hidden, Tensor input_norm, float eps, Tensor[] qkv, int format, int groups, int[] heads, "
        "Tensor cos, Tensor sin) -> (Tensor, Tensor)",
        &layer_head);
  m.def("layer_tail(Tensor hidden, Tensor attn, Tensor[] o_proj, Tensor post_norm, float eps, Tensor[] gate_up, "
        "int groups, Tensor[] down, int[] formats) -> Tensor",
        &layer_tail);
}
