// A Llama-form decoder layer in one call from Python (folio/model/cpu_layer.py).
//
// At batch 1 on a small CPU a decode step's kernels take about half its time; the rest went
// to the Python around them: per layer ten calls through nn.Module and pybind (norms,
// projections, rotary, attention, SiLU), each with its checks, views and argument parsing.
// Here the same kernels run in the same order on the same inputs, so the results are the
// Python path's bit for bit; only the glue between them moved to C++.
#include "decoder_layer.h"

#include <ATen/ops/cat.h>

namespace folio_cpu {

at::Tensor PackedPart::operator()(const at::Tensor& x) const {
  if (zero.defined()) return q4_matmul(x, codes, scale, zero);
  return int8_matmul(x, codes, scale);
}

at::Tensor PackedLinear::operator()(const at::Tensor& x) const {
  at::Tensor out;
  if (parts.size() == 1) {
    out = parts[0](x);
  } else {
    std::vector<at::Tensor> outs;
    outs.reserve(parts.size());
    for (const PackedPart& part : parts) outs.push_back(part(x));
    out = at::cat(outs, 1);
  }
  // in place on the product's own new tensor: the same float additions as Python's out + bias
  if (bias.defined()) out.add_(bias);
  return out;
}

DecoderLayerKernel::DecoderLayerKernel(LayerNorms norms, LayerProjections proj,
                                       LayerAttention attn)
    : norms_(std::move(norms)), proj_(std::move(proj)), attn_(std::move(attn)) {
  TORCH_CHECK(attn_.num_heads > 0 && attn_.num_kv_heads > 0 && attn_.head_dim > 0,
              "head counts and head_dim must be positive");
  TORCH_CHECK(attn_.num_heads % attn_.num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  for (const PackedLinear* p : {&proj_.qkv, &proj_.o, &proj_.gate_up, &proj_.down}) {
    TORCH_CHECK(!p->parts.empty(), "a projection needs at least one packed weight");
    TORCH_CHECK(!p->bias.defined() || (p->bias.scalar_type() == at::kFloat &&
                                       p->bias.dim() == 1 && p->bias.is_contiguous()),
                "a projection's bias must be contiguous float32 [out_features]");
  }
}

std::vector<at::Tensor> DecoderLayerKernel::forward(
    const at::Tensor& positions, const at::Tensor& hidden,
    const c10::optional<at::Tensor>& residual, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens) const {
  const int64_t T = hidden.size(0);
  const int64_t H = attn_.num_heads, KVH = attn_.num_kv_heads, D = attn_.head_dim;
  const int64_t q_size = H * D, kv_size = KVH * D;

  // the input norm, adding the previous layer's output to the stream first
  std::vector<at::Tensor> normed = rms_norm(hidden, norms_.input, norms_.eps, residual);
  at::Tensor stream = residual.has_value() ? normed[1] : hidden;

  at::Tensor qkv = proj_.qkv(normed[0]);
  FOLIO_CHECK(qkv.size(1) == q_size + 2 * kv_size,
              "the qkv projection gives %lld features; the heads need %lld",
              static_cast<long long>(qkv.size(1)), static_cast<long long>(q_size + 2 * kv_size));
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, KVH, D});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, KVH, D});
  std::vector<at::Tensor> rotated =
      rotary_neox(positions, q, k, attn_.cos, attn_.sin, attn_.rotary_dim);

  at::Tensor out = at::empty({T, H, D}, hidden.options());
  paged_attention(out, rotated[0], rotated[1], v, kv_cache, slot_mapping, block_tables,
                  query_start_loc, seq_lens, attn_.scale, attn_.sliding_window,
                  attn_.k_scale, attn_.v_scale, attn_.logits_soft_cap, attn_.sinks);
  at::Tensor attended = proj_.o(out.view({T, q_size}));

  std::vector<at::Tensor> post = rms_norm(attended, norms_.post_attention, norms_.eps, stream);
  at::Tensor mlp_out = proj_.down(silu_and_mul(proj_.gate_up(post[0])));
  return {mlp_out, post[1]};
}

}  // namespace folio_cpu
