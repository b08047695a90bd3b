/*
 * qcomm_builtin._kernels: optional C kernels of the built-in block codecs
 * (int8, fp8_e4m3, fp8_e5m2, mx4), and their round-trip errors for qcomm's
 * measurement of each call's error. Their torch code in int8.py, fp8.py and
 * mx4.py is the reference and the fallback; these give the same bits.
 *
 * Plain C99, no intrinsics and no -march: the loops are written so that gcc
 * and clang vectorize them at -O3 for the baseline ISA (integer compares and
 * selects on float bits, where IEEE rules would keep float min/max scalar).
 * On x86 the encoders and int8 decoding are compiled a second time for AVX2
 * and FMA, which runs where the CPU has them: the same C, the same IEEE
 * operations, the same bits. Floating-point arithmetic must stay IEEE and
 * uncontracted: build with -ffp-contract=off, never with -ffast-math or
 * flush-to-zero. -fno-trapping-math (nothing here relies on FP exceptions)
 * lets gcc vectorize selects between float results.
 *
 * Every function takes addresses (tensor.data_ptr()) and sizes as Python
 * ints. The Python side owns the buffers and sizes them; here the sizes are
 * checked for consistency only. The GIL is released while a kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bodies are inlined into each copy, where the block size is often the
 * constant 32: such loops unroll completely. */
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__AVX2__)
#define X86_DISPATCH 1
static int have_avx2;
/* A kernel `name` whose body is the inline function name##_body, twice. */
#define KERNEL(name, params, args)                                                                \
    __attribute__((noinline)) static void name##_base params { name##_body args; }               \
    __attribute__((noinline, target("avx2,fma"))) static void name##_avx2 params {                \
        name##_body args;                                                                         \
    }                                                                                             \
    static void name params {                                                                     \
        if (have_avx2)                                                                            \
            name##_avx2 args;                                                                     \
        else                                                                                      \
            name##_base args;                                                                     \
    }
#else
#define X86_DISPATCH 0
#define KERNEL(name, params, args)                                                                \
    static void name params { name##_body args; }
#endif
/* One copy only, for kernels that AVX2 does not speed up (table lookups). */
#define KERNEL1(name, params, args)                                                               \
    static void name params { name##_body args; }

INLINE uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

INLINE float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float load_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

INLINE void store_f32(uint8_t *p, float f) { memcpy(p, &f, 4); }

#define QNAN_BITS 0x7FC00000u /* what torch writes for math.nan */
#define INF_BITS 0x7F800000u
#define MIN_NORMAL_BITS 0x00800000u

/* Encoders take up to CHUNK blocks in two passes: first every block's scale,
 * whose divisions and latencies then overlap, then the elements in a loop
 * that no scalar work interrupts. Long blocks come fewer per chunk. */
#define CHUNK 64
#define CHUNK_ELEMENTS 4096

INLINE size_t chunk_blocks(size_t block) {
    size_t k = CHUNK_ELEMENTS / block;
    return k < 1 ? 1 : k > CHUNK ? CHUNK : k;
}

/* Largest |x| of n floats as bits; >= INF_BITS when one is NaN or infinite,
 * so one integer max gives both the maximum and the finiteness. */
INLINE int32_t max_abs_bits(const float *x, size_t n) {
    int32_t m = 0;
    for (size_t j = 0; j < n; j++) {
        int32_t a = (int32_t)(f2u(x[j]) & 0x7FFFFFFFu);
        m = a > m ? a : m;
    }
    return m;
}

/* A partial last block is encoded from a copy padded to a whole block. */
static float *padded_tail(const float *x, size_t have, size_t block, int edge) {
    float *tail = malloc(block * sizeof(float));
    if (tail != NULL) {
        memcpy(tail, x, have * sizeof(float));
        for (size_t j = have; j < block; j++)
            tail[j] = edge ? x[have - 1] : 0.0f;
    }
    return tail;
}

/* ---------------------------------------------------------------- int8 -- */

/* Float bits mapped so that signed integer order is float order (-0 < +0,
 * NaNs beyond the infinities); the map is its own inverse. Ordering -0 below
 * +0 is the one choice torch leaves open: its amin/amax return either zero
 * of a row holding both, depending on how it vectorizes. Only the sign of a
 * zero scale or bias can differ then; the decoded values are the same. */
INLINE int32_t order_key(uint32_t u) { return (int32_t)(u ^ ((uint32_t)((int32_t)u >> 31) >> 1)); }

/* `rows` (<= CHUNK) rows of d floats into the fused 8-bit row-wise format. */
INLINE void int8_encode_body(const float *x, size_t rows, size_t d, uint8_t *out) {
    float mins[CHUNK], inverses[CHUNK];
    unsigned char bad[CHUNK];
    for (size_t r = 0; r < rows; r++) {
        const float *row = x + r * d;
        int32_t lo = INT32_MAX, hi = INT32_MIN;
        for (size_t j = 0; j < d; j++) {
            int32_t k = order_key(f2u(row[j]));
            lo = k < lo ? k : lo;
            hi = k > hi ? k : hi;
        }
        float mn = u2f((uint32_t)order_key((uint32_t)lo));
        float range = u2f((uint32_t)order_key((uint32_t)hi)) - mn;
        /* NaN or +-inf (keys beyond the infinities'), or a range that
         * overflows: int8.py sends NaN scale and bias and zero values. */
        bad[r] = hi >= (int32_t)INF_BITS || lo <= order_key(0xFF800000u) || !isfinite(range);
        /* fbgemm's float32 steps in its order; (float)1e-8 is what torch
         * makes of int8.py's Python float. */
        mins[r] = mn;
        inverses[r] = 255.0f / (range + (float)1e-8);
        uint8_t *meta = out + r * (d + 8) + d;
        store_f32(meta, bad[r] ? u2f(QNAN_BITS) : range / 255.0f);
        store_f32(meta + 4, bad[r] ? u2f(QNAN_BITS) : mn);
    }
    for (size_t r = 0; r < rows; r++) {
        const float *row = x + r * d;
        uint8_t *q = out + r * (d + 8);
        float mn = mins[r], inverse = inverses[r];
        for (size_t j = 0; j < d; j++) {
            /* 0 <= v < 255.5 in a good row. Adding 1.5 * 2**23 rounds v to an
             * integer, half to even like lrintf, in the low mantissa bits. */
            float v = (row[j] - mn) * inverse;
            q[j] = (uint8_t)f2u(v + 12582912.0f);
        }
        if (bad[r])
            memset(q, 0, d);
    }
}

INLINE void int8_encode_rows_body(const float *x, size_t rows, size_t d, uint8_t *out) {
    size_t step = chunk_blocks(d);
    for (size_t r = 0; r < rows; r += step) {
        size_t k = rows - r < step ? rows - r : step;
        if (d == 32) /* the default, unrolled */
            int8_encode_body(x + r * 32, k, 32, out + r * 40);
        else
            int8_encode_body(x + r * d, k, d, out + r * (d + 8));
    }
}
KERNEL(int8_encode_rows, (const float *x, size_t rows, size_t d, uint8_t *out), (x, rows, d, out))

static int int8_encode(const float *x, size_t n, uint8_t *out, size_t d) {
    size_t rows = n / d, rest = n % d;
    int8_encode_rows(x, rows, d, out);
    if (rest) { /* int8.py pads by repeating the last element */
        float *tail = padded_tail(x + rows * d, rest, d, 1);
        if (tail == NULL)
            return -1;
        int8_encode_rows(tail, 1, d, out + rows * (d + 8));
        free(tail);
    }
    return 0;
}

/* q * scale + bias, rounded once (fused) or twice, whichever torch's addcmul
 * does here (int8.py asks it): once where torch's kernels use FMA, as on x86
 * with AVX2, where this code has FMA too; without FMA hardware fmaf() is a
 * slow but exact library call. */
INLINE void int8_decode_body(const uint8_t *in, size_t rows, size_t d, float *out, size_t width,
                             size_t stride, int fused) {
    size_t per_line = width / d;
    for (size_t r = 0; r < rows; out += stride) {
        for (size_t k = 0; k < per_line; k++, r++) {
            const uint8_t *row = in + r * (d + 8);
            float *y = out + k * d;
            float scale = load_f32(row + d), bias = load_f32(row + d + 4);
            if (fused)
                for (size_t j = 0; j < d; j++)
                    y[j] = fmaf((float)row[j], scale, bias);
            else
                for (size_t j = 0; j < d; j++)
                    y[j] = (float)row[j] * scale + bias;
        }
    }
}
KERNEL(int8_decode,
       (const uint8_t *in, size_t rows, size_t d, float *out, size_t width, size_t stride,
        int fused),
       (in, rows, d, out, width, stride, fused))

/* ----------------------------------------------------------------- fp8 -- */

/* torch's (c10's) float32 -> float8_e4m3fn, the same integer steps: round to
 * nearest even with gradual underflow. Only for |f| < 464, where c10 neither
 * saturates nor makes NaN: a finite row scales to |f| <= 240 (1 + 2**-23). */
INLINE uint32_t to_e4m3(float f) {
    uint32_t u = f2u(f), sign = u & 0x80000000u;
    u ^= sign;
    uint32_t small = f2u(u2f(u) + u2f(141u << 23)) - (141u << 23);
    uint32_t big = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
    return ((int32_t)u < (int32_t)(121u << 23) ? small : big) | sign >> 24;
}

/* torch's float32 -> float8_e5m2, for |f| < 61440 (a finite row: 57344). */
INLINE uint32_t to_e5m2(float f) {
    uint32_t u = f2u(f), sign = u & 0x80000000u;
    u ^= sign;
    uint32_t small = f2u(u2f(u) + u2f(134u << 23)) - (134u << 23);
    uint32_t big = (u + ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + ((u >> 21) & 1u)) >> 21;
    return ((int32_t)u < (int32_t)(113u << 23) ? small : big) | sign >> 24;
}

/* fp8.py's element formats: fbgemm's largest value and the power of two that
 * turns fbgemm's units into torch's OCP ones. */
static const float FP8_MAX_POS[2] = {0.9375f, 0.875f};
static const float FP8_SHIFT[2] = {256.0f, 65536.0f};

/* float32 value of an fp8 byte as torch converts it, NaN payloads included;
 * subnormals as integer times 2**-9 (2**-16), exact. */
INLINE float from_e4m3(uint32_t b) {
    uint32_t sign = (b & 0x80u) << 24, mag = b & 0x7Fu;
    uint32_t normal = (mag << 20) + (120u << 23);
    uint32_t small = f2u((float)(int32_t)mag * 0x1p-9f);
    uint32_t bits = mag == 0x7Fu ? 0x7FF00000u : mag < 8u ? small : normal;
    return u2f(bits | sign);
}

INLINE float from_e5m2(uint32_t b) {
    uint32_t sign = (b & 0x80u) << 24, mag = b & 0x7Fu, m = b & 3u;
    uint32_t normal = (mag << 21) + (112u << 23);
    uint32_t small = f2u((float)(int32_t)mag * 0x1p-16f);
    /* inf, or NaN with the payload widened and made quiet */
    uint32_t special = INF_BITS | m << 21 | (m ? 0x00400000u : 0u);
    uint32_t bits = mag >= 0x7Cu ? special : mag < 4u ? small : normal;
    return u2f(bits | sign);
}

INLINE size_t fp8_values_bytes(size_t d) { return (d + 3) / 4 * 4; }

/* `rows` (<= CHUNK) rows of d floats into fp8.py's row-wise wire. */
INLINE void fp8_encode_body(const float *x, size_t rows, size_t d, uint8_t *out, int e5m2) {
    size_t a = fp8_values_bytes(d), row_bytes = a + 8;
    float scales[CHUNK];
    unsigned char bad[CHUNK];
    for (size_t r = 0; r < rows; r++) {
        int32_t m = max_abs_bits(x + r * d, d);
        float scale = FP8_MAX_POS[e5m2] / (u2f((uint32_t)m) + (float)1e-20);
        bad[r] = m >= (int32_t)INF_BITS; /* NaN or +-inf: NaN scale, zero values */
        /* Scaling by the power of two is exact, so x * s rounds once to the
         * same value as fbgemm's x * scale. */
        scales[r] = scale * FP8_SHIFT[e5m2];
        uint8_t *row = out + r * row_bytes;
        memset(row + d, 0, row_bytes - d); /* alignment padding, reserved bytes */
        store_f32(row + a, bad[r] ? u2f(QNAN_BITS) : scale);
    }
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        uint8_t *q = out + r * row_bytes;
        float s = scales[r];
        if (e5m2)
            for (size_t j = 0; j < d; j++)
                q[j] = (uint8_t)to_e5m2(xr[j] * s);
        else
            for (size_t j = 0; j < d; j++)
                q[j] = (uint8_t)to_e4m3(xr[j] * s);
        if (bad[r])
            memset(q, 0, d);
    }
}

INLINE void fp8_encode_rows_body(const float *x, size_t rows, size_t d, uint8_t *out, int e5m2) {
    size_t step = chunk_blocks(d), row_bytes = fp8_values_bytes(d) + 8;
    for (size_t r = 0; r < rows; r += step) {
        size_t k = rows - r < step ? rows - r : step;
        if (d == 32)
            fp8_encode_body(x + r * 32, k, 32, out + r * 40, e5m2);
        else
            fp8_encode_body(x + r * d, k, d, out + r * row_bytes, e5m2);
    }
}
KERNEL(fp8_encode_rows, (const float *x, size_t rows, size_t d, uint8_t *out, int e5m2),
       (x, rows, d, out, e5m2))

static int fp8_encode(const float *x, size_t n, uint8_t *out, size_t d, int e5m2) {
    size_t rows = n / d, rest = n % d;
    fp8_encode_rows(x, rows, d, out, e5m2);
    if (rest) { /* fp8.py pads with zeros */
        float *tail = padded_tail(x + rows * d, rest, d, 0);
        if (tail == NULL)
            return -1;
        fp8_encode_rows(tail, 1, d, out + rows * (fp8_values_bytes(d) + 8), e5m2);
        free(tail);
    }
    return 0;
}

/* from_e4m3 and from_e5m2 of every byte. */
static float FP8_VALUE[2][256];

static void fp8_build_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        FP8_VALUE[0][b] = from_e4m3(b);
        FP8_VALUE[1][b] = from_e5m2(b);
    }
}

INLINE void fp8_decode_row(const uint8_t *row, size_t d, float *y, const float *value,
                           float shift) {
    /* fp8.py divides the value in torch's units by scale * shift: a true
     * division, which a multiplication by the reciprocal would not match.
     * The table lookups first, into a buffer that stays in L1, so that the
     * divisions vectorize and the output is written once, as vectors. */
    float s = load_f32(row + fp8_values_bytes(d)) * shift;
    float v[64];
    for (size_t k = 0; k < d; k += 64) {
        size_t len = d - k < 64 ? d - k : 64;
        for (size_t j = 0; j < len; j++)
            v[j] = value[row[k + j]];
        for (size_t j = 0; j < len; j++)
            y[k + j] = v[j] / s;
    }
}

INLINE void fp8_decode_rows_body(const uint8_t *in, size_t rows, size_t d, float *out,
                                 size_t width, size_t stride, int e5m2) {
    size_t per_line = width / d, row_bytes = fp8_values_bytes(d) + 8;
    const float *value = FP8_VALUE[e5m2];
    float shift = FP8_SHIFT[e5m2];
    for (size_t r = 0; r < rows; out += stride) {
        for (size_t k = 0; k < per_line; k++, r++) {
            if (d == 32)
                fp8_decode_row(in + r * 40, 32, out + k * 32, value, shift);
            else
                fp8_decode_row(in + r * row_bytes, d, out + k * d, value, shift);
        }
    }
}
KERNEL1(fp8_decode_rows,
        (const uint8_t *in, size_t rows, size_t d, float *out, size_t width, size_t stride,
         int e5m2),
        (in, rows, d, out, width, stride, e5m2))

/* ----------------------------------------------------------------- mx4 -- */

/* E2M1 code of a scaled element |v| < 8, sign in bit 3, as mx4.py's
 * thresholds (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) give it: below 1 two
 * compares; from 1 on, rounding to one mantissa bit, ties away from zero
 * (adding half a step to the bits), saturating at 6 (code 7). Checked equal
 * to the thresholds for every float32 below 8. */
INLINE uint32_t e2m1_code(float v) {
    uint32_t u = f2u(v);
    int32_t a = (int32_t)(u & 0x7FFFFFFFu);
    int32_t high = ((a + 0x200000) >> 22) - 252;
    int32_t low = (a >= 0x3E800000) + (a >= 0x3F400000);
    high = high > 7 ? 7 : high;
    return (uint32_t)(a >= 0x3F800000 ? high : low) | ((u >> 28) & 8u);
}

/* Codes a (first) and b (second), each below 16, read as one 64-bit word,
 * into the byte a | b << 4. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define PAIR_BYTE(w) ((w) >> 32 | (w) << 4)
#else
#define PAIR_BYTE(w) ((w) | (w) >> 28)
#endif

/* The exponent byte of a group from its largest magnitude's bits. The table
 * (built by mx4.py from torch's own log2, see _exponent_table there) holds
 * for every float32 exponent field three ints: the byte at the bottom of
 * that binade and two mantissas from which on it is one more each. */
INLINE uint32_t mx4_exponent(int32_t max_bits, int pre_round, const int32_t *table) {
    uint32_t m = (uint32_t)max_bits < MIN_NORMAL_BITS ? MIN_NORMAL_BITS : (uint32_t)max_bits;
    if (pre_round) { /* "even": round to two significant bits, stop at inf */
        m += (1u << 21) - 1u;
        m = m > INF_BITS ? INF_BITS : m;
    }
    const int32_t *t = table + 3 * (m >> 23);
    int32_t mant = (int32_t)(m & 0x7FFFFFu);
    return (uint32_t)(t[0] + (mant >= t[1]) + (mant >= t[2]));
}

/* `groups` (<= CHUNK) groups of g floats into MX4 wire. */
INLINE void mx4_encode_body(const float *x, size_t groups, size_t g, uint8_t *out, int pre_round,
                            const int32_t *table) {
    size_t half = g / 2;
    float inverses[CHUNK];
    for (size_t i = 0; i < groups; i++) {
        int32_t m = max_abs_bits(x + i * g, g);
        uint32_t e = mx4_exponent(m, pre_round, table);
        /* 2**-E, normal for every E the table gives; multiplying by it is
         * exact wherever fbgemm's division by 2**E is. */
        inverses[i] = u2f((254u - e) << 23);
        /* NaN or +-inf: E8M0's NaN, and zero codes below */
        out[i * (half + 1) + half] = m >= (int32_t)INF_BITS ? 255 : (uint8_t)e;
    }
    for (size_t i = 0; i < groups; i++) {
        const float *xg = x + i * g;
        uint8_t *q = out + i * (half + 1);
        float inverse = inverses[i];
        /* Codes first, then two by two into bytes, reading each pair as one
         * 64-bit word: plain loops that vectorize, where one loop reading
         * every other element, or pairing bytes, would not. */
        uint32_t code[64];
        for (size_t k = 0; k < g; k += 64) {
            size_t len = g - k < 64 ? g - k : 64;
            for (size_t j = 0; j < len; j++)
                code[j] = e2m1_code(xg[k + j] * inverse);
            for (size_t j = 0; j < len / 2; j++) {
                uint64_t pair;
                memcpy(&pair, code + 2 * j, 8);
                q[k / 2 + j] = (uint8_t)PAIR_BYTE(pair);
            }
        }
        if (q[half] == 255)
            memset(q, 0, half);
    }
}

INLINE void mx4_encode_groups_body(const float *x, size_t groups, size_t g, uint8_t *out,
                                   int pre_round, const int32_t *table) {
    size_t step = chunk_blocks(g);
    for (size_t i = 0; i < groups; i += step) {
        size_t k = groups - i < step ? groups - i : step;
        if (g == 32)
            mx4_encode_body(x + i * 32, k, 32, out + i * 17, pre_round, table);
        else
            mx4_encode_body(x + i * g, k, g, out + i * (g / 2 + 1), pre_round, table);
    }
}
KERNEL(mx4_encode_groups,
       (const float *x, size_t groups, size_t g, uint8_t *out, int pre_round,
        const int32_t *table),
       (x, groups, g, out, pre_round, table))

static int mx4_encode(const float *x, size_t n, uint8_t *out, size_t g, int pre_round,
                      const int32_t *table) {
    size_t groups = n / g, rest = n % g;
    mx4_encode_groups(x, groups, g, out, pre_round, table);
    if (rest) { /* mx4.py pads with zeros */
        float *tail = padded_tail(x + groups * g, rest, g, 0);
        if (tail == NULL)
            return -1;
        mx4_encode_groups(tail, 1, g, out + groups * (g / 2 + 1), pre_round, table);
        free(tail);
    }
    return 0;
}

/* The two decoded floats of every (exponent byte, element byte) pair, as in
 * mx4.py's _pair_table: exact products, +0.0 for code 8, quiet NaN for
 * exponent byte 255. 512 KiB, but a wire touches only its exponents' rows. */
static uint64_t *MX4_PAIRS;

static int mx4_build_table(void) {
    static const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float value[16];
    for (int c = 0; c < 16; c++)
        value[c] = c == 8 ? 0.0f : (c & 8 ? -e2m1[c & 7] : e2m1[c]);
    MX4_PAIRS = malloc(256 * 256 * sizeof(uint64_t));
    if (MX4_PAIRS == NULL)
        return -1;
    for (uint32_t e = 0; e < 256; e++) {
        float scale = e == 255 ? u2f(QNAN_BITS) : e == 0 ? 0x1p-127f : u2f(e << 23);
        for (uint32_t b = 0; b < 256; b++) {
            uint64_t lo = f2u(value[b & 15] * scale), hi = f2u(value[b >> 4] * scale);
            MX4_PAIRS[e << 8 | b] = lo | hi << 32; /* little-endian: low first */
        }
    }
    return 0;
}

INLINE void mx4_decode_body(const uint8_t *in, size_t groups, size_t g, float *out, size_t width,
                            size_t stride) {
    size_t half = g / 2, per_line = width / g;
    for (size_t i = 0; i < groups; out += stride) {
        for (size_t k = 0; k < per_line; k++, i++) {
            const uint8_t *group = in + i * (half + 1);
            const uint64_t *pairs = MX4_PAIRS + ((size_t)group[half] << 8);
            float *y = out + k * g;
            for (size_t j = 0; j < half; j++)
                memcpy(y + 2 * j, &pairs[group[j]], 8);
        }
    }
}
KERNEL1(mx4_decode,
       (const uint8_t *in, size_t groups, size_t g, float *out, size_t width, size_t stride),
       (in, groups, g, out, width, stride))

/* ---------------------------------------------------- round-trip error -- */

/* The relative RMS error ||y - x|| / ||x|| and the largest error
 * max|y - x| / max|x| of n decoded floats y against x (0 where x and y are
 * all zero, inf where only x is), as qcomm's own measurement takes them
 * (collectives/_measure.py): y - x in float32, squares summed in double,
 * where no square of a float32 overflows or underflows. -1 where an x or
 * y - x is not finite, which qcomm measures itself. Eight independent sums
 * and integer maxima of the bits, so that the loop vectorizes. */
#define LANES 8
static int error_norms(const float *x, const float *y, size_t n, double out[2]) {
    double sum_x[LANES] = {0.0}, sum_lost[LANES] = {0.0};
    int32_t top_x = 0, top_lost = 0;
    for (size_t i = 0; i < n; i += LANES) {
        size_t len = n - i < LANES ? n - i : LANES;
        for (size_t j = 0; j < len; j++) {
            float a = x[i + j], lost = y[i + j] - a;
            int32_t abs_a = (int32_t)(f2u(a) & 0x7FFFFFFFu);
            int32_t abs_lost = (int32_t)(f2u(lost) & 0x7FFFFFFFu);
            top_x = abs_a > top_x ? abs_a : top_x;
            top_lost = abs_lost > top_lost ? abs_lost : top_lost;
            sum_x[j] += (double)a * (double)a;
            sum_lost[j] += (double)lost * (double)lost;
        }
    }
    if (top_x >= (int32_t)INF_BITS || top_lost >= (int32_t)INF_BITS)
        return -1;
    double total_x = 0.0, total_lost = 0.0;
    for (size_t j = 0; j < LANES; j++) {
        total_x += sum_x[j];
        total_lost += sum_lost[j];
    }
    double mx = u2f((uint32_t)top_x), ml = u2f((uint32_t)top_lost);
    out[0] = total_x > 0.0 ? sqrt(total_lost / total_x) : total_lost > 0.0 ? INFINITY : 0.0;
    out[1] = mx > 0.0 ? ml / mx : ml > 0.0 ? INFINITY : 0.0;
    return 0;
}

enum { ROUND_TRIP_INT8, ROUND_TRIP_FP8, ROUND_TRIP_MX4, ROUND_TRIP_FP16, ROUND_TRIP_BF16 };

/* half.py's round trip without a loss scale: the cast to the 16-bit format
 * (round to nearest even, as torch casts), the result clamped to its largest
 * finite value (NaN stays NaN), and back to float32, which is exact. fp16
 * needs the compiler's _Float16, whose conversions are IEEE's. */
#if defined(__FLT16_MANT_DIG__)
#define HAVE_FP16 1
INLINE void fp16_round_trips_body(const float *x, size_t n, float *y) {
    for (size_t i = 0; i < n; i++) {
        float h = (float)(_Float16)x[i];
        y[i] = h > 65504.0f ? 65504.0f : h < -65504.0f ? -65504.0f : h;
    }
}
#if X86_DISPATCH
/* The baseline ISA converts by a library call per element; F16C (on every
 * CPU with AVX2 here) has instructions for it. */
static int have_f16c;
__attribute__((noinline)) static void fp16_round_trips_base(const float *x, size_t n, float *y) {
    fp16_round_trips_body(x, n, y);
}
__attribute__((noinline, target("avx2,fma,f16c"))) static void
fp16_round_trips_f16c(const float *x, size_t n, float *y) {
    fp16_round_trips_body(x, n, y);
}
static void fp16_round_trips(const float *x, size_t n, float *y) {
    if (have_avx2 && have_f16c)
        fp16_round_trips_f16c(x, n, y);
    else
        fp16_round_trips_base(x, n, y);
}
#else
KERNEL1(fp16_round_trips, (const float *x, size_t n, float *y), (x, n, y))
#endif
#else
#define HAVE_FP16 0
#endif

/* torch's float32 -> bfloat16 (c10's round_to_nearest_even: a NaN becomes
 * the quiet NaN 0x7FC0) and back. */
INLINE float bf16_round_trip(float v) {
    uint32_t u = f2u(v);
    uint32_t b = v != v ? 0x7FC00000u : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
    float h = u2f(b), top = u2f(0x7F7F0000u);
    return h > top ? top : h < -top ? -top : h;
}

/* error_norms of `runs` runs of `length` floats, `stride` floats apart
 * (whole blocks each; one run may end in a partial block), encoded and
 * decoded by one of the codecs above: the same encoders and decoders, on a
 * copy of the runs in a buffer of its own; -2 where memory runs out. */
static int round_trip_error(int kind, const float *src, size_t runs, size_t length, size_t stride,
                            size_t block, int flag, const int32_t *table, double out[2]) {
    size_t n = runs * length, blocks = (n + block - 1) / block, floats = blocks * block;
    size_t per_block = kind == ROUND_TRIP_INT8  ? block + 8
                       : kind == ROUND_TRIP_FP8 ? fp8_values_bytes(block) + 8
                       : kind == ROUND_TRIP_MX4 ? block / 2 + 1
                                                : 0;
    if (kind == ROUND_TRIP_FP16 && !HAVE_FP16)
        return -3;
    float *x = malloc(n * sizeof(float));
    uint8_t *wire = malloc(blocks * per_block + 1);
    float *y = malloc(floats * sizeof(float));
    int rc = x == NULL || wire == NULL || y == NULL ? -2 : 0;
    for (size_t r = 0; rc == 0 && r < runs; r++)
        memcpy(x + r * length, src + r * stride, length * sizeof(float));
    if (rc == 0 && kind == ROUND_TRIP_BF16) {
        for (size_t i = 0; i < n; i++)
            y[i] = bf16_round_trip(x[i]);
#if HAVE_FP16
    } else if (rc == 0 && kind == ROUND_TRIP_FP16) {
        fp16_round_trips(x, n, y);
#endif
    } else if (rc == 0 && kind == ROUND_TRIP_INT8) {
        rc = int8_encode(x, n, wire, block) < 0 ? -2 : 0;
        if (rc == 0)
            int8_decode(wire, blocks, block, y, floats, floats, flag);
    } else if (rc == 0 && kind == ROUND_TRIP_FP8) {
        rc = fp8_encode(x, n, wire, block, flag) < 0 ? -2 : 0;
        if (rc == 0)
            fp8_decode_rows(wire, blocks, block, y, floats, floats, flag);
    } else if (rc == 0 && kind == ROUND_TRIP_MX4) {
        rc = mx4_encode(x, n, wire, block, flag, table) < 0 ? -2 : 0;
        if (rc == 0)
            mx4_decode(wire, blocks, block, y, floats, floats);
    }
    if (rc == 0)
        rc = error_norms(x, y, n, out);
    free(x);
    free(wire);
    free(y);
    return rc;
}

/* -------------------------------------------------------- Python glue -- */

/* Sizes fit in memory, so the products below stay far from overflow. */
#define MAX_COUNT ((Py_ssize_t)1 << 48)

static int check_count(const char *what, Py_ssize_t v, Py_ssize_t min) {
    if (v < min || v > MAX_COUNT) {
        PyErr_Format(PyExc_ValueError, "%s must be in [%zd, 2**48], got %zd", what, min, v);
        return -1;
    }
    return 0;
}

static int check_pointer(const char *what, unsigned long long p, Py_ssize_t count) {
    if (count > 0 && p == 0) {
        PyErr_Format(PyExc_ValueError, "%s is a null pointer", what);
        return -1;
    }
    return 0;
}

static int check_even(Py_ssize_t g) {
    if (g % 2) {
        PyErr_Format(PyExc_ValueError, "group_size must be even, got %zd", g);
        return -1;
    }
    return 0;
}

/* An output of `blocks` blocks of `block` floats, laid out as lines of
 * `width` floats `stride` floats apart. */
static int check_lines(Py_ssize_t blocks, Py_ssize_t block, Py_ssize_t width, Py_ssize_t stride) {
    if (check_count("width", width, 1) || check_count("stride", stride, width))
        return -1;
    if (width % block || (blocks * block) % width) {
        PyErr_Format(PyExc_ValueError,
                     "width must be a multiple of the block (%zd) dividing the output "
                     "(%zd floats), got %zd",
                     block, blocks * block, width);
        return -1;
    }
    return 0;
}

#define PTR(type, p) ((type)(uintptr_t)(p))

PyDoc_STRVAR(int8_encode_doc,
             "int8_encode(src, n, dst, row_dim)\n--\n\n"
             "n float32 at src -> ceil(n / row_dim) * (row_dim + 8) bytes of int8.py's wire at dst.");

static PyObject *py_int8_encode(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t n, d;
    int rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKn", &src, &n, &dst, &d))
        return NULL;
    if (check_count("n", n, 0) || check_count("row_dim", d, 1) || check_pointer("src", src, n) ||
        check_pointer("dst", dst, n))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rc = int8_encode(PTR(const float *, src), (size_t)n, PTR(uint8_t *, dst), (size_t)d);
    Py_END_ALLOW_THREADS;
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(int8_decode_doc,
             "int8_decode(src, rows, dst, row_dim, width, stride, fused)\n--\n\n"
             "rows rows of int8.py's wire at src -> rows * row_dim float32 at dst, in lines of "
             "width floats stride floats apart; q * scale + bias rounded once if fused.");

static PyObject *py_int8_decode(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t rows, d, width, stride;
    int fused;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKnnnp", &src, &rows, &dst, &d, &width, &stride, &fused))
        return NULL;
    if (check_count("rows", rows, 0) || check_count("row_dim", d, 1) ||
        check_pointer("src", src, rows) || check_pointer("dst", dst, rows) ||
        check_lines(rows, d, width, stride))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    int8_decode(PTR(const uint8_t *, src), (size_t)rows, (size_t)d, PTR(float *, dst),
                (size_t)width, (size_t)stride, fused);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(fp8_encode_doc,
             "fp8_encode(src, n, dst, row_dim, e5m2)\n--\n\n"
             "n float32 at src -> ceil(n / row_dim) rows of fp8.py's wire at dst.");

static PyObject *py_fp8_encode(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t n, d;
    int e5m2, rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKnp", &src, &n, &dst, &d, &e5m2))
        return NULL;
    if (check_count("n", n, 0) || check_count("row_dim", d, 1) || check_pointer("src", src, n) ||
        check_pointer("dst", dst, n))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rc = fp8_encode(PTR(const float *, src), (size_t)n, PTR(uint8_t *, dst), (size_t)d, e5m2);
    Py_END_ALLOW_THREADS;
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(fp8_decode_doc,
             "fp8_decode(src, rows, dst, row_dim, e5m2, width, stride)\n--\n\n"
             "rows rows of fp8.py's wire at src -> rows * row_dim float32 at dst, in lines of "
             "width floats stride floats apart.");

static PyObject *py_fp8_decode(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t rows, d, width, stride;
    int e5m2;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKnpnn", &src, &rows, &dst, &d, &e5m2, &width, &stride))
        return NULL;
    if (check_count("rows", rows, 0) || check_count("row_dim", d, 1) ||
        check_pointer("src", src, rows) || check_pointer("dst", dst, rows) ||
        check_lines(rows, d, width, stride))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    fp8_decode_rows(PTR(const uint8_t *, src), (size_t)rows, (size_t)d, PTR(float *, dst),
               (size_t)width, (size_t)stride, e5m2);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mx4_encode_doc,
             "mx4_encode(src, n, dst, group_size, pre_round, table)\n--\n\n"
             "n float32 at src -> ceil(n / group_size) groups of MX4 wire at dst. table: 256 * 3 "
             "int32 exponent steps (mx4.py's _exponent_table); pre_round for 'even'.");

static PyObject *py_mx4_encode(PyObject *self, PyObject *args) {
    unsigned long long src, dst, table;
    Py_ssize_t n, g;
    int pre_round, rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKnpK", &src, &n, &dst, &g, &pre_round, &table))
        return NULL;
    if (check_count("n", n, 0) || check_count("group_size", g, 2) || check_even(g) ||
        check_pointer("src", src, n) || check_pointer("dst", dst, n) ||
        check_pointer("table", table, 1))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rc = mx4_encode(PTR(const float *, src), (size_t)n, PTR(uint8_t *, dst), (size_t)g, pre_round,
                    PTR(const int32_t *, table));
    Py_END_ALLOW_THREADS;
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mx4_decode_doc,
             "mx4_decode(src, groups, dst, group_size, width, stride)\n--\n\n"
             "groups MX4 groups at src -> groups * group_size float32 at dst, in lines of width "
             "floats stride floats apart.");

static PyObject *py_mx4_decode(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t groups, g, width, stride;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKnnn", &src, &groups, &dst, &g, &width, &stride))
        return NULL;
    if (check_count("groups", groups, 0) || check_count("group_size", g, 2) || check_even(g) ||
        check_pointer("src", src, groups) || check_pointer("dst", dst, groups) ||
        check_lines(groups, g, width, stride))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    mx4_decode(PTR(const uint8_t *, src), (size_t)groups, (size_t)g, PTR(float *, dst),
               (size_t)width, (size_t)stride);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* The two errors as a tuple; None where an input or a decoded value is not
 * finite, or the codec's round trip is not built here (fp16 without
 * _Float16); MemoryError where memory ran out. */
static PyObject *errors_result(int rc, const double out[2]) {
    if (rc == -2)
        return PyErr_NoMemory();
    if (rc < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(dd)", out[0], out[1]);
}

PyDoc_STRVAR(error_norms_doc,
             "error_norms(src, decoded, n)\n--\n\n"
             "(relative RMS error, largest error relative to the largest |x|) of n float32 at "
             "decoded against n float32 at src; None where a value is not finite.");

static PyObject *py_error_norms(PyObject *self, PyObject *args) {
    unsigned long long src, decoded;
    Py_ssize_t n;
    double out[2];
    int rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKn", &src, &decoded, &n))
        return NULL;
    if (check_count("n", n, 1) || check_pointer("src", src, n) ||
        check_pointer("decoded", decoded, n))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rc = error_norms(PTR(const float *, src), PTR(const float *, decoded), (size_t)n, out);
    Py_END_ALLOW_THREADS;
    return errors_result(rc, out);
}

PyDoc_STRVAR(round_trip_error_doc,
             "round_trip_error(codec, src, runs, length, stride, block, flag, table)\n--\n\n"
             "error_norms of runs runs of length float32 at src, stride floats apart, against "
             "what codec ('int8', 'fp8', 'mx4', 'fp16' or 'bf16', the last two without a loss "
             "scale) decodes of its own encoding of them, with block its row_dim or group_size "
             "(1 for fp16 and bf16); flag: int8_decode's fused, fp8's e5m2, mx4's pre_round; "
             "table: mx4's (else 0). None where fp16 is not built here.");

static PyObject *py_round_trip_error(PyObject *self, PyObject *args) {
    const char *codec;
    unsigned long long src, table;
    Py_ssize_t runs, length, stride, block;
    int flag, kind, rc;
    double out[2];
    (void)self;
    if (!PyArg_ParseTuple(args, "sKnnnnpK", &codec, &src, &runs, &length, &stride, &block, &flag,
                          &table))
        return NULL;
    if (strcmp(codec, "int8") == 0)
        kind = ROUND_TRIP_INT8;
    else if (strcmp(codec, "fp8") == 0)
        kind = ROUND_TRIP_FP8;
    else if (strcmp(codec, "mx4") == 0)
        kind = ROUND_TRIP_MX4;
    else if (strcmp(codec, "fp16") == 0)
        kind = ROUND_TRIP_FP16;
    else if (strcmp(codec, "bf16") == 0)
        kind = ROUND_TRIP_BF16;
    else
        return PyErr_Format(PyExc_ValueError,
                            "codec must be 'int8', 'fp8', 'mx4', 'fp16' or 'bf16', got %R",
                            PyTuple_GET_ITEM(args, 0));
    if (check_count("runs", runs, 1) || check_count("length", length, 1) ||
        check_count("stride", stride, length) || check_count("runs * length", runs * length, 1) ||
        check_count("block", block, kind == ROUND_TRIP_MX4 ? 2 : 1) ||
        (kind == ROUND_TRIP_MX4 && (check_even(block) || check_pointer("table", table, 1))) ||
        check_pointer("src", src, runs))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rc = round_trip_error(kind, PTR(const float *, src), (size_t)runs, (size_t)length,
                          (size_t)stride, (size_t)block, flag, PTR(const int32_t *, table), out);
    Py_END_ALLOW_THREADS;
    return errors_result(rc, out);
}

PyDoc_STRVAR(isa_doc, "isa(name=None)\n--\n\n"
                      "The copy of the kernels that runs: 'avx2' or 'baseline'. With a name, "
                      "switch to that copy first (tests run both); 'avx2' only where the CPU "
                      "has it.");

static PyObject *py_isa(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
#if X86_DISPATCH
    if (name != NULL && strcmp(name, "baseline") == 0)
        have_avx2 = 0;
    else if (name != NULL && strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma"))
        have_avx2 = 1;
    else if (name != NULL)
        return PyErr_Format(PyExc_ValueError, "isa must be 'baseline' or an ISA this CPU has "
                                              "('avx2'), got %R", PyTuple_GET_ITEM(args, 0));
    return PyUnicode_FromString(have_avx2 ? "avx2" : "baseline");
#else
    if (name != NULL && strcmp(name, "baseline") != 0)
        return PyErr_Format(PyExc_ValueError, "isa must be 'baseline' here, got %R",
                            PyTuple_GET_ITEM(args, 0));
    return PyUnicode_FromString("baseline");
#endif
}

static PyMethodDef methods[] = {
    {"isa", py_isa, METH_VARARGS, isa_doc},
    {"int8_encode", py_int8_encode, METH_VARARGS, int8_encode_doc},
    {"int8_decode", py_int8_decode, METH_VARARGS, int8_decode_doc},
    {"fp8_encode", py_fp8_encode, METH_VARARGS, fp8_encode_doc},
    {"fp8_decode", py_fp8_decode, METH_VARARGS, fp8_decode_doc},
    {"mx4_encode", py_mx4_encode, METH_VARARGS, mx4_encode_doc},
    {"mx4_decode", py_mx4_decode, METH_VARARGS, mx4_decode_doc},
    {"error_norms", py_error_norms, METH_VARARGS, error_norms_doc},
    {"round_trip_error", py_round_trip_error, METH_VARARGS, round_trip_error_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "qcomm_builtin._kernels",
    "C kernels of qcomm's built-in block codecs; see qcomm_builtin._native.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
#if X86_DISPATCH
    have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if HAVE_FP16
    have_f16c = __builtin_cpu_supports("f16c");
#endif
#endif
    fp8_build_tables();
    if (MX4_PAIRS == NULL && mx4_build_table() < 0)
        return PyErr_NoMemory();
    return PyModule_Create(&module);
}
