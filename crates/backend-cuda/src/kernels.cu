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

__device__ __forceinline__ float f16_to_f32(u16 h) {
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

__device__ __forceinline__ float ld_f16(const u8* p) {
    return f16_to_f32((u16)p[0] | ((u16)p[1] << 8));
}

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ float pow2i(int k) { return __uint_as_float(((u32)(k + 127)) << 23); }

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
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
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

// ---- quantized matmul ---------------------------------------------------------------
//
// out[r * n + j] = sum over weight blocks b, in block order, of the canonical block step
// (quant::scalar::dot_blocks). One warp per output column j and MT activation rows. The
// integer sums inside a block are exact, so lanes may split them freely; the float steps
// across blocks run in block order, identically in every lane.
//
// Lanes: GL = 32 / G lanes per block, G blocks in flight; each lane covers BL / GL
// consecutive elements of its block (inside one sub-block).

// MT: activation rows per warp (1 for single rows, 4 up to 8 rows, 16 beyond). Tiling over rows never
// changes a row's arithmetic, so both give the same bits (tested).
template <int F, int MT>
__device__ __forceinline__ void matmul_q_impl(const u8* w, const i8* qs, const float* ad, float* out,
                                              int n, int k, int m) {
    const int BL = Meta<F>::BL, BB = Meta<F>::BB, SL = Meta<F>::SL;
    const int G = BL == 32 ? 4 : 1;
    const int GL = 32 / G;
    const int EPL = BL / GL;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    int r0 = blockIdx.y * MT;
    int nr = min(MT, m - r0);
    int nb = k / BL;
    const u8* wrow = w + (size_t)warp * nb * BB;
    int g = lane / GL, gl = lane % GL;
    float acc[MT];
#pragma unroll
    for (int r = 0; r < MT; r++) acc[r] = 0.0f;
    // U rounds of G blocks per iteration: more loads in flight; the float steps still run
    // block by block in order.
    const int U = 2;
    for (int b0 = 0; b0 < nb; b0 += G * U) {
        int isum[U][MT], msum[U][MT];
        float d[U], mm[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int b = b0 + u * G + g;
            d[u] = 0.0f;
            mm[u] = 0.0f;
#pragma unroll
            for (int r = 0; r < MT; r++) { isum[u][r] = 0; msum[u][r] = 0; }
            if (b < nb) {
                const u8* blk = wrow + (size_t)b * BB;
                int e0 = gl * EPL;
                int sc, mn;
                sub_scale<F>(blk, e0 / SL, &sc, &mn);
                // The lane's codes (all fit in i8), packed four to an int for dp4a.
                int cw[EPL / 4];
#pragma unroll
                for (int w4 = 0; w4 < EPL / 4; w4++) {
                    int c = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) c |= (code_at<F>(blk, e0 + 4 * w4 + i) & 0xff) << (8 * i);
                    cw[w4] = c;
                }
#pragma unroll
                for (int r = 0; r < MT; r++) {
                    if (r < nr) {
                        // 4-byte aligned: k and e0 are multiples of 4.
                        const int* a4 = (const int*)(qs + (size_t)(r0 + r) * k + (size_t)b * BL + e0);
                        int dot = 0, asum = 0;
#pragma unroll
                        for (int w4 = 0; w4 < EPL / 4; w4++) {
                            int av = a4[w4];
                            dot = __dp4a(cw[w4], av, dot);
                            asum = __dp4a(0x01010101, av, asum);
                        }
                        isum[u][r] = sc * dot;
                        msum[u][r] = (F == F_Q4_1 || F == F_Q5_1) ? asum : mn * asum;
                    }
                }
                d[u] = block_d<F>(blk);
                mm[u] = block_m<F>(blk);
            }
        }
        // Exact integer reductions inside each group of GL lanes.
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int r = 0; r < MT; r++) {
                for (int o = GL / 2; o > 0; o >>= 1) {
                    isum[u][r] += __shfl_xor_sync(0xffffffffu, isum[u][r], o);
                    msum[u][r] += __shfl_xor_sync(0xffffffffu, msum[u][r], o);
                }
            }
        }
        // The float steps, block by block in order; every lane gets every group's values.
#pragma unroll
        for (int u = 0; u < U; u++) {
            for (int gg = 0; gg < G; gg++) {
                int src = gg * GL;
                int bb = b0 + u * G + gg;
                float dg = __shfl_sync(0xffffffffu, d[u], src);
                float mg = __shfl_sync(0xffffffffu, mm[u], src);
#pragma unroll
                for (int r = 0; r < MT; r++) {
                    int is = __shfl_sync(0xffffffffu, isum[u][r], src);
                    int ms = __shfl_sync(0xffffffffu, msum[u][r], src);
                    if (bb < nb && r < nr) {
                        float da = ad[(size_t)(r0 + r) * (k / BL) + bb];
                        acc[r] = fmaf(__fmul_rn(dg, da), (float)is, acc[r]);
                        if (F == F_Q4_1 || F == F_Q5_1) {
                            acc[r] = fmaf(__fmul_rn(mg, da), (float)ms, acc[r]);
                        } else if (F == F_Q2_K || F == F_Q4_K || F == F_Q5_K) {
                            acc[r] = fmaf(-__fmul_rn(mg, da), (float)ms, acc[r]);
                        }
                    }
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < MT; r++)
            if (r < nr) out[(size_t)(r0 + r) * n + warp] = acc[r];
    }
}

#define MATMUL(name, F) \
    extern "C" __global__ void name(const u8* w, const i8* qs, const float* ad, float* out, int n, int k, int m) { \
        matmul_q_impl<F, 4>(w, qs, ad, out, n, k, m); \
    } \
    extern "C" __global__ void name##_m1(const u8* w, const i8* qs, const float* ad, float* out, int n, int k, int m) { \
        matmul_q_impl<F, 1>(w, qs, ad, out, n, k, m); \
    } \
    extern "C" __global__ void name##_m16(const u8* w, const i8* qs, const float* ad, float* out, int n, int k, int m) { \
        matmul_q_impl<F, 16>(w, qs, ad, out, n, k, m); \
    }
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
    float l = 0.0f;
    if (lane < 16) {
        // The lane's chain in order, its loads issued eight at a time.
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
    ss = __shfl_sync(0xffffffffu, ss, 0);
    float mean = __fdiv_rn(ss, (float)n);
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int i = lane; i < n; i += 32) o[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
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
// pos[r] into block slot[r] (the physical block), offset pos % bsz.

extern "C" __global__ void kv_write(const float* k, const float* v, u16* kc, u16* vc, const int* pos,
                                    const int* phys, int rows, int n_kv, int head_dim, int bsz) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int kvd = n_kv * head_dim;
    if (t >= (long)rows * kvd) return;
    int r = (int)(t / kvd), c = (int)(t % kvd);
    int h = c / head_dim, i = c % head_dim;
    size_t dst = (((size_t)phys[r] * n_kv + h) * bsz + (pos[r] % bsz)) * head_dim + i;
    kc[dst] = f32_to_f16(k[t]);
    vc[dst] = f32_to_f16(v[t]);
}

// Copies `count` u16 values from block `src` to block `dst` (copy-on-write).
extern "C" __global__ void copy_u16(u16* base, long src, long dst, long count) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) base[dst + i] = base[src + i];
}

// Attention (backend_cpu::attention::attend_one): one CTA of ATT_THREADS threads per (row,
// query head). Keys are visited in chunks that end at block boundaries, in position
// order, with the online softmax written out exactly as on the CPU. Scores use canon's
// 16-lane dot (16 threads per key) and tree16. Row r's block table is
// tables[table_off[r] ..], its last position pos[r].
#define ATT_THREADS 128
#define MAX_BSZ 256
#define MAX_HEAD_DIM 512
extern "C" __global__ void attention(const float* q, const u16* kc, const u16* vc, float* out,
                                     const int* pos, const int* table_off, const int* tables,
                                     int n_head, int n_kv, int head_dim, int bsz, float scale) {
    __shared__ float s_q[MAX_HEAD_DIM];
    __shared__ float s_s[MAX_BSZ];
    __shared__ float s_alpha;
    __shared__ float s_m;
    __shared__ int s_rescale;
    int r = blockIdx.x / n_head, h = blockIdx.x % n_head;
    int kvh = h / (n_head / n_kv);
    int t = threadIdx.x;
    const float* qh = q + ((size_t)r * n_head + h) * head_dim;
    for (int i = t; i < head_dim; i += ATT_THREADS) s_q[i] = qh[i];
    float acc[MAX_HEAD_DIM / ATT_THREADS];
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) acc[c] = 0.0f;
    float m = __uint_as_float(0xff800000u);  // -inf (thread 0's copy is the real one)
    float l = 0.0f;
    int p = pos[r];
    const int* tab = tables + table_off[r];
    __syncthreads();
    int start = 0;
    while (start <= p) {
        int b = start / bsz;
        int end = min((b + 1) * bsz, p + 1);
        int nk = end - start, off = start % bsz;
        size_t base = (((size_t)tab[b] * n_kv + kvh) * bsz + off) * head_dim;
        // Scores: 16 threads per key, ATT_THREADS / 16 keys at a time.
        for (int j0 = 0; j0 < nk; j0 += ATT_THREADS / 16) {
            int j = j0 + t / 16, lane = t % 16;
            float part = 0.0f;
            if (j < nk) {
                const u16* kr = kc + base + (size_t)j * head_dim;
#pragma unroll 8
                for (int i = lane; i < head_dim; i += 16) part = fmaf(s_q[i], f16_to_f32(kr[i]), part);
            }
            float sum = tree16(part);
            if (lane == 0 && j < nk) s_s[j] = __fmul_rn(sum, scale);
        }
        __syncthreads();
        // The chunk's running max, in position order (thread 0), and the rescale of the
        // accumulators when it moved.
        if (t == 0) {
            float m_new = m;
            for (int j = 0; j < nk; j++) m_new = s_s[j] > m_new ? s_s[j] : m_new;
            s_rescale = 0;
            if (m_new != m) {
                float alpha = canon_exp(__fsub_rn(m, m_new));
                l = __fmul_rn(l, alpha);
                s_alpha = alpha;
                s_rescale = 1;
                m = m_new;
            }
            s_m = m;
        }
        __syncthreads();
        // e[j] = exp(s[j] - m): independent per key.
        float mc = s_m;
        for (int j = t; j < nk; j += ATT_THREADS) s_s[j] = canon_exp(__fsub_rn(s_s[j], mc));
        __syncthreads();
        // l += e[j] in position order (thread 0) while every thread accumulates V.
        if (t == 0)
            for (int j = 0; j < nk; j++) l = __fadd_rn(l, s_s[j]);
        int rescale = s_rescale;
        float alpha = s_alpha;
#pragma unroll
        for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) {
            int i = t + c * ATT_THREADS;
            if (i < head_dim) {
                float a = acc[c];
                if (rescale) a = __fmul_rn(a, alpha);
                const u16* vr = vc + base + i;
                for (int j0 = 0; j0 < nk; j0 += 8) {
                    float vv[8];
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        vv[u] = j0 + u < nk ? f16_to_f32(vr[(size_t)(j0 + u) * head_dim]) : 0.0f;
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        if (j0 + u < nk) a = fmaf(s_s[j0 + u], vv[u], a);
                }
                acc[c] = a;
            }
        }
        __syncthreads();
        start = end;
    }
    __shared__ float s_inv;
    if (t == 0) s_inv = __fdiv_rn(1.0f, l);
    __syncthreads();
    float inv = s_inv;
    float* o = out + ((size_t)r * n_head + h) * head_dim;
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / ATT_THREADS; c++) {
        int i = t + c * ATT_THREADS;
        if (i < head_dim) o[i] = __fmul_rn(acc[c], inv);
    }
}

// ---- on-device choice ---------------------------------------------------------------

// Greedy choice per row: the index of the largest logit, ties to the lowest id; NaN never
// wins. One CTA of 256 threads per row; out[r] = the token id.
extern "C" __global__ void argmax_rows(const float* logits, int n, int* out) {
    __shared__ float sv[256];
    __shared__ int si[256];
    int r = blockIdx.x, t = threadIdx.x;
    const float* x = logits + (size_t)r * n;
    float best = __uint_as_float(0xff800000u);
    int bi = -1;
    for (int i = t; i < n; i += 256) {
        float v = x[i];
        if (v == v && (bi < 0 || v > best)) { best = v; bi = i; }
    }
    sv[t] = best;
    si[t] = bi;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (t < s) {
            float v = sv[t + s];
            int i = si[t + s];
            if (i >= 0 && (si[t] < 0 || v > sv[t] || (v == sv[t] && i < si[t]))) {
                sv[t] = v;
                si[t] = i;
            }
        }
        __syncthreads();
    }
    if (t == 0) out[r] = si[0] < 0 ? 0 : si[0];
}
