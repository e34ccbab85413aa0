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

// The definition, word by word: words [first, first + m) of the tensor, at `p`.
Sums scalar(const uint8_t* p, uint64_t m, uint64_t first) {
  uint64_t a1[4] = {0, 0, 0, 0};
  uint64_t a2[4] = {0, 0, 0, 0};
  uint64_t k[4];
  for (int j = 0; j < 4; ++j) {
    k[j] = (first + 1 + j) * kP;
  }
  uint64_t i = 0;
  for (; i + 4 <= m; i += 4) {  // four independent chains: the multiplies overlap
    for (int j = 0; j < 4; ++j) {
      const uint64_t x = load_word(p + 8 * (i + j)) ^ k[j];
      a1[j] += x;
      a2[j] += (x & 0xFFFFFFFFull) * (x >> 32);
      k[j] += 4 * kP;
    }
  }
  Sums r{a1[0] + a1[1] + a1[2] + a1[3], a2[0] + a2[1] + a2[2] + a2[3]};
  for (; i < m; ++i) {
    const uint64_t x = load_word(p + 8 * i) ^ ((first + i + 1) * kP);
    r.s1 += x;
    r.s2 += (x & 0xFFFFFFFFull) * (x >> 32);
  }
  return r;
}

#ifdef GRAPHSAFE_X86
__attribute__((target("avx2"))) Sums avx2(const uint8_t* p, uint64_t m, uint64_t first) {
  __m256i k0 = _mm256_set_epi64x((first + 4) * kP, (first + 3) * kP, (first + 2) * kP,
                                 (first + 1) * kP);
  __m256i k1 = _mm256_add_epi64(k0, _mm256_set1_epi64x(4 * kP));
  const __m256i step = _mm256_set1_epi64x(8 * kP);
  __m256i s1a = _mm256_setzero_si256(), s1b = s1a, s2a = s1a, s2b = s1a;
  uint64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256i x0 = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * i)), k0);
    const __m256i x1 = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * i + 32)), k1);
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
  const Sums rest = scalar(p + 8 * i, m - i, first + i);
  return {r.s1 + rest.s1, r.s2 + rest.s2};
}

__attribute__((target("avx512f"))) Sums avx512(const uint8_t* p, uint64_t m, uint64_t first) {
  __m512i k0 = _mm512_set_epi64((first + 8) * kP, (first + 7) * kP, (first + 6) * kP,
                                (first + 5) * kP, (first + 4) * kP, (first + 3) * kP,
                                (first + 2) * kP, (first + 1) * kP);
  __m512i k1 = _mm512_add_epi64(k0, _mm512_set1_epi64(8 * kP));
  const __m512i step = _mm512_set1_epi64(16 * kP);
  __m512i s1a = _mm512_setzero_si512(), s1b = s1a, s2a = s1a, s2b = s1a;
  uint64_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p + 8 * i), k0);
    const __m512i x1 = _mm512_xor_si512(_mm512_loadu_si512(p + 8 * i + 64), k1);
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
  const Sums rest = scalar(p + 8 * i, m - i, first + i);
  return {r.s1 + rest.s1, r.s2 + rest.s2};
}
#endif

using Loop = Sums (*)(const uint8_t*, uint64_t, uint64_t);

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

Loop loop_of(int level) {
#ifdef GRAPHSAFE_X86
  if (level == 2) {
    return avx512;
  }
  if (level == 1) {
    return avx2;
  }
#endif
  return scalar;
}

// Both sums over `nbytes` bytes at `p`, the words split over torch's intra-op threads.
Sums sums_of(const uint8_t* p, uint64_t nbytes, Loop loop) {
  const int64_t m = static_cast<int64_t>(nbytes / 8);
  std::atomic<uint64_t> s1{0}, s2{0};
  at::parallel_for(0, m, kGrain, [&](int64_t begin, int64_t end) {
    const Sums part = loop(p + 8 * begin, static_cast<uint64_t>(end - begin),
                           static_cast<uint64_t>(begin));
    s1.fetch_add(part.s1, std::memory_order_relaxed);  // modulo 2**64
    s2.fetch_add(part.s2, std::memory_order_relaxed);
  });
  Sums r{s1.load(), s2.load()};
  const uint64_t tail = nbytes % 8;
  if (tail != 0) {  // the last word, padded with zero bytes
    uint8_t word[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(word, p + 8 * m, tail);
    const Sums last = scalar(word, 1, static_cast<uint64_t>(m));
    r.s1 += last.s1;
    r.s2 += last.s2;
  }
  return r;
}

// fingerprint_sums(tensor, level: int) -> (s1, s2): the sums over a contiguous CPU
// tensor's bytes; level -1 takes the widest loop this CPU runs (the others are for
// tests). Raises TypeError for anything else; the caller takes the torch path then.
PyObject* fingerprint_sums(PyObject* /*self*/, PyObject* args) {
  PyObject* obj = nullptr;
  int level = -1;
  if (!PyArg_ParseTuple(args, "Oi", &obj, &level)) {
    return nullptr;
  }
  if (THPVariableClass == nullptr ||
      !PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
    PyErr_SetString(PyExc_TypeError, "fingerprint_sums takes a tensor");
    return nullptr;
  }
  const at::Tensor t = THPVariable_Unpack(obj);  // a reference: kept alive without the GIL
  if (!t.device().is_cpu() || t.layout() != c10::kStrided || !t.has_storage() ||
      !t.is_contiguous() || t.is_conj() || t.is_neg()) {
    PyErr_SetString(PyExc_TypeError, "fingerprint_sums takes a contiguous dense CPU tensor");
    return nullptr;
  }
  const int best = best_level();
  if (level > best) {
    PyErr_Format(PyExc_ValueError, "this CPU runs loops up to level %d, not %d", best, level);
    return nullptr;
  }
  const Loop loop = loop_of(level < 0 ? best : level);
  const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  const uint8_t* p = nbytes ? static_cast<const uint8_t*>(t.const_data_ptr()) : nullptr;
  Sums r;
  Py_BEGIN_ALLOW_THREADS
  r = sums_of(p, nbytes, loop);
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
    {"fingerprint_sums", fingerprint_sums, METH_VARARGS, "The two sums of gs.fingerprint."},
    {"fingerprint_level", fingerprint_level, METH_NOARGS, "The widest loop this CPU runs."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
