/* gpucoll's compiled XLA FFI handler for small collectives inside jax.jit (CPU).
 *
 * Built on first use with the machine's C compiler (gpucoll/_jax/native.py), against
 * the c_api.h that jax.ffi.include_dir() ships. Without a compiler every op goes
 * through the Python handler (handler.py), as before.
 *
 * A group's in-jit collectives go through a channel: a shared-memory segment of its
 * ranks (all on one host), set up by native.py at the group's first collective inside
 * jit. Every in-jit collective of the group takes one numbered step on the channel:
 * each rank writes its slot of the op's parity (the signature, for the ops run here
 * the data right after it, and last the op number), then waits until every peer's
 * slot holds the op; a peer's signature that differs is a mismatch, reported on every
 * rank. Every collective whose input (the root's, for broadcast and scatter) is at
 * most slot_bytes runs here without Python: all_reduce, reduce, reduce_scatter,
 * all_gather, gather, scatter, broadcast, barrier; any other (a larger one,
 * all_to_all_single) takes the step from Python (gcj_round) for its signature check
 * and then runs in Python.
 *
 * Two slots per rank, by op parity: a rank writes op k's slot only after it finished
 * op k-1, which needed every peer to have posted op k-1, which each did only after
 * reading op k-2's slots, the ones op k reuses. So a peer's slot of k's parity holds
 * op k-2 or op k, never a later one.
 *
 * Waiting: spin for spin_ns, then sleep on the peer's op number (a futex), checking the
 * abort word, the deadline and the peer's pid every slice. Errors are worded by
 * Python (the explain callback), once per failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "xla/ffi/api/c_api.h"

/* ---- codes shared with native.py ---- */
enum { K_ALL_REDUCE, K_BROADCAST, K_BARRIER, K_REDUCE, K_ALL_GATHER, K_REDUCE_SCATTER, K_GATHER, K_SCATTER,
       K_COUNT };
enum { OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR, OP_AVG };
enum { T_BOOL, T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F16, T_BF16, T_F32, T_F64 };
enum { E_OK = 0, E_MISMATCH = 1, E_TIMEOUT = 2, E_DEAD = 3, E_ABORTED = 4, E_CLOSED = 5, E_BROKEN = 6,
       E_CONCURRENT = 7 };

#define REC_BYTES 256
#define CTL_OFF 4096
#define HDR_BYTES 16 /* a slot's header: its op number, its signature; the data follows */
/* u64 words of a rank's record */
#define W_SLEEP 1
#define W_PID 6
#define W_CPU 7 /* the CPU this rank last waited on, plus one */

typedef struct channel {
  uint8_t* base;
  int rank, size;
  int64_t slot_bytes, slot_stride, data_off;
  int64_t timeout_ns, spin_ns;
  int check_pids;
  uint64_t ops;
  float* scratch; /* the float32 fold of 16-bit floats */
  volatile int busy, closed, broken;
} channel;

typedef struct plan {
  channel* ch;
  int native, kind, dtype, op, root;
  int64_t count;  /* elements a reduction folds */
  int64_t nbytes; /* bytes a rank writes into its slot (its input) */
  int64_t piece;  /* bytes of one rank's part of a stacked operand (gathers, scatters) */
  uint64_t sig;
} plan;

typedef int (*explain_fn)(int64_t index, int code, int peer, uint64_t theirs, uint64_t opno, int64_t pid,
                          char* buf, int64_t cap);
typedef void* (*handler_fn)(XLA_FFI_CallFrame*);

static explain_fn g_explain;
static handler_fn g_fallback[K_COUNT];
static uint64_t g_tag;
static int g_index_bits;

#define CHUNK 4096
static plan** g_chunks[CHUNK]; /* plan index -> plan: CHUNK chunks of CHUNK entries */
static int64_t g_native_ops;   /* ops run here, for tests (not atomic: a count, not a lock) */

static __thread char t_msg[2048];

/* ---- time, futex ---- */
static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static void futex_wait(volatile uint64_t* word, uint32_t expected, int64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake(volatile uint64_t* word) {
  syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

/* ---- the segment ---- */
static inline volatile uint32_t* abort_word(channel* c) { return (volatile uint32_t*)c->base; }
static inline volatile uint64_t* rec(channel* c, int r) {
  return (volatile uint64_t*)(c->base + CTL_OFF + (int64_t)r * REC_BYTES);
}
/* Rank r's slot of this parity: a header (op number, signature) and the data right
 * after it, so that a small op's header and data share a cache line. */
static inline volatile uint64_t* slot_hdr(channel* c, int r, int parity) {
  return (volatile uint64_t*)(c->base + c->data_off + ((int64_t)r * 2 + parity) * c->slot_stride);
}
static inline uint8_t* slot(channel* c, int r, int parity) { return (uint8_t*)slot_hdr(c, r, parity) + HDR_BYTES; }

/* End the channel's ops on every rank: the abort word names this rank (plus one), the
 * next word the peer it failed on (plus one; 0: none), the next the error code. The
 * first rank to abort wins; its culprit and code are written before its word. */
static void abort_all(channel* c, int culprit, int code) {
  volatile uint32_t* w = abort_word(c);
  if (!*w) {
    w[1] = (uint32_t)(culprit + 1);
    w[2] = (uint32_t)code;
  }
  uint32_t zero = 0;
  __atomic_compare_exchange_n(w, &zero, (uint32_t)(c->rank + 1), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  for (int r = 0; r < c->size; r++) {
    futex_wake(slot_hdr(c, r, 0));
    futex_wake(slot_hdr(c, r, 1));
  }
}

/* Publish op k (its header's op number, written last) and wake peers asleep on it. */
static void post(channel* c, uint64_t k, int par) {
  volatile uint64_t* h = slot_hdr(c, c->rank, par);
  __atomic_store_n(&h[0], k, __ATOMIC_SEQ_CST);
  uint64_t mark = (uint64_t)c->rank + 1;
  for (int r = 0; r < c->size; r++) {
    if (r != c->rank && __atomic_load_n(&rec(c, r)[W_SLEEP], __ATOMIC_SEQ_CST) == mark) {
      futex_wake(&h[0]);
      return;
    }
  }
}

static int peer_gone(channel* c, int j, int64_t* pid) {
  *pid = (int64_t)rec(c, j)[W_PID];
  if (!c->check_pids || *pid <= 0) return 0;
  return kill((pid_t)*pid, 0) != 0 && errno == ESRCH;
}

/* Wait until rank j has posted op k (its slot of k's parity holds op k: it cannot be
 * further ahead, see the top). Progress wins over errors: a peer may post and then
 * fail or leave. */
static int wait_for(channel* c, int j, uint64_t k, int64_t* pid) {
  volatile uint64_t* w = slot_hdr(c, j, (int)(k & 1));
  if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == k) return E_OK;
  /* Spin briefly (the fast case: the peer runs on another core), then yield the core
   * (the peer, or whoever, may need it), then sleep. A peer last seen waiting on this
   * very CPU cannot run while this rank spins here: yield at once. */
  int64_t t0 = now_ns(), spin_end = t0 + (c->spin_ns < 5000 ? c->spin_ns : 5000),
          yield_end = t0 + c->spin_ns;
  int cpu = sched_getcpu() + 1;
  volatile uint64_t* me = rec(c, c->rank);
  if (cpu > 0) {
    me[W_CPU] = (uint64_t)cpu;
    if (rec(c, j)[W_CPU] == (uint64_t)cpu) spin_end = t0;
  }
  for (unsigned i = 1;; i++) {
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == k) return E_OK;
    relax();
    if ((i & 63) == 0 && (now_ns() >= spin_end || *abort_word(c))) break;
  }
  while (now_ns() < yield_end && !*abort_word(c)) {
    sched_yield();
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == k) return E_OK;
  }
  int64_t deadline = t0 + c->timeout_ns, next_check = t0;
  __atomic_store_n(&me[W_SLEEP], (uint64_t)j + 1, __ATOMIC_SEQ_CST);
  int rc;
  for (;;) {
    uint64_t cur = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    if (cur == k) { rc = E_OK; break; }
    uint32_t ab = __atomic_load_n(abort_word(c), __ATOMIC_SEQ_CST);
    if (ab && ab != (uint32_t)c->rank + 1) { *pid = ab - 1; rc = E_ABORTED; break; }
    if (c->closed) { rc = E_CLOSED; break; }
    int64_t t = now_ns();
    if (t >= deadline) { *pid = (int64_t)rec(c, j)[W_PID]; rc = E_TIMEOUT; break; }
    if (t >= next_check) {
      if (peer_gone(c, j, pid)) { rc = E_DEAD; break; }
      next_check = t + 100000000LL;
    }
    int64_t left = deadline - t;
    futex_wait(w, (uint32_t)cur, left < 20000000LL ? left : 20000000LL);
  }
  __atomic_store_n(&me[W_SLEEP], 0, __ATOMIC_SEQ_CST);
  return rc;
}

/* ---- reductions: a left fold in rank order, as the CPU backend's (reduce.py) ---- */
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
  float f;
  if (e == 0) {
    f = (float)m * 5.9604644775390625e-08f; /* m * 2^-24 */
    memcpy(&x, &f, 4);
    x |= sign;
  } else if (e == 31) {
    x = sign | 0x7f800000u | (m << 13);
  } else {
    x = sign | ((e + 112u) << 23) | (m << 13);
  }
  memcpy(&f, &x, 4);
  return f;
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even, as NumPy */
  uint32_t x;
  memcpy(&x, &f, 4);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x3ffu); /* NaN */
  if (ax >= 0x47800000u) return sign | 0x7c00u;                                  /* >= 65536 */
  if (ax >= 0x38800000u) {                                                       /* normal */
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;
    if (r >= 0x0f800000u) return sign | 0x7c00u;
    return sign | (uint16_t)(r >> 13);
  }
  if (ax <= 0x33000000u) return sign; /* at most 2^-25: rounds to zero */
  uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
  uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) r++;
  return sign | (uint16_t)r;
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

/* NumPy's minimum/maximum on float32/float64 arrays: a NaN wins (the first one); on
 * equal values (+0 and -0) the second operand. */
#define FMIN(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) < (b) ? (a) : (b))
#define FMAX(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) > (b) ? (a) : (b))

/* o = a op b over n elements, integers wrapping (arithmetic in the unsigned type U) */
#define INT_FOLD(NAME, T, U)                                                                   \
  static void NAME(T* o, const T* a, const T* b, int64_t n, int op) {                         \
    switch (op) {                                                                              \
      case OP_SUM: case OP_AVG: for (int64_t i = 0; i < n; i++) o[i] = (T)((U)a[i] + (U)b[i]); break; \
      case OP_PRODUCT: for (int64_t i = 0; i < n; i++) o[i] = (T)((U)a[i] * (U)b[i]); break;  \
      case OP_MIN: for (int64_t i = 0; i < n; i++) o[i] = b[i] < a[i] ? b[i] : a[i]; break;   \
      case OP_MAX: for (int64_t i = 0; i < n; i++) o[i] = b[i] > a[i] ? b[i] : a[i]; break;   \
      case OP_BAND: for (int64_t i = 0; i < n; i++) o[i] = (T)(a[i] & b[i]); break;           \
      case OP_BOR: for (int64_t i = 0; i < n; i++) o[i] = (T)(a[i] | b[i]); break;            \
      case OP_BXOR: for (int64_t i = 0; i < n; i++) o[i] = (T)(a[i] ^ b[i]); break;           \
    }                                                                                          \
  }
INT_FOLD(fold_i8, int8_t, uint8_t)
INT_FOLD(fold_u8, uint8_t, uint8_t)
INT_FOLD(fold_i16, int16_t, uint16_t)
INT_FOLD(fold_u16, uint16_t, uint16_t)
INT_FOLD(fold_i32, int32_t, uint32_t)
INT_FOLD(fold_u32, uint32_t, uint32_t)
INT_FOLD(fold_i64, int64_t, uint64_t)
INT_FOLD(fold_u64, uint64_t, uint64_t)

#define FLOAT_FOLD(NAME, T)                                                                    \
  static void NAME(T* o, const T* a, const T* b, int64_t n, int op) {                         \
    switch (op) {                                                                              \
      case OP_SUM: case OP_AVG: for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i]; break;    \
      case OP_PRODUCT: for (int64_t i = 0; i < n; i++) o[i] = a[i] * b[i]; break;             \
      case OP_MIN: for (int64_t i = 0; i < n; i++) o[i] = FMIN(a[i], b[i]); break;            \
      case OP_MAX: for (int64_t i = 0; i < n; i++) o[i] = FMAX(a[i], b[i]); break;            \
    }                                                                                          \
  }
FLOAT_FOLD(fold_f32, float)
FLOAT_FOLD(fold_f64, double)

static void fold_bool(uint8_t* o, const uint8_t* a, const uint8_t* b, int64_t n, int op) {
  /* NumPy's bool: SUM and MAX are or, PRODUCT and MIN are and */
  for (int64_t i = 0; i < n; i++) {
    int x = a[i] != 0, y = b[i] != 0;
    switch (op) {
      case OP_SUM: case OP_MAX: case OP_BOR: o[i] = (uint8_t)(x | y); break;
      case OP_PRODUCT: case OP_MIN: case OP_BAND: o[i] = (uint8_t)(x & y); break;
      default: o[i] = (uint8_t)(x ^ y); break;
    }
  }
}

#define INT_AVG(T, n, count, size) \
  for (int64_t i = 0; i < (count); i++) ((T*)(n))[i] = (T)(((T*)(n))[i] / (T)(size))

static const int8_t ITEMSIZE[] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8}; /* by T_* */

static void fold(plan* p, void* out, const uint8_t* const* parts) {
  int n = p->ch->size, op = p->op;
  int64_t c = p->count;
  if (n == 1) {
    memcpy(out, parts[0], (size_t)(c * ITEMSIZE[p->dtype]));
    return;
  }
  if (p->dtype == T_F16 || p->dtype == T_BF16) { /* fold in float32, round once */
    float* acc = p->ch->scratch;
    int bf = p->dtype == T_BF16;
    for (int k = 0; k < n; k++) {
      const uint16_t* h = (const uint16_t*)parts[k];
      if (k == 0) {
        for (int64_t i = 0; i < c; i++) acc[i] = bf ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
        continue;
      }
      for (int64_t i = 0; i < c; i++) {
        float x = acc[i], y = bf ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
        switch (op) {
          case OP_SUM: case OP_AVG: acc[i] = x + y; break;
          case OP_PRODUCT: acc[i] = x * y; break;
          case OP_MIN: acc[i] = FMIN(x, y); break;
          default: acc[i] = FMAX(x, y); break;
        }
      }
    }
    if (op == OP_AVG)
      for (int64_t i = 0; i < c; i++) acc[i] = acc[i] / (float)n;
    uint16_t* o = (uint16_t*)out;
    for (int64_t i = 0; i < c; i++) o[i] = bf ? f32_to_bf16(acc[i]) : f32_to_f16(acc[i]);
    return;
  }
  for (int k = 1; k < n; k++) {
    const void* a = k == 1 ? (const void*)parts[0] : out;
    const void* b = parts[k];
    switch (p->dtype) {
      case T_BOOL: fold_bool(out, a, b, c, op); break;
      case T_I8: fold_i8(out, a, b, c, op); break;
      case T_U8: fold_u8(out, a, b, c, op); break;
      case T_I16: fold_i16(out, a, b, c, op); break;
      case T_U16: fold_u16(out, a, b, c, op); break;
      case T_I32: fold_i32(out, a, b, c, op); break;
      case T_U32: fold_u32(out, a, b, c, op); break;
      case T_I64: fold_i64(out, a, b, c, op); break;
      case T_U64: fold_u64(out, a, b, c, op); break;
      case T_F32: fold_f32(out, a, b, c, op); break;
      case T_F64: fold_f64(out, a, b, c, op); break;
    }
  }
  if (op != OP_AVG) return;
  switch (p->dtype) { /* integers truncate toward zero, as C (and reduce.py) do */
    case T_I8: INT_AVG(int8_t, out, c, n); break;
    case T_U8: INT_AVG(uint8_t, out, c, n); break;
    case T_I16: INT_AVG(int16_t, out, c, n); break;
    case T_U16: INT_AVG(uint16_t, out, c, n); break;
    case T_I32: INT_AVG(int32_t, out, c, n); break;
    case T_U32: INT_AVG(uint32_t, out, c, n); break;
    case T_I64: INT_AVG(int64_t, out, c, n); break;
    case T_U64: INT_AVG(uint64_t, out, c, n); break;
    case T_F32: for (int64_t i = 0; i < c; i++) ((float*)out)[i] = ((float*)out)[i] / (float)n; break;
    case T_F64: for (int64_t i = 0; i < c; i++) ((double*)out)[i] = ((double*)out)[i] / (double)n; break;
  }
}

/* ---- one step on the channel ---- */
static int fail(plan* p, int64_t index, int code, int peer, uint64_t theirs, uint64_t opno, int64_t pid) {
  channel* c = p->ch;
  if (code != E_BROKEN && code != E_CLOSED && code != E_CONCURRENT) {
    c->broken = 1;
    if (code == E_ABORTED) { /* say what the aborting rank said: its culprit (plus one), its code */
      volatile uint32_t* w = abort_word(c);
      theirs = (uint64_t)w[1] | ((uint64_t)w[2] << 32);
    } else {
      abort_all(c, peer, code);
    }
  }
  t_msg[0] = 0;
  if (g_explain) g_explain(index, code, peer, theirs, opno, pid, t_msg, (int64_t)sizeof t_msg);
  t_msg[sizeof t_msg - 1] = 0;
  return code;
}

/* Take op k's step: header (and data, for the ops run here) out, every peer's in. */
static int step(plan* p, int64_t index, const void* in) {
  channel* c = p->ch;
  if (c->closed) return fail(p, index, E_CLOSED, -1, 0, c->ops + 1, 0);
  if (c->broken) return fail(p, index, E_BROKEN, -1, 0, c->ops + 1, 0);
  if (__atomic_exchange_n(&c->busy, 1, __ATOMIC_ACQUIRE))
    return fail(p, index, E_CONCURRENT, -1, 0, c->ops + 1, 0);
  uint64_t k = ++c->ops;
  int par = (int)(k & 1), rc = E_OK;
  slot_hdr(c, c->rank, par)[1] = p->sig;
  if (in && p->nbytes) memcpy(slot(c, c->rank, par), in, (size_t)p->nbytes);
  post(c, k, par);
  for (int j = 0; j < c->size && rc == E_OK; j++) {
    if (j == c->rank) continue;
    int64_t pid = 0;
    int w = wait_for(c, j, k, &pid);
    if (w != E_OK) {
      rc = fail(p, index, w, j, 0, k, pid);
      break;
    }
    uint64_t sig = slot_hdr(c, j, par)[1];
    if (sig != p->sig) rc = fail(p, index, E_MISMATCH, j, sig, k, 0);
  }
  if (rc != E_OK) __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
  return rc;
}

static void* make_error(XLA_FFI_CallFrame* f) {
  XLA_FFI_Error_Create_Args a;
  memset(&a, 0, sizeof a);
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = t_msg;
  a.errc = XLA_FFI_Error_Code_INTERNAL;
  return f->api->XLA_FFI_Error_Create(&a);
}

static inline void* data_of(XLA_FFI_Buffer* const* v, int i) { return v[i]->data; }

/* Run plan p on the frame's buffers (p->native). Returns the FFI error, or NULL. */
static void* run(XLA_FFI_CallFrame* f, plan* p, int64_t index) {
  channel* c = p->ch;
  int kind = p->kind, me = c->rank, n = c->size, root = p->root;
  uint8_t* in = f->args.size > 1 ? data_of((XLA_FFI_Buffer* const*)f->args.args, 0) : NULL;
  uint8_t* out = f->rets.size > 1 ? data_of((XLA_FFI_Buffer* const*)f->rets.rets, 0) : NULL;
  /* what this rank writes into its slot: its input, but for a rooted op only the root's */
  int rooted = kind == K_BROADCAST || kind == K_SCATTER;
  const void* sent = kind == K_BARRIER || (rooted && me != root) ? NULL : in;
  if (step(p, index, sent) != E_OK) return make_error(f);
  int par = (int)(c->ops & 1);
  const uint8_t* parts[n];
  for (int r = 0; r < n; r++) parts[r] = slot(c, r, par);
  switch (kind) {
    case K_ALL_REDUCE:
      fold(p, out, parts);
      break;
    case K_REDUCE: /* the root folds; the others' value passes through */
      if (me == root) fold(p, out, parts);
      else if (out != in && p->nbytes) memcpy(out, in, (size_t)p->nbytes);
      break;
    case K_REDUCE_SCATTER: /* this rank's chunk of every rank's stacked input, folded */
      for (int r = 0; r < n; r++) parts[r] += (int64_t)me * p->piece;
      fold(p, out, parts);
      break;
    case K_ALL_GATHER:
    case K_GATHER: /* every rank's input, stacked in rank order (gather: on the root) */
      if (out && p->piece)
        for (int r = 0; r < n; r++) memcpy(out + (int64_t)r * p->piece, parts[r], (size_t)p->piece);
      break;
    case K_SCATTER: /* this rank's chunk of the root's stacked input */
      if (p->piece) memcpy(out, parts[root] + (int64_t)me * p->piece, (size_t)p->piece);
      break;
    case K_BROADCAST:
      if (me != root) {
        if (p->piece) memcpy(out, parts[root], (size_t)p->piece);
      } else if (out != in && p->piece) {
        memcpy(out, in, (size_t)p->piece);
      }
      break;
    default: /* barrier passes its value through */
      if (out && in && out != in && p->piece) memcpy(out, in, (size_t)p->piece);
  }
  __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
  g_native_ops++;
  return NULL;
}

static plan* find(XLA_FFI_CallFrame* f, int64_t* index) {
  if (f->attrs.size != 1 || f->attrs.types[0] != XLA_FFI_AttrType_SCALAR) return NULL;
  XLA_FFI_Scalar* s = (XLA_FFI_Scalar*)f->attrs.attrs[0];
  if (!s || !s->value) return NULL;
  int64_t v = *(int64_t*)s->value;
  if (((uint64_t)v >> g_index_bits) != g_tag) return NULL;
  int64_t i = v & (((int64_t)1 << g_index_bits) - 1);
  if (i >= (int64_t)CHUNK * CHUNK) return NULL;
  plan** chunk = __atomic_load_n(&g_chunks[i / CHUNK], __ATOMIC_ACQUIRE);
  if (!chunk) return NULL;
  *index = i;
  return __atomic_load_n(&chunk[i % CHUNK], __ATOMIC_ACQUIRE);
}

static void* handle(XLA_FFI_CallFrame* f, int kind) {
  XLA_FFI_Extension_Base* ext = f->extension_start;
  if (ext && ext->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata* md = ((XLA_FFI_Metadata_Extension*)ext)->metadata;
    md->api_version.major_version = XLA_FFI_API_MAJOR;
    md->api_version.minor_version = XLA_FFI_API_MINOR;
    md->traits = 0;
    return NULL;
  }
  if (f->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  int64_t index = -1;
  plan* p = find(f, &index);
  if (!p || !p->native) return g_fallback[kind](f);
  return run(f, p, index);
}

/* ---- the interface native.py calls ---- */
void* gcj_all_reduce(XLA_FFI_CallFrame* f) { return handle(f, K_ALL_REDUCE); }
void* gcj_broadcast(XLA_FFI_CallFrame* f) { return handle(f, K_BROADCAST); }
void* gcj_barrier(XLA_FFI_CallFrame* f) { return handle(f, K_BARRIER); }
void* gcj_reduce(XLA_FFI_CallFrame* f) { return handle(f, K_REDUCE); }
void* gcj_all_gather(XLA_FFI_CallFrame* f) { return handle(f, K_ALL_GATHER); }
void* gcj_reduce_scatter(XLA_FFI_CallFrame* f) { return handle(f, K_REDUCE_SCATTER); }
void* gcj_gather(XLA_FFI_CallFrame* f) { return handle(f, K_GATHER); }
void* gcj_scatter(XLA_FFI_CallFrame* f) { return handle(f, K_SCATTER); }

void gcj_init(explain_fn explain, uint64_t tag, int index_bits) {
  g_explain = explain;
  g_tag = tag;
  g_index_bits = index_bits;
}

void gcj_fallback(int kind, handler_fn fn) {
  if (kind >= 0 && kind < K_COUNT) g_fallback[kind] = fn;
}

/* A channel over ``base`` (the mapped segment, or private memory for one rank). */
channel* gcj_channel(uint8_t* base, int rank, int size, int64_t slot_bytes, int64_t data_off,
                     double timeout_s, double spin_s, int check_pids) {
  channel* c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->scratch = malloc((size_t)(slot_bytes / 2 + 1) * sizeof(float));
  if (!c->scratch) {
    free(c);
    return NULL;
  }
  c->base = base;
  c->rank = rank;
  c->size = size;
  c->slot_bytes = slot_bytes;
  c->slot_stride = (HDR_BYTES + slot_bytes + 63) / 64 * 64;
  c->data_off = data_off;
  c->timeout_ns = (int64_t)(timeout_s * 1e9);
  c->spin_ns = (int64_t)(spin_s * 1e9);
  c->check_pids = check_pids;
  rec(c, rank)[W_PID] = (uint64_t)getpid();
  return c;
}

/* Close a channel: its later ops fail at once; peers waiting on this rank stop waiting
 * (the mapping itself stays: another thread may still be reading it). */
void gcj_close(channel* c) {
  c->closed = 1;
  abort_all(c, -1, E_CLOSED);
}

int gcj_plan(int64_t index, channel* c, int native, int kind, int dtype, int op, int root, int64_t count,
             int64_t nbytes, int64_t piece, uint64_t sig) {
  if (index < 0 || index >= (int64_t)CHUNK * CHUNK) return -1;
  plan** chunk = g_chunks[index / CHUNK];
  if (!chunk) {
    chunk = calloc(CHUNK, sizeof *chunk);
    if (!chunk) return -1;
    __atomic_store_n(&g_chunks[index / CHUNK], chunk, __ATOMIC_RELEASE);
  }
  plan* p = chunk[index % CHUNK];
  if (!p) {
    p = calloc(1, sizeof *p);
    if (!p) return -1;
  }
  p->ch = c;
  p->native = native;
  p->kind = kind;
  p->dtype = dtype;
  p->op = op;
  p->root = root;
  p->count = count;
  p->nbytes = nbytes;
  p->piece = piece;
  p->sig = sig;
  __atomic_store_n(&chunk[index % CHUNK], p, __ATOMIC_RELEASE);
  return 0;
}

/* The channel step of a collective run in Python (its signature check): 0 or an error
 * code (the explain callback has worded it). */
int gcj_round(int64_t index) {
  plan** chunk = index >= 0 && index < (int64_t)CHUNK * CHUNK ? g_chunks[index / CHUNK] : NULL;
  plan* p = chunk ? chunk[index % CHUNK] : NULL;
  if (!p) return -1;
  int rc = step(p, index, NULL);
  if (rc == E_OK) __atomic_store_n(&p->ch->busy, 0, __ATOMIC_RELEASE);
  return rc;
}

/* Run a native plan from Python (its first call, after the channel was set up). */
void* gcj_run(XLA_FFI_CallFrame* f, int64_t index) {
  plan* p = g_chunks[index / CHUNK][index % CHUNK];
  return run(f, p, index);
}

int64_t gcj_native_ops(void) { return g_native_ops; }
