// gpucoll's reduction kernels: the parts of a reduction that NCCL cannot do.
//
// Compiled on first use by NVRTC through cupy.RawModule (gpucoll/_backends/nccl/kernel_loader.py) and
// launched on the group's communication stream. The file includes no headers:
// fixed-width types are spelled out and half/bfloat16 are converted with integer
// arithmetic, so it compiles without the CUDA include path (and as host C++,
// which is how the CPU test suite checks what these kernels compute).
//
// Kernels (T is one of the type suffixes below; every loop is grid-stride):
//   gpucoll_reduce_<op>_<T>(const T* rows, T* out, long long n, int nrows, long long stride)
//       out[i] = rows[0][i] op rows[1][i] op ... op rows[nrows-1][i], i < n, where row r
//       starts at rows + r*stride. out may be one of the rows (each element is read
//       before it is written). op: sum prod min max band bor bxor; T: integers.
//       sum and prod wrap around on overflow, as NumPy's integer arithmetic does.
//   gpucoll_avg_trunc_<T>(T* x, long long n, long long divisor)
//       x[i] = x[i] / divisor, truncating toward zero (C's integer division).
//   gpucoll_scale_<T>(T* x, long long n, <factor>)
//       x[i] = x[i] * factor; factor is long long for integers (wrapping), double
//       for floats (f16/bf16 multiply in float and round to nearest even).
//       T f8e4m3 / f8e5m2 (float8): factor is first rounded to the element type, as
//       ncclRedOpCreatePreMulSum takes it; the exact product is rounded once to nearest
//       even, saturating to the largest finite value as NCCL's conversions do
//       (__NV_SATFINITE); nan stays nan. NCCL's one-rank path lacks these.

typedef signed char gc_i8;
typedef unsigned char gc_u8;
typedef short gc_i16;
typedef unsigned short gc_u16;
typedef int gc_i32;
typedef unsigned int gc_u32;
typedef long long gc_i64;
typedef unsigned long long gc_u64;

// The unsigned type C++ arithmetic promotes T to: sums and products are done in it
// so that they wrap instead of overflowing a signed int (undefined behaviour).
template <typename T> struct gc_wide { typedef unsigned int type; };
template <> struct gc_wide<gc_i64> { typedef unsigned long long type; };
template <> struct gc_wide<gc_u64> { typedef unsigned long long type; };

template <typename T> struct gc_unsigned { static const bool value = false; };
template <> struct gc_unsigned<gc_u8> { static const bool value = true; };
template <> struct gc_unsigned<gc_u16> { static const bool value = true; };
template <> struct gc_unsigned<gc_u32> { static const bool value = true; };
template <> struct gc_unsigned<gc_u64> { static const bool value = true; };

template <typename T> struct gc_sum {
  __device__ __forceinline__ static T apply(T a, T b) {
    typedef typename gc_wide<T>::type W;
    return (T)((W)a + (W)b);
  }
};
template <typename T> struct gc_prod {
  __device__ __forceinline__ static T apply(T a, T b) {
    typedef typename gc_wide<T>::type W;
    return (T)((W)a * (W)b);
  }
};
template <typename T> struct gc_min {
  __device__ __forceinline__ static T apply(T a, T b) { return b < a ? b : a; }
};
template <typename T> struct gc_max {
  __device__ __forceinline__ static T apply(T a, T b) { return a < b ? b : a; }
};
template <typename T> struct gc_band {
  __device__ __forceinline__ static T apply(T a, T b) { return (T)(a & b); }
};
template <typename T> struct gc_bor {
  __device__ __forceinline__ static T apply(T a, T b) { return (T)(a | b); }
};
template <typename T> struct gc_bxor {
  __device__ __forceinline__ static T apply(T a, T b) { return (T)(a ^ b); }
};

#define GC_GRID_LOOP(i, n)                                                        \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);  \
       i += (long long)blockDim.x * gridDim.x)

template <typename Op, typename T>
__device__ __forceinline__ void gc_fold(const T* rows, T* out, long long n, int nrows,
                                        long long stride) {
  GC_GRID_LOOP(i, n) {
    T acc = rows[i];
    for (int r = 1; r < nrows; ++r) acc = Op::apply(acc, rows[r * stride + i]);
    out[i] = acc;
  }
}

template <typename T>
__device__ __forceinline__ void gc_avg_trunc(T* x, long long n, long long divisor) {
  GC_GRID_LOOP(i, n) {
    if (gc_unsigned<T>::value) {
      x[i] = (T)((unsigned long long)x[i] / (unsigned long long)divisor);
    } else {
      x[i] = (T)((long long)x[i] / divisor);
    }
  }
}

template <typename T>
__device__ __forceinline__ void gc_scale_int(T* x, long long n, long long factor) {
  typedef typename gc_wide<T>::type W;
  GC_GRID_LOOP(i, n) { x[i] = (T)((W)x[i] * (W)factor); }
}

#define GC_FOLD(OP, T)                                                                     \
  extern "C" __global__ void gpucoll_reduce_##OP##_##T(const gc_##T* rows, gc_##T* out,    \
                                                       long long n, int nrows,              \
                                                       long long stride) {                  \
    gc_fold<gc_##OP<gc_##T>, gc_##T>(rows, out, n, nrows, stride);                         \
  }

#define GC_INT_KERNELS(T)                                                                  \
  GC_FOLD(sum, T) GC_FOLD(prod, T) GC_FOLD(min, T) GC_FOLD(max, T)                         \
  GC_FOLD(band, T) GC_FOLD(bor, T) GC_FOLD(bxor, T)                                        \
  extern "C" __global__ void gpucoll_avg_trunc_##T(gc_##T* x, long long n,                \
                                                   long long divisor) {                    \
    gc_avg_trunc<gc_##T>(x, n, divisor);                                                   \
  }                                                                                        \
  extern "C" __global__ void gpucoll_scale_##T(gc_##T* x, long long n, long long factor) { \
    gc_scale_int<gc_##T>(x, n, factor);                                                    \
  }

GC_INT_KERNELS(i8)
GC_INT_KERNELS(u8)
GC_INT_KERNELS(i16)
GC_INT_KERNELS(u16)
GC_INT_KERNELS(i32)
GC_INT_KERNELS(u32)
GC_INT_KERNELS(i64)
GC_INT_KERNELS(u64)

// ----- floats: PREMUL_SUM where NCCL has no PreMulSum -----

union gc_f32_bits {
  float f;
  unsigned int u;
};

__device__ __forceinline__ float gc_half_to_float(gc_u16 h) {
  unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
  unsigned int exp = (h >> 10) & 0x1Fu;
  unsigned int man = h & 0x3FFu;
  gc_f32_bits r;
  if (exp == 0x1Fu) {
    r.u = sign | 0x7F800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    r.u = sign | ((exp + 112u) << 23) | (man << 13);  // rebias 15 -> 127
  } else if (man == 0) {
    r.u = sign;
  } else {
    r.f = (float)man * 5.9604644775390625e-8f;  // subnormal: man * 2^-24
    r.u |= sign;
  }
  return r.f;
}

__device__ __forceinline__ gc_u16 gc_float_to_half(float f) {
  gc_f32_bits v;
  v.f = f;
  unsigned int sign = (v.u >> 16) & 0x8000u;
  unsigned int a = v.u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return (gc_u16)(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u));
  if (a >= 0x477FF000u) return (gc_u16)(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                     // below 2^-14: subnormal or zero
    gc_f32_bits s;
    s.u = a;
    float scaled = s.f * 16777216.0f;  // * 2^24, exact
    unsigned int m = (unsigned int)scaled;
    float frac = scaled - (float)m;
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) m += 1u;
    return (gc_u16)(sign | m);
  }
  unsigned int h = (((a >> 23) - 112u) << 10) | ((a & 0x7FFFFFu) >> 13);
  unsigned int rest = a & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1u;  // carries into the exponent
  return (gc_u16)(sign | h);
}

__device__ __forceinline__ float gc_bf16_to_float(gc_u16 b) {
  gc_f32_bits r;
  r.u = (unsigned int)b << 16;
  return r.f;
}

__device__ __forceinline__ gc_u16 gc_float_to_bf16(float f) {
  gc_f32_bits v;
  v.f = f;
  if ((v.u & 0x7F800000u) == 0x7F800000u && (v.u & 0x7FFFFFu)) {
    return (gc_u16)((v.u >> 16) | 0x40u);  // keep nan a (quiet) nan
  }
  return (gc_u16)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void gpucoll_scale_f16(gc_u16* x, long long n, double factor) {
  float k = (float)factor;
  GC_GRID_LOOP(i, n) { x[i] = gc_float_to_half(gc_half_to_float(x[i]) * k); }
}

extern "C" __global__ void gpucoll_scale_bf16(gc_u16* x, long long n, double factor) {
  float k = (float)factor;
  GC_GRID_LOOP(i, n) { x[i] = gc_float_to_bf16(gc_bf16_to_float(x[i]) * k); }
}

extern "C" __global__ void gpucoll_scale_f32(float* x, long long n, double factor) {
  float k = (float)factor;
  GC_GRID_LOOP(i, n) { x[i] = x[i] * k; }
}

extern "C" __global__ void gpucoll_scale_f64(double* x, long long n, double factor) {
  GC_GRID_LOOP(i, n) { x[i] = x[i] * factor; }
}

// ----- float8: PREMUL_SUM on a one-rank communicator (NCCL's one-rank path refuses it) -----
//
// E exponent bits, M mantissa bits, bias B = 2^(E-1) - 1. e4m3fn (E4 M3): no inf, nan is
// S.1111.111, largest finite 0x7E = 448. e5m2 (E5 M2): inf S.11111.00, nan S.11111.xx
// (xx != 0), largest finite 0x7B = 57344.

__device__ __forceinline__ float gc_f8_to_float(gc_u8 v, int E, int M) {
  int B = (1 << (E - 1)) - 1;
  unsigned int sign = (unsigned int)(v & 0x80u) << 24;
  unsigned int ef = (v & 0x7Fu) >> M;
  unsigned int man = v & ((1u << M) - 1u);
  gc_f32_bits r;
  if (E == 4 && (v & 0x7Fu) == 0x7Fu) {
    r.u = sign | 0x7FC00000u;  // e4m3fn nan
  } else if (E == 5 && ef == 0x1Fu) {
    r.u = sign | 0x7F800000u | (man ? 0x400000u : 0u);  // e5m2 inf, nan
  } else if (ef != 0) {
    r.u = sign | ((ef - B + 127u) << 23) | (man << (23 - M));
  } else {
    gc_f32_bits q;  // subnormal: man * 2^(1 - B - M), exact in float
    q.u = (unsigned int)(1 - B - M + 127) << 23;
    r.f = (float)man * q.f;
    r.u |= sign;
  }
  return r.f;
}

__device__ __forceinline__ gc_u8 gc_float_to_f8(float f, int E, int M) {
  int B = (1 << (E - 1)) - 1;
  unsigned int maxfinite = E == 4 ? 0x7Eu : 0x7Bu;
  gc_f32_bits v;
  v.f = f;
  unsigned int sign = (v.u >> 24) & 0x80u;
  unsigned int a = v.u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (gc_u8)(sign | 0x7Fu);  // nan
  int fe = (int)(a >> 23) - 127;
  if (fe < -B - M - 1) return (gc_u8)sign;  // below half the smallest subnormal (float subnormals too)
  unsigned int sig = (a & 0x7FFFFFu) | 0x800000u;
  int e = fe > 1 - B ? fe : 1 - B;  // the exponent whose quantum 2^(e-M) the result has
  int s = 23 + e - M - fe;          // sig * 2^(fe-23) / 2^(e-M) = sig >> s; s is in [23-M, 25]
  unsigned int q = sig >> s;
  unsigned int rest = sig & ((1u << s) - 1u);
  unsigned int half = 1u << (s - 1);
  if (rest > half || (rest == half && (q & 1u))) q += 1u;
  // exponent field (e - (1 - B)) above the subnormals; a carry out of the mantissa
  // moves into the exponent by itself.
  long long code = ((long long)(e - (1 - B)) << M) + q;
  if (code > (long long)maxfinite) code = maxfinite;  // saturate (inf too)
  return (gc_u8)(sign | (unsigned int)code);
}

#define GC_F8_SCALE(T, E, M)                                                          \
  extern "C" __global__ void gpucoll_scale_##T(gc_u8* x, long long n, double factor) { \
    float k = gc_f8_to_float(gc_float_to_f8((float)factor, E, M), E, M);             \
    GC_GRID_LOOP(i, n) { x[i] = gc_float_to_f8(gc_f8_to_float(x[i], E, M) * k, E, M); } \
  }

GC_F8_SCALE(f8e4m3, 4, 3)
GC_F8_SCALE(f8e5m2, 5, 2)
