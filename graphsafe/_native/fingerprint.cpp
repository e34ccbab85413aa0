// gs.fingerprint's kernel on the CPU: the two sums of graphsafe/_fingerprint/digest.py
// over the bytes of a contiguous tensor, in one pass over memory.
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

#include <atomic>
#include <cstdint>
#include <cstring>

#include <ATen/Parallel.h>
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

// The bytes of `obj` if it is a contiguous dense CPU tensor (null with a TypeError set
// otherwise): its data and size, and a reference that keeps it alive without the GIL.
const uint8_t* cpu_bytes(PyObject* obj, at::Tensor& keep, uint64_t& nbytes) {
  if (THPVariableClass == nullptr ||
      !PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
    PyErr_SetString(PyExc_TypeError, "fingerprint_sums takes tensors");
    return nullptr;
  }
  keep = THPVariable_Unpack(obj);
  if (!keep.device().is_cpu() || keep.layout() != c10::kStrided || !keep.has_storage() ||
      !keep.is_contiguous() || keep.is_conj() || keep.is_neg()) {
    PyErr_SetString(PyExc_TypeError, "fingerprint_sums takes contiguous dense CPU tensors");
    return nullptr;
  }
  nbytes = static_cast<uint64_t>(keep.numel()) * keep.element_size();
  static const uint8_t empty = 0;
  return nbytes ? static_cast<const uint8_t*>(keep.const_data_ptr()) : &empty;
}

// fingerprint_sums(tensor, level: int, out: tensor | None = None, first: int = 0)
// -> (s1, s2): the sums over a contiguous CPU tensor's bytes; with `out` (as many bytes),
// the bytes are copied there in the same pass; with `first`, the bytes are words
// `first`, `first + 1`, ... of a larger tensor (a piece of it). Level -1 takes the widest
// loop this CPU runs (the others are for tests). Raises TypeError for anything else; the
// caller takes the torch path then.
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
  const uint8_t* p = cpu_bytes(obj, t, nbytes);
  if (p == nullptr) {
    return nullptr;
  }
  uint8_t* dst = nullptr;
  if (out_obj != Py_None) {
    const uint8_t* q = cpu_bytes(out_obj, out, out_bytes);
    if (q == nullptr) {
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
  Sums r;
  Py_BEGIN_ALLOW_THREADS
  r = sums_of(p, dst, nbytes, level < 0 ? best : level, static_cast<uint64_t>(first));
  Py_END_ALLOW_THREADS
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
