// The Llama-form decoder layer as one C++ object (decoder_layer.cpp), built once per layer
// from the layer's weights and called once per step.
#pragma once

#include "ops.h"

#include <utility>

namespace folio_cpu {

// A weight kept packed: 4-bit planes (codes, scale, zero: q4_matmul) or int8 rows (codes,
// scale; zero undefined: int8_matmul).
struct PackedPart {
  at::Tensor codes, scale, zero;
  at::Tensor operator()(const at::Tensor& x) const;
};

// A projection: one packed weight, or several whose outputs are concatenated (a merged
// projection whose shards were packed in different formats: PackedConcat), plus a float32
// bias when it has one (Qwen2's q/k/v).
struct PackedLinear {
  std::vector<PackedPart> parts;
  at::Tensor bias;  // undefined: none
  at::Tensor operator()(const at::Tensor& x) const;
};

struct LayerNorms {
  at::Tensor input, post_attention;  // float32 [hidden]
  double eps;
};

struct LayerProjections {
  PackedLinear qkv, o, gate_up, down;
};

// What the attention call takes besides the step's tensors: the neox rotary tables, the heads,
// and the options of paged_attention (ops.h).
struct LayerAttention {
  at::Tensor cos, sin;  // float32 [max_positions, rotary_dim]
  int64_t rotary_dim, num_heads, num_kv_heads, head_dim;
  double scale;
  int64_t sliding_window;  // 0 = none
  at::Tensor k_scale, v_scale;  // float32 [num_kv_heads]: read at each call, updated in place
  double logits_soft_cap;  // 0 = none
  c10::optional<at::Tensor> sinks;
};

class DecoderLayerKernel {
 public:
  DecoderLayerKernel(LayerNorms norms, LayerProjections proj, LayerAttention attn);

  // (the MLP's output, the residual stream) for hidden [T, hidden] float32, residual the
  // stream before this layer's input (none for the first layer), the step's layout as
  // CpuPagedAttention hands it to paged_attention.
  std::vector<at::Tensor> forward(const at::Tensor& positions, const at::Tensor& hidden,
                                  const c10::optional<at::Tensor>& residual,
                                  const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc,
                                  const at::Tensor& seq_lens) const;

 private:
  LayerNorms norms_;
  LayerProjections proj_;
  LayerAttention attn_;
};

}  // namespace folio_cpu
