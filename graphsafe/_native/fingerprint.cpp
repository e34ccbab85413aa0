// gs.fingerprint's kernel on the CPU: the two sums of graphsafe/_fingerprint/digest.py
// over a tensor's bytes, in one pass over memory (a strided tensor: in its logical order,
// gathered chunk by chunk into a buffer that stays in cache, then summed from there; a
// permuted one, made contiguous first).
//
// Word i (0-based) is the i-th 8 bytes of the tensor, little-endian, the last one padded
// with zero bytes; k_i = (i + 1) * P mod 2**64; x_i = word_i ^ k_i;
//   s1 = sum of x_i                      mod 2**64
//   s2 = sum of lo32(x_i) * hi32(x_i)    mod 2**64
// Sums are taken modulo 2**64, so any split of the words (threads, vector lanes) gives
// the same answer: the AVX-512, AVX2 and scalar loops below agree bit for bit, with
// each other and with the torch formulation (graphsafe/_fingerprint/torch_sums.py).
// lo32(x) * hi32(x) is one unsigned 32x32->64 multiply per word (vpmuludq), which every
// x86-64 vector unit has: no 64-bit multiply in the loop.

#include <Python.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/ExpandUtils.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/autograd/python_variable.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GRAPHSAFE_X86 1
#endif

#include "tracker.h"

namespace {

constexpr uint64_t kP = 0x9E3779B97F4A7C15ull;  // the golden ratio's 64-bit Weyl step
constexpr int64_t kGrain = 1 << 20;  // words per thread's chunk (8 MiB): small tensors
                                     // stay on the calling thread

struct Sums {
  uint64_t s1 = 0;
  uint64_t s2 = 0;
};

inline uint64_t load_word(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // little-endian hosts only (x86-64, aarch64)
  return w;
}

// The definition, word by word: words [first, first + m) of the tensor, at `p`; with
// `out`, each word is also written there as it is read (the packing copy, in the same
// pass: the sums are of the bytes read, whatever becomes of the copy).
template <bool kCopy>
Sums scalar(const uint8_t* p, uint8_t* out, uint64_t m, uint64_t first) {
  uint64_t a1[4] = {0, 0, 0, 0};
  uint64_t a2[4] = {0, 0, 0, 0};
  uint64_t k[4];
  for (int j = 0; j < 4; ++j) {
    k[j] = (first + 1 + j) * kP;
  }
  uint64_t i = 0;
  for (; i + 4 <= m; i += 4) {  // four independent chains: the multiplies overlap
    for (int j = 0; j < 4; ++j) {
      const uint64_t w = load_word(p + 8 * (i + j));
      if constexpr (kCopy) {
        std::memcpy(out + 8 * (i + j), &w, 8);
      }
      const uint64_t x = w ^ k[j];
      a1[j] += x;
      a2[j] += (x & 0xFFFFFFFFull) * (x >> 32);
      k[j] += 4 * kP;
    }
  }
  Sums r{a1[0] + a1[1] + a1[2] + a1[3], a2[0] + a2[1] + a2[2] + a2[3]};
  for (; i < m; ++i) {
    const uint64_t w = load_word(p + 8 * i);
    if constexpr (kCopy) {
      std::memcpy(out + 8 * i, &w, 8);
    }
    const uint64_t x = w ^ ((first + i + 1) * kP);
    r.s1 += x;
    r.s2 += (x & 0xFFFFFFFFull) * (x >> 32);
  }
  return r;
}

#ifdef GRAPHSAFE_X86
template <bool kCopy>
__attribute__((target("avx2"))) Sums avx2(const uint8_t* p, uint8_t* out, uint64_t m,
                                          uint64_t first) {
  __m256i k0 = _mm256_set_epi64x((first + 4) * kP, (first + 3) * kP, (first + 2) * kP,
                                 (first + 1) * kP);
  __m256i k1 = _mm256_add_epi64(k0, _mm256_set1_epi64x(4 * kP));
  const __m256i step = _mm256_set1_epi64x(8 * kP);
  __m256i s1a = _mm256_setzero_si256(), s1b = s1a, s2a = s1a, s2b = s1a;
  uint64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * i));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * i + 32));
    if constexpr (kCopy) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i), w0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i + 32), w1);
    }
    const __m256i x0 = _mm256_xor_si256(w0, k0);
    const __m256i x1 = _mm256_xor_si256(w1, k1);
    s1a = _mm256_add_epi64(s1a, x0);
    s1b = _mm256_add_epi64(s1b, x1);
    // vpmuludq multiplies the low 32 bits of each lane: lo32(x) * lo32(x >> 32).
    s2a = _mm256_add_epi64(s2a, _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)));
    s2b = _mm256_add_epi64(s2b, _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32)));
    k0 = _mm256_add_epi64(k0, step);
    k1 = _mm256_add_epi64(k1, step);
  }
  uint64_t t1[4], t2[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(t1), _mm256_add_epi64(s1a, s1b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(t2), _mm256_add_epi64(s2a, s2b));
  Sums r{t1[0] + t1[1] + t1[2] + t1[3], t2[0] + t2[1] + t2[2] + t2[3]};
  const Sums rest = scalar<kCopy>(p + 8 * i, out + (kCopy ? 8 * i : 0), m - i, first + i);
  return {r.s1 + rest.s1, r.s2 + rest.s2};
}

template <bool kCopy>
__attribute__((target("avx512f"))) Sums avx512(const uint8_t* p, uint8_t* out, uint64_t m,
                                               uint64_t first) {
  __m512i k0 = _mm512_set_epi64((first + 8) * kP, (first + 7) * kP, (first + 6) * kP,
                                (first + 5) * kP, (first + 4) * kP, (first + 3) * kP,
                                (first + 2) * kP, (first + 1) * kP);
  __m512i k1 = _mm512_add_epi64(k0, _mm512_set1_epi64(8 * kP));
  const __m512i step = _mm512_set1_epi64(16 * kP);
  __m512i s1a = _mm512_setzero_si512(), s1b = s1a, s2a = s1a, s2b = s1a;
  uint64_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m512i w0 = _mm512_loadu_si512(p + 8 * i);
    const __m512i w1 = _mm512_loadu_si512(p + 8 * i + 64);
    if constexpr (kCopy) {
      _mm512_storeu_si512(out + 8 * i, w0);
      _mm512_storeu_si512(out + 8 * i + 64, w1);
    }
    const __m512i x0 = _mm512_xor_si512(w0, k0);
    const __m512i x1 = _mm512_xor_si512(w1, k1);
    s1a = _mm512_add_epi64(s1a, x0);
    s1b = _mm512_add_epi64(s1b, x1);
    // The maskz forms, all lanes on: the plain ones read an undefined register that
    // GCC 12 warns about inside its own header.
    const __m512i h0 = _mm512_maskz_srli_epi64(0xFF, x0, 32);
    const __m512i h1 = _mm512_maskz_srli_epi64(0xFF, x1, 32);
    s2a = _mm512_add_epi64(s2a, _mm512_maskz_mul_epu32(0xFF, x0, h0));
    s2b = _mm512_add_epi64(s2b, _mm512_maskz_mul_epu32(0xFF, x1, h1));
    k0 = _mm512_add_epi64(k0, step);
    k1 = _mm512_add_epi64(k1, step);
  }
  uint64_t t1[8], t2[8];  // no _mm512_reduce_add_epi64: GCC warns inside its header
  _mm512_storeu_si512(t1, _mm512_add_epi64(s1a, s1b));
  _mm512_storeu_si512(t2, _mm512_add_epi64(s2a, s2b));
  Sums r;
  for (int j = 0; j < 8; ++j) {
    r.s1 += t1[j];
    r.s2 += t2[j];
  }
  const Sums rest = scalar<kCopy>(p + 8 * i, out + (kCopy ? 8 * i : 0), m - i, first + i);
  return {r.s1 + rest.s1, r.s2 + rest.s2};
}
#endif

using Loop = Sums (*)(const uint8_t*, uint8_t*, uint64_t, uint64_t);

// The widest loop this CPU runs: 2 AVX-512, 1 AVX2, 0 scalar.
int best_level() {
#ifdef GRAPHSAFE_X86
  if (__builtin_cpu_supports("avx512f")) {
    return 2;
  }
  if (__builtin_cpu_supports("avx2")) {
    return 1;
  }
#endif
  return 0;
}

template <bool kCopy>
Loop loop_of(int level) {
#ifdef GRAPHSAFE_X86
  if (level == 2) {
    return avx512<kCopy>;
  }
  if (level == 1) {
    return avx2<kCopy>;
  }
#endif
  return scalar<kCopy>;
}

// Both sums over `nbytes` bytes at `p` (copied to `out` on the way when it is not
// null), the words split over torch's intra-op threads. The bytes are words `first`,
// `first + 1`, ... of a tensor (0: the whole tensor): a piece of a tensor read as it
// arrives, whose sums add up with its other pieces' to the tensor's.
Sums sums_of(const uint8_t* p, uint8_t* out, uint64_t nbytes, int level, uint64_t first) {
  const Loop loop = out != nullptr ? loop_of<true>(level) : loop_of<false>(level);
  const int64_t m = static_cast<int64_t>(nbytes / 8);
  std::atomic<uint64_t> s1{0}, s2{0};
  at::parallel_for(0, m, kGrain, [&](int64_t begin, int64_t end) {
    const Sums part = loop(p + 8 * begin, out != nullptr ? out + 8 * begin : nullptr,
                           static_cast<uint64_t>(end - begin),
                           first + static_cast<uint64_t>(begin));
    s1.fetch_add(part.s1, std::memory_order_relaxed);  // modulo 2**64
    s2.fetch_add(part.s2, std::memory_order_relaxed);
  });
  Sums r{s1.load(), s2.load()};
  const uint64_t tail = nbytes % 8;
  if (tail != 0) {  // the last word, padded with zero bytes
    uint8_t word[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(word, p + 8 * m, tail);
    if (out != nullptr) {
      std::memcpy(out + 8 * m, word, tail);
    }
    const Sums last = scalar<false>(word, nullptr, 1, first + static_cast<uint64_t>(m));
    r.s1 += last.s1;
    r.s2 += last.s2;
  }
  return r;
}

// A strided tensor's bytes in its logical (row-major) order, in chunks of at most
// at::internal::GRAIN_SIZE elements (128 KiB of float32): each chunk is a view of the
// tensor (its leading indices selected, a range of one dimension), whose logical bytes
// are the range [offset, offset + nbytes) of the tensor's. It is gathered into a buffer
// that stays in cache, by one ATen copy small enough that ATen runs it on the calling
// thread: a copy that parallelizes opens a parallel region per chunk, and on a loaded
// machine each one waits for a core.
int64_t chunk_limit(const at::Tensor& t) {
  return at::internal::GRAIN_SIZE * static_cast<int64_t>(t.element_size());
}

struct Chunk {
  int64_t lead;  // the leading indices (dimensions before `dim`), as one row-major index
  int64_t begin, end;  // the range of dimension `dim`
  uint64_t offset, nbytes;  // where its bytes lie in the tensor's logical bytes
};

struct Chunking {
  int64_t dim = 0;
  std::vector<Chunk> chunks;
};

// Cut `t` (non-contiguous, at least one element) into chunks: `dim` is the outermost
// dimension whose rows (the dimensions after it) hold at most `chunk_limit` bytes; each
// block of it (one set of leading indices) is cut evenly, so no chunk holds under half
// the limit but where the whole tensor does.
Chunking chunking(const at::Tensor& t) {
  const auto sizes = t.sizes();
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const int64_t limit = chunk_limit(t);
  Chunking c;
  if (t.numel() == 0) {
    return c;
  }
  int64_t row = static_cast<int64_t>(t.element_size());  // bytes of one index of `dim`
  int64_t k = nd - 1;
  while (k > 0 && row * sizes[k] <= limit) {
    row *= sizes[k];
    --k;
  }
  c.dim = k;
  int64_t leads = 1;
  for (int64_t d = 0; d < k; ++d) {
    leads *= sizes[d];
  }
  const int64_t rows = sizes[k];
  const int64_t block = rows * row;
  const int64_t most = std::max<int64_t>(1, limit / row);  // rows a chunk may hold
  const int64_t pieces = (rows + most - 1) / most;
  const int64_t per = (rows + pieces - 1) / pieces;  // at most `most`
  for (int64_t lead = 0; lead < leads; ++lead) {
    for (int64_t b = 0; b < rows; b += per) {
      const int64_t e = std::min(rows, b + per);
      c.chunks.push_back({lead, b, e, static_cast<uint64_t>(lead * block + b * row),
                          static_cast<uint64_t>((e - b) * row)});
    }
  }
  return c;
}

// The view of `t` that chunk `c` covers.
at::Tensor chunk_view(const at::Tensor& t, int64_t dim, const Chunk& c) {
  at::Tensor v = t;
  int64_t lead = c.lead;
  for (int64_t d = dim - 1; d >= 0; --d) {  // the last leading index varies fastest
    const int64_t size = t.size(d);
    v = v.select(d, lead % size);
    lead /= size;
  }
  return v.narrow(0, c.begin, c.end - c.begin);
}

// The bytes of a chunk that do not fill a word of their own (its first ones, up to a
// multiple of 8, and its last ones, from one): they are summed once every chunk has
// given its part of the words they share.
struct Edge {
  uint64_t at = 0;  // the tensor's byte where they start
  uint32_t n = 0;
  uint8_t bytes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
};

// Whether `t`'s memory holds its elements in another order than its logical one (a
// transposed or permuted view), rather than in that order with gaps (a slice).
bool permuted(const at::Tensor& t) {
  const std::vector<int64_t> dense = at::infer_dense_strides(t.sizes(), t.strides());
  int64_t stride = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.size(d) > 1 && dense[static_cast<size_t>(d)] != stride) {
      return true;
    }
    stride *= t.size(d);
  }
  return false;
}

// Both sums over the logical bytes of `t`, a strided tensor that is not contiguous (with
// `out`: a contiguous buffer of as many bytes, where those bytes are written), read
// once. Each chunk is copied by ATen into a buffer of this thread, then summed and
// written to `out` from there in one pass: the sums are of the bytes read from `t`, not
// of anything read back from `out`. Chunks are split over torch's intra-op threads, as
// `sums_of` splits words. A permuted `t` is first made contiguous by ATen (whose
// transpose goes tile by tile; a chunk of logical rows reads a cache line per element,
// for a few bytes of it), then copied and summed as a contiguous tensor: two passes.
Sums strided_sums(const at::Tensor& t, uint8_t* out, int level) {
  // Internal copies: no RecordFunction callback (load trackers, the write observer, the
  // strays hook) is told of them, as none is told of the contiguous loop's reads.
  at::RecordFunctionGuard no_callbacks(false);
  if (permuted(t)) {
    const at::Tensor logical = t.contiguous();
    const uint64_t nbytes = static_cast<uint64_t>(logical.numel()) * logical.element_size();
    return sums_of(static_cast<const uint8_t*>(logical.const_data_ptr()), out, nbytes,
                   level, 0);
  }
  const Chunking c = chunking(t);
  const Loop copy_loop = loop_of<true>(level);
  const Loop sum_loop = loop_of<false>(level);
  std::vector<std::array<Edge, 2>> edges(c.chunks.size());
  std::atomic<uint64_t> s1{0}, s2{0};
  const int64_t limit = chunk_limit(t);
  const int64_t grain = std::max<int64_t>(1, kGrain * 8 / limit);  // 8 MiB, as sums_of
  at::parallel_for(0, static_cast<int64_t>(c.chunks.size()), grain,
                   [&](int64_t first_chunk, int64_t last_chunk) {
    at::RecordFunctionGuard no_callbacks(false);  // in each of torch's threads
    std::vector<uint8_t> buffer(static_cast<size_t>(limit + 64));
    uint8_t* const scratch = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64);
    uint64_t a1 = 0, a2 = 0;
    for (int64_t i = first_chunk; i < last_chunk; ++i) {
      const Chunk& ch = c.chunks[static_cast<size_t>(i)];
      const at::Tensor view = chunk_view(t, c.dim, ch);
      at::from_blob(scratch, view.sizes(), view.options()).copy_(view);
      const uint64_t lo = ch.offset, hi = ch.offset + ch.nbytes;
      const uint64_t w0 = std::min(hi, (lo + 7) / 8 * 8);  // its whole words: [w0, w1)
      const uint64_t w1 = std::max(w0, hi / 8 * 8);
      if (w1 > w0) {
        const Sums part = out != nullptr
            ? copy_loop(scratch + (w0 - lo), out + w0, (w1 - w0) / 8, w0 / 8)
            : sum_loop(scratch + (w0 - lo), nullptr, (w1 - w0) / 8, w0 / 8);
        a1 += part.s1;
        a2 += part.s2;
      }
      auto& edge = edges[static_cast<size_t>(i)];
      const uint64_t parts[2][2] = {{lo, w0}, {w1, hi}};
      for (int j = 0; j < 2; ++j) {
        const uint64_t from = parts[j][0], to = parts[j][1];
        edge[j].at = from;
        edge[j].n = static_cast<uint32_t>(to - from);
        if (to > from) {
          std::memcpy(edge[j].bytes, scratch + (from - lo), to - from);
          if (out != nullptr) {
            std::memcpy(out + from, scratch + (from - lo), to - from);
          }
        }
      }
    }
    s1.fetch_add(a1, std::memory_order_relaxed);  // modulo 2**64
    s2.fetch_add(a2, std::memory_order_relaxed);
  });
  // The words the chunks share, or the last one, padded with zero bytes: put together
  // from the edges, each summed once.
  std::map<uint64_t, std::array<uint8_t, 8>> words;
  for (const auto& pair : edges) {
    for (const Edge& e : pair) {
      for (uint32_t j = 0; j < e.n; ++j) {
        words[(e.at + j) / 8][(e.at + j) % 8] = e.bytes[j];
      }
    }
  }
  Sums r{s1.load(), s2.load()};
  for (const auto& [index, word] : words) {
    const Sums part = scalar<false>(word.data(), nullptr, 1, index);
    r.s1 += part.s1;
    r.s2 += part.s2;
  }
  return r;
}

// Whether `obj` is a dense CPU tensor whose bytes are its values (no lazy conjugate or
// negation), with `contiguous`: and contiguous (sets a TypeError otherwise); its tensor
// in `keep`, which keeps it alive without the GIL, and its logical bytes in `nbytes`.
bool cpu_tensor(PyObject* obj, bool contiguous, at::Tensor& keep, uint64_t& nbytes) {
  if (THPVariableClass == nullptr ||
      !PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
    PyErr_SetString(PyExc_TypeError, "fingerprint_sums takes tensors");
    return false;
  }
  keep = THPVariable_Unpack(obj);
  if (!keep.device().is_cpu() || keep.layout() != c10::kStrided || !keep.has_storage() ||
      keep.is_quantized() || keep.is_conj() || keep.is_neg() ||
      (contiguous && !keep.is_contiguous())) {
    PyErr_SetString(PyExc_TypeError, contiguous
        ? "fingerprint_sums takes contiguous dense CPU tensors here"
        : "fingerprint_sums takes dense CPU tensors");
    return false;
  }
  nbytes = static_cast<uint64_t>(keep.numel()) * keep.element_size();
  return true;
}

// The data of a tensor `cpu_tensor` took (any pointer when it holds no byte).
const uint8_t* data_of(const at::Tensor& t, uint64_t nbytes) {
  static const uint8_t empty = 0;
  return nbytes ? static_cast<const uint8_t*>(t.const_data_ptr()) : &empty;
}

// fingerprint_sums(tensor, level: int, out: tensor | None = None, first: int = 0)
// -> (s1, s2): the sums over a dense CPU tensor's logical bytes; with `out` (a contiguous
// tensor of as many bytes), the bytes are copied there in the same pass. A tensor that
// is not contiguous is read in its logical order (`strided_sums`); a contiguous one may
// be a piece of a larger tensor: with `first`, its bytes are words `first`, `first + 1`,
// ... of it. Level -1 takes the widest loop this CPU runs (the others are for tests).
// Raises TypeError for anything else; the caller takes the torch path then.
PyObject* fingerprint_sums(PyObject* /*self*/, PyObject* args) {
  PyObject* obj = nullptr;
  PyObject* out_obj = Py_None;
  int level = -1;
  unsigned long long first = 0;
  if (!PyArg_ParseTuple(args, "Oi|OK", &obj, &level, &out_obj, &first)) {
    return nullptr;
  }
  at::Tensor t, out;
  uint64_t nbytes = 0, out_bytes = 0;
  if (!cpu_tensor(obj, first != 0, t, nbytes)) {
    return nullptr;
  }
  uint8_t* dst = nullptr;
  if (out_obj != Py_None) {
    if (!cpu_tensor(out_obj, true, out, out_bytes)) {
      return nullptr;
    }
    if (out_bytes != nbytes) {
      PyErr_SetString(PyExc_ValueError, "fingerprint_sums: out holds another number of bytes");
      return nullptr;
    }
    dst = nbytes ? static_cast<uint8_t*>(out.data_ptr()) : nullptr;
  }
  const int best = best_level();
  if (level > best) {
    PyErr_Format(PyExc_ValueError, "this CPU runs loops up to level %d, not %d", best, level);
    return nullptr;
  }
  const int loop = level < 0 ? best : level;
  const bool strided = !t.is_contiguous();
  const uint8_t* p = strided ? nullptr : data_of(t, nbytes);
  if (strided) {
    t = t.detach();  // read as they are: no autograd history for the chunks' copies
  }
  Sums r;
  std::string failed;  // what ATen raised gathering a chunk, raised once the GIL is back
  Py_BEGIN_ALLOW_THREADS
  try {
    r = strided ? strided_sums(t, dst, loop)
                : sums_of(p, dst, nbytes, loop, static_cast<uint64_t>(first));
  } catch (const std::exception& e) {
    failed = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!failed.empty()) {
    PyErr_Format(PyExc_RuntimeError, "fingerprint_sums: %s", failed.c_str());
    return nullptr;
  }
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(r.s1),
                       static_cast<unsigned long long>(r.s2));
}

// fingerprint_level() -> int: the loop fingerprint_sums(t, -1) runs on this CPU.
PyObject* fingerprint_level(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromLong(best_level());
}

}  // namespace

namespace graphsafe_native {

PyMethodDef fingerprint_methods[] = {
    {"fingerprint_sums", fingerprint_sums, METH_VARARGS,
     "The two sums of gs.fingerprint (copying the bytes to out on the way)."},
    {"fingerprint_level", fingerprint_level, METH_NOARGS, "The widest loop this CPU runs."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
