// The CPU kernel of the `textgen::paged_attention` op, which a compiled decode step
// (runners/compiled.py) calls once a layer from inductor's C++ wrapper: with this kernel a
// decode step's layer goes from the graph to cpu_decode.cpp's kernel with no Python on the
// way (through Python, the op's dispatch and argument handling cost ~4x the attention
// itself on a one-stream step). cpu_decode.py compiles and loads it (loading registers it).
//
// The step's layout (slots, block tables, lengths) and each layer's pools and compiled
// kernel are handed over by Python (paged.py) through the extern "C" functions below, per
// thread: an engine's steps run on its own thread. A call the layout doesn't cover (no step
// begun, a layer not yet registered, shapes or dtypes the kernel doesn't take) goes to
// `textgen::paged_attention_general`, the op's Python implementation, which also registers
// the layer for the next steps.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <vector>

namespace {

// cpu_decode.cpp's textgen_decode_write_attention, compiled for one kind of layer
using Kernel = void (*)(const void* q, const void* k_new, const void* v_new,
                        const int64_t* slots, void* keys, void* values, const int64_t* tables,
                        const int64_t* lengths, void* out, float* part, int64_t batch,
                        int64_t width, float scale, int64_t window, float softcap,
                        const float* sinks, int threads);

struct Layer {
  Kernel kernel = nullptr;
  void* keys = nullptr;
  void* values = nullptr;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

struct Step {
  bool active = false;
  const int64_t* slots = nullptr;
  const int64_t* tables = nullptr;
  const int64_t* lengths = nullptr;
  int64_t batch = 0, width = 0, splits = 0;
  int threads = 1;
};

thread_local Step step;
thread_local std::vector<Layer> layers;
std::atomic<int64_t> calls{0};  // layers attended here, all threads (cpu_decode.Stats)

constexpr int64_t SPLIT = 256;  // cpu_decode.cpp's: tokens an item attends

bool shaped(const at::Tensor& t, int64_t heads, int64_t dim) {  // [1, heads, T, dim]
  return t.dim() == 4 && t.size(0) == 1 && t.size(1) == heads && t.size(2) == step.batch &&
         t.size(3) == dim;
}

// [1, heads, T, dim] token-major, as the kernel reads it: the projections' own layout, so
// no copy on a model's step
at::Tensor token_major(const at::Tensor& t) { return t.transpose(1, 2).contiguous(); }

at::Tensor general(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   int64_t layer_idx, double scaling, int64_t window, double softcap,
                   const std::optional<at::Tensor>& sinks,
                   const std::optional<at::Tensor>& alibi_slopes, double alibi_scale,
                   int64_t chunk) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("textgen::paged_attention_general", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, double, int64_t, double,
                                         const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&, double, int64_t)>();
  return op.call(query, key, value, layer_idx, scaling, window, softcap, sinks, alibi_slopes,
                 alibi_scale, chunk);
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, int64_t layer_idx, double scaling,
                               int64_t window, double softcap,
                               const std::optional<at::Tensor>& sinks,
                               const std::optional<at::Tensor>& alibi_slopes,
                               double alibi_scale, int64_t chunk) {
  const bool known = step.active && layer_idx >= 0 &&
                     layer_idx < int64_t(layers.size()) && layers[layer_idx].kernel != nullptr;
  if (!known || alibi_slopes.has_value() || chunk != 0)
    return general(query, key, value, layer_idx, scaling, window, softcap, sinks, alibi_slopes,
                   alibi_scale, chunk);
  const Layer& l = layers[layer_idx];
  const auto dtype = query.scalar_type();
  if (dtype != l.dtype || key.scalar_type() != dtype || value.scalar_type() != dtype ||
      !shaped(query, l.heads, l.head_dim) || !shaped(key, l.kv_heads, l.head_dim) ||
      !shaped(value, l.kv_heads, l.v_dim))
    return general(query, key, value, layer_idx, scaling, window, softcap, sinks, alibi_slopes,
                   alibi_scale, chunk);
  const at::Tensor q = token_major(query), k = token_major(key), v = token_major(value);
  std::optional<at::Tensor> sink_logits;
  if (sinks.has_value()) sink_logits = sinks->to(at::kFloat).contiguous();
  auto out = at::empty({1, step.batch, l.heads, l.v_dim}, query.options());
  auto part = at::empty({step.batch * step.splits * l.heads * (l.v_dim + 2)},
                        query.options().dtype(at::kFloat));
  const int threads = int(std::min<int64_t>(step.threads, step.batch * step.splits * l.kv_heads));
  calls.fetch_add(1, std::memory_order_relaxed);
  l.kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), step.slots, l.keys, l.values,
           step.tables, step.lengths, out.data_ptr(), part.data_ptr<float>(), step.batch,
           step.width, float(scaling), window, float(softcap),
           sink_logits ? sink_logits->data_ptr<float>() : nullptr, threads);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(textgen, CPU, m) {
  m.impl("paged_attention", TORCH_FN(paged_attention_cpu));
}

// A step of `batch` decodes, one a sequence, begins on this thread: the new K/V's pool
// slots [batch], block tables [batch, width] and lengths [batch] (long, contiguous; kept
// alive by the caller until textgen_decode_step_end).
extern "C" void textgen_decode_step_begin(const int64_t* slots, const int64_t* tables,
                                          const int64_t* lengths, int64_t batch, int64_t width,
                                          int64_t block_size, int threads) {
  step = Step{true, slots, tables, lengths, batch, width,
              (width * block_size + SPLIT - 1) / SPLIT, threads};
}

extern "C" void textgen_decode_step_end() { step.active = false; }

// Layer `index`'s kernel and pools (of `dtype`, a c10::ScalarType) for this thread's steps.
extern "C" void textgen_decode_layer(int64_t index, void* kernel, void* keys, void* values,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t v_dim, int dtype) {
  if (index >= int64_t(layers.size())) layers.resize(index + 1);
  layers[index] = Layer{reinterpret_cast<Kernel>(kernel), keys, values, heads, kv_heads,
                        head_dim, v_dim, static_cast<c10::ScalarType>(dtype)};
}

extern "C" int64_t textgen_decode_op_calls() { return calls.load(); }

// Forget this thread's layers (their pools are another pool's now).
extern "C" void textgen_decode_forget() { layers.clear(); }
