// lockstep CUDA kernels, compiled at run time by NVRTC (no headers, no fast-math,
// --fmad=false: every fused multiply-add below is an explicit fmaf, every other product
// and sum is rounded on its own, exactly as in crates/backend-cpu/src/canon.rs and
// crates/quant/src/scalar.rs). Each kernel reproduces the CPU reference bit for bit; the
// reduction orders are fixed and never depend on how many rows a launch covers (G1).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- numbers ------------------------------------------------------------------------

__device__ __noinline__ float f16_to_f32_soft(u16 h) {
    u32 sign = ((u32)(h & 0x8000)) << 16;
    u32 exp = (h >> 10) & 0x1f;
    u32 man = h & 0x03ff;
    u32 bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            u32 s = __clz(man) - 21;
            u32 m2 = (man << s) & 0x03ff;
            u32 e2 = 113 - s;
            bits = sign | (e2 << 23) | (m2 << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man == 0 ? 0u : (0x00400000u | (man << 13)));
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

// f16 -> f32 by the hardware conversion (exact for every non-NaN value); NaNs keep the
// software path's payload rule.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x03ffu)) return f16_to_f32_soft(h);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// N f16 values to f32 with f16_to_f32's bits: the hardware conversions first, then one
// branch for the group (the software path for all N where any is a NaN, which is rare), so
// the loads that feed a group are not serialized behind a branch each.
template <int N>
__device__ __forceinline__ void f16_to_f32_many(const u16 (&h)[N], float (&f)[N]) {
    bool nan = false;
#pragma unroll
    for (int i = 0; i < N; i++) {
        asm("cvt.f32.f16 %0, %1;" : "=f"(f[i]) : "h"(h[i]));
        nan |= f[i] != f[i];
    }
    if (nan) {
#pragma unroll
        for (int i = 0; i < N; i++) f[i] = f16_to_f32_soft(h[i]);
    }
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
    u32 b = __float_as_uint(x);
    u16 sign = (u16)((b >> 16) & 0x8000);
    int exp = (int)((b >> 23) & 0xff);
    u32 man = b & 0x007fffff;
    if (exp == 0xff) {
        if (man == 0) return sign | 0x7c00;
        return sign | 0x7e00 | (u16)(man >> 13);
    }
    int e = exp - 127 + 15;
    if (e >= 0x1f) return sign | 0x7c00;
    if (e <= 0) {
        u32 shift = (u32)(14 - e);
        if (shift > 24) return sign;
        u32 m = man | 0x00800000;
        u32 q = m >> shift;
        u32 rem = m & ((1u << shift) - 1);
        u32 half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q += 1;
        return sign | (u16)q;
    }
    u32 q = (((u32)e) << 10) | (man >> 13);
    u32 rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) q += 1;
    return sign | (u16)q;
}

// p is 2-byte aligned: every block format's f16 fields sit at even offsets of blocks that
// start at even addresses (as ld_u32_2 below assumes too), so one 16-bit load.
__device__ __forceinline__ float ld_f16(const u8* p) {
    return f16_to_f32(*(const u16*)p);
}

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ float pow2i(int k) { return __uint_as_float(((u32)(k + 127)) << 23); }

// Programmatic dependent launch (compute capability 9.0+; nothing before): pdl_trigger lets
// the next kernel's launch begin, pdl_wait waits until the kernel before has finished and its
// writes are visible. A kernel launched with the attribute (device.rs `PDL`) reads nothing
// an earlier kernel wrote before its pdl_wait.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// canon::exp
__device__ __forceinline__ float canon_exp(float x) {
    if (x != x) return x;
    if (x > 89.0f) return __uint_as_float(0x7f800000u);
    if (x < -104.0f) return 0.0f;
    const float LOG2E = __uint_as_float(0x3fb8aa3bu);
    float n = rintf(__fmul_rn(x, LOG2E));
    float r = fmaf(-n, __uint_as_float(0x3f317200u), x);
    r = fmaf(-n, __uint_as_float(0x35bfbe8eu), r);
    float y = __uint_as_float(0x39506967u);
    y = fmaf(y, r, __uint_as_float(0x3ab743ceu));
    y = fmaf(y, r, __uint_as_float(0x3c088908u));
    y = fmaf(y, r, __uint_as_float(0x3d2aa9c1u));
    y = fmaf(y, r, __uint_as_float(0x3e2aaaaau));
    y = fmaf(y, r, __uint_as_float(0x3f000000u));
    y = __fadd_rn(fmaf(y, __fmul_rn(r, r), r), 1.0f);
    int ni = (int)n;
    int h = ni >> 1;
    return __fmul_rn(__fmul_rn(y, pow2i(h)), pow2i(ni - h));
}

__device__ __forceinline__ float canon_silu(float x) {
    return __fdiv_rn(x, __fadd_rn(1.0f, canon_exp(-x)));
}

// Sum of the 16 lane partials held by lanes 0..15 of each 16-lane group, in the order of
// canon::tree16 (l[j] + l[j+8], then + 4, + 2, + 1). Valid in lane 0 of the group.
__device__ __forceinline__ float tree16(float v) {
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 8, 16));
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 4, 16));
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 2, 16));
    v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 1, 16));
    return v;
}

// tree16 of P values at once (P a power of two, 2..16): lane group of 16, value k of lane i
// in v[k]. Each level pairs lane i with lane i ^ o (o = 8, 4, 2, 1), the pairs tree16 adds
// at that level; while a lane holds more than one value it keeps half of them (the upper
// half where lane bit o is set) and trades the other half with its partner, so a level
// costs P / 2, P / 4, ... shuffles instead of P. Addition is commutative, so every sum has
// tree16's bits. Returns, in lane i, the sum of value i >> (4 - log2 P) (every lane of the
// group holds one; 16 / P lanes hold the same one). v is overwritten.
template <int P>
__device__ __forceinline__ float tree16_many(float* v, int lane16) {
    int n = P;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        if (n > 1) {
            int h = n >> 1;
            bool up = (lane16 & o) != 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                if (k < h) {
                    float send = up ? v[k] : v[k + h];
                    float keep = up ? v[k + h] : v[k];
                    v[k] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, o, 16));
                }
            }
            n = h;
        } else {
            v[0] = __fadd_rn(v[0], __shfl_xor_sync(0xffffffffu, v[0], o, 16));
        }
    }
    return v[0];
}

// log2 of the power of two P (1..16).
__host__ __device__ constexpr int log2_pow2(int P) { return P >= 16 ? 4 : P >= 8 ? 3 : P >= 4 ? 2 : P >= 2 ? 1 : 0; }

// ---- activation quantizer (quant::acts::quantize_block_scalar) ------------------------

// One warp per block of `bl` (32 or 256) values; grid (k / bl, m).
extern "C" __global__ void quantize_acts(const float* x, int k, int bl, i8* qs, float* d) {
    int b = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    const float* xb = x + (size_t)row * k + (size_t)b * bl;
    i8* qb = qs + (size_t)row * k + (size_t)b * bl;
    u32 amax = 0;
    for (int i = lane; i < bl; i += 32) amax = max(amax, __float_as_uint(xb[i]) & 0x7fffffffu);
    for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float a = __uint_as_float(amax);
    float dd = __fdiv_rn(a, 127.0f);
    float id = a == 0.0f ? 0.0f : __fdiv_rn(127.0f, a);
    for (int i = lane; i < bl; i += 32) {
        float v = __fmul_rn(xb[i], id);
        v = v < 127.0f ? v : 127.0f;
        v = v > -127.0f ? v : -127.0f;
        qb[i] = (i8)(int)rintf(v);
    }
    if (lane == 0) d[(size_t)row * (k / bl) + b] = dd;
}

// ---- weight codes (quant::blocks::decode, one element at a time) -----------------------

enum Fmt { F_Q4_0 = 2, F_Q4_1 = 3, F_Q5_0 = 6, F_Q5_1 = 7, F_Q8_0 = 8, F_Q2_K = 10, F_Q3_K = 11,
           F_Q4_K = 12, F_Q5_K = 13, F_Q6_K = 14 };

template <int F> struct Meta;
template <> struct Meta<F_Q4_0> { enum { BL = 32, BB = 18, SL = 32 }; };
template <> struct Meta<F_Q4_1> { enum { BL = 32, BB = 20, SL = 32 }; };
template <> struct Meta<F_Q5_0> { enum { BL = 32, BB = 22, SL = 32 }; };
template <> struct Meta<F_Q5_1> { enum { BL = 32, BB = 24, SL = 32 }; };
template <> struct Meta<F_Q8_0> { enum { BL = 32, BB = 34, SL = 32 }; };
template <> struct Meta<F_Q2_K> { enum { BL = 256, BB = 84, SL = 16 }; };
template <> struct Meta<F_Q3_K> { enum { BL = 256, BB = 110, SL = 16 }; };
template <> struct Meta<F_Q4_K> { enum { BL = 256, BB = 144, SL = 32 }; };
template <> struct Meta<F_Q5_K> { enum { BL = 256, BB = 176, SL = 32 }; };
template <> struct Meta<F_Q6_K> { enum { BL = 256, BB = 210, SL = 16 }; };

template <int F> __device__ __forceinline__ int code_at(const u8* b, int e);

template <> __device__ __forceinline__ int code_at<F_Q4_0>(const u8* b, int e) {
    u8 q = b[2 + (e & 15)];
    return (int)(e < 16 ? (q & 0xF) : (q >> 4)) - 8;
}
template <> __device__ __forceinline__ int code_at<F_Q4_1>(const u8* b, int e) {
    u8 q = b[4 + (e & 15)];
    return (int)(e < 16 ? (q & 0xF) : (q >> 4));
}
template <> __device__ __forceinline__ int code_at<F_Q5_0>(const u8* b, int e) {
    u32 qh = ld_u32(b + 2);
    u8 q = b[6 + (e & 15)];
    int lo = e < 16 ? (q & 0xF) : (q >> 4);
    int hi = (qh >> e) & 1;
    return (lo | (hi << 4)) - 16;
}
template <> __device__ __forceinline__ int code_at<F_Q5_1>(const u8* b, int e) {
    u32 qh = ld_u32(b + 4);
    u8 q = b[8 + (e & 15)];
    int lo = e < 16 ? (q & 0xF) : (q >> 4);
    int hi = (qh >> e) & 1;
    return lo | (hi << 4);
}
template <> __device__ __forceinline__ int code_at<F_Q8_0>(const u8* b, int e) {
    return (int)(i8)b[2 + e];
}
template <> __device__ __forceinline__ int code_at<F_Q2_K>(const u8* b, int e) {
    int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
    return (b[16 + 32 * h + l] >> (2 * s)) & 3;
}
template <> __device__ __forceinline__ int code_at<F_Q3_K>(const u8* b, int e) {
    int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
    int q2 = (b[32 + 32 * h + l] >> (2 * s)) & 3;
    int hi = (b[l] >> (4 * h + s)) & 1;
    return q2 - (hi ? 0 : 4);
}
template <> __device__ __forceinline__ int code_at<F_Q4_K>(const u8* b, int e) {
    int j = e >> 6, l = e & 31;
    u8 q = b[16 + 32 * j + l];
    return (e & 32) ? (q >> 4) : (q & 0xF);
}
template <> __device__ __forceinline__ int code_at<F_Q5_K>(const u8* b, int e) {
    int j = e >> 6, l = e & 31;
    u8 q = b[48 + 32 * j + l];
    u8 qh = b[16 + l];
    if (e & 32) return (q >> 4) | (((qh >> (2 * j + 1)) & 1) << 4);
    return (q & 0xF) | (((qh >> (2 * j)) & 1) << 4);
}
template <> __device__ __forceinline__ int code_at<F_Q6_K>(const u8* b, int e) {
    int h = e >> 7, r = e & 127, quarter = r >> 5, l = r & 31;
    const u8* ql = b + 64 * h;
    const u8* qh = b + 128 + 32 * h;
    int v;
    switch (quarter) {
        case 0: v = (ql[l] & 0xF) | ((qh[l] & 3) << 4); break;
        case 1: v = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4); break;
        case 2: v = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4); break;
        default: v = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4); break;
    }
    return v - 32;
}

// Sub-block scale and min (quant::blocks::decode's sc/mn) of sub-block j.
template <int F> __device__ __forceinline__ void sub_scale(const u8* b, int j, int* sc, int* mn) {
    *sc = 1;
    *mn = 0;
}
template <> __device__ __forceinline__ void sub_scale<F_Q2_K>(const u8* b, int j, int* sc, int* mn) {
    *sc = b[j] & 0xF;
    *mn = b[j] >> 4;
}
template <> __device__ __forceinline__ void sub_scale<F_Q3_K>(const u8* b, int j, int* sc, int* mn) {
    const u8* s = b + 96;
    int low = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
    int high = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    *sc = (int)((i8)(u8)(low | (high << 4))) - 32;
    *mn = 0;
}
// Without a branch (lanes of one warp ask for different j): a = q[j & 3], b = q[(j & 3) +
// 4], c = q[8 + (j & 3)]; for j < 4 sc = a & 63, mn = b & 63; else sc = (c & 0xF) | (a >> 6)
// << 4, mn = (c >> 4) | (b >> 6) << 4 (j - 4 = j & 3 and j = (j & 3) + 4 there).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* mn) {
    int i = j & 3;
    int a = q[i], b = q[i + 4], c = q[i + 8];
    bool lo = j < 4;
    *sc = lo ? (a & 63) : ((c & 0xF) | ((a >> 6) << 4));
    *mn = lo ? (b & 63) : ((c >> 4) | ((b >> 6) << 4));
}
template <> __device__ __forceinline__ void sub_scale<F_Q4_K>(const u8* b, int j, int* sc, int* mn) {
    scale_min_k4(j, b + 4, sc, mn);
}
template <> __device__ __forceinline__ void sub_scale<F_Q5_K>(const u8* b, int j, int* sc, int* mn) {
    scale_min_k4(j, b + 4, sc, mn);
}
template <> __device__ __forceinline__ void sub_scale<F_Q6_K>(const u8* b, int j, int* sc, int* mn) {
    *sc = (int)(i8)b[192 + j];
    *mn = 0;
}

template <int F> __device__ __forceinline__ float block_d(const u8* b) {
    switch (F) {
        case F_Q2_K: return ld_f16(b + 80);
        case F_Q3_K: return ld_f16(b + 108);
        case F_Q6_K: return ld_f16(b + 208);
        default: return ld_f16(b);
    }
}
template <int F> __device__ __forceinline__ float block_m(const u8* b) {
    switch (F) {
        case F_Q4_1: case F_Q5_1: case F_Q4_K: case F_Q5_K: return ld_f16(b + 2);
        case F_Q2_K: return ld_f16(b + 82);
        default: return 0.0f;
    }
}

// canon::dot(x, x) of one row for RMSNorm, in every lane of the warp: 16 lane chains
// (element i in lane i % 16, in order, loads issued eight at a time), then tree16.
__device__ __forceinline__ float row_sumsq(const float* xr, int n, int lane) {
    float l = 0.0f;
    if (lane < 16) {
        int i = lane;
        for (; i + 16 * 7 < n; i += 16 * 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = xr[i + 16 * u];
#pragma unroll
            for (int u = 0; u < 8; u++) l = fmaf(v[u], v[u], l);
        }
        for (; i < n; i += 16) l = fmaf(xr[i], xr[i], l);
    }
    float ss = tree16(l);
    return __shfl_sync(0xffffffffu, ss, 0);
}

// ---- quantized matmul ---------------------------------------------------------------
//
// out[r * n + j] = sum over weight blocks b, in block order, of the canonical block step
// (quant::scalar::dot_blocks). One warp per output column j and MT activation rows. The
// integer sums inside a block are exact, so lanes may split them freely; the float steps
// across blocks run in block order, identically in every lane.
//
// The warp first copies its weight row (in chunks that fit its share of shared memory)
// with 16-byte asynchronous copies (cp.async), every copy of the chunk in flight at once,
// then works from shared memory. Rows are read from 16 bytes below their start to 16
// bytes past their end, rounded to 16-byte lines: device matrices carry 16 bytes of
// padding after the last row (ops.rs).
//
// Lanes: GL lanes per block (4 for 32-value blocks, 8 for 256-value k-quant blocks), G =
// 32 / GL blocks in flight; each lane covers EPL = BL / GL consecutive values of its
// block, in segments of SEG values that share one sub-block scale.
//
// Launch modes (one kernel per format and row tile):
//   0: up to three matrices of the same format and K in one launch (warps 0..n0 the
//      first, then n1, then n2), each with its own output and optional bias:
//      out = acc (+ bias[j]);
//   1: one matrix whose result is added to the output: out = out + acc (the residual);
//   2: a gate/up pair (w0, w1, both n0 rows) into o0: out = silu(gate) * up.
// Each is the same arithmetic as the separate matmul, bias add, residual add and SwiGLU
// of the CPU model, so fusing them changes no bit.
//   + 4: unordered, for measuring what the fixed order costs (cuda_bench --unordered):
//      each lane group sums its own blocks and the groups meet in a tree. Not the
//      canonical order: never used by the engine.

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(s)), "l"(g) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}

// The dynamic shared memory this launch was given (bytes): the kernels that lay out their
// own check it against what they need and trap rather than run past the end.
__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// A 4-byte copy (cp.async takes 4, 8 or 16 bytes; under 16 through L1).
__device__ __forceinline__ void cp_async4(void* s, const void* g) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(s)), "l"(g) : "memory");
}

// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N committed groups are still in flight (the newest ones).
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Queues the copy of bytes [src, src + len) into s (16-byte aligned); returns where src[0]
// lands.
__device__ __forceinline__ const u8* stage_issue(u8* s, const u8* src, int len, int lane) {
    const u8* a0 = (const u8*)((size_t)src & ~(size_t)15);
    int off = (int)(src - a0);
    int n16 = (off + len + 15) >> 4;
    for (int i = lane; i < n16; i += 32) cp_async16(s + 16 * i, a0 + 16 * i);
    return s + off;
}

// Codes may come back shifted by a constant: codes4 returns code + OFF<F> in each byte
// (all small and non-negative where OFF > 0), and the dot product subtracts OFF times the
// activation sum, an exact integer identity.
template <int F> struct Off { enum { V = 0 }; };
template <> struct Off<F_Q4_0> { enum { V = 8 }; };
template <> struct Off<F_Q6_K> { enum { V = 32 }; };

__device__ __forceinline__ u32 ld_u32_2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

// Four consecutive codes (e a multiple of 4, inside one segment) packed as signed bytes.
template <int F> __device__ __forceinline__ int codes4(const u8* b, int e) {
    int c = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) c |= (code_at<F>(b, e + i) & 0xff) << (8 * i);
    return c;
}
// Q4_K blocks sit 16-byte aligned in shared memory (144-byte blocks, rows of whole
// blocks): one 4-byte load gives four codes.
template <> __device__ __forceinline__ int codes4<F_Q4_K>(const u8* b, int e) {
    u32 w = *(const u32*)(b + 16 + 32 * (e >> 6) + (e & 31));
    return (int)((e & 32) ? ((w >> 4) & 0x0F0F0F0Fu) : (w & 0x0F0F0F0Fu));
}
// Q4_0 (18-byte blocks, 2-byte aligned): code + 8 is the nibble itself.
template <> __device__ __forceinline__ int codes4<F_Q4_0>(const u8* b, int e) {
    u32 w = ld_u32_2(b + 2 + (e & 15));
    return (int)((e < 16 ? w : (w >> 4)) & 0x0F0F0F0Fu);
}
// Q4_1 (20-byte blocks): the nibbles themselves.
template <> __device__ __forceinline__ int codes4<F_Q4_1>(const u8* b, int e) {
    u32 w = ld_u32_2(b + 4 + (e & 15));
    return (int)((e < 16 ? w : (w >> 4)) & 0x0F0F0F0Fu);
}
// The four high bits (qh >> e) & 15 of Q5_0/Q5_1 moved to bit 4 of each byte: one multiply
// puts bit i at bit 8 i (the other shifted copies land on bits the mask clears, and no two
// products share a bit, so nothing carries).
__device__ __forceinline__ u32 high_bits4(u32 qh, int e) {
    return ((((qh >> e) & 0xFu) * 0x00204081u) & 0x01010101u) << 4;
}
// Q5_0 (22-byte blocks, 2-byte aligned): nibble | high bit, minus 16 in each byte.
template <> __device__ __forceinline__ int codes4<F_Q5_0>(const u8* b, int e) {
    u32 w = ld_u32_2(b + 6 + (e & 15));
    u32 lo = (e < 16 ? w : (w >> 4)) & 0x0F0F0F0Fu;
    return (int)__vsub4(lo | high_bits4(ld_u32_2(b + 2), e), 0x10101010u);
}
// Q5_1 (24-byte blocks): nibble | high bit.
template <> __device__ __forceinline__ int codes4<F_Q5_1>(const u8* b, int e) {
    u32 w = ld_u32_2(b + 8 + (e & 15));
    u32 lo = (e < 16 ? w : (w >> 4)) & 0x0F0F0F0Fu;
    return (int)(lo | high_bits4(ld_u32_2(b + 4), e));
}
// Q6_K (210-byte blocks, 2-byte aligned): code + 32 is the 4 low bits from ql and the 2
// high bits from qh (quant::blocks' layout, as code_at).
template <> __device__ __forceinline__ int codes4<F_Q6_K>(const u8* b, int e) {
    int h = e >> 7, quarter = (e >> 5) & 3, l = e & 31;
    u32 lo = ld_u32_2(b + 64 * h + (quarter & 1) * 32 + l);
    u32 hi = ld_u32_2(b + 128 + 32 * h + l);
    u32 low = (quarter >> 1) ? ((lo >> 4) & 0x0F0F0F0Fu) : (lo & 0x0F0F0F0Fu);
    return (int)(low | (((hi >> (2 * quarter)) & 0x03030303u) << 4));
}
// Q8_0 blocks are 2-byte aligned (34-byte blocks): two 2-byte loads.
template <> __device__ __forceinline__ int codes4<F_Q8_0>(const u8* b, int e) {
    const u16* p = (const u16*)(b + 2 + e);
    return (int)((u32)p[0] | ((u32)p[1] << 16));
}

// The canonical float step of one block (quant::scalar::dot_blocks): weight scale d (and
// min m), activation scale da, the block's exact integer sums is (codes) and ms (minimums).
template <int F>
__device__ __forceinline__ float block_step(float acc, float d, float m, float da, int is, int ms) {
    acc = fmaf(__fmul_rn(d, da), (float)is, acc);
    if (F == F_Q4_1 || F == F_Q5_1) {
        acc = fmaf(__fmul_rn(m, da), (float)ms, acc);
    } else if (F == F_Q2_K || F == F_Q4_K || F == F_Q5_K) {
        acc = fmaf(-__fmul_rn(m, da), (float)ms, acc);
    }
    return acc;
}

template <int F, int MT, int PAIR>
__device__ __forceinline__ void matmul_q_impl(const u8* w0, const u8* w1, const u8* w2, int n0, int n1,
                                              int n2, float* o0, float* o1, float* o2, const float* b0,
                                              const float* b1, const float* b2, const i8* qs,
                                              const float* ad, int k, int m, int mode, int sb, int sa) {
    extern __shared__ __align__(16) u8 smem[];
    const int BL = Meta<F>::BL, BB = Meta<F>::BB, SL = Meta<F>::SL;
    const int GL = BL == 32 ? 4 : 8;
    const int G = 32 / GL;
    const int EPL = BL / GL;
    const int SEG = EPL < SL ? EPL : SL;
    const int NSEG = EPL / SEG;
    const bool MIN1 = F == F_Q4_1 || F == F_Q5_1;
    const bool MINK = F == F_Q2_K || F == F_Q4_K || F == F_Q5_K;
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int wi = blockIdx.x * (blockDim.x >> 5) + wib;
    int r0 = blockIdx.y * MT;
    // Single rows (sa > 0): the CTA's warps share one activation row, staged in shared
    // memory first (codes, then block scales), before any warp may leave.
    const i8* sq = nullptr;
    const float* sd = nullptr;
    if (MT == 1 && sa > 0) {
        int nbl = k / BL;
        u8* sa_q = smem;
        float* sa_d = (float*)(smem + ((k + 15) & ~15));
        const u8* src = (const u8*)(qs + (size_t)r0 * k);
        for (int i = threadIdx.x; i < k / 16; i += blockDim.x) cp_async16(sa_q + 16 * i, src + 16 * i);
        for (int i = threadIdx.x; i < nbl; i += blockDim.x) sa_d[i] = ad[(size_t)r0 * nbl + i];
        cp_async_wait_all();
        __syncthreads();
        sq = (const i8*)sa_q;
        sd = sa_d;
    }
    const u8* w = w0;
    float* out = o0;
    const float* bias = b0;
    int n = n0, j = wi;
    if (PAIR) {
        if (wi >= n0) return;
    } else if (wi < n0) {
    } else if (wi < n0 + n1) {
        w = w1; out = o1; bias = b1; n = n1; j = wi - n0;
    } else if (wi < n0 + n1 + n2) {
        w = w2; out = o2; bias = b2; n = n2; j = wi - n0 - n1;
    } else {
        return;
    }
    int nr = min(MT, m - r0);
    int nb = k / BL;
    const u8* wrow = w + (size_t)j * nb * BB;
    const u8* urow = PAIR ? w1 + (size_t)j * nb * BB : wrow;
    u8* sw = smem + sa + (size_t)wib * sb * (PAIR ? 2 : 1);
    int cb = (sb - 32) / BB;
    cb -= cb % G;
    int g = lane / GL, gl = lane % GL;
    float acc[MT], acc2[MT];
#pragma unroll
    for (int r = 0; r < MT; r++) { acc[r] = 0.0f; acc2[r] = 0.0f; }
    for (int c0 = 0; c0 < nb; c0 += cb) {
        int cn = min(cb, nb - c0);
        __syncwarp();
        const u8* s0 = stage_issue(sw, wrow + (size_t)c0 * BB, cn * BB, lane);
        const u8* s1 = PAIR ? stage_issue(sw + sb, urow + (size_t)c0 * BB, cn * BB, lane) : s0;
        cp_async_wait_all();
        __syncwarp();
        for (int q0 = 0; q0 < cn; q0 += G) {
            int qb = q0 + g;           // block inside the chunk
            int b = c0 + qb;           // block inside the row
            bool valid = qb < cn;
#pragma unroll
            for (int half = 0; half < (PAIR ? 2 : 1); half++) {
                const u8* blk = (half ? s1 : s0) + (size_t)qb * BB;
                int isum[MT], msum[MT];
#pragma unroll
                for (int r = 0; r < MT; r++) { isum[r] = 0; msum[r] = 0; }
                float d = 0.0f, mm = 0.0f;
                if (valid) {
#pragma unroll
                    for (int sg = 0; sg < NSEG; sg++) {
                        int e0 = gl * EPL + sg * SEG;
                        int sc, mn;
                        sub_scale<F>(blk, e0 / SL, &sc, &mn);
                        int cw[SEG / 4];
#pragma unroll
                        for (int w4 = 0; w4 < SEG / 4; w4++) cw[w4] = codes4<F>(blk, e0 + 4 * w4);
#pragma unroll
                        for (int r = 0; r < MT; r++) {
                            if (r < nr) {
                                // 4-byte aligned: k and e0 are multiples of 4.
                                const int* a4 = (const int*)(sq ? sq + (size_t)b * BL + e0
                                                                : qs + (size_t)(r0 + r) * k + (size_t)b * BL + e0);
                                int dot = 0, asum = 0;
#pragma unroll
                                for (int w4 = 0; w4 < SEG / 4; w4++) {
                                    int av = a4[w4];
                                    dot = __dp4a(cw[w4], av, dot);
                                    asum = __dp4a(0x01010101, av, asum);
                                }
                                if (Off<F>::V) dot -= Off<F>::V * asum;
                                isum[r] += sc * dot;
                                msum[r] += MIN1 ? asum : mn * asum;
                            }
                        }
                    }
                    d = block_d<F>(blk);
                    mm = block_m<F>(blk);
                }
                // Exact integer reductions inside each group of GL lanes.
#pragma unroll
                for (int r = 0; r < MT; r++) {
#pragma unroll
                    for (int o = GL / 2; o > 0; o >>= 1) {
                        isum[r] += __shfl_xor_sync(0xffffffffu, isum[r], o);
                        if (MIN1 || MINK) msum[r] += __shfl_xor_sync(0xffffffffu, msum[r], o);
                    }
                }
                if (mode & 4) {
                    // Unordered (benchmark only, see below): each group adds its own blocks.
#pragma unroll
                    for (int r = 0; r < MT; r++) {
                        if (valid && r < nr) {
                            float da = sd ? sd[b] : ad[(size_t)(r0 + r) * (k / BL) + b];
                            float& a = half ? acc2[r] : acc[r];
                            a = block_step<F>(a, d, mm, da, isum[r], msum[r]);
                        }
                    }
                    continue;
                }
                // The float steps, block by block in order; every lane gets every group's values.
#pragma unroll
                for (int gg = 0; gg < G; gg++) {
                    int src = gg * GL;
                    int bb = b - g + gg;
                    bool ok = q0 + gg < cn;
                    float dg = __shfl_sync(0xffffffffu, d, src);
                    float mg = __shfl_sync(0xffffffffu, mm, src);
#pragma unroll
                    for (int r = 0; r < MT; r++) {
                        int is = __shfl_sync(0xffffffffu, isum[r], src);
                        int ms = __shfl_sync(0xffffffffu, msum[r], src);
                        if (ok && r < nr) {
                            float da = sd ? sd[bb] : ad[(size_t)(r0 + r) * (k / BL) + bb];
                            float& a = half ? acc2[r] : acc[r];
                            a = block_step<F>(a, dg, mg, da, is, ms);
                        }
                    }
                }
            }
        }
    }
    if (mode & 4) {
        // Unordered: the groups' partial sums meet in a tree, an order of their own.
#pragma unroll
        for (int r = 0; r < MT; r++) {
#pragma unroll
            for (int o = GL; o < 32; o <<= 1) {
                acc[r] = __fadd_rn(acc[r], __shfl_xor_sync(0xffffffffu, acc[r], o));
                acc2[r] = __fadd_rn(acc2[r], __shfl_xor_sync(0xffffffffu, acc2[r], o));
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < MT; r++) {
            if (r < nr) {
                float* o = out + (size_t)(r0 + r) * n + j;
                float v = acc[r];
                if (PAIR) {
                    v = __fmul_rn(canon_silu(v), acc2[r]);
                } else {
                    if (bias) v = __fadd_rn(v, bias[j]);
                    if ((mode & 3) == 1) v = __fadd_rn(*o, v);
                }
                *o = v;
            }
        }
    }
}

#define MATMUL_ARGS const u8 *w0, const u8 *w1, const u8 *w2, int n0, int n1, int n2, float *o0, float *o1, \
    float *o2, const float *b0, const float *b1, const float *b2, const i8 *qs, const float *ad, int k, int m, \
    int mode, int sb, int sa
#define MATMUL_PASS w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, qs, ad, k, m, mode, sb, sa
#define MATMUL_TILE(name, F, MT) \
    extern "C" __global__ void name(MATMUL_ARGS) { \
        if ((mode & 3) == 2) matmul_q_impl<F, MT, 1>(MATMUL_PASS); \
        else matmul_q_impl<F, MT, 0>(MATMUL_PASS); \
    }
#define MATMUL(name, F) \
    MATMUL_TILE(name, F, 4) \
    MATMUL_TILE(name##_m1, F, 1) \
    MATMUL_TILE(name##_m16, F, 16)
MATMUL(matmul_q4_0, F_Q4_0)
MATMUL(matmul_q4_1, F_Q4_1)
MATMUL(matmul_q5_0, F_Q5_0)
MATMUL(matmul_q5_1, F_Q5_1)
MATMUL(matmul_q8_0, F_Q8_0)
MATMUL(matmul_q2_k, F_Q2_K)
MATMUL(matmul_q3_k, F_Q3_K)
MATMUL(matmul_q4_k, F_Q4_K)
MATMUL(matmul_q5_k, F_Q5_K)
MATMUL(matmul_q6_k, F_Q6_K)

// ---- tensor-core matmul for prefill (k-quants, many rows) -----------------------------
//
// The same canonical arithmetic as matmul_q_impl (per output: acc = 0, then for each
// 256-value block in block order the exact integer sums isum = sum_j sc_j * dot_j and
// msum = sum_j mn_j * asum_j, then block_step), with the integer dot products dot_j of
// each sub-block computed by int8 tensor cores (mma m16n8k16 s8 -> s32, exact). A CTA
// computes a tile of MMQ_M rows by MMQ_N columns; for each weight block it stages the
// columns' raw blocks and the rows' activation codes in shared memory (cp.async), unpacks
// the weight codes to signed bytes (Q6_K: code - 32, so no offset term; Q4_K: 0..15), the
// sub-block scales and mins, and the rows' per-sub-block code sums, then runs the mma.
// Launch modes as the matmul_* kernels (0: up to three matrices with bias, 1: residual,
// 2: gate/up pair with SwiGLU); no unordered mode. sb and sa are unused.
#define MMQ_M 32
#define MMQ_N 64
#define MMQ_THREADS 128
#define MMQ_LD 272  // bytes per code row in shared memory (256 + 16: no bank conflicts)

// Fragments (PTX ISA, mma.m16n8k16 with .s8): g = lane / 4, t = lane % 4; a0 holds
// A[g][4t..4t+3], a1 A[g+8][4t..4t+3], b0 B[4t..4t+3][g] (B stored column by column),
// c[i] is C[g + 8 (i / 2)][2t + i % 2]. The host launches the mmq kernels only on compute
// capability 8.0 and newer; older targets compile a trap in their place.
__device__ __forceinline__ void mma_s8_16(int* c, int a0, int a1, int b0) {
#if __CUDA_ARCH__ < 800
    __trap();
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
#endif
}

// The matrix and column tile of a mmq CTA (blockIdx.x runs over the tiles of w0, then w1,
// then w2; a gate/up pair has w0's tiles only): sets *w, *out, *bias, *n, returns the tile.
__device__ __forceinline__ int mmq_pick(bool pair, const u8* w0, const u8* w1, const u8* w2, int n0, int n1,
                                        int n2, float* o0, float* o1, float* o2, const float* b0,
                                        const float* b1, const float* b2, const u8** w, float** out,
                                        const float** bias, int* n) {
    int t = blockIdx.x;
    int t0 = (n0 + MMQ_N - 1) / MMQ_N, t1 = pair ? 0 : (n1 + MMQ_N - 1) / MMQ_N;
    *w = w0; *out = o0; *bias = b0; *n = n0;
    if (t >= t0) {
        t -= t0;
        if (t < t1) {
            *w = w1; *out = o1; *bias = b1; *n = n1;
        } else {
            t -= t1;
            *w = w2; *out = o2; *bias = b2; *n = n2;
        }
    }
    return t;
}

// A warp's 16 × 32 outputs (fragment layout above; row0 = the tile's row + g, col0 = its
// column + 2 tq) by launch mode: store (+ bias), accumulate (residual), or silu(gate) * up.
__device__ __forceinline__ void mmq_store(const float (&acc)[4][4], const float (&accg)[4][4], float* out,
                                          const float* bias, int n, int m, int row0, int col0, int mode) {
#pragma unroll
    for (int a = 0; a < 4; a++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int col = col0 + 8 * a + (i & 1);
            int row = row0 + 8 * (i >> 1);
            if (row < m && col < n) {
                float* o = out + (size_t)row * n + col;
                float v = acc[a][i];
                if ((mode & 3) == 2) {
                    v = __fmul_rn(canon_silu(accg[a][i]), v);
                } else {
                    if (bias) v = __fadd_rn(v, bias[col]);
                    if ((mode & 3) == 1) v = __fadd_rn(*o, v);
                }
                *o = v;
            }
        }
    }
}

template <int F>
__device__ __forceinline__ void mmq_impl(const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int n2,
                                         float* o0, float* o1, float* o2, const float* b0, const float* b1,
                                         const float* b2, const i8* qs, const float* ad, int k, int m,
                                         int mode) {
    const bool PAIR = (mode & 3) == 2;
    const int BB = Meta<F>::BB, SL = Meta<F>::SL;
    const int NS = 256 / SL;
    const int RS = (BB + 30) / 16 * 16;  // room for a block starting anywhere in a 16-byte line
    const bool MINK = F == F_Q4_K;
    __shared__ __align__(16) u8 s_raw[MMQ_N * RS];
    __shared__ __align__(16) i8 s_w[MMQ_N * MMQ_LD];
    __shared__ __align__(16) i8 s_a[MMQ_M * MMQ_LD];
    __shared__ short s_sc[MMQ_N * NS];
    __shared__ short s_mn[MINK ? MMQ_N * NS : 1];
    __shared__ int s_as[MINK ? MMQ_M * NS : 1];
    __shared__ float s_d[MMQ_N], s_m[MMQ_N], s_da[MMQ_M];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int g = lane >> 2, tq = lane & 3;
    // Which matrix and which column tile.
    const u8* w;
    float* out;
    const float* bias;
    int n;
    int t = mmq_pick(PAIR, w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, &w, &out, &bias, &n);
    int col0 = t * MMQ_N, r0 = blockIdx.y * MMQ_M;
    int nb = k / 256;
    int wr = (warp & 1) * 16, wc = (warp >> 1) * 32;
    float acc[4][4], accg[4][4];
    for (int h = 0; h < (PAIR ? 2 : 1); h++) {
        const u8* wm = h ? w1 : w;
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[a][i] = 0.0f;
        for (int b = 0; b < nb; b++) {
            __syncthreads();  // every read of the previous block's shared data is done
            // Stage: each warp copies every fourth column's block; rows and columns past the
            // end read the last one (valid memory; their results are never stored).
            for (int c = warp; c < MMQ_N; c += MMQ_THREADS / 32) {
                int col = min(col0 + c, n - 1);
                stage_issue(s_raw + c * RS, wm + ((size_t)col * nb + b) * BB, BB, lane);
            }
            for (int i = tid; i < MMQ_M * 16; i += MMQ_THREADS) {
                int r = i >> 4, ch = i & 15;
                int row = min(r0 + r, m - 1);
                cp_async16(s_a + r * MMQ_LD + ch * 16, qs + (size_t)row * k + (size_t)b * 256 + ch * 16);
            }
            if (tid < MMQ_M) s_da[tid] = ad[(size_t)min(r0 + tid, m - 1) * nb + b];
            cp_async_wait_all();
            __syncthreads();
            // Unpack the weight codes (signed bytes), scales and mins.
            for (int i = tid; i < MMQ_N * 64; i += MMQ_THREADS) {
                int c = i >> 6, q = i & 63;
                int col = min(col0 + c, n - 1);
                const u8* blk = s_raw + c * RS + (int)((size_t)(wm + ((size_t)col * nb + b) * BB) & 15);
                int v = codes4<F>(blk, 4 * q);
                if (Off<F>::V) v = (int)__vsub4((u32)v, (u32)Off<F>::V * 0x01010101u);
                *(int*)(s_w + c * MMQ_LD + 4 * q) = v;
            }
            for (int i = tid; i < MMQ_N * NS; i += MMQ_THREADS) {
                int c = i / NS, j = i % NS;
                int col = min(col0 + c, n - 1);
                const u8* blk = s_raw + c * RS + (int)((size_t)(wm + ((size_t)col * nb + b) * BB) & 15);
                int sc, mn;
                sub_scale<F>(blk, j, &sc, &mn);
                s_sc[c * NS + j] = (short)sc;
                if (MINK) s_mn[c * NS + j] = (short)mn;
                if (j == 0) {
                    s_d[c] = block_d<F>(blk);
                    s_m[c] = block_m<F>(blk);
                }
            }
            if (MINK) {
                for (int i = tid; i < MMQ_M * NS; i += MMQ_THREADS) {
                    int r = i / NS, j = i % NS;
                    const int* a4 = (const int*)(s_a + r * MMQ_LD + j * SL);
                    int s = 0;
#pragma unroll
                    for (int u = 0; u < SL / 4; u++) s = __dp4a(0x01010101, a4[u], s);
                    s_as[r * NS + j] = s;
                }
            }
            __syncthreads();
            // Exact integer sums of the block.
            int isum[4][4], msum[4][4];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int i = 0; i < 4; i++) { isum[a][i] = 0; msum[a][i] = 0; }
#pragma unroll 2
            for (int j = 0; j < NS; j++) {
                int dot[4][4];
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) dot[a][i] = 0;
#pragma unroll
                for (int kk = 0; kk < SL / 16; kk++) {
                    int ko = j * SL + kk * 16 + 4 * tq;
                    int a0 = *(const int*)(s_a + (wr + g) * MMQ_LD + ko);
                    int a1 = *(const int*)(s_a + (wr + g + 8) * MMQ_LD + ko);
#pragma unroll
                    for (int a = 0; a < 4; a++) {
                        int bv = *(const int*)(s_w + (wc + 8 * a + g) * MMQ_LD + ko);
                        mma_s8_16(dot[a], a0, a1, bv);
                    }
                }
#pragma unroll
                for (int a = 0; a < 4; a++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int c = wc + 8 * a + 2 * tq + (i & 1);
                        isum[a][i] += (int)s_sc[c * NS + j] * dot[a][i];
                        if (MINK) msum[a][i] += (int)s_mn[c * NS + j] * s_as[(wr + g + 8 * (i >> 1)) * NS + j];
                    }
                }
            }
            // The block's float step, in block order.
#pragma unroll
            for (int a = 0; a < 4; a++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int c = wc + 8 * a + 2 * tq + (i & 1);
                    int r = wr + g + 8 * (i >> 1);
                    acc[a][i] = block_step<F>(acc[a][i], s_d[c], s_m[c], s_da[r], isum[a][i], msum[a][i]);
                }
            }
        }
        if (PAIR && h == 0) {
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int i = 0; i < 4; i++) accg[a][i] = acc[a][i];
        }
    }
    mmq_store(acc, accg, out, bias, n, m, r0 + wr + g, col0 + wc + 2 * tq, mode);
}

#define MMQ(name, F) \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS) name(MATMUL_ARGS) { \
        mmq_impl<F>(w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, qs, ad, k, m, mode); \
    }
MMQ(mmq_q4_k, F_Q4_K)
MMQ(mmq_q6_k, F_Q6_K)

// ---- wide tensor-core tiles for Q4_K (mmqw) ---------------------------------------------
//
// The arithmetic of mmq_impl (per output and 256-value block: isum = sum_j sc_j * dot_j and
// msum = sum_j mn_j * asum_j as exact integers, then block_step in block order) with less
// work around each tensor-core step: a CTA computes MMQW_M = 64 rows by MMQ_N = 64 columns
// (four warps of 32 × 32, so each staged weight block serves twice the rows), one
// m16n8k32 step covers a whole 32-value sub-block, and its weight fragment comes straight
// from the staged raw block (sub-block j is the low or high nibbles of 32 consecutive code
// bytes, no unpacked copy). The mins' integer sum is itself a product of two small
// matrices (rows' sub-block code sums by columns' 6-bit mins over j = 0..7); each code sum
// |asum_j| <= 32 * 127 splits exactly as hi * 128 + lo with hi in [-32, 31] and lo in
// [0, 127], so two m16n8k16 steps (k padded with zeros) give it exactly. Raw blocks are
// staged whole and 16-byte aligned (the host launches mmqw only for 16-byte-aligned
// matrices); a 144-byte row stride puts the eight columns and four k-quads of a fragment
// load in 32 different banks.
#define MMQW_M 64
// CTAs per multiprocessor the wide kernels are compiled for (at most 170 registers a
// thread): without it the driver's compiler gave mmqw_q4_k 218, two CTAs (8 warps) per SM.
#define MMQW_CTAS 3
#define MMQW_RS 144
// mmqw_q4_k's dynamic shared memory: two stages (raw blocks, codes, activation scales: one
// in flight while the other is computed), then the scales and mins of the columns, the
// rows' code sums as hi and lo bytes, the columns' d and dmin.
#define MMQW4_STAGE (MMQ_N * MMQW_RS + MMQW_M * MMQ_LD + 4 * MMQW_M)
#define MMQW4_SMEM (2 * MMQW4_STAGE + 2 * 8 * MMQ_N + 2 * 8 * MMQW_M + 4 * 2 * MMQ_N)

// m16n8k32 (.s8), C = 0: a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..],
// a3 = A[g+8][16+4t..]; b0 = B[4t..4t+3][g], b1 = B[16+4t..16+4t+3][g]; d as mma_s8_16.
__device__ __forceinline__ void mma_s8_32(int* d, int a0, int a1, int a2, int a3, int b0, int b1) {
#if __CUDA_ARCH__ < 800
    __trap();
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
#endif
}

// One stage of mmqw_q4_k (MMQW4_STAGE bytes at st): the columns' whole raw blocks b, the
// rows' codes and activation scales of block b, as asynchronous copies (rows and columns
// past the end read the last one; their results are never stored). The caller commits.
__device__ __forceinline__ void mmqw4_issue(u8* st, const u8* wm, const i8* qs, const float* ad, int col0, int n,
                                            int r0, int m, int k, int nb, int b, int tid) {
    const int BB = Meta<F_Q4_K>::BB;
    i8* s_a = (i8*)(st + MMQ_N * MMQW_RS);
    float* s_da = (float*)(s_a + MMQW_M * MMQ_LD);
    for (int i = tid; i < MMQ_N * (BB / 16); i += MMQ_THREADS) {
        int c = i / (BB / 16), ch = i - c * (BB / 16);
        int col = min(col0 + c, n - 1);
        cp_async16(st + c * MMQW_RS + ch * 16, wm + ((size_t)col * nb + b) * BB + ch * 16);
    }
    for (int i = tid; i < MMQW_M * 16; i += MMQ_THREADS) {
        int r = i >> 4, ch = i & 15;
        int row = min(r0 + r, m - 1);
        cp_async16(s_a + r * MMQ_LD + ch * 16, qs + (size_t)row * k + (size_t)b * 256 + ch * 16);
    }
    if (tid < MMQW_M) cp_async4(s_da + tid, ad + (size_t)min(r0 + tid, m - 1) * nb + b);
}

template <int F>
__device__ __forceinline__ void mmqw_impl(const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int n2,
                                          float* o0, float* o1, float* o2, const float* b0, const float* b1,
                                          const float* b2, const i8* qs, const float* ad, int k, int m,
                                          int mode) {
    static_assert(F == F_Q4_K, "mmqw takes Q4_K");
    const bool PAIR = (mode & 3) == 2;
    extern __shared__ __align__(16) u8 smem[];
    if (dynamic_smem_bytes() < MMQW4_SMEM) __trap();
    u8* s_sc = smem + 2 * MMQW4_STAGE;
    u8* s_mn = s_sc + MMQ_N * 8;
    u8* s_ah = s_mn + MMQ_N * 8;
    u8* s_al = s_ah + MMQW_M * 8;
    float* s_d = (float*)(s_al + MMQW_M * 8);
    float* s_m = s_d + MMQ_N;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int g = lane >> 2, tq = lane & 3;
    const u8* w;
    float* out;
    const float* bias;
    int n;
    int t = mmq_pick(PAIR, w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, &w, &out, &bias, &n);
    int col0 = t * MMQ_N, r0 = blockIdx.y * MMQW_M;
    int nb = k / 256;
    int wr = (warp & 1) * 32, wc = (warp >> 1) * 32;
    float acc[2][4][4], accg[2][4][4];
    for (int h = 0; h < (PAIR ? 2 : 1); h++) {
        const u8* wm = h ? w1 : w;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[mi][a][i] = 0.0f;
        mmqw4_issue(smem, wm, qs, ad, col0, n, r0, m, k, nb, 0, tid);
        cp_async_commit();
        for (int b = 0; b < nb; b++) {
            // The next block's stage goes in flight while this one is computed.
            if (b + 1 < nb) mmqw4_issue(smem + ((b + 1) & 1) * MMQW4_STAGE, wm, qs, ad, col0, n, r0, m, k, nb, b + 1, tid);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            const u8* s_raw = smem + (b & 1) * MMQW4_STAGE;
            const i8* s_a = (const i8*)(s_raw + MMQ_N * MMQW_RS);
            const float* s_da = (const float*)(s_a + MMQW_M * MMQ_LD);
            // The columns' sub-block scales and mins (a thread per column), the rows'
            // sub-block code sums as hi and lo bytes (two threads per row, four j each).
            if (tid < MMQ_N) {
                const u8* blk = s_raw + tid * MMQW_RS;
                u32 sc[2] = {0, 0}, mn[2] = {0, 0};
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    int s, q;
                    sub_scale<F>(blk, j, &s, &q);
                    sc[j >> 2] |= (u32)s << (8 * (j & 3));
                    mn[j >> 2] |= (u32)q << (8 * (j & 3));
                }
                *(u32*)(s_sc + tid * 8) = sc[0];
                *(u32*)(s_sc + tid * 8 + 4) = sc[1];
                *(u32*)(s_mn + tid * 8) = mn[0];
                *(u32*)(s_mn + tid * 8 + 4) = mn[1];
                s_d[tid] = block_d<F>(blk);
                s_m[tid] = block_m<F>(blk);
            }
            {
                int r = tid >> 1, j0 = (tid & 1) * 4;
                const int* a4 = (const int*)(s_a + r * MMQ_LD + j0 * 32);
                u32 hi = 0, lo = 0;
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    int s = 0;
#pragma unroll
                    for (int u = 0; u < 8; u++) s = __dp4a(0x01010101, a4[jj * 8 + u], s);
                    hi |= ((u32)(s >> 7) & 0xFFu) << (8 * jj);
                    lo |= ((u32)s & 0x7Fu) << (8 * jj);
                }
                *(u32*)(s_ah + r * 8 + j0) = hi;
                *(u32*)(s_al + r * 8 + j0) = lo;
            }
            __syncthreads();
            // Exact integer sums of the block.
            int isum[2][4][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) isum[mi][a][i] = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                int af[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const i8* ra = s_a + (wr + 16 * mi + g) * MMQ_LD + 32 * j + 4 * tq;
                    af[mi][0] = *(const int*)ra;
                    af[mi][1] = *(const int*)(ra + 8 * MMQ_LD);
                    af[mi][2] = *(const int*)(ra + 16);
                    af[mi][3] = *(const int*)(ra + 8 * MMQ_LD + 16);
                }
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    const u8* cb = s_raw + (wc + 8 * a + g) * MMQW_RS + 16 + 32 * (j >> 1) + 4 * tq;
                    u32 x0 = *(const u32*)cb, x1 = *(const u32*)(cb + 16);
                    int bf0 = (int)((x0 >> (4 * (j & 1))) & 0x0F0F0F0Fu);
                    int bf1 = (int)((x1 >> (4 * (j & 1))) & 0x0F0F0F0Fu);
                    int sc0 = s_sc[(wc + 8 * a + 2 * tq) * 8 + j];
                    int sc1 = s_sc[(wc + 8 * a + 2 * tq + 1) * 8 + j];
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) {
                        int d[4];
                        mma_s8_32(d, af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf0, bf1);
                        isum[mi][a][0] += sc0 * d[0];
                        isum[mi][a][1] += sc1 * d[1];
                        isum[mi][a][2] += sc0 * d[2];
                        isum[mi][a][3] += sc1 * d[3];
                    }
                }
            }
            // The mins' sums (two m16n8k16 steps on the hi and lo bytes), then the block's
            // float step, in block order.
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                int ro = (wr + 16 * mi + g) * 8 + 4 * tq;
                bool kin = tq < 2;
                int h0 = kin ? *(const int*)(s_ah + ro) : 0;
                int h1 = kin ? *(const int*)(s_ah + ro + 64) : 0;
                int l0 = kin ? *(const int*)(s_al + ro) : 0;
                int l1 = kin ? *(const int*)(s_al + ro + 64) : 0;
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    int bm = kin ? *(const int*)(s_mn + (wc + 8 * a + g) * 8 + 4 * tq) : 0;
                    int dh[4] = {0, 0, 0, 0}, dl[4] = {0, 0, 0, 0};
                    mma_s8_16(dh, h0, h1, bm);
                    mma_s8_16(dl, l0, l1, bm);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int c = wc + 8 * a + 2 * tq + (i & 1);
                        int r = wr + 16 * mi + g + 8 * (i >> 1);
                        acc[mi][a][i] = block_step<F>(acc[mi][a][i], s_d[c], s_m[c], s_da[r], isum[mi][a][i],
                                                      dh[i] * 128 + dl[i]);
                    }
                }
            }
            __syncthreads();  // every read of this stage is done before it is refilled
        }
        if (PAIR && h == 0) {
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) accg[mi][a][i] = acc[mi][a][i];
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
        mmq_store(acc[mi], accg[mi], out, bias, n, m, r0 + wr + 16 * mi + g, col0 + wc + 2 * tq, mode);
}

extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQW_CTAS) mmqw_q4_k(MATMUL_ARGS) {
    mmqw_impl<F_Q4_K>(w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, qs, ad, k, m, mode);
}

// Bytes a column of the 32-element formats' tiles takes in a stage: eight blocks starting
// anywhere in a 16-byte line.
template <int F> struct Rs32 { enum { V = (8 * Meta<F>::BB + 30) / 16 * 16 }; };

// One stage of the 32-element formats' tensor-core kernels (mmq32_impl, mmqw32_impl): blocks
// b0s .. b0s + nbl (nbl <= 8) of every column of the tile into raw (Rs32 bytes a column),
// the codes of ROWS activation rows over those blocks into sa (MMQ_LD bytes a row), their
// scales into da (8 a row), as asynchronous copies (rows and columns past the end read the
// last one; their results are never stored). The caller commits and waits.
template <int F, int ROWS>
__device__ __forceinline__ void mmq32_issue(u8* raw, i8* sa, float* da, const u8* wm, const i8* qs, const float* ad,
                                            int col0, int n, int r0, int m, int k, int nb, int b0s, int nbl,
                                            int tid) {
    const int BB = Meta<F>::BB;
    int warp = tid >> 5, lane = tid & 31;
    for (int c = warp; c < MMQ_N; c += MMQ_THREADS / 32) {
        int col = min(col0 + c, n - 1);
        stage_issue(raw + c * Rs32<F>::V, wm + ((size_t)col * nb + b0s) * BB, nbl * BB, lane);
    }
    for (int i = tid; i < ROWS * 16; i += MMQ_THREADS) {
        int r = i >> 4, ch = i & 15;
        int row = min(r0 + r, m - 1);
        if (ch < 2 * nbl)
            cp_async16(sa + r * MMQ_LD + ch * 16, qs + (size_t)row * k + (size_t)b0s * 32 + ch * 16);
    }
    for (int i = tid; i < ROWS * 8; i += MMQ_THREADS) {
        int r = i >> 3, j = i & 7;
        if (j < nbl) cp_async4(da + i, ad + (size_t)min(r0 + r, m - 1) * nb + b0s + j);
    }
}

// The tensor-core kernel of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
// the same tiles, warps and fragments as mmq_impl; a stage holds up to eight consecutive
// blocks of every column (256 activations per row; the last stage of a row may hold fewer,
// since k need only be a multiple of 32). Per output, each block's exact integer sum comes
// from two m16n8k16 steps, then the block's float step (block_step, with the activation
// block sum for the minimum of Q4_1 / Q5_1) in block order: matmul_q_impl's arithmetic.
template <int F>
__device__ __forceinline__ void mmq32_impl(const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int n2,
                                           float* o0, float* o1, float* o2, const float* b0, const float* b1,
                                           const float* b2, const i8* qs, const float* ad, int k, int m,
                                           int mode) {
    const bool PAIR = (mode & 3) == 2;
    const int BB = Meta<F>::BB;
    const int RS = Rs32<F>::V;
    const bool MIN = F == F_Q4_1 || F == F_Q5_1;
    __shared__ __align__(16) u8 s_raw[MMQ_N * RS];
    __shared__ __align__(16) i8 s_w[MMQ_N * MMQ_LD];
    __shared__ __align__(16) i8 s_a[MMQ_M * MMQ_LD];
    __shared__ float s_d[MMQ_N * 8];
    __shared__ float s_m[MIN ? MMQ_N * 8 : 1];
    __shared__ int s_as[MIN ? MMQ_M * 8 : 1];
    __shared__ float s_da[MMQ_M * 8];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int g = lane >> 2, tq = lane & 3;
    const u8* w;
    float* out;
    const float* bias;
    int n;
    int t = mmq_pick(PAIR, w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, &w, &out, &bias, &n);
    int col0 = t * MMQ_N, r0 = blockIdx.y * MMQ_M;
    int nb = k / 32;
    int wr = (warp & 1) * 16, wc = (warp >> 1) * 32;
    float acc[4][4], accg[4][4];
    for (int h = 0; h < (PAIR ? 2 : 1); h++) {
        const u8* wm = h ? w1 : w;
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[a][i] = 0.0f;
        for (int b0s = 0; b0s < nb; b0s += 8) {
            int nbl = min(8, nb - b0s);
            __syncthreads();  // every read of the previous stage's shared data is done
            mmq32_issue<F, MMQ_M>(s_raw, s_a, s_da, wm, qs, ad, col0, n, r0, m, k, nb, b0s, nbl, tid);
            cp_async_wait_all();
            __syncthreads();
            for (int i = tid; i < MMQ_N * 64; i += MMQ_THREADS) {
                int c = i >> 6, q = i & 63, j = q >> 3;
                if (j >= nbl) continue;
                int col = min(col0 + c, n - 1);
                const u8* blk = s_raw + c * RS + (int)((size_t)(wm + ((size_t)col * nb + b0s) * BB) & 15) + j * BB;
                int v = codes4<F>(blk, 4 * (q & 7));
                if (Off<F>::V) v = (int)__vsub4((u32)v, (u32)Off<F>::V * 0x01010101u);
                *(int*)(s_w + c * MMQ_LD + 4 * q) = v;
            }
            for (int i = tid; i < MMQ_N * 8; i += MMQ_THREADS) {
                int c = i >> 3, j = i & 7;
                if (j >= nbl) continue;
                int col = min(col0 + c, n - 1);
                const u8* blk = s_raw + c * RS + (int)((size_t)(wm + ((size_t)col * nb + b0s) * BB) & 15) + j * BB;
                s_d[i] = block_d<F>(blk);
                if (MIN) s_m[i] = block_m<F>(blk);
            }
            if (MIN) {
                for (int i = tid; i < MMQ_M * 8; i += MMQ_THREADS) {
                    int r = i >> 3, j = i & 7;
                    if (j >= nbl) continue;
                    const int* a4 = (const int*)(s_a + r * MMQ_LD + j * 32);
                    int s = 0;
#pragma unroll
                    for (int u = 0; u < 8; u++) s = __dp4a(0x01010101, a4[u], s);
                    s_as[i] = s;
                }
            }
            __syncthreads();
            for (int j = 0; j < nbl; j++) {
                int dot[4][4];
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) dot[a][i] = 0;
#pragma unroll
                for (int kk = 0; kk < 2; kk++) {
                    int ko = j * 32 + kk * 16 + 4 * tq;
                    int a0 = *(const int*)(s_a + (wr + g) * MMQ_LD + ko);
                    int a1 = *(const int*)(s_a + (wr + g + 8) * MMQ_LD + ko);
#pragma unroll
                    for (int a = 0; a < 4; a++) {
                        int bv = *(const int*)(s_w + (wc + 8 * a + g) * MMQ_LD + ko);
                        mma_s8_16(dot[a], a0, a1, bv);
                    }
                }
#pragma unroll
                for (int a = 0; a < 4; a++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int c = wc + 8 * a + 2 * tq + (i & 1);
                        int r = wr + g + 8 * (i >> 1);
                        acc[a][i] = block_step<F>(acc[a][i], s_d[c * 8 + j], MIN ? s_m[c * 8 + j] : 0.0f,
                                                  s_da[r * 8 + j], dot[a][i], MIN ? s_as[r * 8 + j] : 0);
                    }
                }
            }
        }
        if (PAIR && h == 0) {
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int i = 0; i < 4; i++) accg[a][i] = acc[a][i];
        }
    }
    mmq_store(acc, accg, out, bias, n, m, r0 + wr + g, col0 + wc + 2 * tq, mode);
}

// Wide tiles for Q6_K (mmqw6): 64 rows by 64 columns like mmqw_impl, with the sub-block
// scales folded into the weights. Each weight w = sc_j * code (code in [-32, 31], sc_j a
// signed byte) lies in [-4064, 4096] and splits exactly as hi * 64 + lo with hi in [-64, 64]
// and lo in [0, 63], both signed bytes; so isum = sum_j sc_j * dot_j of the block is the
// exact integer 64 * (A . Hi) + (A . Lo), two accumulating m16n8k32 chains over the block's
// 256 values with no per-sub-block scaling in the loop. Then block_step in block order, as
// every other kernel. Dynamic shared memory (MMQW6_SMEM bytes; the host raises the limit).
// Two stages (raw blocks, codes, activation scales, where each column's block landed): one
// in flight while the other is computed; then the hi and lo weight bytes and the columns' d.
#define MMQW6_RS 240  // a 210-byte block starting anywhere in a 16-byte line
#define MMQW6_STAGE (MMQ_N * MMQW6_RS + MMQW_M * MMQ_LD + 4 * MMQW_M + 4 * MMQ_N)
#define MMQW6_SMEM (2 * MMQW6_STAGE + 2 * MMQ_N * MMQ_LD + 4 * MMQ_N)

// m16n8k32 (.s8) accumulating into c (fragments as mma_s8_32).
__device__ __forceinline__ void mma_s8_32c(int* c, int a0, int a1, int a2, int a3, int b0, int b1) {
#if __CUDA_ARCH__ < 800
    __trap();
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// One stage of mmqw_q6_k (MMQW6_STAGE bytes at st), as mmqw4_issue; Q6_K's 210-byte blocks
// start anywhere in a 16-byte line, so where each column's block lands is kept with them.
__device__ __forceinline__ void mmqw6_issue(u8* st, const u8* wm, const i8* qs, const float* ad, int col0, int n,
                                            int r0, int m, int k, int nb, int b, int tid) {
    const int BB = Meta<F_Q6_K>::BB;
    int warp = tid >> 5, lane = tid & 31;
    i8* s_a = (i8*)(st + MMQ_N * MMQW6_RS);
    float* s_da = (float*)(s_a + MMQW_M * MMQ_LD);
    int* s_off = (int*)(s_da + MMQW_M);
    for (int c = warp; c < MMQ_N; c += MMQ_THREADS / 32) {
        int col = min(col0 + c, n - 1);
        const u8* at = stage_issue(st + c * MMQW6_RS, wm + ((size_t)col * nb + b) * BB, BB, lane);
        if (lane == 0) s_off[c] = (int)(at - (st + c * MMQW6_RS));
    }
    for (int i = tid; i < MMQW_M * 16; i += MMQ_THREADS) {
        int r = i >> 4, ch = i & 15;
        int row = min(r0 + r, m - 1);
        cp_async16(s_a + r * MMQ_LD + ch * 16, qs + (size_t)row * k + (size_t)b * 256 + ch * 16);
    }
    if (tid < MMQW_M) cp_async4(s_da + tid, ad + (size_t)min(r0 + tid, m - 1) * nb + b);
}

extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQW_CTAS) mmqw_q6_k(MATMUL_ARGS) {
    const int F = F_Q6_K;
    const bool PAIR = (mode & 3) == 2;
    extern __shared__ __align__(16) u8 smem[];
    if (dynamic_smem_bytes() < MMQW6_SMEM) __trap();
    i8* s_wh = (i8*)(smem + 2 * MMQW6_STAGE);
    i8* s_wl = s_wh + MMQ_N * MMQ_LD;
    float* s_d = (float*)(s_wl + MMQ_N * MMQ_LD);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int g = lane >> 2, tq = lane & 3;
    const u8* w;
    float* out;
    const float* bias;
    int n;
    int t = mmq_pick(PAIR, w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, &w, &out, &bias, &n);
    int col0 = t * MMQ_N, r0 = blockIdx.y * MMQW_M;
    int nb = k / 256;
    int wr = (warp & 1) * 32, wc = (warp >> 1) * 32;
    float acc[2][4][4], accg[2][4][4];
    for (int h = 0; h < (PAIR ? 2 : 1); h++) {
        const u8* wm = h ? w1 : w;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[mi][a][i] = 0.0f;
        mmqw6_issue(smem, wm, qs, ad, col0, n, r0, m, k, nb, 0, tid);
        cp_async_commit();
        for (int b = 0; b < nb; b++) {
            // The next block's stage goes in flight while this one is computed.
            if (b + 1 < nb) mmqw6_issue(smem + ((b + 1) & 1) * MMQW6_STAGE, wm, qs, ad, col0, n, r0, m, k, nb, b + 1, tid);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            const u8* s_raw = smem + (b & 1) * MMQW6_STAGE;
            const i8* s_a = (const i8*)(s_raw + MMQ_N * MMQW6_RS);
            const float* s_da = (const float*)(s_a + MMQW_M * MMQ_LD);
            const int* s_off = (const int*)(s_da + MMQW_M);
            // The scaled weights split into hi and lo bytes (four values per step).
            for (int i = tid; i < MMQ_N * 64; i += MMQ_THREADS) {
                int c = i >> 6, q = i & 63;
                const u8* blk = s_raw + c * MMQW6_RS + s_off[c];
                u32 v = __vsub4((u32)codes4<F>(blk, 4 * q), 0x20202020u);
                int sc = (int)(i8)blk[192 + (q >> 2)];
                u32 hi = 0, lo = 0;
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    int wv = (int)(i8)(u8)(v >> (8 * u)) * sc;
                    hi |= ((u32)(wv >> 6) & 0xFFu) << (8 * u);
                    lo |= ((u32)wv & 0x3Fu) << (8 * u);
                }
                *(u32*)(s_wh + c * MMQ_LD + 4 * q) = hi;
                *(u32*)(s_wl + c * MMQ_LD + 4 * q) = lo;
            }
            if (tid < MMQ_N) s_d[tid] = block_d<F>(s_raw + tid * MMQW6_RS + s_off[tid]);
            __syncthreads();
            int dh[2][4][4], dl[2][4][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) { dh[mi][a][i] = 0; dl[mi][a][i] = 0; }
#pragma unroll 2
            for (int j = 0; j < 8; j++) {
                int af[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const i8* ra = s_a + (wr + 16 * mi + g) * MMQ_LD + 32 * j + 4 * tq;
                    af[mi][0] = *(const int*)ra;
                    af[mi][1] = *(const int*)(ra + 8 * MMQ_LD);
                    af[mi][2] = *(const int*)(ra + 16);
                    af[mi][3] = *(const int*)(ra + 8 * MMQ_LD + 16);
                }
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    int o = (wc + 8 * a + g) * MMQ_LD + 32 * j + 4 * tq;
                    int h0 = *(const int*)(s_wh + o), h1 = *(const int*)(s_wh + o + 16);
                    int l0 = *(const int*)(s_wl + o), l1 = *(const int*)(s_wl + o + 16);
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) {
                        mma_s8_32c(dh[mi][a], af[mi][0], af[mi][1], af[mi][2], af[mi][3], h0, h1);
                        mma_s8_32c(dl[mi][a], af[mi][0], af[mi][1], af[mi][2], af[mi][3], l0, l1);
                    }
                }
            }
            // The block's float step, in block order.
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int c = wc + 8 * a + 2 * tq + (i & 1);
                        int r = wr + 16 * mi + g + 8 * (i >> 1);
                        acc[mi][a][i] = block_step<F>(acc[mi][a][i], s_d[c], 0.0f, s_da[r],
                                                      dh[mi][a][i] * 64 + dl[mi][a][i], 0);
                    }
            __syncthreads();  // every read of this stage is done before it is refilled
        }
        if (PAIR && h == 0) {
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) accg[mi][a][i] = acc[mi][a][i];
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
        mmq_store(acc[mi], accg[mi], out, bias, n, m, r0 + wr + 16 * mi + g, col0 + wc + 2 * tq, mode);
}

// mmqw32's dynamic shared memory: two stages (raw blocks, codes, activation scales of eight
// blocks: one in flight while the other is computed), then the columns' d (and m) and the
// rows' code sums of Q4_1 / Q5_1. The host's `mmqw32_smem` computes the same sizes.
template <int F> struct Mmqw32Smem {
    enum {
        STAGE = MMQ_N * Rs32<F>::V + MMQW_M * MMQ_LD + 4 * MMQW_M * 8,
        MIN = F == F_Q4_1 || F == F_Q5_1,
        BYTES = 2 * STAGE + 4 * MMQ_N * 8 + (MIN ? 4 * MMQ_N * 8 + 4 * MMQW_M * 8 : 0),
    };
};

template <int F>
__device__ __forceinline__ void mmqw32_issue(u8* st, const u8* wm, const i8* qs, const float* ad, int col0, int n,
                                             int r0, int m, int k, int nb, int b0s, int tid) {
    i8* sa = (i8*)(st + MMQ_N * Rs32<F>::V);
    float* da = (float*)(sa + MMQW_M * MMQ_LD);
    mmq32_issue<F, MMQW_M>(st, sa, da, wm, qs, ad, col0, n, r0, m, k, nb, b0s, min(8, nb - b0s), tid);
}

// Wide tiles for the 32-element block formats (mmqw32): mmq32_impl's stages and arithmetic
// (per output and block: the exact integer dot, then block_step in block order) over 64
// rows by 64 columns (four warps of 32 × 32), one m16n8k32 step per block, its weight
// fragment decoded straight from the staged raw block (codes4 at 4t and 16 + 4t), so no
// unpacked copy of the codes and no shared-memory round trip for them.
template <int F>
__device__ __forceinline__ void mmqw32_impl(const u8* w0, const u8* w1, const u8* w2, int n0, int n1, int n2,
                                            float* o0, float* o1, float* o2, const float* b0, const float* b1,
                                            const float* b2, const i8* qs, const float* ad, int k, int m,
                                            int mode) {
    const bool PAIR = (mode & 3) == 2;
    const int BB = Meta<F>::BB;
    const int RS = Rs32<F>::V;
    const int STAGE = Mmqw32Smem<F>::STAGE;
    const bool MIN = F == F_Q4_1 || F == F_Q5_1;
    extern __shared__ __align__(16) u8 smem[];
    if (dynamic_smem_bytes() < Mmqw32Smem<F>::BYTES) __trap();
    float* s_d = (float*)(smem + 2 * STAGE);
    float* s_m = s_d + MMQ_N * 8;        // Q4_1 and Q5_1 only
    int* s_as = (int*)(s_m + MMQ_N * 8);  // Q4_1 and Q5_1 only
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int g = lane >> 2, tq = lane & 3;
    const u8* w;
    float* out;
    const float* bias;
    int n;
    int t = mmq_pick(PAIR, w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, &w, &out, &bias, &n);
    int col0 = t * MMQ_N, r0 = blockIdx.y * MMQW_M;
    int nb = k / 32;
    int wr = (warp & 1) * 32, wc = (warp >> 1) * 32;
    float acc[2][4][4], accg[2][4][4];
    for (int h = 0; h < (PAIR ? 2 : 1); h++) {
        const u8* wm = h ? w1 : w;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[mi][a][i] = 0.0f;
        mmqw32_issue<F>(smem, wm, qs, ad, col0, n, r0, m, k, nb, 0, tid);
        cp_async_commit();
        for (int b0s = 0, st = 0; b0s < nb; b0s += 8, st ^= 1) {
            int nbl = min(8, nb - b0s);
            // The next stage goes in flight while this one is computed.
            if (b0s + 8 < nb) mmqw32_issue<F>(smem + (st ^ 1) * STAGE, wm, qs, ad, col0, n, r0, m, k, nb, b0s + 8, tid);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            const u8* s_raw = smem + st * STAGE;
            const i8* s_a = (const i8*)(s_raw + MMQ_N * RS);
            const float* s_da = (const float*)(s_a + MMQW_M * MMQ_LD);
            for (int i = tid; i < MMQ_N * 8; i += MMQ_THREADS) {
                int c = i >> 3, j = i & 7;
                if (j >= nbl) continue;
                int col = min(col0 + c, n - 1);
                const u8* blk = s_raw + c * RS + (int)((size_t)(wm + ((size_t)col * nb + b0s) * BB) & 15) + j * BB;
                s_d[i] = block_d<F>(blk);
                if (MIN) s_m[i] = block_m<F>(blk);
            }
            if (MIN) {
                for (int i = tid; i < MMQW_M * 8; i += MMQ_THREADS) {
                    int r = i >> 3, j = i & 7;
                    if (j >= nbl) continue;
                    const int* a4 = (const int*)(s_a + r * MMQ_LD + j * 32);
                    int s = 0;
#pragma unroll
                    for (int u = 0; u < 8; u++) s = __dp4a(0x01010101, a4[u], s);
                    s_as[i] = s;
                }
            }
            __syncthreads();
            // Where this thread's four fragment columns' first blocks landed.
            const u8* cb[4];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                int c = wc + 8 * a + g;
                int col = min(col0 + c, n - 1);
                cb[a] = s_raw + c * RS + (int)((size_t)(wm + ((size_t)col * nb + b0s) * BB) & 15);
            }
#pragma unroll 2
            for (int j = 0; j < nbl; j++) {
                int af[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const i8* ra = s_a + (wr + 16 * mi + g) * MMQ_LD + 32 * j + 4 * tq;
                    af[mi][0] = *(const int*)ra;
                    af[mi][1] = *(const int*)(ra + 8 * MMQ_LD);
                    af[mi][2] = *(const int*)(ra + 16);
                    af[mi][3] = *(const int*)(ra + 8 * MMQ_LD + 16);
                }
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    const u8* blk = cb[a] + j * BB;
                    int bf0 = codes4<F>(blk, 4 * tq);
                    int bf1 = codes4<F>(blk, 16 + 4 * tq);
                    if (Off<F>::V) {
                        bf0 = (int)__vsub4((u32)bf0, (u32)Off<F>::V * 0x01010101u);
                        bf1 = (int)__vsub4((u32)bf1, (u32)Off<F>::V * 0x01010101u);
                    }
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) {
                        int d[4];
                        mma_s8_32(d, af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf0, bf1);
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            int c = wc + 8 * a + 2 * tq + (i & 1);
                            int r = wr + 16 * mi + g + 8 * (i >> 1);
                            acc[mi][a][i] = block_step<F>(acc[mi][a][i], s_d[c * 8 + j], MIN ? s_m[c * 8 + j] : 0.0f,
                                                          s_da[r * 8 + j], d[i], MIN ? s_as[r * 8 + j] : 0);
                        }
                    }
                }
            }
            __syncthreads();  // every read of this stage is done before it is refilled
        }
        if (PAIR && h == 0) {
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int i = 0; i < 4; i++) accg[mi][a][i] = acc[mi][a][i];
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
        mmq_store(acc[mi], accg[mi], out, bias, n, m, r0 + wr + 16 * mi + g, col0 + wc + 2 * tq, mode);
}

#define MMQ32(name, F) \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS) name(MATMUL_ARGS) { \
        mmq32_impl<F>(w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, qs, ad, k, m, mode); \
    }
MMQ32(mmq_q4_0, F_Q4_0)
MMQ32(mmq_q4_1, F_Q4_1)
MMQ32(mmq_q5_0, F_Q5_0)
MMQ32(mmq_q5_1, F_Q5_1)
MMQ32(mmq_q8_0, F_Q8_0)
#define MMQW32(name, F) \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQW_CTAS) name(MATMUL_ARGS) { \
        mmqw32_impl<F>(w0, w1, w2, n0, n1, n2, o0, o1, o2, b0, b1, b2, qs, ad, k, m, mode); \
    }
MMQW32(mmqw_q4_0, F_Q4_0)
MMQW32(mmqw_q4_1, F_Q4_1)
MMQW32(mmqw_q5_0, F_Q5_0)
MMQW32(mmqw_q5_1, F_Q5_1)
MMQW32(mmqw_q8_0, F_Q8_0)

// ---- matrix-vector products (one activation row: decode) ------------------------------
//
// The same canonical arithmetic as matmul_q_impl with MT = 1 (per weight row: exact integer
// block sums, then the float steps block by block in order), organised for one row:
//   - each weight row belongs to one group of GL lanes, which runs its blocks in order and
//     reduces each block's integer sums inside the group: no broadcast of block sums across
//     the warp, G = 32 / GL rows per warp at a time;
//   - up to three matrices of quantized formats sharing one block length in one launch (q,
//     k, v of a Q4_K_M file are Q4_K, Q4_K, Q6_K);
//   - the CTA makes the activation row itself in its prologue: from the f32 row `x` (staged
//     in shared memory), optionally RMS-normalized with weight `nw` first (the operations of
//     norm_quant and quantize_acts, so every CTA gets the bits those kernels write), or
//     copies pre-quantized codes when `x` is null;
//   - persistent warps: warp gw of GW takes row groups gw, gw + GW, ..., each in units of
//     up to cb blocks per row staged through a ring of two shared buffers with cp.async, the
//     next unit's copy in flight while the current one is computed. The first two units are
//     issued before the kernel waits for the one before it (programmatic dependent launch),
//     so weight reads overlap the previous kernel's tail and this one's prologue.
// mode & 3: 0 store (+ bias), 1 accumulate into the output (residual), 2 gate/up pair
// (w0 gate, w1 up, out = silu(gate) * up). The benchmark's unordered flag (mode & 4) does not
// apply: a row's blocks run in order in one lane group at no extra cost.

__device__ __forceinline__ int fmt_bl(int f) { return f >= F_Q2_K ? 256 : 32; }
__device__ __forceinline__ int fmt_bb(int f) {
    switch (f) {
        case F_Q4_0: return 18;
        case F_Q4_1: return 20;
        case F_Q5_0: return 22;
        case F_Q5_1: return 24;
        case F_Q8_0: return 34;
        case F_Q2_K: return 84;
        case F_Q3_K: return 110;
        case F_Q4_K: return 144;
        case F_Q5_K: return 176;
        default: return 210;
    }
}

// Element i of a three-element array with constant indices only (no local memory).
#define PICK(a, i) ((i) == 0 ? (a)[0] : ((i) == 1 ? (a)[1] : (a)[2]))

// The matvec prologue, called once the first weight units are issued: loads the norm weight
// values of the warp's first activation block (block = warp index; weights, not the kernel
// before's output, so before the wait), waits for the kernel before (programmatic dependent
// launch), then puts the activation row into shared memory as codes sq and block scales sd.
// From an f32 row x (optionally RMS-normalized with weight nw first): the operations of
// norm_quant and quantize_acts, so every CTA gets the bits those kernels write; the row is
// read with plain loads (not cp.async, whose groups complete in order: waiting for the row
// would wait for the weight units issued before it), so the norm and quantizer run while
// the weights are still arriving. Without x, the pre-quantized codes qs and scales ad are
// copied. Ends with a barrier.
__device__ __forceinline__ void mv_prologue(const float* x, const float* nw, float eps, const i8* qs,
                                            const float* ad, int k, int bla, i8* sq, float* sd, float* sx) {
    __shared__ float s_inv;
    const int nwarps = blockDim.x >> 5;
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nba = k / bla;
    float nwv[8];
#pragma unroll
    for (int u = 0; u < 8; u++) {
        int i = lane + 32 * u;
        nwv[u] = nw && i < bla && wib < nba ? nw[(size_t)wib * bla + i] : 0.0f;
    }
    pdl_wait();
    if (x) {
        for (int i = threadIdx.x; i < k / 4; i += blockDim.x)
            *(float4*)(sx + 4 * i) = __ldcg((const float4*)(x + 4 * i));
    } else {
        for (int i = threadIdx.x; i < k / 16; i += blockDim.x)
            *(int4*)(sq + 16 * i) = __ldcg((const int4*)(qs + 16 * i));
        for (int i = threadIdx.x; i < nba; i += blockDim.x) sd[i] = __ldcg(ad + i);
        __syncthreads();
        return;
    }
    __syncthreads();
    float inv = 0.0f;
    if (nw) {
        if (wib == 0) {
            float ss = row_sumsq(sx, k, lane);
            float mean = __fdiv_rn(ss, (float)k);
            float iv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
            if (lane == 0) s_inv = iv;
        }
        __syncthreads();
        inv = s_inv;
    }
    for (int b = wib; b < nba; b += nwarps) {
        const float* xb = sx + (size_t)b * bla;
        float v[8];
        u32 amax = 0;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = lane + 32 * u;
            if (i < bla) {
                float y = xb[i];
                if (nw) y = __fmul_rn(__fmul_rn(y, inv), b == wib ? nwv[u] : nw[(size_t)b * bla + i]);
                v[u] = y;
                amax = max(amax, __float_as_uint(y) & 0x7fffffffu);
            }
        }
        for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float a = __uint_as_float(amax);
        float dd = __fdiv_rn(a, 127.0f);
        float id = a == 0.0f ? 0.0f : __fdiv_rn(127.0f, a);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = lane + 32 * u;
            if (i < bla) {
                float y = __fmul_rn(v[u], id);
                y = y < 127.0f ? y : 127.0f;
                y = y > -127.0f ? y : -127.0f;
                sq[(size_t)b * bla + i] = (i8)(int)rintf(y);
            }
        }
        if (lane == 0) sd[b] = dd;
    }
    __syncthreads();
}

// The codes of SEG consecutive values from e0 of block blk, four per word (codes4). For
// Q4_K's 32-value segments (one sub-block: 32 contiguous bytes, one nibble of each) the
// address and the nibble's shift are worked out once, not per word.
template <int F, int SEG>
__device__ __forceinline__ void lane_codes(const u8* blk, int e0, int* cw) {
    if (F == F_Q4_K && SEG == 32) {
        const u32* base = (const u32*)(blk + 16 + 32 * (e0 >> 6));
        int sh = (e0 & 32) ? 4 : 0;
#pragma unroll
        for (int w4 = 0; w4 < SEG / 4; w4++) cw[w4] = (int)((base[w4] >> sh) & 0x0F0F0F0Fu);
    } else {
#pragma unroll
        for (int w4 = 0; w4 < SEG / 4; w4++) cw[w4] = codes4<F>(blk, e0 + 4 * w4);
    }
}

// block_step with the block's products and sums made beforehand: p = d * da, pm = m * da
// (each rounded, as block_step rounds them), fi = (float)is, fm = (float)ms. The same bits
// as block_step; lets the lane group that owns a block do the multiplications before its
// values are broadcast.
template <int F>
__device__ __forceinline__ float block_step_pre(float acc, float p, float pm, float fi, float fm) {
    acc = fmaf(p, fi, acc);
    if (F == F_Q4_1 || F == F_Q5_1) {
        acc = fmaf(pm, fm, acc);
    } else if (F == F_Q2_K || F == F_Q4_K || F == F_Q5_K) {
        acc = fmaf(-pm, fm, acc);
    }
    return acc;
}

// One staged unit of a lane group's row: cn blocks starting at block bbase, in block order,
// into acc (acc2: the up row of a pair). The GL lanes of the group split each block's
// values (exact integer sums, reduced inside the group), then every lane of the group runs
// the block's float step.
template <int F, int PAIR>
__device__ __forceinline__ void mv_rows(const u8* s0, const u8* s1, int cn, int bbase, const i8* sq,
                                        const float* sd, float& acc, float& acc2) {
    const int BL = Meta<F>::BL, BB = Meta<F>::BB, SL = Meta<F>::SL;
    const int GL = BL == 32 ? 4 : 8;
    const int EPL = BL / GL;
    const int SEG = EPL < SL ? EPL : SL;
    const int NSEG = EPL / SEG;
    const bool MIN1 = F == F_Q4_1 || F == F_Q5_1;
    const bool MINK = F == F_Q2_K || F == F_Q4_K || F == F_Q5_K;
    int gl = (threadIdx.x & 31) % GL;
    for (int q = 0; q < cn; q++) {
        int b = bbase + q;
        float da = sd[b];
#pragma unroll
        for (int half = 0; half < (PAIR ? 2 : 1); half++) {
            const u8* blk = (half ? s1 : s0) + (size_t)q * BB;
            int isum = 0, msum = 0;
#pragma unroll
            for (int sg = 0; sg < NSEG; sg++) {
                int e0 = gl * EPL + sg * SEG;
                int sc, mn;
                sub_scale<F>(blk, e0 / SL, &sc, &mn);
                int cw[SEG / 4];
                lane_codes<F, SEG>(blk, e0, cw);
                const int* a4 = (const int*)(sq + (size_t)b * BL + e0);
                int dot = 0, asum = 0;
#pragma unroll
                for (int w4 = 0; w4 < SEG / 4; w4++) {
                    int av = a4[w4];
                    dot = __dp4a(cw[w4], av, dot);
                    if (Off<F>::V || MIN1 || MINK) asum = __dp4a(0x01010101, av, asum);
                }
                if (Off<F>::V) dot -= Off<F>::V * asum;
                isum += sc * dot;
                msum += MIN1 ? asum : mn * asum;
            }
#pragma unroll
            for (int o = GL / 2; o > 0; o >>= 1) {
                isum += __shfl_xor_sync(0xffffffffu, isum, o);
                if (MIN1 || MINK) msum += __shfl_xor_sync(0xffffffffu, msum, o);
            }
            float& a = half ? acc2 : acc;
            a = block_step<F>(a, block_d<F>(blk), block_m<F>(blk), da, isum, msum);
        }
    }
}

// The block-parallel matvec (rows of few, long blocks: each warp one row at a time, GL
// lanes per block and G = 32 / GL blocks of the row in flight, the float steps broadcast
// across the warp in block order, as matmul_q_impl).
// One staged unit (cn blocks starting at block bbase of the row) into acc (acc2: the up row
// of a pair).
template <int F, int PAIR>
__device__ __forceinline__ void mv_unit(const u8* s0, const u8* s1, int cn, int bbase, const i8* sq,
                                        const float* sd, int unordered, float& acc, float& acc2) {
    const int BL = Meta<F>::BL, BB = Meta<F>::BB, SL = Meta<F>::SL;
    const int GL = BL == 32 ? 4 : 8;
    const int G = 32 / GL;
    const int EPL = BL / GL;
    const int SEG = EPL < SL ? EPL : SL;
    const int NSEG = EPL / SEG;
    const bool MIN1 = F == F_Q4_1 || F == F_Q5_1;
    const bool MINK = F == F_Q2_K || F == F_Q4_K || F == F_Q5_K;
    int lane = threadIdx.x & 31, g = lane / GL, gl = lane % GL;
    for (int q0 = 0; q0 < cn; q0 += G) {
        int qb = q0 + g;
        int b = bbase + qb;
        bool valid = qb < cn;
#pragma unroll
        for (int half = 0; half < (PAIR ? 2 : 1); half++) {
            const u8* blk = (half ? s1 : s0) + (size_t)qb * BB;
            int isum = 0, msum = 0;
            float d = 0.0f, mm = 0.0f;
            if (valid) {
#pragma unroll
                for (int sg = 0; sg < NSEG; sg++) {
                    int e0 = gl * EPL + sg * SEG;
                    int sc, mn;
                    sub_scale<F>(blk, e0 / SL, &sc, &mn);
                    int cw[SEG / 4];
                    lane_codes<F, SEG>(blk, e0, cw);
                    const int* a4 = (const int*)(sq + (size_t)b * BL + e0);
                    int dot = 0, asum = 0;
#pragma unroll
                    for (int w4 = 0; w4 < SEG / 4; w4++) {
                        int av = a4[w4];
                        dot = __dp4a(cw[w4], av, dot);
                        asum = __dp4a(0x01010101, av, asum);
                    }
                    if (Off<F>::V) dot -= Off<F>::V * asum;
                    isum += sc * dot;
                    msum += MIN1 ? asum : mn * asum;
                }
                d = block_d<F>(blk);
                mm = block_m<F>(blk);
            }
#pragma unroll
            for (int o = GL / 2; o > 0; o >>= 1) {
                isum += __shfl_xor_sync(0xffffffffu, isum, o);
                if (MIN1 || MINK) msum += __shfl_xor_sync(0xffffffffu, msum, o);
            }
            float& a = half ? acc2 : acc;
            if (unordered) {
                if (valid) a = block_step<F>(a, d, mm, sd[b], isum, msum);
                continue;
            }
            // Each group's products and sums first, then the steps in block order.
            float da = valid ? sd[b] : 0.0f;
            float p = __fmul_rn(d, da), pm = __fmul_rn(mm, da);
            float fi = (float)isum, fm = (float)msum;
#pragma unroll
            for (int gg = 0; gg < G; gg++) {
                int src = gg * GL;
                float pg = __shfl_sync(0xffffffffu, p, src);
                float fig = __shfl_sync(0xffffffffu, fi, src);
                float pmg = 0.0f, fmg = 0.0f;
                if (MIN1 || MINK) {
                    pmg = __shfl_sync(0xffffffffu, pm, src);
                    fmg = __shfl_sync(0xffffffffu, fm, src);
                }
                float na = block_step_pre<F>(a, pg, pmg, fig, fmg);
                a = q0 + gg < cn ? na : a;
            }
        }
    }
}

template <int FA, int FB, int PAIR>
__device__ __forceinline__ void matvec_impl_b(const u8* w0, const u8* w1, const u8* w2, int f0, int f1,
                                            int f2, int n0, int n1, int n2, float* o0, float* o1,
                                            float* o2, const float* b0, const float* b1,
                                            const float* b2, const float* x, const float* nw, float eps,
                                            const i8* qs, const float* ad, int k, int bla, int mode,
                                            int sb) {
    extern __shared__ __align__(16) u8 smem[];
    const int nwarps = blockDim.x >> 5;
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int unordered = (mode & 4) != 0;
    int acc_mode = mode & 3;
    int nba = k / bla;
    i8* sq = (i8*)smem;
    float* sd = (float*)(smem + ((k + 15) & ~15));
    float* sx = (float*)(smem + ((k + 15) & ~15) + ((nba * 4 + 15) & ~15));
    int sa = ((k + 15) & ~15) + ((nba * 4 + 15) & ~15) + (x ? 4 * k : 0);
    u8* ring = smem + sa + (size_t)wib * sb * 2 * (PAIR ? 2 : 1);
    int total = PAIR ? n0 : n0 + n1 + n2;
    int gw = blockIdx.x * nwarps + wib, GW = gridDim.x * nwarps;
    // Per matrix (up to three): format, blocks per row, bytes per block, blocks per unit and
    // units per row, worked out once so that a unit's bookkeeping has no division (with one
    // format, FA = FB, the format is a constant).
    int fm[3], nbm[3], bbm[3], cbm[3], num[3];
#pragma unroll
    for (int i = 0; i < 3; i++) {
        int f = FA == FB ? FA : (i == 0 ? f0 : (i == 1 ? f1 : f2));
        fm[i] = f;
        bbm[i] = fmt_bb(f);
        nbm[i] = k / fmt_bl(f);
        cbm[i] = (sb - 32) / bbm[i];
        num[i] = (nbm[i] + cbm[i] - 1) / cbm[i];
    }
    const u8* wm[3] = {w0, w1, w2};
    auto mat = [&](int t) { return (PAIR || t < n0) ? 0 : (t < n0 + n1 ? 1 : 2); };
    // Row t of the launch: its weight row, row inside its matrix, format, blocks per unit,
    // units per row, bytes per block and blocks per row.
    auto locate = [&](int t, const u8*& w, int& f, int& j, int& cb, int& nu, int& bb, int& nb) {
        int i = mat(t);
        j = t - (i == 0 ? 0 : (i == 1 ? n0 : n0 + n1));
        f = PICK(fm, i);
        cb = PICK(cbm, i);
        nu = PICK(num, i);
        bb = PICK(bbm, i);
        nb = PICK(nbm, i);
        w = PICK(wm, i) + (size_t)j * nb * bb;
    };
    auto issue = [&](int t, int c, int slot) {
        if (t < total) {
            const u8* w;
            int f, j, cb, nu, bb, nb;
            locate(t, w, f, j, cb, nu, bb, nb);
            int c0 = c * cb, cn = min(cb, nb - c0);
            u8* dst = ring + (size_t)slot * sb * (PAIR ? 2 : 1);
            stage_issue(dst, w + (size_t)c0 * bb, cn * bb, lane);
            if (PAIR) stage_issue(dst + sb, w1 + (w - w0) + (size_t)c0 * bb, cn * bb, lane);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    auto next = [&](int& t, int& c) {
        if (t >= total) return;
        if (c + 1 < PICK(num, mat(t))) c++;
        else { t += GW; c = 0; }
    };
    // The first two weight units and the norm weights (weights only: before waiting for the
    // kernel before), then mv_prologue waits and makes the activation row (from the f32 row,
    // 16-byte aligned with k a multiple of 4, or from its codes).
    pdl_trigger();
    int t = gw, c = 0;
    int t1 = t, c1 = c;
    next(t1, c1);
    issue(t, c, 0);
    issue(t1, c1, 1);
    mv_prologue(x, nw, eps, qs, ad, k, bla, sq, sd, sx);
    float acc = 0.0f, acc2 = 0.0f;
    int slot = 0;
    while (t < total) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        const u8* w;
        int f, j, cb, nu, bb, nb;
        locate(t, w, f, j, cb, nu, bb, nb);
        int c0 = c * cb, cn = min(cb, nb - c0);
        const u8* src = w + (size_t)c0 * bb;
        int off = (int)((size_t)src & 15);
        const u8* s0 = ring + (size_t)slot * sb * (PAIR ? 2 : 1) + off;
        const u8* s1 = s0 + sb;
        if (PAIR) s1 = ring + (size_t)slot * sb * 2 + sb + (int)((size_t)(w1 + (w - w0) + (size_t)c0 * bb) & 15);
        if (FA == FB || f == FA) mv_unit<FA, PAIR>(s0, s1, cn, c0, sq, sd, unordered, acc, acc2);
        else mv_unit<FB, PAIR>(s0, s1, cn, c0, sq, sd, unordered, acc, acc2);
        if (c + 1 == nu) {
            if (unordered) {
                int gl = fmt_bl(f) == 32 ? 4 : 8;
                for (int o = gl; o < 32; o <<= 1) {
                    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
                    acc2 = __fadd_rn(acc2, __shfl_xor_sync(0xffffffffu, acc2, o));
                }
            }
            if (lane == 0) {
                float* out = PAIR || t < n0 ? o0 : (t < n0 + n1 ? o1 : o2);
                const float* bias = PAIR || t < n0 ? b0 : (t < n0 + n1 ? b1 : b2);
                float vv = acc;
                if (PAIR) {
                    vv = __fmul_rn(canon_silu(acc), acc2);
                } else {
                    if (bias) vv = __fadd_rn(vv, bias[j]);
                    if (acc_mode == 1) vv = __fadd_rn(out[j], vv);
                }
                out[j] = vv;
            }
            acc = 0.0f;
            acc2 = 0.0f;
        }
        __syncwarp();
        // The unit two ahead goes into the buffer just read.
        int t2 = t1, c2 = c1;
        next(t2, c2);
        issue(t2, c2, slot);
        t = t1; c = c1;
        t1 = t2; c1 = c2;
        slot ^= 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}


#define MV_THREADS 256

// The matvec kernel body. Lanes: groups of GL (4 for 32-value blocks, 8 for 256-value
// blocks), each group one weight row (G = 32 / GL rows per warp at a time); a warp's unit is
// G consecutive rows of one matrix, cb blocks of each (rows longer than a unit take
// several, in block order). Units go through a ring of two shared buffers per warp (G row
// chunks of rs bytes each, twice for a gate/up pair).

template <int FA, int FB, int PAIR>
__device__ __forceinline__ void matvec_impl(const u8* w0, const u8* w1, const u8* w2, int f0, int f1,
                                            int f2, int n0, int n1, int n2, float* o0, float* o1,
                                            float* o2, const float* b0, const float* b1,
                                            const float* b2, const float* x, const float* nw, float eps,
                                            const i8* qs, const float* ad, int k, int bla, int mode,
                                            int rs) {
    extern __shared__ __align__(16) u8 smem[];
    const int nwarps = blockDim.x >> 5;
    const int GL = Meta<FA>::BL == 32 ? 4 : 8;  // FB has the same block length
    const int G = 32 / GL;
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int grp = lane / GL, gl = lane % GL;
    int acc_mode = mode & 3;
    int nba = k / bla;
    // Shared memory: codes (k), scales (k / bla), with an f32 input row the row itself (k
    // floats), then each warp's ring.
    i8* sq = (i8*)smem;
    float* sd = (float*)(smem + ((k + 15) & ~15));
    float* sx = (float*)(smem + ((k + 15) & ~15) + ((nba * 4 + 15) & ~15));
    int sa = ((k + 15) & ~15) + ((nba * 4 + 15) & ~15) + (x ? 4 * k : 0);
    const int ub = G * rs * (PAIR ? 2 : 1);  // bytes of one unit
    u8* ring = smem + sa + (size_t)wib * ub * 2;
    // Per matrix: format, blocks per row, row bytes, blocks per unit, units per row, row groups.
    int nm = PAIR ? 1 : (n2 > 0 ? 3 : (n1 > 0 ? 2 : 1));
    int fm[3] = {f0, f1, f2}, nn[3] = {n0, n1, n2};
    int nbm[3], rbm[3], cbm[3], num[3], ngm[3];
#pragma unroll
    for (int i = 0; i < 3; i++) {
        int bb = fmt_bb(fm[i]);
        nbm[i] = k / fmt_bl(fm[i]);
        rbm[i] = nbm[i] * bb;
        cbm[i] = (rs - 32) / bb;
        num[i] = (nbm[i] + cbm[i] - 1) / cbm[i];
        ngm[i] = i < nm ? (nn[i] + G - 1) / G : 0;
    }
    int total = ngm[0] + ngm[1] + ngm[2];  // row groups
    int gw = blockIdx.x * nwarps + wib, GW = gridDim.x * nwarps;
    // Row group t: its matrix i and first row j0.
    auto locate = [&](int t, int& i, int& j0) {
        i = t < ngm[0] ? 0 : (t < ngm[0] + ngm[1] ? 1 : 2);
        j0 = (t - (i == 0 ? 0 : (i == 1 ? ngm[0] : ngm[0] + ngm[1]))) * G;
    };
    const u8* wm[3] = {w0, w1, w2};
    auto issue = [&](int t, int c, int slot) {
        if (t < total) {
            int i, j0;
            locate(t, i, j0);
            int bb = fmt_bb(PICK(fm, i));
            int c0 = c * PICK(cbm, i), cn = min(PICK(cbm, i), PICK(nbm, i) - c0);
            u8* dst = ring + (size_t)slot * ub;
            for (int g = 0; g < G && j0 + g < PICK(nn, i); g++) {
                size_t o = (size_t)(j0 + g) * PICK(rbm, i) + (size_t)c0 * bb;
                stage_issue(dst + g * rs, PICK(wm, i) + o, cn * bb, lane);
                if (PAIR) stage_issue(dst + (G + g) * rs, w1 + o, cn * bb, lane);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    auto next = [&](int& t, int& c) {
        if (t >= total) return;
        int i, j0;
        locate(t, i, j0);
        if (c + 1 < PICK(num, i)) c++;
        else { t += GW; c = 0; }
    };
    // The first two weight units and the norm weights (weights only: before waiting for the
    // kernel before), then mv_prologue waits and makes the activation row (from the f32 row,
    // 16-byte aligned with k a multiple of 4, or from its codes).
    pdl_trigger();
    int t = gw, c = 0;
    int t1 = t, c1 = c;
    next(t1, c1);
    issue(t, c, 0);
    issue(t1, c1, 1);
    mv_prologue(x, nw, eps, qs, ad, k, bla, sq, sd, sx);
    float acc = 0.0f, acc2 = 0.0f;
    int slot = 0;
    while (t < total) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        int i, j0;
        locate(t, i, j0);
        int f = PICK(fm, i), bb = fmt_bb(f);
        int c0 = c * PICK(cbm, i), cn = min(PICK(cbm, i), PICK(nbm, i) - c0);
        int row = j0 + grp;
        size_t o = (size_t)min(row, PICK(nn, i) - 1) * PICK(rbm, i) + (size_t)c0 * bb;
        const u8* s0 = ring + (size_t)slot * ub + grp * rs + (int)((size_t)(PICK(wm, i) + o) & 15);
        const u8* s1 = PAIR ? ring + (size_t)slot * ub + (G + grp) * rs + (int)((size_t)(w1 + o) & 15) : s0;
        if (FA == FB || f == FA) mv_rows<FA, PAIR>(s0, s1, cn, c0, sq, sd, acc, acc2);
        else mv_rows<FB, PAIR>(s0, s1, cn, c0, sq, sd, acc, acc2);
        if (c + 1 == PICK(num, i)) {
            if (gl == 0 && row < PICK(nn, i)) {
                float* out = i == 0 ? o0 : (i == 1 ? o1 : o2);
                const float* bias = i == 0 ? b0 : (i == 1 ? b1 : b2);
                float vv = acc;
                if (PAIR) {
                    vv = __fmul_rn(canon_silu(acc), acc2);
                } else {
                    if (bias) vv = __fadd_rn(vv, bias[row]);
                    if (acc_mode == 1) vv = __fadd_rn(out[row], vv);
                }
                out[row] = vv;
            }
            acc = 0.0f;
            acc2 = 0.0f;
        }
        __syncwarp();
        // The unit two ahead goes into the buffer just read.
        int t2 = t1, c2 = c1;
        next(t2, c2);
        issue(t2, c2, slot);
        t = t1; c = c1;
        t1 = t2; c1 = c2;
        slot ^= 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

#define MATVEC_ARGS const u8 *w0, const u8 *w1, const u8 *w2, int f0, int f1, int f2, int n0, int n1, \
    int n2, float *o0, float *o1, float *o2, const float *b0, const float *b1, const float *b2, const float *x, \
    const float *nw, float eps, const i8 *qs, const float *ad, int k, int bla, int mode, int rs
#define MATVEC_PASS w0, w1, w2, f0, f1, f2, n0, n1, n2, o0, o1, o2, b0, b1, b2, x, nw, eps, qs, ad, k, bla, \
    mode, rs
// One kernel per format (FA = FB), and for the K-quant mixes of *_K_M files (FA for the
// first matrices, FB for the third: q, k in Q4_K with v in Q6_K).
#define MATVEC(name, FA, FB) \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, 3) name(MATVEC_ARGS) { \
        if ((mode & 3) == 2) matvec_impl_b<FA, FB, 1>(MATVEC_PASS); \
        else matvec_impl_b<FA, FB, 0>(MATVEC_PASS); \
    } \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, 3) name##_rows(MATVEC_ARGS) { \
        if ((mode & 3) == 2) matvec_impl<FA, FB, 1>(MATVEC_PASS); \
        else matvec_impl<FA, FB, 0>(MATVEC_PASS); \
    }
MATVEC(matvec_q4_0, F_Q4_0, F_Q4_0)
MATVEC(matvec_q4_1, F_Q4_1, F_Q4_1)
MATVEC(matvec_q5_0, F_Q5_0, F_Q5_0)
MATVEC(matvec_q5_1, F_Q5_1, F_Q5_1)
MATVEC(matvec_q8_0, F_Q8_0, F_Q8_0)
MATVEC(matvec_q2_k, F_Q2_K, F_Q2_K)
MATVEC(matvec_q3_k, F_Q3_K, F_Q3_K)
MATVEC(matvec_q4_k, F_Q4_K, F_Q4_K)
MATVEC(matvec_q5_k, F_Q5_K, F_Q5_K)
MATVEC(matvec_q6_k, F_Q6_K, F_Q6_K)
MATVEC(matvec_q4_k_q6_k, F_Q4_K, F_Q6_K)
MATVEC(matvec_q5_k_q6_k, F_Q5_K, F_Q6_K)

// ---- matvec on tensor cores (Q4_K, Q6_K and their mix) ----------------------------------
//
// The arithmetic of matvec_impl (per output: acc = 0, then for each 256-value block in block
// order the exact integer sums isum = sum_j sc_j * dot_j and msum = sum_j mn_j * asum_j, then
// block_step), with the sub-block dot products dot_j of 16 weight rows at once from an int8
// tensor-core step: the weights are the A operand (16 rows), the activation row the B operand,
// the same row in all eight columns, so every lane's C fragment holds its two rows' dots
// whatever its column. Q4_K: one m16n8k32 step per 32-value sub-block (its codes are the low
// or high nibbles of 32 consecutive bytes); Q6_K: one m16n8k16 step per 16-value sub-block,
// its codes + 32 (0..63) as unsigned bytes against the signed activation codes, and
// sum_j sc_j * 32 * asum_j taken off after (an exact integer identity). Lane (g, t) (g =
// lane / 4, t = lane % 4) holds rows g and g + 8 of the warp's 16; a unit is 16 consecutive
// rows of one matrix, cb blocks of each, through the two-buffer ring of matvec_impl. The
// prologue also sums the activation codes of each 16-value sub-block (asum, exact).
#define TC_G 16

// mma m16n8k32 (.s8 x .s8) and m16n8k16 (.u8 x .s8), C = 0, without `volatile` (no side
// effects: the compiler may schedule them); fragments as mma_s8_32 and mma_s8_16.
__device__ __forceinline__ void tc_mma_k32(int* d, int a0, int a1, int a2, int a3, int b0, int b1) {
#if __CUDA_ARCH__ < 800
    __trap();
#else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
#endif
}
__device__ __forceinline__ void tc_mma_u8_k16(int* d, int a0, int a1, int b0) {
#if __CUDA_ARCH__ < 800
    __trap();
#else
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
#endif
}

// Q4_K's eight 6-bit scales and mins of one block (scale_min_k4 for every j), packed a byte
// each: s[0] the scales of sub-blocks 0..3, s[1] of 4..7, s[2] and s[3] the mins. Bytes
// 4 .. 15 of the block, read as three words (Q4_K blocks sit 4-byte aligned here, as
// codes4<F_Q4_K> assumes).
__device__ __forceinline__ void tc_scales_q4k(const u8* b, u32* s) {
    u32 w0 = *(const u32*)(b + 4), w1 = *(const u32*)(b + 8), w2 = *(const u32*)(b + 12);
    s[0] = w0 & 0x3f3f3f3fu;
    s[1] = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    s[2] = w1 & 0x3f3f3f3fu;
    s[3] = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
}

// One Q4_K block of rows g (bg) and g + 8 (bh) against the activation block of B row g (qa:
// 256 codes; zero where !bok) with the sub-block sums (16 values each) of the lane's
// activation rows r0 = 2 tq and r1 = 2 tq + 1 (a0s, a1s; with MR = 1 one row, in every
// column): the canonical step into acc = {(r0, g), (r0, g + 8), (r1, g), (r1, g + 8)}.
// tc_sums_q4k gives the step's exact integer sums (is, ms in acc's order), tc_block_q4k
// the step.
template <int MR>
__device__ __forceinline__ void tc_sums_q4k(const u8* bg, const u8* bh, const i8* qa, bool bok, const int* a0s,
                                            const int* a1s, int tq, int* is, int* ms) {
    const u32 M4 = 0x0f0f0f0fu;
    u32 sg[4], sh[4];
    tc_scales_q4k(bg, sg);
    tc_scales_q4k(bh, sh);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        is[e] = 0;
        ms[e] = 0;
    }
#pragma unroll
    for (int p = 0; p < 4; p++) {
        // Sub-blocks 2p and 2p + 1: the low and high nibbles of code bytes 32p .. 32p + 31.
        const u8* qg = bg + 16 + 32 * p + 4 * tq;
        const u8* qh = bh + 16 + 32 * p + 4 * tq;
        u32 wg0 = *(const u32*)qg, wg1 = *(const u32*)(qg + 16);
        u32 wh0 = *(const u32*)qh, wh1 = *(const u32*)(qh + 16);
        const i8* a = qa + 64 * p + 4 * tq;
        int b00 = 0, b01 = 0, b10 = 0, b11 = 0;
        if (MR == 1 || bok) {
            b00 = *(const int*)a;
            b01 = *(const int*)(a + 16);
            b10 = *(const int*)(a + 32);
            b11 = *(const int*)(a + 48);
        }
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            int sh4 = 4 * hi;
            int d[4];
            tc_mma_k32(d, (int)((wg0 >> sh4) & M4), (int)((wh0 >> sh4) & M4), (int)((wg1 >> sh4) & M4),
                       (int)((wh1 >> sh4) & M4), hi ? b10 : b00, hi ? b11 : b01);
            int sc_g = (int)((sg[p >> 1] >> (16 * (p & 1) + 8 * hi)) & 0xffu);
            int sc_h = (int)((sh[p >> 1] >> (16 * (p & 1) + 8 * hi)) & 0xffu);
            is[0] += sc_g * d[0];
            is[1] += sc_h * d[2];
            if (MR > 1) {
                is[2] += sc_g * d[1];
                is[3] += sc_h * d[3];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int mn_g = (int)((sg[2 + (j >> 2)] >> (8 * (j & 3))) & 0xffu);
        int mn_h = (int)((sh[2 + (j >> 2)] >> (8 * (j & 3))) & 0xffu);
        int a0 = a0s[2 * j] + a0s[2 * j + 1];
        ms[0] += mn_g * a0;
        ms[1] += mn_h * a0;
        if (MR > 1) {
            int a1 = a1s[2 * j] + a1s[2 * j + 1];
            ms[2] += mn_g * a1;
            ms[3] += mn_h * a1;
        }
    }
}
template <int MR>
__device__ __forceinline__ void tc_block_q4k(const u8* bg, const u8* bh, const i8* qa, bool bok, const int* a0s,
                                             const int* a1s, int tq, float da0, float da1, float* acc) {
    int is[4], ms[4];
    tc_sums_q4k<MR>(bg, bh, qa, bok, a0s, a1s, tq, is, ms);
    float dg = ld_f16(bg), mg = ld_f16(bg + 2), dh = ld_f16(bh), mh = ld_f16(bh + 2);
    acc[0] = block_step<F_Q4_K>(acc[0], dg, mg, da0, is[0], ms[0]);
    acc[1] = block_step<F_Q4_K>(acc[1], dh, mh, da0, is[1], ms[1]);
    if (MR > 1) {
        acc[2] = block_step<F_Q4_K>(acc[2], dg, mg, da1, is[2], ms[2]);
        acc[3] = block_step<F_Q4_K>(acc[3], dh, mh, da1, is[3], ms[3]);
    }
}

// Lane tq's code words of one Q6_K block (2-byte aligned): for sub-block j (16 values) the
// four codes + 32 at values 4 tq .. 4 tq + 3, as code_at's layout (h = j / 8, quarter =
// (j / 2) % 4, l = 16 (j % 2) + 4 tq): low bits from ql[64 h + 32 (quarter % 2) + l], nibble
// quarter / 2; high bits from qh[32 h + l], bits 2 quarter and 2 quarter + 1.
__device__ __forceinline__ void tc_codes_q6k(const u8* b, int tq, u32* c) {
    u32 ql[2][2][2], qh[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int jo = 0; jo < 2; jo++) {
            qh[h][jo] = ld_u32_2(b + 128 + 32 * h + 16 * jo + 4 * tq);
#pragma unroll
            for (int q1 = 0; q1 < 2; q1++) ql[h][q1][jo] = ld_u32_2(b + 64 * h + 32 * q1 + 16 * jo + 4 * tq);
        }
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int h = j >> 3, quarter = (j >> 1) & 3, jo = j & 1;
        u32 lo = (ql[h][quarter & 1][jo] >> (4 * (quarter >> 1))) & 0x0f0f0f0fu;
        u32 hi = ((qh[h][jo] >> (2 * quarter)) & 0x03030303u) << 4;
        c[j] = lo | hi;
    }
}

// One Q6_K block of rows g (bg) and g + 8 (bh), operands as tc_block_q4k: its exact
// integer sums (the offset of 32 taken off; no min sums) into is in acc's order.
template <int MR>
__device__ __forceinline__ void tc_sums_q6k(const u8* bg, const u8* bh, const i8* qa, bool bok, const int* a0s,
                                            const int* a1s, int tq, int* isum) {
    u32 cg[16], ch[16];
    tc_codes_q6k(bg, tq, cg);
    tc_codes_q6k(bh, tq, ch);
    int is[4] = {0, 0, 0, 0}, os[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int bv = (MR == 1 || bok) ? *(const int*)(qa + 16 * j + 4 * tq) : 0;
        int d[4];
        tc_mma_u8_k16(d, (int)cg[j], (int)ch[j], bv);
        int sc_g = (int)(i8)bg[192 + j], sc_h = (int)(i8)bh[192 + j];
        is[0] += sc_g * d[0];
        is[1] += sc_h * d[2];
        os[0] += sc_g * a0s[j];
        os[1] += sc_h * a0s[j];
        if (MR > 1) {
            is[2] += sc_g * d[1];
            is[3] += sc_h * d[3];
            os[2] += sc_g * a1s[j];
            os[3] += sc_h * a1s[j];
        }
    }
#pragma unroll
    for (int e = 0; e < 4; e++) isum[e] = is[e] - 32 * os[e];
}
template <int MR>
__device__ __forceinline__ void tc_block_q6k(const u8* bg, const u8* bh, const i8* qa, bool bok, const int* a0s,
                                             const int* a1s, int tq, float da0, float da1, float* acc) {
    int is[4];
    tc_sums_q6k<MR>(bg, bh, qa, bok, a0s, a1s, tq, is);
    float dg = ld_f16(bg + 208), dh = ld_f16(bh + 208);
    acc[0] = block_step<F_Q6_K>(acc[0], dg, 0.0f, da0, is[0], 0);
    acc[1] = block_step<F_Q6_K>(acc[1], dh, 0.0f, da0, is[1], 0);
    if (MR > 1) {
        acc[2] = block_step<F_Q6_K>(acc[2], dg, 0.0f, da1, is[2], 0);
        acc[3] = block_step<F_Q6_K>(acc[3], dh, 0.0f, da1, is[3], 0);
    }
}

template <int F, int MR>
__device__ __forceinline__ void tc_block(const u8* bg, const u8* bh, const i8* qa, bool bok, const int* a0s,
                                         const int* a1s, int tq, float da0, float da1, float* acc) {
    if (F == F_Q4_K) tc_block_q4k<MR>(bg, bh, qa, bok, a0s, a1s, tq, da0, da1, acc);
    else tc_block_q6k<MR>(bg, bh, qa, bok, a0s, a1s, tq, da0, da1, acc);
}

// The kernel body: arguments and launch modes as matvec_impl (bla = 256); rs is the bytes
// staged per row and unit. MR = 1: one activation row (an f32 row normalized and quantized
// in the prologue, or its codes), in every B column. MR = 8: m = mode >> 8 rows (1 to 8) of
// codes and scales, row r in B column r, outputs out[r * n + j]. Shared memory: codes (m rows
// of k), block scales (m rows of k / 256), with an f32 input row the row itself (k floats),
// the sub-block sums (m rows of k / 16 ints), then each warp's ring of two units (16 row
// chunks of rs bytes, twice for a gate/up pair).
// The tensor-core matvec kernels' unit lookup: group t of the up-to-three matrices' 16-row
// groups (ngm each, in matrix order) is matrix i's rows j0 .. j0 + 15.
__device__ __forceinline__ void tc_locate(const int* ngm, int t, int& i, int& j0) {
    i = t < ngm[0] ? 0 : (t < ngm[0] + ngm[1] ? 1 : 2);
    j0 = (t - (i == 0 ? 0 : (i == 1 ? ngm[0] : ngm[0] + ngm[1]))) * TC_G;
}

// The m activation rows' codes and block scales (made by the kernel before) into shared
// memory. Ends with a barrier.
__device__ __forceinline__ void tc_copy_rows(i8* sq, float* sd, const i8* qs, const float* ad, int m, int k,
                                             int nba) {
    pdl_wait();
    for (int i = threadIdx.x; i < m * k / 16; i += blockDim.x)
        *(int4*)(sq + 16 * i) = __ldcg((const int4*)(qs + 16 * i));
    for (int i = threadIdx.x; i < m * nba; i += blockDim.x) sd[i] = __ldcg(ad + i);
    __syncthreads();
}

// Each 16-value sub-block's code sum for the m rows in shared memory (s_as[row * nsb + j]).
// Ends with a barrier.
__device__ __forceinline__ void tc_code_sums(int* s_as, const i8* sq, int m, int nsb) {
    for (int i = threadIdx.x; i < m * nsb; i += blockDim.x) {
        const int* a4 = (const int*)(sq + 16 * i);
        int s = 0;
#pragma unroll
        for (int u = 0; u < 4; u++) s = __dp4a(a4[u], 0x01010101, s);
        s_as[i] = s;
    }
    __syncthreads();
}

template <int FA, int FB, int PAIR, int MR>
__device__ __forceinline__ void matvec_impl_tc(const u8* w0, const u8* w1, const u8* w2, int f0, int f1, int f2,
                                               int n0, int n1, int n2, float* o0, float* o1, float* o2,
                                               const float* b0, const float* b1, const float* b2, const float* x,
                                               const float* nw, float eps, const i8* qs, const float* ad, int k,
                                               int bla, int mode, int rs) {
    extern __shared__ __align__(16) u8 smem[];
    const int nwarps = blockDim.x >> 5;
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, tq = lane & 3;
    int acc_mode = mode & 3;
    int m = MR == 1 ? 1 : (mode >> 8) & 15;
    int nba = k / bla;
    int nsb = k / 16;
    i8* sq = (i8*)smem;
    size_t o_sd = ((size_t)m * k + 15) & ~(size_t)15;
    float* sd = (float*)(smem + o_sd);
    size_t o_sx = o_sd + (((size_t)m * nba * 4 + 15) & ~(size_t)15);
    float* sx = (float*)(smem + o_sx);
    size_t o_as = o_sx + (MR == 1 && x ? 4 * (size_t)k : 0);
    int* s_as = (int*)(smem + o_as);
    size_t sa = o_as + (((size_t)m * nsb * 4 + 15) & ~(size_t)15);
    const int ub = TC_G * rs * (PAIR ? 2 : 1);
    u8* ring = smem + sa + (size_t)wib * ub * 2;
    int nm = PAIR ? 1 : (n2 > 0 ? 3 : (n1 > 0 ? 2 : 1));
    int fm[3] = {f0, f1, f2}, nn[3] = {n0, n1, n2};
    int nbm[3], rbm[3], cbm[3], num[3], ngm[3];
#pragma unroll
    for (int i = 0; i < 3; i++) {
        int bb = fmt_bb(fm[i]);
        nbm[i] = nba;
        rbm[i] = nbm[i] * bb;
        cbm[i] = (rs - 32) / bb;
        num[i] = (nbm[i] + cbm[i] - 1) / cbm[i];
        ngm[i] = i < nm ? (nn[i] + TC_G - 1) / TC_G : 0;
    }
    int total = ngm[0] + ngm[1] + ngm[2];
    int gw = blockIdx.x * nwarps + wib, GW = gridDim.x * nwarps;
    auto locate = [&](int t, int& i, int& j0) { tc_locate(ngm, t, i, j0); };
    const u8* wm[3] = {w0, w1, w2};
    auto issue = [&](int t, int c, int slot) {
        if (t < total) {
            int i, j0;
            locate(t, i, j0);
            int bb = fmt_bb(PICK(fm, i));
            int c0 = c * PICK(cbm, i), cn = min(PICK(cbm, i), PICK(nbm, i) - c0);
            u8* dst = ring + (size_t)slot * ub;
            for (int r = 0; r < TC_G && j0 + r < PICK(nn, i); r++) {
                size_t o = (size_t)(j0 + r) * PICK(rbm, i) + (size_t)c0 * bb;
                stage_issue(dst + r * rs, PICK(wm, i) + o, cn * bb, lane);
                if (PAIR) stage_issue(dst + (TC_G + r) * rs, w1 + o, cn * bb, lane);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    auto next = [&](int& t, int& c) {
        if (t >= total) return;
        int i, j0;
        locate(t, i, j0);
        if (c + 1 < PICK(num, i)) c++;
        else { t += GW; c = 0; }
    };
    pdl_trigger();
    int t = gw, c = 0;
    int t1 = t, c1 = c;
    next(t1, c1);
    issue(t, c, 0);
    issue(t1, c1, 1);
    if (MR == 1) mv_prologue(x, nw, eps, qs, ad, k, bla, sq, sd, sx);
    else tc_copy_rows(sq, sd, qs, ad, m, k, nba);
    tc_code_sums(s_as, sq, m, nsb);
    // This lane's activation rows: B column g's (its codes), and the C columns 2 tq, 2 tq + 1
    // (their sums and scales); rows past m read row m - 1 (never stored) or zeros (B).
    bool bok = g < m;
    int rb_ = MR == 1 ? 0 : min(g, m - 1);
    int r0 = MR == 1 ? 0 : min(2 * tq, m - 1), r1 = MR == 1 ? 0 : min(2 * tq + 1, m - 1);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, up[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int slot = 0;
    while (t < total) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncwarp();
        int i, j0;
        locate(t, i, j0);
        int f = PICK(fm, i), bb = fmt_bb(f);
        int n = PICK(nn, i);
        int c0 = c * PICK(cbm, i), cn = min(PICK(cbm, i), PICK(nbm, i) - c0);
        size_t rb = (size_t)PICK(rbm, i);
        const u8* wb = PICK(wm, i);
        size_t og = (size_t)min(j0 + g, n - 1) * rb + (size_t)c0 * bb;
        size_t oh = (size_t)min(j0 + g + 8, n - 1) * rb + (size_t)c0 * bb;
        const u8* u0 = ring + (size_t)slot * ub;
        const u8* sg = u0 + g * rs + (int)((size_t)(wb + og) & 15);
        const u8* sh = u0 + (g + 8) * rs + (int)((size_t)(wb + oh) & 15);
        const u8* pg = u0 + (TC_G + g) * rs + (int)((size_t)(w1 + og) & 15);
        const u8* ph = u0 + (TC_G + g + 8) * rs + (int)((size_t)(w1 + oh) & 15);
        for (int bi = 0; bi < cn; bi++) {
            int b = c0 + bi;
            const i8* qa = sq + (size_t)rb_ * k + (size_t)b * 256;
            const int* a0s = s_as + (size_t)r0 * nsb + b * 16;
            const int* a1s = s_as + (size_t)r1 * nsb + b * 16;
            float da0 = sd[r0 * nba + b], da1 = sd[r1 * nba + b];
            if (FA == FB || f == FA)
                tc_block<FA, MR>(sg + bi * bb, sh + bi * bb, qa, bok, a0s, a1s, tq, da0, da1, acc);
            else
                tc_block<FB, MR>(sg + bi * bb, sh + bi * bb, qa, bok, a0s, a1s, tq, da0, da1, acc);
            if (PAIR) tc_block<FA, MR>(pg + bi * bb, ph + bi * bb, qa, bok, a0s, a1s, tq, da0, da1, up);
        }
        if (c + 1 == PICK(num, i)) {
            float* out = i == 0 ? o0 : (i == 1 ? o1 : o2);
            const float* bias = i == 0 ? b0 : (i == 1 ? b1 : b2);
            // MR = 1: lane (g, 0) stores row g, lane (g, 1) row g + 8 (every lane of a row
            // group holds both). MR = 8: each lane its four (activation row, row) outputs.
#pragma unroll
            for (int e = 0; e < (MR == 1 ? 1 : 4); e++) {
                int ei = MR == 1 ? tq : e;
                int row = j0 + g + 8 * (ei & 1);
                int ar = MR == 1 ? 0 : 2 * tq + (e >> 1);
                if ((MR > 1 || tq < 2) && row < n && ar < m) {
                    float* o = out + (size_t)ar * n + row;
                    float vv = ei == 0 ? acc[0] : (ei == 1 ? acc[1] : (ei == 2 ? acc[2] : acc[3]));
                    if (PAIR) {
                        float u = ei == 0 ? up[0] : (ei == 1 ? up[1] : (ei == 2 ? up[2] : up[3]));
                        vv = __fmul_rn(canon_silu(vv), u);
                    } else {
                        if (bias) vv = __fadd_rn(vv, bias[row]);
                        if (acc_mode == 1) vv = __fadd_rn(*o, vv);
                    }
                    *o = vv;
                }
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[e] = 0.0f;
                up[e] = 0.0f;
            }
        }
        __syncwarp();
        int t2 = t1, c2 = c1;
        next(t2, c2);
        issue(t2, c2, slot);
        t = t1; c = c1;
        t1 = t2; c1 = c2;
        slot ^= 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// `_tc`: one activation row (the decode step's matvecs); `_tc8`: up to eight rows of codes
// (verify blocks and batched decode), the row count in mode >> 8.
#define MATVEC_TC(name, FA, FB) \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, 1) name##_tc(MATVEC_ARGS) { \
        if ((mode & 3) == 2) matvec_impl_tc<FA, FB, 1, 1>(MATVEC_PASS); \
        else matvec_impl_tc<FA, FB, 0, 1>(MATVEC_PASS); \
    } \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, 1) name##_tc8(MATVEC_ARGS) { \
        if ((mode & 3) == 2) matvec_impl_tc<FA, FB, 1, 8>(MATVEC_PASS); \
        else matvec_impl_tc<FA, FB, 0, 8>(MATVEC_PASS); \
    }
MATVEC_TC(matvec_q4_k, F_Q4_K, F_Q4_K)
MATVEC_TC(matvec_q6_k, F_Q6_K, F_Q6_K)
MATVEC_TC(matvec_q4_k_q6_k, F_Q4_K, F_Q6_K)

// ---- tensor-core matvec of a few rows, a row group's blocks over a CTA's warps (`_tcs8`) ----
//
// `_tc8` gives a warp a whole 16-row group and all its blocks: one warp per sixteen rows, so
// the down projection of the 1.5B shape (1,536 rows of 35 blocks) runs on 96 warps, too few
// to keep the weight loads in flight. Here a CTA takes one 16-row group at a time and its W
// warps take the group's blocks b = w, w + W, ...: each computes the exact integer sums of
// its blocks for the 16 weight rows and up to eight activation rows (the same tensor-core
// steps as `_tc8`, tc_sums_*) and writes them, with each weight row's block scale and min,
// to shared memory. After one barrier, thread c < 16 m runs the float steps of (weight row c
// % 16, activation row c / 16) in block order (block_step on those values), so the bits are
// those of every other matmul kernel. Two buffers of sums, by group parity: a thread chains
// group k before it reaches the barrier that ends group k + 1, so nobody writes group k + 2's
// sums over them too early. A warp's units are (group, block) pairs in order, through a
// two-slot cp.async ring of 16 row blocks (twice for a gate/up pair).

// Lane (g, tq)'s sums of one block into red (16 weight rows by 8 activation rows: entry
// 8 row + column) and, from lanes tq < 2, rows g and g + 8's scale and min into dm.
template <int F>
__device__ __forceinline__ void tcs8_block(const u8* bg, const u8* bh, const i8* qa, bool bok, const int* a0s,
                                           const int* a1s, int g, int tq, int m, int2* red, float2* dm) {
    int is[4], ms[4] = {0, 0, 0, 0};
    if (F == F_Q4_K) tc_sums_q4k<8>(bg, bh, qa, bok, a0s, a1s, tq, is, ms);
    else tc_sums_q6k<8>(bg, bh, qa, bok, a0s, a1s, tq, is);
    int c0 = 2 * tq, c1 = 2 * tq + 1;
    if (c0 < m) {
        red[8 * g + c0] = make_int2(is[0], ms[0]);
        red[8 * (g + 8) + c0] = make_int2(is[1], ms[1]);
    }
    if (c1 < m) {
        red[8 * g + c1] = make_int2(is[2], ms[2]);
        red[8 * (g + 8) + c1] = make_int2(is[3], ms[3]);
    }
    if (tq < 2) {
        const u8* b = tq ? bh : bg;
        dm[g + 8 * tq] = make_float2(block_d<F>(b), block_m<F>(b));
    }
}

// One output's float steps in block order from the shared sums (row r of the group,
// activation row a).
template <int F>
__device__ __forceinline__ float tcs8_chain(const int2* red, const float2* dm, const float* sd, int nba, int r,
                                            int a) {
    float acc = 0.0f;
    for (int bk = 0; bk < nba; bk++) {
        int2 e = red[(size_t)bk * 128 + 8 * r + a];
        float2 s = dm[(size_t)bk * 16 + r];
        acc = block_step<F>(acc, s.x, s.y, sd[a * nba + bk], e.x, e.y);
    }
    return acc;
}

// The kernel body: arguments and launch modes as matvec_impl_tc with MR = 8 (m = mode >> 8
// rows of codes and scales, bla = 256); rs is the ring's bytes per row block (at least the
// largest block plus 30). Shared memory: codes (m rows of k), block scales (m rows of k /
// 256), the sub-block sums (m rows of k / 16 ints), two buffers of sums (int2, k / 256
// blocks by 16 by 8, twice for a pair) and of scales and mins (float2, k / 256 blocks by 16,
// twice for a pair), then each warp's two-slot ring (16 row blocks of rs bytes, twice for a
// pair).
template <int FA, int FB, int PAIR>
__device__ __forceinline__ void matvec_impl_tcs8(const u8* w0, const u8* w1, const u8* w2, int f0, int f1, int f2,
                                                 int n0, int n1, int n2, float* o0, float* o1, float* o2,
                                                 const float* b0, const float* b1, const float* b2, const i8* qs,
                                                 const float* ad, int k, int mode, int rs) {
    extern __shared__ __align__(16) u8 smem[];
    const int W = blockDim.x >> 5;
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, tq = lane & 3;
    int acc_mode = mode & 3;
    int m = (mode >> 8) & 15;
    int nba = k / 256;
    int nsb = k / 16;
    const int NP = PAIR ? 2 : 1;
    i8* sq = (i8*)smem;
    size_t o_sd = ((size_t)m * k + 15) & ~(size_t)15;
    float* sd = (float*)(smem + o_sd);
    size_t o_as = o_sd + (((size_t)m * nba * 4 + 15) & ~(size_t)15);
    int* s_as = (int*)(smem + o_as);
    size_t o_red = o_as + (((size_t)m * nsb * 4 + 15) & ~(size_t)15);
    int2* s_red = (int2*)(smem + o_red);  // [2][NP][nba][16][8]
    size_t red_half = (size_t)NP * nba * 128;
    size_t o_dm = o_red + 2 * red_half * sizeof(int2);
    float2* s_dm = (float2*)(smem + o_dm);  // [2][NP][nba][16]
    size_t dm_half = (size_t)NP * nba * 16;
    size_t o_ring = o_dm + 2 * dm_half * sizeof(float2);
    const int ub = TC_G * rs * NP;
    u8* ring = smem + o_ring + (size_t)wib * ub * 2;
    int nm = PAIR ? 1 : (n2 > 0 ? 3 : (n1 > 0 ? 2 : 1));
    int fm[3] = {f0, f1, f2}, nn[3] = {n0, n1, n2};
    int ngm[3];
#pragma unroll
    for (int i = 0; i < 3; i++) ngm[i] = i < nm ? (nn[i] + TC_G - 1) / TC_G : 0;
    int total = ngm[0] + ngm[1] + ngm[2];
    auto locate = [&](int t, int& i, int& j0) { tc_locate(ngm, t, i, j0); };
    const u8* wm[3] = {w0, w1, w2};
    // This warp's units: (group t, block b), b = wib, wib + W, ... of each of the CTA's groups.
    auto issue = [&](int t, int b, int slot) {
        if (t < total) {
            int i, j0;
            locate(t, i, j0);
            int bb = fmt_bb(PICK(fm, i));
            size_t rb = (size_t)nba * bb;
            u8* dst = ring + (size_t)slot * ub;
            for (int r = 0; r < TC_G && j0 + r < PICK(nn, i); r++) {
                size_t o = (size_t)(j0 + r) * rb + (size_t)b * bb;
                stage_issue(dst + r * rs, PICK(wm, i) + o, bb, lane);
                if (PAIR) stage_issue(dst + (TC_G + r) * rs, w1 + o, bb, lane);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    auto next = [&](int& t, int& b) {
        if (t >= total) return;
        b += W;
        if (b >= nba) {
            t += gridDim.x;
            b = wib;
        }
    };
    pdl_trigger();
    // A warp past the last block of every group (W > nba) has no units.
    int t = wib < nba ? (int)blockIdx.x : total, b = wib;
    int t1 = t, u1 = b;
    next(t1, u1);
    issue(t, b, 0);
    issue(t1, u1, 1);
    // The rows' codes and scales (made by the kernel before), then each sub-block's code sum.
    tc_copy_rows(sq, sd, qs, ad, m, k, nba);
    tc_code_sums(s_as, sq, m, nsb);
    // This lane's activation rows: B column g's (its codes), and the C columns 2 tq, 2 tq + 1
    // (their sums); rows past m read row m - 1 (never stored) or zeros (B).
    bool bok = g < m;
    int rb_ = min(g, m - 1);
    int r0 = min(2 * tq, m - 1), r1 = min(2 * tq + 1, m - 1);
    int slot = 0, par = 0, gi = 0;
    for (int tg = blockIdx.x; tg < total; tg += gridDim.x, par ^= 1, gi++) {
        int i, j0;
        locate(tg, i, j0);
        int f = PICK(fm, i), bb = fmt_bb(f);
        int n = PICK(nn, i);
        size_t rb = (size_t)nba * bb;
        const u8* wb = PICK(wm, i);
        int2* red = s_red + (size_t)par * red_half;
        float2* dmb = s_dm + (size_t)par * dm_half;
        // This warp's blocks of group tg (its units come in this order).
        while (t == tg) {
            asm volatile("cp.async.wait_group 1;" ::: "memory");
            __syncwarp();
            size_t og = (size_t)min(j0 + g, n - 1) * rb + (size_t)b * bb;
            size_t oh = (size_t)min(j0 + g + 8, n - 1) * rb + (size_t)b * bb;
            const u8* u0 = ring + (size_t)slot * ub;
            const u8* sg = u0 + g * rs + (int)((size_t)(wb + og) & 15);
            const u8* sh = u0 + (g + 8) * rs + (int)((size_t)(wb + oh) & 15);
            const i8* qa = sq + (size_t)rb_ * k + (size_t)b * 256;
            const int* a0s = s_as + (size_t)r0 * nsb + b * 16;
            const int* a1s = s_as + (size_t)r1 * nsb + b * 16;
            int2* rr = red + (size_t)b * 128;
            float2* dd = dmb + (size_t)b * 16;
            if (FA == FB || f == FA) tcs8_block<FA>(sg, sh, qa, bok, a0s, a1s, g, tq, m, rr, dd);
            else tcs8_block<FB>(sg, sh, qa, bok, a0s, a1s, g, tq, m, rr, dd);
            if (PAIR) {
                const u8* pg = u0 + (TC_G + g) * rs + (int)((size_t)(w1 + og) & 15);
                const u8* ph = u0 + (TC_G + g + 8) * rs + (int)((size_t)(w1 + oh) & 15);
                tcs8_block<FA>(pg, ph, qa, bok, a0s, a1s, g, tq, m, rr + (size_t)nba * 128,
                               dd + (size_t)nba * 16);
            }
            __syncwarp();
            int t2 = t1, u2 = u1;
            next(t2, u2);
            issue(t2, u2, slot);
            t = t1; b = u1;
            t1 = t2; u1 = u2;
            slot ^= 1;
        }
        __syncthreads();
        // The float steps in block order: chain c = 16 a + r (row j0 + r, activation row a),
        // starting from a different warp each group (a CTA of fewer than 16 m threads takes
        // several).
        int c0 = (int)((threadIdx.x + blockDim.x - (unsigned)((gi % W) * 32)) % blockDim.x);
        for (int c = c0; c < 16 * m; c += blockDim.x) {
            int r = c & 15, a = c >> 4;
            int row = j0 + r;
            if (row < n) {
                float vv = FA == FB || f == FA ? tcs8_chain<FA>(red, dmb, sd, nba, r, a)
                                               : tcs8_chain<FB>(red, dmb, sd, nba, r, a);
                float* out = i == 0 ? o0 : (i == 1 ? o1 : o2);
                const float* bias = i == 0 ? b0 : (i == 1 ? b1 : b2);
                float* o = out + (size_t)a * n + row;
                if (PAIR) {
                    float u = tcs8_chain<FA>(red + (size_t)nba * 128, dmb + (size_t)nba * 16, sd, nba, r, a);
                    vv = __fmul_rn(canon_silu(vv), u);
                } else {
                    if (bias) vv = __fadd_rn(vv, bias[row]);
                    if (acc_mode == 1) vv = __fadd_rn(*o, vv);
                }
                *o = vv;
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

#define MATVEC_TCS8(name, FA, FB) \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, 1) name##_tcs8(MATVEC_ARGS) { \
        if ((mode & 3) == 2) matvec_impl_tcs8<FA, FB, 1>(w0, w1, w2, f0, f1, f2, n0, n1, n2, o0, o1, o2, b0, b1, b2, \
                                                         qs, ad, k, mode, rs); \
        else matvec_impl_tcs8<FA, FB, 0>(w0, w1, w2, f0, f1, f2, n0, n1, n2, o0, o1, o2, b0, b1, b2, qs, ad, k, \
                                         mode, rs); \
    }
MATVEC_TCS8(matvec_q4_k, F_Q4_K, F_Q4_K)
MATVEC_TCS8(matvec_q6_k, F_Q6_K, F_Q6_K)
MATVEC_TCS8(matvec_q4_k_q6_k, F_Q4_K, F_Q6_K)

// Float weights: one sequential fma chain over K per output (quant::scalar::dot). One
// thread per (column, row). kind 0 = f32, 1 = f16, 2 = bf16.
extern "C" __global__ void matmul_float(const u8* w, const float* x, float* out, int n, int k, int m, int kind) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y;
    if (j >= n || r >= m) return;
    const float* xr = x + (size_t)r * k;
    float acc = 0.0f;
    if (kind == 0) {
        const float* wr = (const float*)w + (size_t)j * k;
        for (int i = 0; i < k; i++) acc = fmaf(wr[i], xr[i], acc);
    } else if (kind == 1) {
        const u16* wr = (const u16*)w + (size_t)j * k;
        for (int i = 0; i < k; i++) acc = fmaf(f16_to_f32(wr[i]), xr[i], acc);
    } else {
        const u16* wr = (const u16*)w + (size_t)j * k;
        for (int i = 0; i < k; i++) acc = fmaf(__uint_as_float(((u32)wr[i]) << 16), xr[i], acc);
    }
    out[(size_t)r * n + j] = acc;
}

// ---- row ops ------------------------------------------------------------------------

// RMSNorm (backend_cpu::Kernels::rms_norm, plain weight): one warp per row. The sum of
// squares is canon::dot(x, x): 16 lane partials (element i in lane i % 16), then tree16.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int n, float eps) {
    int row = blockIdx.x, lane = threadIdx.x;
    const float* xr = x + (size_t)row * n;
    float* o = out + (size_t)row * n;
    float ss = row_sumsq(xr, n, lane);
    float mean = __fdiv_rn(ss, (float)n);
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int i = lane; i < n; i += 32) o[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}

// RMSNorm fused with the activation quantizer: grid (k / bl, rows), one warp per (block,
// row). Every warp computes the row's sum of squares exactly as rms_norm does (so every
// warp gets the same bits), writes its block of the normalized row to `out` and quantizes
// it as quantize_acts does.
//
// With `staged` the warp first copies the row into dynamic shared memory (n floats, n a
// multiple of 4), so the 16 lane chains below wait on no global load.
extern "C" __global__ void norm_quant(const float* x, const float* w, float* out, int n, float eps,
                                      int bl, i8* qs, float* d, int staged) {
    extern __shared__ __align__(16) float s_row[];
    int b = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    const float* xr = x + (size_t)row * n;
    if (staged) {
        for (int i = lane; i < n / 4; i += 32) cp_async16(s_row + 4 * i, xr + 4 * i);
        cp_async_wait_all();
        __syncwarp();
        xr = s_row;
    }
    float ss = row_sumsq(xr, n, lane);
    float mean = __fdiv_rn(ss, (float)n);
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    float* o = out + (size_t)row * n + (size_t)b * bl;
    const float* xb = xr + (size_t)b * bl;
    const float* wb = w + (size_t)b * bl;
    u32 amax = 0;
    for (int i = lane; i < bl; i += 32) {
        float v = __fmul_rn(__fmul_rn(xb[i], inv), wb[i]);
        o[i] = v;
        amax = max(amax, __float_as_uint(v) & 0x7fffffffu);
    }
    for (int s = 16; s > 0; s >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, s));
    float a = __uint_as_float(amax);
    float dd = __fdiv_rn(a, 127.0f);
    float id = a == 0.0f ? 0.0f : __fdiv_rn(127.0f, a);
    i8* qb = qs + (size_t)row * n + (size_t)b * bl;
    for (int i = lane; i < bl; i += 32) {
        float v = __fmul_rn(__fmul_rn(__fmul_rn(xb[i], inv), wb[i]), id);
        v = v < 127.0f ? v : 127.0f;
        v = v > -127.0f ? v : -127.0f;
        qb[i] = (i8)(int)rintf(v);
    }
    if (lane == 0) d[(size_t)row * (n / bl) + b] = dd;
}

// RoPE of q and k fused with the KV-cache write: one thread per (row, head of q or k, pair
// slot p < head_dim / 2). Slots below dims / 2 rotate their pair (as `rope`); the others
// carry the unrotated tail. k heads and v go to the cache as f16 (see "paged KV cache" below); q stays
// in place.
extern "C" __global__ void rope_kv(float* q, const float* k, const float* v, u16* kc, u16* vc,
                                   const int* pos, const int* phys, const float* cos_t,
                                   const float* sin_t, int rows, int n_head, int n_kv, int head_dim,
                                   int dims, int neox, int bsz) {
    pdl_trigger();
    pdl_wait();
    int hp = head_dim / 2, half = dims / 2;
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long per_row = (long)(n_head + n_kv) * hp + (long)n_kv * head_dim;
    if (t >= (long)rows * per_row) return;
    int r = (int)(t / per_row);
    int u = (int)(t % per_row);
    int p = pos[r];
    if (u >= (n_head + n_kv) * hp) {
        // v: one element.
        int c = u - (n_head + n_kv) * hp;
        int h = c / head_dim, i = c % head_dim;
        size_t dst = (((size_t)phys[r] * n_kv + h) * bsz + (p % bsz)) * head_dim + i;
        vc[dst] = f32_to_f16(v[(size_t)r * n_kv * head_dim + c]);
        return;
    }
    int h = u / hp, s = u % hp;
    bool is_k = h >= n_head;
    int kh = h - n_head;
    float* hq = is_k ? nullptr : q + ((size_t)r * n_head + h) * head_dim;
    const float* hk = is_k ? k + ((size_t)r * n_kv + kh) * head_dim : nullptr;
    int a, b;
    float x0, x1;
    if (s < half) {
        a = neox ? s : 2 * s;
        b = neox ? s + half : 2 * s + 1;
        const float* src = is_k ? hk : hq;
        size_t pi = (size_t)p * half + s;
        float c = cos_t[pi], sn = sin_t[pi];
        float y0 = src[a], y1 = src[b];
        x0 = __fsub_rn(__fmul_rn(y0, c), __fmul_rn(y1, sn));
        x1 = __fadd_rn(__fmul_rn(y0, sn), __fmul_rn(y1, c));
    } else {
        a = dims + 2 * (s - half);
        b = a + 1;
        const float* src = is_k ? hk : hq;
        x0 = src[a];
        x1 = src[b];
    }
    if (is_k) {
        size_t base = (((size_t)phys[r] * n_kv + kh) * bsz + (p % bsz)) * head_dim;
        kc[base + a] = f32_to_f16(x0);
        kc[base + b] = f32_to_f16(x1);
    } else if (s < half) {
        hq[a] = x0;
        hq[b] = x1;
    }
}

// x[i] += y[i]
extern "C" __global__ void add_in_place(float* x, const float* y, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = __fadd_rn(x[i], y[i]);
}

// x[r * n + i] += b[i] (biases)
extern "C" __global__ void add_bias(float* x, const float* b, int n, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = __fadd_rn(x[i], b[i % n]);
}

// g[i] = silu(g[i]) * u[i]
extern "C" __global__ void swiglu(float* g, const float* u, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) g[i] = __fmul_rn(canon_silu(g[i]), u[i]);
}

// RoPE over rows of `width` floats (whole heads of head_dim); the first `dims` values of
// each head rotate with cos/sin[pos * (dims / 2) + i]. neox: pairs (i, i + dims/2), else
// (2i, 2i+1). One thread per (row, head, pair).
extern "C" __global__ void rope(float* x, const int* pos, const float* cos_t, const float* sin_t,
                                int rows, int width, int head_dim, int dims, int neox) {
    int half = dims / 2;
    int heads = width / head_dim;
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)rows * heads * half;
    if (t >= total) return;
    int i = (int)(t % half);
    int h = (int)((t / half) % heads);
    int r = (int)(t / ((long)half * heads));
    float* hp = x + (size_t)r * width + (size_t)h * head_dim;
    size_t p = (size_t)pos[r] * half + i;
    float c = cos_t[p], s = sin_t[p];
    int a = neox ? i : 2 * i;
    int b = neox ? i + half : 2 * i + 1;
    float x0 = hp[a], x1 = hp[b];
    hp[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    hp[b] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// ---- paged KV cache -----------------------------------------------------------------
//
// Per layer: K and V, each [blocks][n_kv][bsz][head_dim] f16. Row r writes position
// pos[r] into block phys[r] (the physical block), offset pos % bsz (rope_kv above), as f16
// rounded to nearest even (f32_to_f16, the CPU's conversion).

// Copies `count` u16 values from block `src` to block `dst` (copy-on-write).
extern "C" __global__ void copy_u16(u16* base, long src, long dst, long count) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) base[dst + i] = base[src + i];
}

// Queues the copies of keys [ts, ts + nk) of KV head kvh from the cache(s) (laid out
// [block][n_kv][bsz][head_dim] f16) into the tile(s) at sk and sv (key ts + j at row j):
// the range covers whole blocks but perhaps the first and last, each block's rows one
// contiguous run in the cache, so the block-table entries are loaded eight at a time (the
// same entry in every thread) and then each run copied in 16-byte pieces by threads t, t +
// nt, .... With kc null only V is copied. The copies join the caller's open group.
__device__ __forceinline__ void stage_kv_tile(u16* sk, u16* sv, const u16* kc, const u16* vc, const int* tab,
                                              int ts, int nk, int n_kv, int kvh, int bsz, int head_dim, int t,
                                              int nt) {
    int c_first = ts / bsz, c_last = (ts + nk - 1) / bsz;
    int h8 = head_dim / 8;
    for (int c0 = c_first; c0 <= c_last; c0 += 8) {
        int blk[8];
#pragma unroll
        for (int u = 0; u < 8; u++) blk[u] = c0 + u <= c_last ? tab[c0 + u] : 0;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int c = c0 + u;
            if (c <= c_last) {
                int a = max(ts, c * bsz), e = min(ts + nk, (c + 1) * bsz);
                size_t src = (((size_t)blk[u] * n_kv + kvh) * bsz + (a - c * bsz)) * head_dim;
                size_t dst = (size_t)(a - ts) * head_dim;
                int n16 = (e - a) * h8;
                for (int i = t; i < n16; i += nt) {
                    if (kc) cp_async16(sk + dst + 8 * (size_t)i, kc + src + 8 * (size_t)i);
                    cp_async16(sv + dst + 8 * (size_t)i, vc + src + 8 * (size_t)i);
                }
            }
        }
    }
}

// Attention (backend_cpu::attention::attend_one): one CTA of ATT_THREADS threads per (row,
// query head). Keys are visited in chunks that end at block boundaries, in position order,
// with the CPU's online softmax; the work is split so that only the two sequential chains
// (the running sum l and, per dimension, the V accumulator) run in order, while the rest
// runs in parallel without changing a bit:
//   1. the scores of a span of ATT_SPAN keys (16 threads per key, canon's 16-lane dot and
//      tree16);
//   2. each chunk's max (a max is exact in any order, NaN never wins as in the CPU fold;
//      the sign of a zero max never reaches a result: it only enters s - m and m - m_new
//      under exp, and equal maxima skip the rescale) and the running max after each chunk
//      with its rescale factor, chunk by chunk in order (one thread);
//   3. e[j] = exp(s[j] - m) with the running max of j's chunk;
//   4. the chains, key by key in position order: thread ATT_THREADS - 1 runs l (rescaled
//      where the max moved), threads below head_dim the V accumulators.
// Row r's block table is tables[table_off[r] ..], its last position pos[r].
#define ATT_THREADS 256
#define ATT_SPAN 2048
#define MAX_BSZ 256
#define MAX_HEAD_DIM 512
#define ATT_MAX_CHUNKS (ATT_SPAN / 16 + 2)
// V rows are staged through a ring of ATT_VBUF shared buffers of ATT_VBYTES each,
// ATT_VAHEAD units ahead of the chains (cp.async).
#define ATT_VBUF 4
#define ATT_VAHEAD 3
#define ATT_VBYTES 8192
extern "C" __global__ void attention(const float* q, const u16* kc, const u16* vc, float* out,
                                     const int* pos, const int* table_off, const int* tables,
                                     int n_head, int n_kv, int head_dim, int bsz, float scale) {
    __shared__ float s_q[MAX_HEAD_DIM];
    __shared__ float s_e[ATT_SPAN];
    __shared__ float s_m[ATT_MAX_CHUNKS];
    __shared__ float s_alpha[ATT_MAX_CHUNKS];
    __shared__ int s_tab[ATT_MAX_CHUNKS];
    __shared__ __align__(16) u16 s_v[ATT_VBUF][ATT_VBYTES / 2];
    __shared__ float s_l;
    int r = blockIdx.x / n_head, h = blockIdx.x % n_head;
    int kvh = h / (n_head / n_kv);
    int t = threadIdx.x;
    int warp = t >> 5, wl = t & 31;
    const float* qh = q + ((size_t)r * n_head + h) * head_dim;
    for (int i = t; i < head_dim; i += ATT_THREADS) s_q[i] = qh[i];
    float acc[MAX_HEAD_DIM / ATT_THREADS];
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) acc[c] = 0.0f;
    float m = __uint_as_float(0xff800000u);  // -inf: the running max (thread 0's is used)
    float l = 0.0f;                          // thread ATT_THREADS - 1's is used
    int p = pos[r];
    const int* tab = tables + table_off[r];
    // Spans hold whole blocks.
    int span = (ATT_SPAN / bsz) * bsz;
    // Keys per staged V unit (units never cross a chunk).
    int sk = min(bsz, ATT_VBYTES / (2 * head_dim));
    int upc = (bsz + sk - 1) / sk;
    int n16_row = head_dim / 8;  // 16-byte pieces per V row
    for (int ps = 0; ps <= p; ps += span) {
        int pe = min(ps + span, p + 1);
        int nk = pe - ps;
        int nc = (nk + bsz - 1) / bsz;
        __syncthreads();
        for (int c = t; c < nc; c += ATT_THREADS) s_tab[c] = tab[ps / bsz + c];
        __syncthreads();
        // 1. scores, four keys per 16-thread group at a time. The loop is uniform across
        // the warp (tree16 shuffles need every lane).
        {
            int grp = t >> 4, lane = t & 15;
            const int NG = ATT_THREADS / 16;
            for (int j0 = 0; j0 < nk; j0 += 4 * NG) {
                float part[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    int j = j0 + grp + u * NG;
                    part[u] = 0.0f;
                    if (j < nk) {
                        const u16* kr = kc + (((size_t)s_tab[j / bsz] * n_kv + kvh) * bsz + (ps + j) % bsz) * head_dim;
                        float pa = 0.0f;
#pragma unroll 8
                        for (int i = lane; i < head_dim; i += 16) pa = fmaf(s_q[i], f16_to_f32(kr[i]), pa);
                        part[u] = pa;
                    }
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    int j = j0 + grp + u * NG;
                    float sum = tree16(part[u]);
                    if (lane == 0 && j < nk) s_e[j] = __fmul_rn(sum, scale);
                }
            }
        }
        __syncthreads();
        // 2. chunk maxima (one warp per chunk), then the running max chunk by chunk.
        for (int c = warp; c < nc; c += ATT_THREADS / 32) {
            int a = c * bsz, e = min(a + bsz, nk);
            float cm = __uint_as_float(0xff800000u);
            for (int j = a + wl; j < e; j += 32) {
                float x = s_e[j];
                cm = x > cm ? x : cm;
            }
            for (int o = 16; o > 0; o >>= 1) {
                float y = __shfl_xor_sync(0xffffffffu, cm, o);
                cm = y > cm ? y : cm;
            }
            if (wl == 0) s_m[c] = cm;
        }
        __syncthreads();
        if (t == 0) {
            for (int c = 0; c < nc; c++) {
                float cm = s_m[c];
                float m_new = cm > m ? cm : m;
                // alpha = exp(m - m_new), only where the max moved (NaN marks "unchanged").
                float alpha = 0.0f;
                int moved = m_new != m;
                if (moved) alpha = canon_exp(__fsub_rn(m, m_new));
                m = m_new;
                s_m[c] = m;
                s_alpha[c] = moved ? alpha : __uint_as_float(0x7fc00000u);
            }
        }
        __syncthreads();
        // 3. e[j] = exp(s[j] - m of j's chunk).
        for (int j = t; j < nk; j += ATT_THREADS) s_e[j] = canon_exp(__fsub_rn(s_e[j], s_m[j / bsz]));
        __syncthreads();
        // 4. the chains, unit by unit (sk keys of one chunk), V staged ahead through the ring.
        int nu = nc * upc;
        // Queues (this thread's share of) unit un's V rows into its ring buffer, then closes
        // a copy group (an empty one past the last unit, so every iteration counts alike).
        auto issue_v = [&](int un) {
            if (un < nu) {
                int c = un / upc, ks = c * bsz + (un % upc) * sk, ke = min(min(ks + sk, (c + 1) * bsz), nk);
                if (ks < ke) {
                    const u16* src = vc + (((size_t)s_tab[c] * n_kv + kvh) * bsz + (ks - c * bsz)) * head_dim;
                    int n16 = (ke - ks) * n16_row;
                    for (int i = t; i < n16; i += ATT_THREADS) cp_async16(&s_v[un % ATT_VBUF][8 * i], src + 8 * i);
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
        for (int u = 0; u < ATT_VAHEAD; u++) issue_v(u);
        for (int u = 0; u < nu; u++) {
            asm volatile("cp.async.wait_group 2;" ::: "memory");  // ATT_VAHEAD - 1
            __syncthreads();
            issue_v(u + ATT_VAHEAD);
            int c = u / upc, first = (u % upc) == 0;
            int ks = c * bsz + (u % upc) * sk, ke = min(min(ks + sk, (c + 1) * bsz), nk);
            const u16* sv = s_v[u % ATT_VBUF];
            if (t == ATT_THREADS - 1) {
                if (first) {
                    float al = s_alpha[c];
                    if (al == al) l = __fmul_rn(l, al);
                }
                int j = ks;
                for (; j + 8 <= ke; j += 8) {
                    float ev[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) ev[u] = s_e[j + u];
#pragma unroll
                    for (int u = 0; u < 8; u++) l = __fadd_rn(l, ev[u]);
                }
                for (; j < ke; j++) l = __fadd_rn(l, s_e[j]);
            }
#pragma unroll
            for (int cc = 0; cc < MAX_HEAD_DIM / ATT_THREADS; cc++) {
                int i = t + cc * ATT_THREADS;
                if (i < head_dim) {
                    float av = acc[cc];
                    if (first) {
                        float al = s_alpha[c];
                        if (al == al) av = __fmul_rn(av, al);
                    }
                    // Loads first, then the chain in key order.
                    int j = ks;
                    for (; j + 8 <= ke; j += 8) {
                        float ev[8], vv[8];
                        u16 vh[8];
#pragma unroll
                        for (int u = 0; u < 8; u++) {
                            ev[u] = s_e[j + u];
                            vh[u] = sv[(j + u - ks) * head_dim + i];
                        }
                        f16_to_f32_many(vh, vv);
#pragma unroll
                        for (int u = 0; u < 8; u++) av = fmaf(ev[u], vv[u], av);
                    }
                    for (; j < ke; j++) av = fmaf(s_e[j], f16_to_f32(sv[(j - ks) * head_dim + i]), av);
                    acc[cc] = av;
                }
            }
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();
    if (t == ATT_THREADS - 1) s_l = __fdiv_rn(1.0f, l);
    __syncthreads();
    float inv = s_l;
    float* o = out + ((size_t)r * n_head + h) * head_dim;
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) {
        int i = t + c * ATT_THREADS;
        if (i < head_dim) o[i] = __fmul_rn(acc[c], inv);
    }
}

// Attention in tiles (the same arithmetic as `attention` above, so the same bits): one CTA
// of ATT_THREADS threads per (row, query head); keys in tiles of `tk` positions (whole KV
// blocks, tk a multiple of bsz), each tile's K and V rows copied into shared memory
// together (cp.async), the next tile's copies in flight while the current one is worked.
// Per tile, as `attention` per span: the scores (16 threads per key, canon's 16-lane dot
// and tree16), chunk maxima, the running max chunk by chunk with its rescale factors, the
// exponentials, then the chains in key order (l in thread ATT_THREADS - 1, each V
// accumulator in thread i < head_dim). The tile size only decides what is staged at once:
// the chunk sequence, and so every operation, is that of the CPU's attend_one.
// Dynamic shared memory: two buffers of (K, V) tiles, 4 * tk * head_dim u16 values.
//
// With PRE (attention_tiled_pre, after att_scores below) the scores come from the scratch
// rows att_scores wrote (scores + soff[r] + h * (pos[r] + 1)) instead of being computed
// here: only V tiles are staged (two buffers, 2 * tk * head_dim u16 values), the tile's
// scores copied beside them; every later phase is the same code, so the same bits.
#define ATT_MAX_TK 256

// The running max after each of a tile's nc <= 32 chunks and its rescale factor, in one warp
// (chunk c in lane c), from the chunk maxima in s_m and the running max m before the tile
// (held by every lane, updated to the max after the last chunk). The serial fold m_c =
// (cm_c > m_{c-1} ? cm_c : m_{c-1}) keeps the earlier of equal values and never takes a NaN;
// that operation is associative, so an inclusive scan of the chunk maxima (a NaN read as
// -inf, which never wins either) folded into m gives every m_c with the fold's bits. Then
// each lane's factor exp(m_{c-1} - m_c), NaN marking "unchanged", as the serial loop wrote.
__device__ __forceinline__ void running_max_chunks(float* s_m, float* s_alpha, int nc, float& m, int wl) {
    const float NEG_INF = __uint_as_float(0xff800000u);
    float cm = wl < nc ? s_m[wl] : NEG_INF;
    if (cm != cm) cm = NEG_INF;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        float y = __shfl_up_sync(0xffffffffu, cm, o);
        if (wl >= o) cm = cm > y ? cm : y;
    }
    float m_new = cm > m ? cm : m;
    float prev = __shfl_up_sync(0xffffffffu, m_new, 1);
    if (wl == 0) prev = m;
    int moved = m_new != prev;
    float alpha = moved ? canon_exp(__fsub_rn(prev, m_new)) : __uint_as_float(0x7fc00000u);
    if (wl < nc) {
        s_m[wl] = m_new;
        s_alpha[wl] = alpha;
    }
    m = __shfl_sync(0xffffffffu, m_new, nc - 1);
}
template <bool PRE>
__device__ __forceinline__ void attention_tiled_impl(
    const float* q, const u16* kc, const u16* vc, float* out, const int* pos, const int* table_off,
    const int* tables, int n_head, int n_kv, int head_dim, int bsz, float scale, int tk,
    const float* scores, const int* soff) {
    extern __shared__ __align__(16) u16 s_kv[];
    __shared__ float s_q[MAX_HEAD_DIM];
    __shared__ float s_e2[PRE ? 2 * ATT_MAX_TK : ATT_MAX_TK];
    __shared__ float s_m[ATT_MAX_TK / 16 + 1];
    __shared__ float s_alpha[ATT_MAX_TK / 16 + 1];
    __shared__ float s_l;
    pdl_trigger();
    int r = blockIdx.x / n_head, h = blockIdx.x % n_head;
    int kvh = h / (n_head / n_kv);
    int t = threadIdx.x;
    int warp = t >> 5, wl = t & 31;
    // The step's positions and block tables are copied in before its first kernel, so they
    // are read before the wait for the kernel before (which writes this row's K and V).
    int p = pos[r];
    const int* tab = tables + table_off[r];
    const float* srow = PRE ? scores + soff[r] + (size_t)h * (p + 1) : nullptr;
    pdl_wait();
    size_t tile_elems = (size_t)tk * head_dim;
    // Queues tile ts's K and V rows (PRE: V rows and scores) into buffer slot, then closes a
    // copy group (an empty one past the last tile).
    auto issue = [&](int ts, int slot) {
        if (ts <= p) {
            int nk = min(tk, p + 1 - ts);
            u16* sk = s_kv + (size_t)slot * (PRE ? 1 : 2) * tile_elems;
            u16* sv = PRE ? sk : sk + tile_elems;
            if (PRE) {
                for (int j = t; j < nk; j += ATT_THREADS) cp_async4(s_e2 + slot * ATT_MAX_TK + j, srow + ts + j);
            }
            stage_kv_tile(sk, sv, PRE ? nullptr : kc, vc, tab, ts, nk, n_kv, kvh, bsz, head_dim, t, ATT_THREADS);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    issue(0, 0);
    if (!PRE) {
        const float* qh = q + ((size_t)r * n_head + h) * head_dim;
        for (int i = t; i < head_dim; i += ATT_THREADS) s_q[i] = qh[i];
    }
    float acc[MAX_HEAD_DIM / ATT_THREADS];
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) acc[c] = 0.0f;
    float m = __uint_as_float(0xff800000u);  // -inf: the running max (warp 0's is used)
    float l = 0.0f;                          // thread ATT_THREADS - 1's is used
    int slot = 0;
    for (int ts = 0; ts <= p; ts += tk) {
        int nk = min(tk, p + 1 - ts);
        int nc = (nk + bsz - 1) / bsz;
        issue(ts + tk, slot ^ 1);
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
        const u16* sk = s_kv + (size_t)slot * (PRE ? 1 : 2) * tile_elems;
        const u16* sv = PRE ? sk : sk + tile_elems;
        float* s_e = s_e2 + (PRE ? slot * ATT_MAX_TK : 0);
        // 1. scores, 16 threads per key (PRE: already in s_e).
        if (!PRE) {
            int grp = t >> 4, lane = t & 15;
            const int NG = ATT_THREADS / 16;
            for (int j0 = 0; j0 < nk; j0 += 2 * NG) {
                float part[2];
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    int j = j0 + grp + u * NG;
                    float pa = 0.0f;
                    if (j < nk) {
                        const u16* kr = sk + (size_t)j * head_dim;
#pragma unroll 8
                        for (int i = lane; i < head_dim; i += 16) pa = fmaf(s_q[i], f16_to_f32(kr[i]), pa);
                    }
                    part[u] = pa;
                }
                // Lanes 0-7 hold key j0 + grp's sum, lanes 8-15 key j0 + grp + NG's.
                float sum = tree16_many<2>(part, lane);
                int j = j0 + grp + (lane >> 3) * NG;
                if ((lane & 7) == 0 && j < nk) s_e[j] = __fmul_rn(sum, scale);
            }
        }
        __syncthreads();
        // 2. chunk maxima (one warp per chunk), then the running max chunk by chunk.
        for (int c = warp; c < nc; c += ATT_THREADS / 32) {
            int a = c * bsz, e = min(a + bsz, nk);
            float cm = __uint_as_float(0xff800000u);
            for (int j = a + wl; j < e; j += 32) {
                float xv = s_e[j];
                cm = xv > cm ? xv : cm;
            }
            for (int o = 16; o > 0; o >>= 1) {
                float y = __shfl_xor_sync(0xffffffffu, cm, o);
                cm = y > cm ? y : cm;
            }
            if (wl == 0) s_m[c] = cm;
        }
        __syncthreads();
        if (warp == 0) running_max_chunks(s_m, s_alpha, nc, m, wl);
        __syncthreads();
        // 3. e[j] = exp(s[j] - m of j's chunk).
        for (int j = t; j < nk; j += ATT_THREADS) s_e[j] = canon_exp(__fsub_rn(s_e[j], s_m[j / bsz]));
        __syncthreads();
        // 4. the chains, chunk by chunk in key order.
        if (t == ATT_THREADS - 1) {
            for (int c = 0; c < nc; c++) {
                float al = s_alpha[c];
                if (al == al) l = __fmul_rn(l, al);
                int j = c * bsz, ke = min(j + bsz, nk);
                for (; j + 8 <= ke; j += 8) {
                    float ev[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) ev[u] = s_e[j + u];
#pragma unroll
                    for (int u = 0; u < 8; u++) l = __fadd_rn(l, ev[u]);
                }
                for (; j < ke; j++) l = __fadd_rn(l, s_e[j]);
            }
        }
#pragma unroll
        for (int cc = 0; cc < MAX_HEAD_DIM / ATT_THREADS; cc++) {
            int i = t + cc * ATT_THREADS;
            if (i < head_dim) {
                float av = acc[cc];
                for (int c = 0; c < nc; c++) {
                    float al = s_alpha[c];
                    if (al == al) av = __fmul_rn(av, al);
                    int j = c * bsz, ke = min(j + bsz, nk);
                    for (; j + 8 <= ke; j += 8) {
                        float ev[8], vv[8];
                        u16 vh[8];
#pragma unroll
                        for (int u = 0; u < 8; u++) {
                            ev[u] = s_e[j + u];
                            vh[u] = sv[(size_t)(j + u) * head_dim + i];
                        }
                        f16_to_f32_many(vh, vv);
#pragma unroll
                        for (int u = 0; u < 8; u++) av = fmaf(ev[u], vv[u], av);
                    }
                    for (; j < ke; j++) av = fmaf(s_e[j], f16_to_f32(sv[(size_t)j * head_dim + i]), av);
                }
                acc[cc] = av;
            }
        }
        __syncthreads();  // the buffer just read is the next issue's target
        slot ^= 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (t == ATT_THREADS - 1) s_l = __fdiv_rn(1.0f, l);
    __syncthreads();
    float inv = s_l;
    float* o = out + ((size_t)r * n_head + h) * head_dim;
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) {
        int i = t + c * ATT_THREADS;
        if (i < head_dim) o[i] = __fmul_rn(acc[c], inv);
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_tiled(
    const float* q, const u16* kc, const u16* vc, float* out, const int* pos, const int* table_off,
    const int* tables, int n_head, int n_kv, int head_dim, int bsz, float scale, int tk) {
    attention_tiled_impl<false>(q, kc, vc, out, pos, table_off, tables, n_head, n_kv, head_dim, bsz, scale, tk,
                                nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_tiled_pre(
    const float* q, const u16* kc, const u16* vc, float* out, const int* pos, const int* table_off,
    const int* tables, int n_head, int n_kv, int head_dim, int bsz, float scale, int tk, const float* scores,
    const int* soff) {
    attention_tiled_impl<true>(q, kc, vc, out, pos, table_off, tables, n_head, n_kv, head_dim, bsz, scale, tk,
                               scores, soff);
}

// stage_kv_tile for one of K or V (into dst from src), out of line: the compact kernel
// stages four times in its code, and each inlined copy is a long unrolled loop.
__device__ __noinline__ void stage_rows(u16* dst, const u16* src, const int* tab, int ts, int nk, int n_kv, int kvh,
                                        int bsz, int head_dim, int t, int nt) {
    stage_kv_tile(nullptr, dst, nullptr, src, tab, ts, nk, n_kv, kvh, bsz, head_dim, t, nt);
}

// Compact attention for steps of few rows (decode and verify blocks): the arithmetic of
// `attention` (so the same bits), with the head dimension HD (64 or 128) fixed at compile
// time, ATC_THREADS threads per (row, query head) CTA and three barriers per tile of `tk`
// keys (whole KV blocks of a power-of-two bsz from 16 to tk; tk a multiple of bsz, at most
// ATC_MAX_TK). K and V tiles are copied by cp.async into one of two (K, V) buffers, K and V
// as separate groups, so the scores start while V still arrives and the next tile's
// copies fly while this one is worked. Per tile:
//   1. the scores: canon's 16-lane dot (lane L of a 16-thread group holds q[L + 16u] in
//      registers) and tree16, four keys per group at a time (tree16_many), times scale;
//   2. in every warp alike, so no thread waits for another: lane L's maximum of keys 4L ..
//      4L + 3 (one chunk: bsz is a multiple of 4), the chunk maxima by a butterfly within
//      each chunk's bsz / 4 lanes, the running max after each chunk and its rescale factor
//      by running_max_chunks' scan, held in lane c for chunk c (a max is exact in any
//      order; see `attention`); then warp w's exponentials of keys 32w .. 32w + 31;
//   3. the chains in key order: every thread runs the running sum l (the same operations
//      in the same order in each thread, so every thread holds the same l), thread i < HD
//      the V accumulator of dimension i, chunk c rescaled by lane c's factor where the max
//      moved.
// Dynamic shared memory: two (K, V) tile buffers, 4 * tk * HD u16 values.
#define ATC_THREADS 128
#define ATC_MAX_TK 128
template <int HD>
__device__ __forceinline__ void attention_compact_impl(const float* q, const u16* kc, const u16* vc, float* out,
                                                       const int* pos, const int* table_off, const int* tables,
                                                       int n_head, int n_kv, int bsz, float scale, int tk) {
    extern __shared__ __align__(16) u16 s_kv[];
    __shared__ __align__(16) float s_s[ATC_MAX_TK];  // the tile's scores
    __shared__ __align__(16) float s_x[ATC_MAX_TK];  // their exponentials
    const float NEG_INF = __uint_as_float(0xff800000u);
    const float QNAN = __uint_as_float(0x7fc00000u);
    pdl_trigger();
    int r = blockIdx.x / n_head, h = blockIdx.x % n_head;
    int kvh = h / (n_head / n_kv);
    int t = threadIdx.x, warp = t >> 5, wl = t & 31;
    // Positions and block tables are copied in before the step's first kernel.
    int p = pos[r];
    const int* tab = tables + table_off[r];
    int seg = bsz / 4;  // lanes per chunk in phase 2 (tk <= 128 keys over 32 lanes)
    size_t tile_elems = (size_t)tk * HD;
    // Queues tile ts's K rows, then its V rows, into buffer `slot`, as two copy groups (empty
    // past the last tile, so every tile counts its groups alike).
    auto issue = [&](int ts, int slot) {
        u16* sk = s_kv + (size_t)slot * 2 * tile_elems;
        int nk = min(tk, p + 1 - ts);
        if (ts <= p) stage_rows(sk, kc, tab, ts, nk, n_kv, kvh, bsz, HD, t, ATC_THREADS);
        cp_async_commit();
        if (ts <= p) stage_rows(sk + tile_elems, vc, tab, ts, nk, n_kv, kvh, bsz, HD, t, ATC_THREADS);
        cp_async_commit();
    };
    pdl_wait();
    issue(0, 0);
    constexpr int QE = HD / 16;  // elements of canon's dot per lane
    const int lane16 = t & 15, grp = t >> 4;
    constexpr int NG = ATC_THREADS / 16;
    float qv[QE];
    {
        const float* qh = q + ((size_t)r * n_head + h) * HD;
#pragma unroll
        for (int e = 0; e < QE; e++) qv[e] = qh[lane16 + 16 * e];
    }
    float av = 0.0f;  // dimension t's accumulator (t < HD)
    float l = 0.0f;   // the running sum, alike in every thread
    float m = NEG_INF;
    int slot = 0;
    for (int ts = 0; ts <= p; ts += tk) {
        int nk = min(tk, p + 1 - ts);
        int nc = (nk + bsz - 1) / bsz;
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // this tile's K
        __syncthreads();  // K visible; the last tile's reads of the other buffer are done
        issue(ts + tk, slot ^ 1);
        const u16* sk = s_kv + (size_t)slot * 2 * tile_elems;
        const u16* sv = sk + tile_elems;
        // 1. scores.
        for (int j0 = 0; j0 < nk; j0 += 4 * NG) {
            // The four keys' K elements are loaded together (a key past the tile reads the
            // tile's last key and is dropped), then the dots.
            u16 kh[4 * QE];
            float kv[4 * QE];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const u16* kr = sk + (size_t)min(j0 + grp + u * NG, nk - 1) * HD + lane16;
#pragma unroll
                for (int e = 0; e < QE; e++) kh[u * QE + e] = kr[16 * e];
            }
            f16_to_f32_many(kh, kv);
            float part[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                float pa = 0.0f;
#pragma unroll
                for (int e = 0; e < QE; e++) pa = fmaf(qv[e], kv[u * QE + e], pa);
                part[u] = j0 + grp + u * NG < nk ? pa : 0.0f;
            }
            // Lanes 4u .. 4u + 3 of a group hold key j0 + grp + u * NG's sum.
            float sum = tree16_many<4>(part, lane16);
            int j = j0 + grp + (lane16 >> 2) * NG;
            if ((lane16 & 3) == 0 && j < nk) s_s[j] = __fmul_rn(sum, scale);
        }
        __syncthreads();
        // 2. chunk maxima, the running max after each chunk with its factor, exponentials.
        float m_c, alpha;
        {
            float cm = NEG_INF;
            if (4 * wl < nk) {
                float4 x4 = *(const float4*)&s_s[4 * wl];
                float xs[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (4 * wl + u < nk) cm = xs[u] > cm ? xs[u] : cm;
            }
            for (int o = 1; o < seg && o < 32; o <<= 1) {
                float y = __shfl_xor_sync(0xffffffffu, cm, o);
                cm = y > cm ? y : cm;
            }
            // Chunk wl's maximum into lane wl, then the scan of running_max_chunks.
            float c = __shfl_sync(0xffffffffu, cm, (wl * seg) & 31);
            if (wl >= nc) c = NEG_INF;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                float y = __shfl_up_sync(0xffffffffu, c, o);
                if (wl >= o) c = c > y ? c : y;
            }
            m_c = c > m ? c : m;
            float prev = __shfl_up_sync(0xffffffffu, m_c, 1);
            if (wl == 0) prev = m;
            alpha = m_c != prev ? canon_exp(__fsub_rn(prev, m_c)) : QNAN;
            m = __shfl_sync(0xffffffffu, m_c, nc - 1);
        }
        {
            int j = 32 * warp + wl;
            float mj = __shfl_sync(0xffffffffu, m_c, min(j / bsz, 31));
            if (j < nk) s_x[j] = canon_exp(__fsub_rn(s_s[j], mj));
        }
        asm volatile("cp.async.wait_group 2;" ::: "memory");  // this tile's V
        __syncthreads();
        // 3. the chains, chunk by chunk in key order.
        if (warp < (HD + 31) / 32) {
            for (int c = 0; c < nc; c++) {
                float al = __shfl_sync(0xffffffffu, alpha, c);
                if (al == al) {
                    l = __fmul_rn(l, al);
                    av = __fmul_rn(av, al);
                }
                int j = c * bsz, ke = min(j + bsz, nk);
                for (; j + 8 <= ke; j += 8) {
                    float4 ea = *(const float4*)&s_x[j];
                    float4 eb = *(const float4*)&s_x[j + 4];
                    float ev[8] = {ea.x, ea.y, ea.z, ea.w, eb.x, eb.y, eb.z, eb.w};
                    u16 vh[8];
                    float vv[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) vh[u] = sv[(size_t)(j + u) * HD + t];
                    f16_to_f32_many(vh, vv);
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        av = fmaf(ev[u], vv[u], av);
                        l = __fadd_rn(l, ev[u]);
                    }
                }
                for (; j < ke; j++) {
                    float ev = s_x[j];
                    av = fmaf(ev, f16_to_f32(sv[(size_t)j * HD + t]), av);
                    l = __fadd_rn(l, ev);
                }
            }
        }
        slot ^= 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (t < HD) out[((size_t)r * n_head + h) * HD + t] = __fmul_rn(av, __fdiv_rn(1.0f, l));
}

extern "C" __global__ void __launch_bounds__(ATC_THREADS) attention_compact_64(
    const float* q, const u16* kc, const u16* vc, float* out, const int* pos, const int* table_off,
    const int* tables, int n_head, int n_kv, int bsz, float scale, int tk) {
    attention_compact_impl<64>(q, kc, vc, out, pos, table_off, tables, n_head, n_kv, bsz, scale, tk);
}

extern "C" __global__ void __launch_bounds__(ATC_THREADS) attention_compact_128(
    const float* q, const u16* kc, const u16* vc, float* out, const int* pos, const int* table_off,
    const int* tables, int n_head, int n_kv, int bsz, float scale, int tk) {
    attention_compact_impl<128>(q, kc, vc, out, pos, table_off, tables, n_head, n_kv, bsz, scale, tk);
}

// The scores of decode attention, spread over the device (attention_tiled_pre takes them
// from here): CTA (x, y) takes row r = y / n_kv and KV head y % n_kv, and key tiles x, x +
// gridDim.x, ... of ATS_TK positions up to pos[r]; each tile's K rows are staged once for
// the G = n_head / n_kv query heads of that KV head, and every (query head, key) score is
// attention_tiled's (16 threads, canon's 16-lane dot and tree16, times scale), written to
// scores[soff[r] + h * (pos[r] + 1) + key]. Dynamic shared memory: the G query rows (f32),
// then one K tile (ATS_TK * head_dim u16).
#define ATS_TK 64
#define ATS_MAXG 16
extern "C" __global__ void __launch_bounds__(ATT_THREADS) att_scores(
    const float* q, const u16* kc, const int* pos, const int* table_off, const int* tables, const int* soff,
    float* scores, int n_head, int n_kv, int head_dim, int bsz, float scale) {
    extern __shared__ __align__(16) u8 smem[];
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.y / n_kv, kvh = blockIdx.y % n_kv;
    int G = n_head / n_kv;
    int t = threadIdx.x;
    int p = pos[r];
    int ntiles = p / ATS_TK + 1;
    if ((int)blockIdx.x >= ntiles) return;
    const int* tab = tables + table_off[r];
    float* s_q = (float*)smem;
    u16* s_k = (u16*)(smem + (((size_t)G * head_dim * 4 + 15) & ~(size_t)15));
    const float* qg = q + ((size_t)r * n_head + (size_t)kvh * G) * head_dim;
    for (int i = t; i < G * head_dim; i += ATT_THREADS) s_q[i] = qg[i];
    float* srow = scores + soff[r] + (size_t)kvh * G * (p + 1);
    int grp = t >> 4, lane = t & 15;
    const int NG = ATT_THREADS / 16;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        int ts = tile * ATS_TK;
        int nk = min(ATS_TK, p + 1 - ts);
        __syncthreads();  // the previous tile's K rows are read
        stage_kv_tile(nullptr, s_k, nullptr, kc, tab, ts, nk, n_kv, kvh, bsz, head_dim, t, ATT_THREADS);
        cp_async_wait_all();
        __syncthreads();
        int np = G * nk;
        // Uniform trip count per warp (tree16 needs every lane of the warp).
        for (int p0 = 0; p0 < np; p0 += NG) {
            int pi = p0 + grp;
            bool ok = pi < np;
            int hh = ok ? pi / nk : 0, j = ok ? pi - hh * nk : 0;
            const float* qh = s_q + (size_t)hh * head_dim;
            const u16* kr = s_k + (size_t)j * head_dim;
            float pa = 0.0f;
            if (ok) {
#pragma unroll 8
                for (int i = lane; i < head_dim; i += 16) pa = fmaf(qh[i], f16_to_f32(kr[i]), pa);
            }
            float sum = tree16(pa);
            if (lane == 0 && ok) srow[(size_t)hh * (p + 1) + ts + j] = __fmul_rn(sum, scale);
        }
    }
}

// Attention for many rows of one sequence (prefill chunks): the same arithmetic as
// `attention` (per (row, query head): chunks ending at block boundaries in position order,
// the CPU's online softmax, canon's 16-lane dot and tree16 for every score), organised so
// that each K and V row staged in shared memory serves several rows and every query head
// of its KV head:
//   - a CTA takes a tile of up to blockDim.x / 32 (at most ATTR_MAX_ROWS) consecutive rows
//     of one sequence (`tiles`, the host's list of tile starts, ntiles + 1 entries; a tile's
//     rows share a block table) and one KV head (blockIdx.y); warp w is the tile's row w
//     with its G = n_head / n_kv query heads (G a template parameter); tiles are taken
//     last first (the longest rows start first);
//   - keys go in tiles of tk positions (whole KV blocks): K and V copied by cp.async into
//     one of two f16 buffers, the next tile's copies in flight while the current one is
//     worked, and each tile converted once to f32 in shared memory for all rows;
//   - scores: lane L holds lane L % 16 of canon's dot (elements i = L % 16 + 16 u in order,
//     its q elements in registers) for keys j0 + L / 16 and j0 + 2 + L / 16, every head; the
//     tree16 levels by shuffles, all of a pass's sums reduced together (tree16_many);
//   - chunk maxima (lanes over (key, head), then across the warp; a max is exact in any
//     order), the running max with its rescale factors (lane g for head g, chunk by
//     chunk), the exponentials (lanes over (key, head)),
//     the running sum l (lane g, key by key) and the V accumulators (lane L holds
//     dimensions [HD/32 L, HD/32 (L + 1)) of every head, key by key).
// Each (row, head, dimension) goes through the operations of `attention`, in its order, so
// the bits are the same.
// Dynamic shared memory: two f16 buffers of (K, V) tiles (tk rows of HD), the f32 K tile
// (rows of HD + ATTR_PAD), the f32 V tile (rows of HD), then the scores/exponentials,
// (rows per CTA) * tk * ATTR_MAXG floats.
#define ATTR_MAX_ROWS 8
#define ATTR_MAXG 8
#define ATTR_MAXC 8
#define ATTR_PAD 16
template <int HD, int G>
__device__ __forceinline__ void attention_rows_impl(
    const float* q, const u16* kc, const u16* vc, float* out, const int* pos, const int* table_off,
    const int* tables, const int* tiles, int ntiles, int n_head, int n_kv, int bsz, float scale,
    int tk) {
    constexpr int CL = HD / 16;        // elements per canon lane of a dot
    constexpr int DPT = HD / 32;       // V dimensions per lane
    constexpr int KS = HD + ATTR_PAD;  // f32 K row stride: the two half-warps on other banks
    // Scores reduced together per pass (two keys, G heads), to a power of two.
    constexpr int NV = 2 * G <= 2 ? 2 : 2 * G <= 4 ? 4 : 2 * G <= 8 ? 8 : 16;
    extern __shared__ __align__(16) u16 s_kv[];
    __shared__ float s_m[ATTR_MAX_ROWS][ATTR_MAXC][ATTR_MAXG];
    __shared__ float s_alpha[ATTR_MAX_ROWS][ATTR_MAXC][ATTR_MAXG];
    const float NEG_INF = __uint_as_float(0xff800000u);
    int tile = ntiles - 1 - (int)blockIdx.x;
    int r0 = tiles[tile], nr = tiles[tile + 1] - r0;
    int kvh = blockIdx.y;
    int t = threadIdx.x, w = t >> 5, L = t & 31, c16 = L & 15;
    int has_row = w < nr;
    int r = r0 + (has_row ? w : 0);
    int p = has_row ? pos[r] : -1;
    int pmax = 0;
    for (int i = 0; i < nr; i++) pmax = max(pmax, pos[r0 + i]);
    const int* tab = tables + table_off[r0];
    size_t tile_elems = (size_t)tk * HD;
    float* kf = (float*)(s_kv + 4 * tile_elems);
    float* vf = kf + (size_t)tk * KS;
    float* s_e = vf + (size_t)tk * HD + (size_t)w * tk * ATTR_MAXG;
    // Queues key tile ts's K and V rows into buffer slot, then closes a copy group (an empty
    // one past the last tile).
    auto issue = [&](int ts, int slot) {
        if (ts <= pmax) {
            int nk = min(tk, pmax + 1 - ts);
            u16* sk = s_kv + (size_t)slot * 2 * tile_elems;
            u16* sv = sk + tile_elems;
            stage_kv_tile(sk, sv, kc, vc, tab, ts, nk, n_kv, kvh, bsz, HD, t, blockDim.x);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    issue(0, 0);
    float qr[G][CL];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float* qh = q + ((size_t)r * n_head + kvh * G + g) * HD + c16;
#pragma unroll
        for (int u = 0; u < CL; u++) qr[g][u] = has_row ? qh[16 * u] : 0.0f;
    }
    float acc[G][DPT];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int d = 0; d < DPT; d++) acc[g][d] = 0.0f;
    float m = NEG_INF;  // lane g's: head g's running max
    float l = 0.0f;     // lane g's: head g's running sum
    int slot = 0;
    for (int ts = 0; ts <= pmax; ts += tk) {
        issue(ts + tk, slot ^ 1);
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
        // The tile in f32, once for every row.
        {
            const u16* sk = s_kv + (size_t)slot * 2 * tile_elems;
            const u16* sv = sk + tile_elems;
            int n8 = min(tk, pmax + 1 - ts) * (HD / 8);
            for (int i = t; i < n8; i += blockDim.x) {
                int j = i / (HD / 8), c = 8 * (i % (HD / 8));
                uint4 xk = *(const uint4*)(sk + 8 * (size_t)i);
                uint4 xv = *(const uint4*)(sv + 8 * (size_t)i);
                u32 wk[4] = {xk.x, xk.y, xk.z, xk.w}, wv[4] = {xv.x, xv.y, xv.z, xv.w};
                u16 hk[8], hv[8];
                float fk[8], fv[8];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    hk[2 * u] = (u16)(wk[u] & 0xffffu);
                    hk[2 * u + 1] = (u16)(wk[u] >> 16);
                    hv[2 * u] = (u16)(wv[u] & 0xffffu);
                    hv[2 * u + 1] = (u16)(wv[u] >> 16);
                }
                f16_to_f32_many(hk, fk);
                f16_to_f32_many(hv, fv);
                float4* dk = (float4*)(kf + (size_t)j * KS + c);
                float4* dv = (float4*)(vf + (size_t)j * HD + c);
                dk[0] = make_float4(fk[0], fk[1], fk[2], fk[3]);
                dk[1] = make_float4(fk[4], fk[5], fk[6], fk[7]);
                dv[0] = make_float4(fv[0], fv[1], fv[2], fv[3]);
                dv[1] = make_float4(fv[4], fv[5], fv[6], fv[7]);
            }
        }
        __syncthreads();
        if (ts <= p) {
            int nk = min(tk, p + 1 - ts);
            int nc = (nk + bsz - 1) / bsz;
            // 1. scores: four keys per pass (two per lane), every head, the sums side by side.
            for (int j0 = 0; j0 < nk; j0 += 4) {
                int ja = j0 + (L >> 4), jb = ja + 2;
                const float* ka = kf + (size_t)min(ja, nk - 1) * KS + c16;
                const float* kb = kf + (size_t)min(jb, nk - 1) * KS + c16;
                float xa[CL], xb[CL];
#pragma unroll
                for (int u = 0; u < CL; u++) {
                    xa[u] = ka[16 * u];
                    xb[u] = kb[16 * u];
                }
                // v[g]: key ja, head g; v[G + g]: key jb, head g; zeros up to NV.
                float v[NV];
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float pa = 0.0f, pb = 0.0f;
#pragma unroll
                    for (int u = 0; u < CL; u++) {
                        pa = fmaf(qr[g][u], xa[u], pa);
                        pb = fmaf(qr[g][u], xb[u], pb);
                    }
                    v[g] = pa;
                    v[G + g] = pb;
                }
#pragma unroll
                for (int k = 2 * G; k < NV; k++) v[k] = 0.0f;
                float sum = tree16_many<NV>(v, c16);
                int idx = c16 >> (4 - log2_pow2(NV));
                if ((c16 & ((16 / NV) - 1)) == 0 && idx < 2 * G) {
                    int j = idx < G ? ja : jb;
                    int g = idx < G ? idx : idx - G;
                    if (j < nk) s_e[j * ATTR_MAXG + g] = __fmul_rn(sum, scale);
                }
            }
            __syncwarp();
            // 2. chunk maxima (lane L: head L % 8 over keys L / 8, L / 8 + 4, ... of the
            // chunk, then the four lanes of a head combined; a max is exact in any order),
            // then the running max chunk by chunk (lane g, head g).
            for (int c = 0; c < nc; c++) {
                int a = c * bsz, e = min(a + bsz, nk);
                float cm = NEG_INF;
                for (int j = a + (L >> 3); j < e; j += 4) {
                    float xv = s_e[j * ATTR_MAXG + (L & 7)];
                    cm = xv > cm ? xv : cm;
                }
                float o8 = __shfl_xor_sync(0xffffffffu, cm, 8);
                cm = o8 > cm ? o8 : cm;
                float o16 = __shfl_xor_sync(0xffffffffu, cm, 16);
                cm = o16 > cm ? o16 : cm;
                if (L < G) {
                    float m_new = cm > m ? cm : m;
                    float alpha = 0.0f;
                    int moved = m_new != m;
                    if (moved) alpha = canon_exp(__fsub_rn(m, m_new));
                    m = m_new;
                    s_m[w][c][L] = m;
                    s_alpha[w][c][L] = moved ? alpha : __uint_as_float(0x7fc00000u);
                }
            }
            __syncwarp();
            // 3. e[j] = exp(s[j] - m of j's chunk), lanes over (key, head).
            for (int i = L; i < nk * ATTR_MAXG; i += 32) {
                int j = i / ATTR_MAXG, g = i % ATTR_MAXG;
                if (g < G) s_e[i] = canon_exp(__fsub_rn(s_e[i], s_m[w][j / bsz][g]));
            }
            __syncwarp();
            // 4. the chains in key order: l in lane g, the V accumulators in every lane.
            if (L < G) {
                for (int c = 0; c < nc; c++) {
                    float al = s_alpha[w][c][L];
                    if (al == al) l = __fmul_rn(l, al);
                    int e = min(c * bsz + bsz, nk);
#pragma unroll 8
                    for (int j = c * bsz; j < e; j++) l = __fadd_rn(l, s_e[j * ATTR_MAXG + L]);
                }
            }
            for (int c = 0; c < nc; c++) {
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float al = s_alpha[w][c][g];
                    if (al == al) {
#pragma unroll
                        for (int d = 0; d < DPT; d++) acc[g][d] = __fmul_rn(acc[g][d], al);
                    }
                }
                int e = min(c * bsz + bsz, nk);
#pragma unroll 4
                for (int j = c * bsz; j < e; j++) {
                    const float* vr = vf + (size_t)j * HD + DPT * L;
                    float vv[DPT];
                    if (DPT == 4) {
                        float4 x = *(const float4*)vr;
                        vv[0] = x.x;
                        vv[1] = x.y;
                        vv[DPT > 2 ? 2 : 0] = x.z;
                        vv[DPT > 3 ? 3 : 0] = x.w;
                    } else {
#pragma unroll
                        for (int d = 0; d < DPT; d++) vv[d] = vr[d];
                    }
                    const float4* ep = (const float4*)(s_e + j * ATTR_MAXG);
                    float4 e0 = ep[0], e1 = ep[1];
                    float ev[8] = {e0.x, e0.y, e0.z, e0.w, e1.x, e1.y, e1.z, e1.w};
#pragma unroll
                    for (int g = 0; g < G; g++) {
#pragma unroll
                        for (int d = 0; d < DPT; d++) acc[g][d] = fmaf(ev[g], vv[d], acc[g][d]);
                    }
                }
            }
        }
        __syncthreads();  // the buffers just read are the next issue's and conversion's target
        slot ^= 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (has_row) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            float lg = __shfl_sync(0xffffffffu, l, g);
            float inv = __fdiv_rn(1.0f, lg);
            float* o = out + ((size_t)r * n_head + kvh * G + g) * HD + DPT * L;
#pragma unroll
            for (int d = 0; d < DPT; d++) o[d] = __fmul_rn(acc[g][d], inv);
        }
    }
}

#define ATTENTION_ROWS(HD, G)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTR_MAX_ROWS * 32, 1) attention_rows_##HD##_##G( \
        const float* q, const u16* kc, const u16* vc, float* out, const int* pos,                  \
        const int* table_off, const int* tables, const int* tiles, int ntiles, int n_head,         \
        int n_kv, int bsz, float scale, int tk) {                                                  \
        attention_rows_impl<HD, G>(q, kc, vc, out, pos, table_off, tables, tiles, ntiles, n_head,  \
                                   n_kv, bsz, scale, tk);                                          \
    }
#define ATTENTION_ROWS_G(HD) \
    ATTENTION_ROWS(HD, 1)    \
    ATTENTION_ROWS(HD, 2)    \
    ATTENTION_ROWS(HD, 3)    \
    ATTENTION_ROWS(HD, 4)    \
    ATTENTION_ROWS(HD, 5)    \
    ATTENTION_ROWS(HD, 6)    \
    ATTENTION_ROWS(HD, 7)    \
    ATTENTION_ROWS(HD, 8)
ATTENTION_ROWS_G(64)
ATTENTION_ROWS_G(128)

// ---- on-device choice ---------------------------------------------------------------

// Greedy choice per row: the index of the largest logit, ties to the lowest id; NaN never
// wins (the result does not depend on how the row is split: the lowest index among the
// values equal to the largest). Two launches: argmax_part, grid (P, rows) of 256 threads,
// leaves each CTA's best of its slice in pv/pi[r * P + c]; argmax_rows then combines a
// row's P partials (P <= 256) into out[r].
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

__device__ __forceinline__ void best_of_block(float* sv, int* si, float best, int bi) {
    int t = threadIdx.x;
    sv[t] = best;
    si[t] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s && better(sv[t + s], si[t + s], sv[t], si[t])) {
            sv[t] = sv[t + s];
            si[t] = si[t + s];
        }
        __syncthreads();
    }
}

extern "C" __global__ void argmax_part(const float* logits, int n, float* pv, int* pi) {
    __shared__ float sv[256];
    __shared__ int si[256];
    pdl_trigger();
    pdl_wait();
    int c = blockIdx.x, P = gridDim.x, r = blockIdx.y, t = threadIdx.x;
    int per = (n + P - 1) / P;
    int a = c * per, e = min(a + per, n);
    const float* x = logits + (size_t)r * n;
    float best = __uint_as_float(0xff800000u);
    int bi = -1;
    for (int i0 = a + t; i0 < e; i0 += 8 * 256) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = i0 + u * 256;
            v[u] = i < e ? x[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = i0 + u * 256;
            if (i < e && v[u] == v[u] && better(v[u], i, best, bi)) { best = v[u]; bi = i; }
        }
    }
    best_of_block(sv, si, best, bi);
    if (t == 0) {
        pv[(size_t)r * P + c] = sv[0];
        pi[(size_t)r * P + c] = si[0];
    }
}

extern "C" __global__ void argmax_rows(const float* pv, const int* pi, int P, int* out) {
    __shared__ float sv[256];
    __shared__ int si[256];
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x, t = threadIdx.x;
    float best = __uint_as_float(0xff800000u);
    int bi = -1;
    if (t < P) {
        best = pv[(size_t)r * P + t];
        bi = pi[(size_t)r * P + t];
    }
    best_of_block(sv, si, best, bi);
    if (t == 0) out[r] = si[0] < 0 ? 0 : si[0];
}

// ---- row summaries for the greedy choice (sampling::RowSummary) ----------------------

// `exp_nonpositive` of crates/sampling/src/logprob.rs, the same operations in the same
// order (every product and sum rounded on its own: compiled with --fmad=false, and the
// intrinsics say so again), constants by their f32 bits.
__device__ __forceinline__ float exp_nonpositive(float x) {
    const float LOG2E = __int_as_float(0x3fb8aa3b);
    const float LN2_HI = __int_as_float(0x3f318000);
    const float LN2_LO = __int_as_float(0xb95e8083);
    const float MAGIC = __int_as_float(0x4b400000);  // 1.5 * 2^23
    const float LO = __int_as_float(0xc2ae0000);     // -87
    float xc = fmaxf(x, LO);  // NaN -> -87, as f32::max
    float t = __fadd_rn(__fmul_rn(xc, LOG2E), MAGIC);
    float n = __fsub_rn(t, MAGIC);
    int ni = (int)((unsigned)__float_as_int(t) - 0x4B400000u);
    float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = __int_as_float(0x39506967);
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3ab743cf));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3c088908));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3d2aa9c1));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3e2aaaaa));
    p = __fadd_rn(__fmul_rn(p, r), __int_as_float(0x3f000000));
    float y = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    float scale = __int_as_float((int)(((unsigned)ni + 127u) << 23));
    unsigned keep = x >= LO ? 0xffffffffu : 0u;
    return __int_as_float((int)((unsigned)__float_as_int(__fmul_rn(y, scale)) & keep));
}

// First launch, grid (P, rows) of 256 threads: ex[r * n + i] = exp_nonpositive(x[i] - max)
// with max = x[ids[r]] (the row's argmax), or NaN where x[i] is NaN (so the lane sum is
// NaN and the host falls back to the full row).
extern "C" __global__ void summary_exp(const float* logits, int n, const int* ids, float* ex) {
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.y;
    const float* x = logits + (size_t)r * n;
    float* e = ex + (size_t)r * n;
    float mx = x[ids[r]];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = x[i];
        e[i] = v == v ? exp_nonpositive(__fsub_rn(v, mx)) : __int_as_float(0x7fc00000);
    }
}

// Second launch, grid rows of 256 threads (sampling's NORM_LANES): thread j sums, in index
// order, the f64 of ex[r * n + i] for i % 256 == j (logprob.rs `lane_sums`), then the lanes
// are folded by the adjacent-pair tree down to 8 (`fold_lanes`): out[r * 10 + j] = those 8,
// out[r * 10 + 8] = the max (the argmax's logit), out[r * 10 + 9] = the argmax.
extern "C" __global__ void __launch_bounds__(256) summary_lanes(const float* logits, int n, const int* ids,
                                                                const float* ex, double* out) {
    __shared__ double s[256];
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x, j = threadIdx.x;
    const float* e = ex + (size_t)r * n;
    double acc = 0.0;
    int i = j;
    for (; i + 7 * 256 < n; i += 8 * 256) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = e[i + 256 * u];
#pragma unroll
        for (int u = 0; u < 8; u++) acc = __dadd_rn(acc, (double)v[u]);
    }
    for (; i < n; i += 256) acc = __dadd_rn(acc, (double)e[i]);
    s[j] = acc;
    __syncthreads();
    for (int w = 128; w >= 8; w >>= 1) {
        double v = j < w ? __dadd_rn(s[2 * j], s[2 * j + 1]) : 0.0;
        __syncthreads();
        if (j < w) s[j] = v;
        __syncthreads();
    }
    if (j < 8) out[(size_t)r * 10 + j] = s[j];
    if (j == 0) {
        int id = ids[r];
        out[(size_t)r * 10 + 8] = (double)logits[(size_t)r * n + id];
        out[(size_t)r * 10 + 9] = (double)id;
    }
}
