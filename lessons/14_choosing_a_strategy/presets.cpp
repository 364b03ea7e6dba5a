// GENERATED from solutions/14_choosing_a_strategy/presets.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 14 — the presets: clusters and models with the published figures they come from.
#include "common/error.h"
#include "planner.h"

namespace cp {

namespace {

/// One H100 SXM5 (80 GB), as FlashAttention-2 runs on it at head dim 128, 8k tokens: forward
/// 370 TFLOP/s without a mask and 333 with the causal one, backward 318 without a mask (the
/// FlashAttention-3 paper, Shah et al. 2024, figures 5 and 7, the FlashAttention-2 bars). The
/// causal backward is not in those figures: 318 · 333/370 = 286 assumes it loses what the causal
/// forward loses. HBM3 3.35 TB/s (NVIDIA's H100 datasheet). The H800 is the same GPU with
/// NVLink cut to 400 GB/s.
Cluster h100_node(const std::string& name, int nodes, double nvlink_gbytes_per_s) {
  Cluster c;
  c.name = name;
  c.gpus_per_node = 8;
  c.nodes = nodes;
  c.forward_tflops = 370;
  c.forward_causal_tflops = 333;
  c.backward_tflops = 318;
  c.backward_causal_tflops = 318.0 * 333 / 370;
  c.memory_gbytes_per_s = 3350;
  c.launch_us = 10;  // an estimate: one kernel launch and its first and last waves
  c.intra = {nvlink_gbytes_per_s, 5};  // latency: an estimate for one NCCL send/recv within a node
  c.inter = {50, 10};                  // one 400 Gb/s NIC per GPU; latency an estimate
  c.memory_gbytes = 80;
  return c;
}

}  // namespace

const std::vector<Cluster>& cluster_presets() {
  static const std::vector<Cluster> presets = [] {
    Cluster h100 = h100_node("h100x8", 1, 450);
    h100.source = "8 H100 SXM5 in one node, NVLink 4 at 900 GB/s both ways (450 each way)";
    Cluster h800 = h100_node("h800x8", 1, 200);
    h800.source = "8 H800 SXM5 in one node, NVLink at 400 GB/s both ways (200 each way): "
                  "ring-flash-attention's benchmark machine";
    Cluster ib = h100_node("h100x32-ib", 4, 450);
    ib.source = "4 nodes of 8 H100 SXM5, NVLink 4 inside, 400 Gb/s InfiniBand NDR (50 GB/s) per GPU across";
    return std::vector<Cluster>{h100, h800, ib};
  }();
  return presets;
}

const Cluster& cluster_preset(const std::string& name) {
  std::string names;
  for (const Cluster& c : cluster_presets()) {
    if (c.name == name) return c;
    names += (names.empty() ? "" : ", ") + c.name;
  }
  CP_FAIL("cluster: no preset named '", name, "'; the presets are ", names);
}

std::vector<std::string> model_preset_names() { return {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"}; }

AttentionShape model_preset(const std::string& name, int64_t seq) {
  // From the models' published configurations (num_hidden_layers, num_attention_heads,
  // num_key_value_heads, hidden_size / num_attention_heads).
  AttentionShape s;
  s.model = name;
  s.seq = seq;
  s.heads_kv = 8;
  s.head_dim = 128;
  if (name == "llama-3.1-8b") {
    s.layers = 32;
    s.heads_q = 32;
  } else if (name == "llama-3.1-70b") {
    s.layers = 80;
    s.heads_q = 64;
  } else if (name == "llama-3.1-405b") {
    s.layers = 126;
    s.heads_q = 128;
  } else {
    std::string names;
    for (const std::string& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
    CP_FAIL("model: no preset named '", name, "'; the presets are ", names);
  }
  return s;
}

}  // namespace cp
