//! The operations of the forward on device buffers, each one launch (or a few) of a kernel
//! in `kernels.cu`, plus host-in/host-out forms of each for the oracle tests.

use crate::CudaError;
use crate::device::{Arg, Buf, Device};
use quant::{ActLayout, Format};

/// Activation rows a batched matmul launch covers per warp (`MT` in `kernels.cu`).
const MT: usize = 4;

/// Threads per block of the elementwise kernels.
const EW: u32 = 256;

fn blocks(len: usize, per: u32) -> u32 {
    u32::try_from(len.div_ceil(per as usize)).unwrap_or(u32::MAX)
}

pub(crate) fn i32_of(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} {v} does not fit in i32")))
}

/// A weight matrix on the device in its GGUF block layout: `n` rows of `k` values.
#[derive(Debug)]
pub struct DevMatrix {
    /// Storage format.
    pub format: Format,
    /// Output rows.
    pub n: usize,
    /// Values per row.
    pub k: usize,
    bytes: usize,
    data: Buf<u8>,
}

impl DevMatrix {
    /// Bytes of the matrix on the device (its GGUF bytes; the padding not counted).
    pub fn n_bytes(&self) -> usize {
        self.bytes
    }
}

/// Bytes of padding after a matrix's last row: the matmul kernels copy rows in aligned
/// 16-byte lines, up to 15 bytes past a row's end.
const MATRIX_PAD: usize = 16;

/// Warps (output columns) per matmul CTA.
const MM_WARPS: usize = 4;

/// Most shared memory one warp stages per matrix (bytes); a longer row is staged in chunks.
const MM_STAGE_CAP: usize = 6144;

/// Shared memory a matmul CTA may use (bytes): what every device grants without an opt-in.
const MM_SMEM: usize = 48 * 1024;

/// Threads per matvec CTA (`MV_THREADS` in `kernels.cu`).
const MV_THREADS: usize = 256;

/// Bytes of weights a row-group matvec warp stages per unit (G rows, or G gate/up pairs, of
/// at most this share each: longer rows go in several units).
const MV_UNIT_BYTES: usize = 4096;

/// Most bytes a block-parallel matvec warp stages per unit (a longer row goes in several).
const MV_STAGE_CAP: usize = 4096;

/// Where a matvec launch gets its activation row.
#[derive(Clone, Copy, Debug)]
pub(crate) enum MvInput<'a> {
    /// Codes and block scales made earlier (row 0 of the activations).
    Quantized(&'a DevActs),
    /// `m` rows (1 to [`TC_MAX_ROWS`]) of codes and block scales made earlier, from row
    /// `row0`, through the tensor-core kernels only (`matvec_*_tc8`; outputs row by row,
    /// each `n` long, from the given output addresses).
    Batch(&'a DevActs, usize, usize),
    /// An f32 row at this device address, quantized by every CTA in its prologue, after an
    /// RMSNorm with this weight and epsilon when given.
    Row(u64, Option<(&'a Buf<f32>, f32)>),
}

/// The matvec kernel for matrices of these formats (the third may differ in the
/// K-quant mixes of `*_K_M` files), or `None` when no single launch covers them.
pub(crate) fn matvec_kernel(formats: &[Format]) -> Option<&'static str> {
    let first = *formats.first()?;
    let same = |f: &[Format]| f.iter().all(|&x| x == first);
    if same(formats) {
        return Some(match first {
            Format::Q4_0 => "matvec_q4_0",
            Format::Q4_1 => "matvec_q4_1",
            Format::Q5_0 => "matvec_q5_0",
            Format::Q5_1 => "matvec_q5_1",
            Format::Q8_0 => "matvec_q8_0",
            Format::Q2_K => "matvec_q2_k",
            Format::Q3_K => "matvec_q3_k",
            Format::Q4_K => "matvec_q4_k",
            Format::Q5_K => "matvec_q5_k",
            Format::Q6_K => "matvec_q6_k",
            _ => return None,
        });
    }
    let (head, last) = formats.split_at(formats.len() - 1);
    if !same(head) {
        return None;
    }
    match (first, last[0]) {
        (Format::Q4_K, Format::Q6_K) => Some("matvec_q4_k_q6_k"),
        (Format::Q5_K, Format::Q6_K) => Some("matvec_q5_k_q6_k"),
        _ => None,
    }
}

/// Logits per slice of the device argmax's first launch (at most [`ARGMAX_PARTS`] slices).
const ARGMAX_SLICE: usize = 2048;
/// Most slices per row (`argmax_rows` combines them in one CTA of 256 threads).
const ARGMAX_PARTS: usize = 256;

/// The slice results of the device argmax ([`Device::argmax_rows`]) for up to `rows` rows.
#[derive(Debug)]
pub struct ArgmaxParts {
    rows: usize,
    v: Buf<f32>,
    i: Buf<i32>,
}

impl ArgmaxParts {
    /// Room for `rows` rows.
    pub fn new(dev: &Device, rows: usize) -> Result<ArgmaxParts, CudaError> {
        Ok(ArgmaxParts {
            rows,
            v: dev.zeros(rows * ARGMAX_PARTS)?,
            i: dev.zeros(rows * ARGMAX_PARTS)?,
        })
    }
}

/// How a matvec launch spreads a matrix over a warp (the same bits either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MvStyle {
    /// One row per warp at a time, several of its blocks in flight (`matvec_*`): for
    /// matrices of few rows, long rows.
    Blocks,
    /// One row per lane group, G rows per warp (`matvec_*_rows`): for matrices of many
    /// short rows (the output head).
    Rows,
    /// Sixteen rows per warp, each sub-block's integer dot products by an int8 tensor-core
    /// step (`matvec_*_tc`: Q4_K, Q6_K and the Q4_K/Q6_K mix, compute capability 8.0 and
    /// newer with [`Device::mma`] on); other formats and devices take `Blocks`.
    Tensor,
}

/// Most activation rows of one tensor-core matvec launch ([`MvInput::Batch`]).
pub(crate) const TC_MAX_ROWS: usize = 8;

/// Most rows a matmul takes the tensor-core matvec kernels for, in launches of up to
/// [`TC_MAX_ROWS`] rows each (from [`Device::tc_min_rows`]).
pub(crate) const TC_CHUNKED_ROWS: usize = 16;

/// Kernels of [`MvStyle::Tensor`]: the block-parallel kernel's name with `_tc` (`_tc8` for
/// several rows).
pub(crate) fn tensor_matvec(kernel: &str) -> bool {
    matches!(kernel, "matvec_q4_k" | "matvec_q6_k" | "matvec_q4_k_q6_k")
}

/// Most bytes a [`MvStyle::Tensor`] unit stages per matrix (16 row chunks).
const MV_TC_UNIT_BYTES: usize = 16384;

/// The format code of `kernels.cu`'s `Fmt` (the GGML type id).
fn fmt_code(f: Format) -> i32 {
    match f {
        Format::Q4_0 => 2,
        Format::Q4_1 => 3,
        Format::Q5_0 => 6,
        Format::Q5_1 => 7,
        Format::Q8_0 => 8,
        Format::Q2_K => 10,
        Format::Q3_K => 11,
        Format::Q4_K => 12,
        Format::Q5_K => 13,
        _ => 14,
    }
}

/// How a matmul launch combines its result with the output (`mode` in `kernels.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `out = acc (+ bias)`, up to three matrices of one format in one launch.
    Store,
    /// `out = out + acc`: the residual add.
    Accumulate,
    /// `out = silu(acc of the first) * acc of the second`: gate and up.
    SwiGlu,
}

impl Epilogue {
    /// The low bits of a kernel's `mode` argument for this epilogue.
    fn mode(self) -> i32 {
        match self {
            Epilogue::Store => 0,
            Epilogue::Accumulate => 1,
            Epilogue::SwiGlu => 2,
        }
    }
}

/// Bytes per weight block and blocks in flight per warp (`Meta::BB` and `G` in
/// `kernels.cu`) of a quantized format.
fn block_geometry(f: Format) -> (usize, usize) {
    let g = if f.block_len() == 32 { 8 } else { 4 };
    (f.block_bytes(), g)
}

/// The kernel for a weight format, or an error for formats without a CUDA kernel.
/// Rows per tensor-core matmul tile (`MMQ_M` in kernels.cu).
const MMQ_M: usize = 32;
/// Rows per wide Q4_K tensor-core tile (`MMQW_M` in kernels.cu).
const MMQW_M: usize = 64;
/// Dynamic shared memory of the wide Q6_K kernel (`MMQW6_SMEM` in kernels.cu): two stages
/// (raw blocks, the rows' codes, activation scales, block offsets), the hi and lo weight
/// bytes, the columns' scales.
const MMQW6_SMEM: u32 = 2 * (64 * 240 + 64 * 272 + 4 * 64 + 4 * 64) + 2 * 64 * 272 + 4 * 64;
/// Dynamic shared memory of the wide Q4_K kernel (`MMQW4_SMEM` in kernels.cu): two stages
/// (raw blocks, the rows' codes, activation scales), the columns' sub-block scales and mins,
/// the rows' code sums as hi and lo bytes, the columns' d and dmin.
const MMQW4_SMEM: u32 = 2 * (64 * 144 + 64 * 272 + 4 * 64) + 2 * 8 * 64 + 2 * 8 * 64 + 4 * 2 * 64;
/// Dynamic shared memory of the wide kernels of the 32-element block formats
/// (`Mmqw32Smem<F>::BYTES` in kernels.cu): two stages of eight blocks (each column's raw
/// blocks from any 16-byte line, the rows' codes and activation scales), the columns' d, and
/// for the formats with a minimum (Q4_1, Q5_1) the columns' m and the rows' code sums.
fn mmqw32_smem(f: Format) -> u32 {
    let bb = f.block_bytes() as u32;
    let rs = (8 * bb + 30) / 16 * 16;
    let stage = 64 * rs + 64 * 272 + 4 * 64 * 8;
    let min = matches!(f, Format::Q4_1 | Format::Q5_1);
    2 * stage + 4 * 64 * 8 + if min { 4 * 64 * 8 + 4 * 64 * 8 } else { 0 }
}
/// Columns per tensor-core matmul tile (`MMQ_N` in kernels.cu).
const MMQ_N: usize = 64;
/// Threads per tensor-core matmul CTA (`MMQ_THREADS` in kernels.cu).
const MMQ_THREADS: u32 = 128;

/// The tensor-core prefill kernel of a weight format, where there is one.
fn mmq_kernel(f: Format) -> Option<&'static str> {
    match f {
        Format::Q4_K => Some("mmq_q4_k"),
        Format::Q6_K => Some("mmq_q6_k"),
        Format::Q4_0 => Some("mmq_q4_0"),
        Format::Q4_1 => Some("mmq_q4_1"),
        Format::Q5_0 => Some("mmq_q5_0"),
        Format::Q5_1 => Some("mmq_q5_1"),
        Format::Q8_0 => Some("mmq_q8_0"),
        _ => None,
    }
}

/// The wide (64-row) tensor-core prefill kernel of a weight format, where there is one.
fn mmqw_kernel(f: Format) -> Option<&'static str> {
    match f {
        Format::Q4_K => Some("mmqw_q4_k"),
        Format::Q6_K => Some("mmqw_q6_k"),
        Format::Q4_0 => Some("mmqw_q4_0"),
        Format::Q4_1 => Some("mmqw_q4_1"),
        Format::Q5_0 => Some("mmqw_q5_0"),
        Format::Q5_1 => Some("mmqw_q5_1"),
        Format::Q8_0 => Some("mmqw_q8_0"),
        _ => None,
    }
}

fn matmul_kernel(f: Format) -> Result<&'static str, CudaError> {
    Ok(match f {
        Format::Q4_0 => "matmul_q4_0",
        Format::Q4_1 => "matmul_q4_1",
        Format::Q5_0 => "matmul_q5_0",
        Format::Q5_1 => "matmul_q5_1",
        Format::Q8_0 => "matmul_q8_0",
        Format::Q2_K => "matmul_q2_k",
        Format::Q3_K => "matmul_q3_k",
        Format::Q4_K => "matmul_q4_k",
        Format::Q5_K => "matmul_q5_k",
        Format::Q6_K => "matmul_q6_k",
        Format::F32 | Format::F16 | Format::BF16 => "matmul_float",
        other => {
            return Err(CudaError::Unsupported(format!(
                "no CUDA matmul kernel for weight format {other}"
            )));
        }
    })
}

/// Quantized activation rows on the device (the layout of `quant::QuantizedActs`: i8 codes
/// row-major, one f32 scale per block), or the f32 rows themselves for float weights.
#[derive(Debug)]
pub struct DevActs {
    layout: ActLayout,
    k: usize,
    cap: usize,
    qs: Buf<i8>,
    d: Buf<f32>,
}

impl DevActs {
    /// Room for `rows` rows of `k` values in `layout`.
    pub fn new(
        dev: &Device,
        layout: ActLayout,
        k: usize,
        rows: usize,
    ) -> Result<DevActs, CudaError> {
        let bl = layout.block_len();
        if layout == ActLayout::Float || k == 0 || !k.is_multiple_of(bl) {
            return Err(CudaError::Shape(format!(
                "activation rows of {k} values cannot be quantized in blocks of {bl}"
            )));
        }
        Ok(DevActs {
            layout,
            k,
            cap: rows,
            qs: dev.zeros(rows * k)?,
            d: dev.zeros(rows * k / bl)?,
        })
    }
}

impl Device {
    /// Uploads a weight matrix given in its GGUF bytes (`n` rows of `k` values).
    pub fn upload_matrix(
        &self,
        format: Format,
        bytes: &[u8],
        n: usize,
        k: usize,
    ) -> Result<DevMatrix, CudaError> {
        matmul_kernel(format)?;
        let rb = format
            .row_bytes(k)
            .map_err(|e| CudaError::Shape(format!("matrix rows: {e}")))?;
        if bytes.len() != rb * n {
            return Err(CudaError::Shape(format!(
                "matrix of {n}×{k} {format} needs {} bytes, got {}",
                rb * n,
                bytes.len()
            )));
        }
        let mut data = self.zeros::<u8>(bytes.len() + MATRIX_PAD)?;
        self.write(bytes, &mut data)?;
        Ok(DevMatrix {
            format,
            n,
            k,
            bytes: bytes.len(),
            data,
        })
    }

    /// Quantizes `m` rows of `x` (row length `acts.k`) into `acts`.
    pub fn quantize_acts(
        &self,
        x: &Buf<f32>,
        m: usize,
        acts: &mut DevActs,
    ) -> Result<(), CudaError> {
        if m > acts.cap || m * acts.k > x.len() {
            return Err(CudaError::Shape(format!(
                "quantize {m} rows: room for {} rows, input of {}",
                acts.cap,
                x.len()
            )));
        }
        let bl = acts.layout.block_len();
        self.launch(
            "quantize_acts",
            (
                blocks(acts.k, bl as u32),
                u32::try_from(m).unwrap_or(u32::MAX),
                1,
            ),
            (32, 1, 1),
            &[
                Arg::Ptr(self.ptr(x, 0)),
                Arg::I32(i32_of("k", acts.k)?),
                Arg::I32(i32_of("block", bl)?),
                Arg::Ptr(self.ptr(&acts.qs, 0)),
                Arg::Ptr(self.ptr(&acts.d, 0)),
            ],
        )
    }

    /// `out[r][j] = w[j] · x[r]` for `m` rows: quantized weights read `acts` (made from `x`
    /// by [`Device::quantize_acts`] in the weight's activation layout), float weights
    /// read `x` itself.
    pub fn matmul(
        &self,
        w: &DevMatrix,
        x: &Buf<f32>,
        acts: Option<&DevActs>,
        out: &mut Buf<f32>,
        m: usize,
    ) -> Result<(), CudaError> {
        if out.len() < m * w.n || x.len() < m * w.k {
            return Err(CudaError::Shape(format!(
                "matmul {}×{} over {m} rows: output {} input {}",
                w.n,
                w.k,
                out.len(),
                x.len()
            )));
        }
        let kernel = matmul_kernel(w.format)?;
        let (n, k, mi) = (i32_of("n", w.n)?, i32_of("k", w.k)?, i32_of("m", m)?);
        if w.format.is_float() {
            let kind = match w.format {
                Format::F32 => 0,
                Format::F16 => 1,
                _ => 2,
            };
            return self.launch(
                kernel,
                (blocks(w.n, 128), u32::try_from(m).unwrap_or(u32::MAX), 1),
                (128, 1, 1),
                &[
                    Arg::Ptr(self.ptr(&w.data, 0)),
                    Arg::Ptr(self.ptr(x, 0)),
                    Arg::Ptr(self.ptr(out, 0)),
                    Arg::I32(n),
                    Arg::I32(k),
                    Arg::I32(mi),
                    Arg::I32(kind),
                ],
            );
        }
        let acts =
            acts.ok_or_else(|| CudaError::Shape("quantized matmul without activations".into()))?;
        let o = self.ptr(out, 0);
        self.matmul_fused(&[(w, o, None)], acts, m, Epilogue::Store)
    }

    /// Quantized matmuls of one format and K over the same activation rows in one launch,
    /// each `(matrix, output address, bias)`, combined by `epi` (see [`Epilogue`]). The
    /// caller has checked every output's size (at least `m × n` values each).
    pub(crate) fn matmul_fused(
        &self,
        ws: &[(&DevMatrix, u64, Option<&Buf<f32>>)],
        acts: &DevActs,
        m: usize,
        epi: Epilogue,
    ) -> Result<(), CudaError> {
        let Some(&(w, _, _)) = ws.first() else {
            return Ok(());
        };
        let want = match epi {
            Epilogue::Store => 1..=3,
            Epilogue::Accumulate => 1..=1,
            Epilogue::SwiGlu => 2..=2,
        };
        if !want.contains(&ws.len()) {
            return Err(CudaError::Shape(format!(
                "{} matrices for a {epi:?} matmul",
                ws.len()
            )));
        }
        for &(x, _, b) in ws {
            if x.format != w.format || x.k != w.k || (epi == Epilogue::SwiGlu && x.n != w.n) {
                return Err(CudaError::Shape(format!(
                    "fused matmul over {} {}×{} and {} {}×{}",
                    w.format, w.n, w.k, x.format, x.n, x.k
                )));
            }
            if b.is_some_and(|b| b.len() < x.n) {
                return Err(CudaError::Shape(format!("bias shorter than {}", x.n)));
            }
        }
        if w.format.is_float() {
            return Err(CudaError::Shape("fused matmul over float weights".into()));
        }
        if acts.layout != w.format.act_layout() || acts.k != w.k || m > acts.cap {
            return Err(CudaError::Shape(format!(
                "activations {:?}×{} (room {}) for {} weights of k {} over {m} rows",
                acts.layout, acts.k, acts.cap, w.format, w.k
            )));
        }
        let mode = epi.mode() | if self.unordered_matmul() { 4 } else { 0 };
        let at = |i: usize| ws.get(i);
        let wp = |i: usize| at(i).map_or(0, |x| self.ptr(&x.0.data, 0));
        let np = |i: usize| at(i).map_or(0, |x| x.0.n);
        let op = |i: usize| at(i).map_or(0, |x| x.1);
        let bp = |i: usize| at(i).and_then(|x| x.2).map_or(0, |b| self.ptr(b, 0));
        let args = |sb: usize, sa: usize| -> Result<Vec<Arg>, CudaError> {
            Ok(vec![
                Arg::Ptr(wp(0)),
                Arg::Ptr(wp(1)),
                Arg::Ptr(wp(2)),
                Arg::I32(i32_of("n", np(0))?),
                Arg::I32(i32_of("n", np(1))?),
                Arg::I32(i32_of("n", np(2))?),
                Arg::Ptr(op(0)),
                Arg::Ptr(op(1)),
                Arg::Ptr(op(2)),
                Arg::Ptr(bp(0)),
                Arg::Ptr(bp(1)),
                Arg::Ptr(bp(2)),
                Arg::Ptr(self.ptr(&acts.qs, 0)),
                Arg::Ptr(self.ptr(&acts.d, 0)),
                Arg::I32(i32_of("k", w.k)?),
                Arg::I32(i32_of("m", m)?),
                Arg::I32(mode),
                Arg::I32(i32_of("stage", sb)?),
                Arg::I32(i32_of("stage", sa)?),
            ])
        };
        let pair = epi == Epilogue::SwiGlu;
        // Up to `tc_max_rows` rows of Q4_K or Q6_K, when on: the tensor-core matvec kernels
        // in launches of up to TC_MAX_ROWS rows (each weight block read once per launch;
        // the same bits).
        if m <= self.tc_max_rows()
            && self.tc_min_rows() > 0
            && m >= self.tc_min_rows()
            && self.mma()
            && !self.unordered_matmul()
            && matvec_kernel(&[w.format]).is_some_and(tensor_matvec)
        {
            for r0 in (0..m).step_by(TC_MAX_ROWS) {
                let rows = (m - r0).min(TC_MAX_ROWS);
                let part: Vec<(&DevMatrix, u64, Option<&Buf<f32>>)> = ws
                    .iter()
                    .map(|&(x, o, b)| (x, if o == 0 { 0 } else { o + (r0 * x.n * 4) as u64 }, b))
                    .collect();
                self.matvec(&part, MvInput::Batch(acts, r0, rows), epi, MvStyle::Tensor)?;
            }
            return Ok(());
        }
        // Tensor cores for many rows of the formats that have a kernel for them: tiles of
        // MMQ_M rows by MMQ_N columns, the same bits as the warp kernels below.
        if let Some(kernel) = mmq_kernel(w.format)
            .filter(|_| m >= self.mma_min_rows() && self.mma() && !self.unordered_matmul())
        {
            let tiles: usize = if pair {
                w.n.div_ceil(MMQ_N)
            } else {
                ws.iter().map(|x| x.0.n.div_ceil(MMQ_N)).sum()
            };
            // More than one 32-row tile: the wide tiles where the format has them (Q4_K's
            // stage whole raw blocks with 16-byte copies, so its matrices must start
            // 16-byte aligned).
            let wide = mmqw_kernel(w.format).filter(|_| {
                m > MMQ_M
                    && self.mmq_wide()
                    && (w.format != Format::Q4_K || (0..ws.len()).all(|i| wp(i) % 16 == 0))
            });
            let (kernel, rows) = match wide {
                Some(wk) => (wk, MMQW_M),
                None => (kernel, MMQ_M),
            };
            let grid = (
                u32::try_from(tiles).unwrap_or(u32::MAX),
                u32::try_from(m.div_ceil(rows)).unwrap_or(u32::MAX),
                1,
            );
            // The wide kernels keep two stages in dynamic shared memory.
            let smem = match (kernel, wide.is_some()) {
                ("mmqw_q6_k", _) => Some(MMQW6_SMEM),
                ("mmqw_q4_k", _) => Some(MMQW4_SMEM),
                (_, true) => Some(mmqw32_smem(w.format)),
                _ => None,
            };
            if let Some(smem) = smem {
                return self.launch_smem(kernel, grid, (MMQ_THREADS, 1, 1), smem, &args(0, 0)?);
            }
            return self.launch(kernel, grid, (MMQ_THREADS, 1, 1), &args(0, 0)?);
        }
        let kernel = matmul_kernel(w.format)?;
        // Row tiling by batch size: 1, 4 or 16 rows per warp (the same arithmetic per row).
        let (name, mt) = match m {
            1 => (format!("{kernel}_m1"), 1),
            2..=8 => (kernel.to_string(), MT),
            _ => (format!("{kernel}_m16"), 16),
        };
        let (bb, g) = block_geometry(w.format);
        let nbl = w.k / w.format.block_len();
        let row_bytes = nbl * bb;
        let per_warp = if pair { 2 } else { 1 };
        let sb_min = (g * bb + 32).div_ceil(16) * 16;
        // Single rows stage the shared activation row too (codes, then scales), when it
        // leaves room for the weights.
        let mut sa = if mt == 1 {
            w.k.div_ceil(16) * 16 + (nbl * 4).div_ceil(16) * 16
        } else {
            0
        };
        if sa + MM_WARPS * per_warp * sb_min > MM_SMEM {
            sa = 0;
        }
        let room = (MM_SMEM - sa) / (MM_WARPS * per_warp) / 16 * 16;
        let sb = (row_bytes.div_ceil(16) * 16 + 32)
            .min(MM_STAGE_CAP)
            .min(room)
            .max(sb_min);
        let smem = sa + MM_WARPS * sb * per_warp;
        let warps = if pair {
            w.n
        } else {
            ws.iter().map(|x| x.0.n).sum()
        };
        self.launch_smem(
            &name,
            (
                blocks(warps, MM_WARPS as u32),
                u32::try_from(m.div_ceil(mt)).unwrap_or(u32::MAX),
                1,
            ),
            ((MM_WARPS * 32) as u32, 1, 1),
            u32::try_from(smem).unwrap_or(u32::MAX),
            &args(sb, sa)?,
        )
    }

    /// One activation row times up to three quantized matrices of one activation layout in
    /// one launch (formats as [`matvec_kernel`] allows), each `(matrix, output address,
    /// bias)`, combined by `epi`: the decode step's matrix-vector products. The same
    /// arithmetic as [`Device::matmul_fused`] over one row, so the same bits. The caller
    /// has checked every output's size (at least `n` values each).
    pub(crate) fn matvec(
        &self,
        ws: &[(&DevMatrix, u64, Option<&Buf<f32>>)],
        input: MvInput<'_>,
        epi: Epilogue,
        style: MvStyle,
    ) -> Result<(), CudaError> {
        let Some(&(w, _, _)) = ws.first() else {
            return Ok(());
        };
        let formats: Vec<Format> = ws.iter().map(|x| x.0.format).collect();
        let kernel = matvec_kernel(&formats).ok_or_else(|| {
            CudaError::Shape(format!("no matvec kernel for the formats {formats:?}"))
        })?;
        let want = match epi {
            Epilogue::Store => 1..=3,
            Epilogue::Accumulate => 1..=1,
            Epilogue::SwiGlu => 2..=2,
        };
        if !want.contains(&ws.len()) {
            return Err(CudaError::Shape(format!(
                "{} matrices for a {epi:?} matvec",
                ws.len()
            )));
        }
        let layout = w.format.act_layout();
        let k = w.k;
        for &(x, _, b) in ws {
            if x.format.act_layout() != layout
                || x.k != k
                || (epi == Epilogue::SwiGlu && (x.n != w.n || x.format != w.format))
            {
                return Err(CudaError::Shape(format!(
                    "fused matvec over {} {}×{} and {} {}×{}",
                    w.format, w.n, w.k, x.format, x.n, x.k
                )));
            }
            if b.is_some_and(|b| b.len() < x.n) {
                return Err(CudaError::Shape(format!("bias shorter than {}", x.n)));
            }
        }
        let bla = layout.block_len();
        if layout == ActLayout::Float || k == 0 || !k.is_multiple_of(bla) {
            return Err(CudaError::Shape(format!(
                "matvec over rows of {k} in blocks of {bla}"
            )));
        }
        let rows = match input {
            MvInput::Batch(a, r0, m) => {
                if !(1..=TC_MAX_ROWS).contains(&m) || r0 + m > a.cap {
                    return Err(CudaError::Shape(format!(
                        "{m} rows for a tensor-core matvec (room {}, at most {TC_MAX_ROWS})",
                        a.cap
                    )));
                }
                if !(tensor_matvec(kernel) && self.mma() && bla == 256) {
                    return Err(CudaError::Shape(format!(
                        "no tensor-core matvec for the formats {formats:?}"
                    )));
                }
                m
            }
            _ => 1,
        };
        let (xp, nwp, eps, qp, dp) = match input {
            MvInput::Quantized(a) | MvInput::Batch(a, _, _) => {
                if a.layout != layout || a.k != k {
                    return Err(CudaError::Shape(format!(
                        "activations {:?}×{} for {} weights of k {k}",
                        a.layout, a.k, w.format
                    )));
                }
                let r0 = match input {
                    MvInput::Batch(_, r0, _) => r0,
                    _ => 0,
                };
                (
                    0,
                    0,
                    0.0,
                    self.ptr(&a.qs, r0 * k),
                    self.ptr(&a.d, r0 * (k / bla)),
                )
            }
            MvInput::Row(x, norm) => {
                if norm.is_some_and(|(nw, _)| nw.len() < k) {
                    return Err(CudaError::Shape(format!("norm weight shorter than {k}")));
                }
                (
                    x,
                    norm.map_or(0, |(nw, _)| self.ptr(nw, 0)),
                    norm.map_or(0.0, |(_, e)| e),
                    0,
                    0,
                )
            }
        };
        let pair = epi == Epilogue::SwiGlu;
        let staged_row = if matches!(input, MvInput::Row(..)) {
            4 * k
        } else {
            0
        };
        if matches!(input, MvInput::Row(x, _) if x % 16 != 0) || !k.is_multiple_of(16) {
            return Err(CudaError::Shape(format!(
                "matvec input rows must be 16-byte aligned with k ({k}) a multiple of 16"
            )));
        }
        let style = match style {
            _ if matches!(input, MvInput::Batch(..)) => MvStyle::Tensor,
            MvStyle::Tensor if !(tensor_matvec(kernel) && self.mma() && bla == 256) => {
                MvStyle::Blocks
            }
            s => s,
        };
        if matches!(input, MvInput::Batch(..)) && self.tc_split() {
            return self.matvec_split8(ws, (qp, dp, rows), epi, kernel, k);
        }
        // The tensor-core kernels also keep each 16-value sub-block's code sum.
        let sums = if style == MvStyle::Tensor {
            (rows * k / 16 * 4).div_ceil(16) * 16
        } else {
            0
        };
        let sa = (rows * k).div_ceil(16) * 16
            + (rows * k / bla * 4).div_ceil(16) * 16
            + staged_row
            + sums;
        // Rows a warp works on at once (one, one per lane group, or sixteen), the bytes
        // staged per row and unit, and the warps the launch has work for.
        let g = match style {
            MvStyle::Blocks => 1,
            MvStyle::Rows if bla == 32 => 8,
            MvStyle::Rows => 4,
            MvStyle::Tensor => 16,
        };
        let row_cap = match style {
            MvStyle::Blocks => MV_STAGE_CAP,
            MvStyle::Rows => MV_UNIT_BYTES / g,
            MvStyle::Tensor => MV_TC_UNIT_BYTES / g,
        } / if pair { 2 } else { 1 };
        let mut rs = 0;
        for &(x, _, _) in ws {
            let (bb, inflight) = block_geometry(x.format);
            let rb = (k / x.format.block_len()) * bb;
            let least = match style {
                MvStyle::Blocks => inflight * bb + 32,
                MvStyle::Rows | MvStyle::Tensor => bb + 32,
            };
            let want = (rb.div_ceil(16) * 16 + 32)
                .min(row_cap)
                .max(least.div_ceil(16) * 16);
            rs = rs.max(want);
        }
        let work: usize = if pair {
            w.n.div_ceil(g)
        } else {
            ws.iter().map(|x| x.0.n.div_ceil(g)).sum()
        };
        // Warps per CTA: enough CTAs to reach every multiprocessor first, at most eight (and
        // as many rings as shared memory holds).
        let ring = 2 * g * rs * if pair { 2 } else { 1 };
        let fit = (self.smem_limit().saturating_sub(sa) / ring).max(1);
        let warps = (work / self.sm_count()).clamp(1, MV_THREADS / 32).min(fit);
        let smem = sa + warps * ring;
        if smem > self.smem_limit() {
            return Err(CudaError::Shape(format!(
                "matvec over rows of {k}: {smem} bytes of shared memory"
            )));
        }
        let name = match style {
            MvStyle::Blocks => kernel.to_string(),
            MvStyle::Rows => format!("{kernel}_rows"),
            MvStyle::Tensor if matches!(input, MvInput::Batch(..)) => format!("{kernel}_tc8"),
            MvStyle::Tensor => format!("{kernel}_tc"),
        };
        let threads = (warps * 32) as u32;
        let per_sm = self.occupancy(&name, threads, smem);
        let grid = work.div_ceil(warps).min(self.sm_count() * per_sm).max(1);
        let mode = epi.mode()
            | if self.unordered_matmul() { 4 } else { 0 }
            | if matches!(input, MvInput::Batch(..)) {
                (rows as i32) << 8
            } else {
                0
            };
        self.launch_smem(
            &name,
            (u32::try_from(grid).unwrap_or(u32::MAX), 1, 1),
            (threads, 1, 1),
            u32::try_from(smem).unwrap_or(u32::MAX),
            &self.matvec_args(ws, (xp, nwp, eps, qp, dp), k, bla, mode, rs)?,
        )
    }

    /// The arguments of a matvec kernel (`MATVEC_ARGS` in kernels.cu): up to three
    /// matrices' weights, formats, rows, outputs and biases, then the input (f32 row, norm
    /// weight, epsilon, codes, scales), row length, activation block length, mode and the
    /// staged bytes per row.
    fn matvec_args(
        &self,
        ws: &[(&DevMatrix, u64, Option<&Buf<f32>>)],
        input: (u64, u64, f32, u64, u64),
        k: usize,
        bla: usize,
        mode: i32,
        rs: usize,
    ) -> Result<Vec<Arg>, CudaError> {
        let (xp, nwp, eps, qp, dp) = input;
        let f0 = fmt_code(ws[0].0.format);
        let at = |i: usize| ws.get(i);
        let wp = |i: usize| at(i).map_or(0, |x| self.ptr(&x.0.data, 0));
        let fp = |i: usize| at(i).map_or(f0, |x| fmt_code(x.0.format));
        let np = |i: usize| at(i).map_or(0, |x| x.0.n);
        let op = |i: usize| at(i).map_or(0, |x| x.1);
        let bp = |i: usize| at(i).and_then(|x| x.2).map_or(0, |b| self.ptr(b, 0));
        Ok(vec![
            Arg::Ptr(wp(0)),
            Arg::Ptr(wp(1)),
            Arg::Ptr(wp(2)),
            Arg::I32(fp(0)),
            Arg::I32(fp(1)),
            Arg::I32(fp(2)),
            Arg::I32(i32_of("n", np(0))?),
            Arg::I32(i32_of("n", np(1))?),
            Arg::I32(i32_of("n", np(2))?),
            Arg::Ptr(op(0)),
            Arg::Ptr(op(1)),
            Arg::Ptr(op(2)),
            Arg::Ptr(bp(0)),
            Arg::Ptr(bp(1)),
            Arg::Ptr(bp(2)),
            Arg::Ptr(xp),
            Arg::Ptr(nwp),
            Arg::F32(eps),
            Arg::Ptr(qp),
            Arg::Ptr(dp),
            Arg::I32(i32_of("k", k)?),
            Arg::I32(i32_of("block", bla)?),
            Arg::I32(mode),
            Arg::I32(i32_of("stage", rs)?),
        ])
    }

    /// The `_tcs8` launch of [`Device::matvec`] for [`MvInput::Batch`] (its checks done;
    /// `input` the codes and scales addresses and the row count): a CTA per 16-row group at
    /// a time, the group's blocks over up to eight warps (at most one per block), two
    /// buffers of block sums and each warp's two-slot ring in shared memory.
    fn matvec_split8(
        &self,
        ws: &[(&DevMatrix, u64, Option<&Buf<f32>>)],
        input: (u64, u64, usize),
        epi: Epilogue,
        kernel: &str,
        k: usize,
    ) -> Result<(), CudaError> {
        let (qp, dp, m) = input;
        let w = ws[0].0;
        let pair = epi == Epilogue::SwiGlu;
        let np = if pair { 2 } else { 1 };
        let nba = k / 256;
        let groups: usize = if pair {
            w.n.div_ceil(16)
        } else {
            ws.iter().map(|x| x.0.n.div_ceil(16)).sum()
        };
        // Ring bytes per row block: the largest block, from anywhere in a 16-byte line.
        let rs = ws
            .iter()
            .map(|x| block_geometry(x.0.format).0)
            .max()
            .unwrap_or(0)
            .saturating_add(30)
            .div_ceil(16)
            * 16;
        let sa = (m * k).div_ceil(16) * 16
            + (m * nba * 4).div_ceil(16) * 16
            + (m * (k / 16) * 4).div_ceil(16) * 16
            + 2 * np * nba * 16 * 8 * 8
            + 2 * np * nba * 16 * 8;
        let ring = 2 * 16 * rs * np;
        let fit = self.smem_limit().saturating_sub(sa) / ring;
        let warps = (MV_THREADS / 32).min(nba).min(fit);
        if warps == 0 {
            return Err(CudaError::Shape(format!(
                "split tensor-core matvec over {m} rows of {k}: {} bytes of shared memory",
                sa + ring
            )));
        }
        let smem = sa + warps * ring;
        let name = format!("{kernel}_tcs8");
        let threads = (warps * 32) as u32;
        let per_sm = self.occupancy(&name, threads, smem);
        let grid = groups.min(self.sm_count() * per_sm).max(1);
        let mode = epi.mode() | ((m as i32) << 8);
        self.launch_smem(
            &name,
            (u32::try_from(grid).unwrap_or(u32::MAX), 1, 1),
            (threads, 1, 1),
            u32::try_from(smem).unwrap_or(u32::MAX),
            &self.matvec_args(ws, (0, 0, 0.0, qp, dp), k, 256, mode, rs)?,
        )
    }

    /// RMSNorm of `rows` rows of `x` (from element `x_off`) into `out` (from `out_off`)
    /// fused with the activation quantizer into `acts` rows `act_row..`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_quant_at(
        &self,
        x: &Buf<f32>,
        x_off: usize,
        w: &Buf<f32>,
        out: &mut Buf<f32>,
        out_off: usize,
        acts: &mut DevActs,
        act_row: usize,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let n = acts.k;
        let bl = acts.layout.block_len();
        if x_off + rows * n > x.len()
            || out_off + rows * n > out.len()
            || w.len() < n
            || act_row + rows > acts.cap
        {
            return Err(CudaError::Shape(format!("norm_quant {rows}×{n}")));
        }
        // The row goes through shared memory when it fits and rows are 16-byte aligned.
        let staged = n.is_multiple_of(4) && x_off.is_multiple_of(4) && n * 4 <= MM_SMEM;
        self.launch_smem(
            "norm_quant",
            (
                blocks(n, bl as u32),
                u32::try_from(rows).unwrap_or(u32::MAX),
                1,
            ),
            (32, 1, 1),
            if staged { (n * 4) as u32 } else { 0 },
            &[
                Arg::Ptr(self.ptr(x, x_off)),
                Arg::Ptr(self.ptr(w, 0)),
                Arg::Ptr(self.ptr(out, out_off)),
                Arg::I32(i32_of("n", n)?),
                Arg::F32(eps),
                Arg::I32(i32_of("block", bl)?),
                Arg::Ptr(self.ptr(&acts.qs, act_row * n)),
                Arg::Ptr(self.ptr(&acts.d, act_row * (n / bl))),
                Arg::I32(i32::from(staged)),
            ],
        )
    }

    /// RMSNorm of `rows` rows of `n`: `out = x / rms(x) * w`.
    pub fn rms_norm(
        &self,
        x: &Buf<f32>,
        w: &Buf<f32>,
        out: &mut Buf<f32>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        self.rms_norm_at(x, 0, w, out, 0, rows, n, eps)
    }

    /// [`Device::rms_norm`] reading `x` from element `x_off`, writing from `out_off`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_at(
        &self,
        x: &Buf<f32>,
        x_off: usize,
        w: &Buf<f32>,
        out: &mut Buf<f32>,
        out_off: usize,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        if x_off + rows * n > x.len() || out_off + rows * n > out.len() || w.len() < n {
            return Err(CudaError::Shape(format!("rms_norm {rows}×{n}")));
        }
        self.launch(
            "rms_norm",
            (u32::try_from(rows).unwrap_or(u32::MAX), 1, 1),
            (32, 1, 1),
            &[
                Arg::Ptr(self.ptr(x, x_off)),
                Arg::Ptr(self.ptr(w, 0)),
                Arg::Ptr(self.ptr(out, out_off)),
                Arg::I32(i32_of("n", n)?),
                Arg::F32(eps),
            ],
        )
    }

    /// `x[i] += y[i]` for `len` elements.
    pub fn add_in_place(
        &self,
        x: &mut Buf<f32>,
        y: &Buf<f32>,
        len: usize,
    ) -> Result<(), CudaError> {
        if len > x.len() || len > y.len() {
            return Err(CudaError::Shape(format!("add of {len}")));
        }
        self.launch(
            "add_in_place",
            (blocks(len, EW), 1, 1),
            (EW, 1, 1),
            &[
                Arg::Ptr(self.ptr(x, 0)),
                Arg::Ptr(self.ptr(y, 0)),
                Arg::I32(i32_of("len", len)?),
            ],
        )
    }

    /// `x[r][i] += b[i]` over `len` elements of rows of `n`.
    pub fn add_bias(
        &self,
        x: &mut Buf<f32>,
        b: &Buf<f32>,
        n: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        if len > x.len() || n > b.len() || n == 0 {
            return Err(CudaError::Shape(format!("bias of {n} over {len}")));
        }
        self.launch(
            "add_bias",
            (blocks(len, EW), 1, 1),
            (EW, 1, 1),
            &[
                Arg::Ptr(self.ptr(x, 0)),
                Arg::Ptr(self.ptr(b, 0)),
                Arg::I32(i32_of("n", n)?),
                Arg::I32(i32_of("len", len)?),
            ],
        )
    }

    /// `g[i] = silu(g[i]) * u[i]` for `len` elements.
    pub fn swiglu(&self, g: &mut Buf<f32>, u: &Buf<f32>, len: usize) -> Result<(), CudaError> {
        if len > g.len() || len > u.len() {
            return Err(CudaError::Shape(format!("swiglu of {len}")));
        }
        self.launch(
            "swiglu",
            (blocks(len, EW), 1, 1),
            (EW, 1, 1),
            &[
                Arg::Ptr(self.ptr(g, 0)),
                Arg::Ptr(self.ptr(u, 0)),
                Arg::I32(i32_of("len", len)?),
            ],
        )
    }

    /// RoPE in place over `rows` rows of `width` (whole heads of `head_dim`), positions
    /// `pos`, tables `cos`/`sin` of `dims / 2` values per position.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut Buf<f32>,
        pos: &Buf<i32>,
        cos: &Buf<f32>,
        sin: &Buf<f32>,
        rows: usize,
        width: usize,
        head_dim: usize,
        dims: usize,
        neox: bool,
    ) -> Result<(), CudaError> {
        if head_dim == 0
            || !width.is_multiple_of(head_dim)
            || dims > head_dim
            || !dims.is_multiple_of(2)
        {
            return Err(CudaError::Shape(format!(
                "rope width {width} head {head_dim} dims {dims}"
            )));
        }
        if rows * width > x.len() || rows > pos.len() {
            return Err(CudaError::Shape(format!("rope of {rows} rows")));
        }
        let total = rows * (width / head_dim) * (dims / 2);
        self.launch(
            "rope",
            (blocks(total, EW), 1, 1),
            (EW, 1, 1),
            &[
                Arg::Ptr(self.ptr(x, 0)),
                Arg::Ptr(self.ptr(pos, 0)),
                Arg::Ptr(self.ptr(cos, 0)),
                Arg::Ptr(self.ptr(sin, 0)),
                Arg::I32(i32_of("rows", rows)?),
                Arg::I32(i32_of("width", width)?),
                Arg::I32(i32_of("head_dim", head_dim)?),
                Arg::I32(i32_of("dims", dims)?),
                Arg::I32(i32::from(neox)),
            ],
        )
    }

    /// Greedy choice per row on the device: `out[r]` = the index of the largest of the
    /// `n` logits of row `r` (ties to the lowest id, NaN never chosen), in two launches
    /// through `parts` (each row split into slices, then the slices' bests combined).
    pub(crate) fn argmax_rows(
        &self,
        logits: &Buf<f32>,
        rows: usize,
        n: usize,
        parts: &mut ArgmaxParts,
        out: &mut Buf<i32>,
    ) -> Result<(), CudaError> {
        if rows * n > logits.len() || rows > out.len() || rows > parts.rows || n == 0 {
            return Err(CudaError::Shape(format!("argmax of {rows}×{n}")));
        }
        let p = n.div_ceil(ARGMAX_SLICE).clamp(1, ARGMAX_PARTS);
        let r = u32::try_from(rows).unwrap_or(u32::MAX);
        self.launch(
            "argmax_part",
            (p as u32, r, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(self.ptr(logits, 0)),
                Arg::I32(i32_of("n", n)?),
                Arg::Ptr(self.ptr(&parts.v, 0)),
                Arg::Ptr(self.ptr(&parts.i, 0)),
            ],
        )?;
        self.launch(
            "argmax_rows",
            (r, 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(self.ptr(&parts.v, 0)),
                Arg::Ptr(self.ptr(&parts.i, 0)),
                Arg::I32(p as i32),
                Arg::Ptr(self.ptr(out, 0)),
            ],
        )
    }

    // ---- host-in / host-out forms (oracle tests, tools) -------------------------------

    /// `m` rows of `x` times the `n × k` matrix `w` (GGUF bytes), on the device; returns
    /// `m × n` values row-major (as `quant::Kernels::matmul`).
    pub fn matmul_host(
        &self,
        format: Format,
        w: &[u8],
        n: usize,
        k: usize,
        x: &[f32],
    ) -> Result<Vec<f32>, CudaError> {
        if k == 0 || !x.len().is_multiple_of(k) {
            return Err(CudaError::Shape(format!(
                "input of {} is not rows of {k}",
                x.len()
            )));
        }
        let m = x.len() / k;
        let wm = self.upload_matrix(format, w, n, k)?;
        let xb = self.upload(x)?;
        let mut out = self.zeros::<f32>(m * n)?;
        if format.is_float() {
            self.matmul(&wm, &xb, None, &mut out, m)?;
        } else {
            let mut acts = DevActs::new(self, format.act_layout(), k, m)?;
            self.quantize_acts(&xb, m, &mut acts)?;
            self.matmul(&wm, &xb, Some(&acts), &mut out, m)?;
        }
        self.read(&out, m * n)
    }

    /// One activation row `x` times up to three quantized matrices `(format, GGUF bytes,
    /// rows)` of `k` columns in one matvec launch (the decode step's kernel), each result
    /// returned on its own. With `norm` (weight, epsilon) the launch RMS-normalizes `x` and
    /// quantizes it in its prologue; without, `x` is quantized by [`Device::quantize_acts`]
    /// first and the launch copies the codes.
    pub fn matvec_host(
        &self,
        mats: &[(Format, &[u8], usize)],
        k: usize,
        x: &[f32],
        norm: Option<(&[f32], f32)>,
        style: MvStyle,
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        if x.len() != k {
            return Err(CudaError::Shape(format!("a row of {} for k {k}", x.len())));
        }
        let Some(&(f0, _, _)) = mats.first() else {
            return Ok(Vec::new());
        };
        let ms = mats
            .iter()
            .map(|&(f, w, n)| self.upload_matrix(f, w, n, k))
            .collect::<Result<Vec<_>, _>>()?;
        let mut outs = ms
            .iter()
            .map(|m| self.zeros::<f32>(m.n))
            .collect::<Result<Vec<_>, _>>()?;
        let xb = self.upload(x)?;
        let jobs: Vec<(&DevMatrix, u64, Option<&Buf<f32>>)> = ms
            .iter()
            .zip(&outs)
            .map(|(m, o)| (m, self.ptr(o, 0), None))
            .collect();
        match norm {
            Some((w, eps)) => {
                let wb = self.upload(w)?;
                self.matvec(
                    &jobs,
                    MvInput::Row(self.ptr(&xb, 0), Some((&wb, eps))),
                    Epilogue::Store,
                    style,
                )?;
                self.sync()?;
            }
            None => {
                let mut acts = DevActs::new(self, f0.act_layout(), k, 1)?;
                self.quantize_acts(&xb, 1, &mut acts)?;
                self.matvec(&jobs, MvInput::Quantized(&acts), Epilogue::Store, style)?;
                self.sync()?;
            }
        }
        outs.iter_mut()
            .zip(&ms)
            .map(|(o, m)| self.read(o, m.n))
            .collect()
    }

    /// The activation quantizer on the device: codes and block scales of the rows of `x`.
    pub fn quantize_host(
        &self,
        layout: ActLayout,
        k: usize,
        x: &[f32],
    ) -> Result<(Vec<i8>, Vec<f32>), CudaError> {
        if k == 0 || !x.len().is_multiple_of(k) {
            return Err(CudaError::Shape(format!(
                "input of {} is not rows of {k}",
                x.len()
            )));
        }
        let m = x.len() / k;
        let xb = self.upload(x)?;
        let mut acts = DevActs::new(self, layout, k, m)?;
        self.quantize_acts(&xb, m, &mut acts)?;
        let qs = self.read(&acts.qs, m * k)?;
        let d = self.read(&acts.d, m * k / layout.block_len())?;
        Ok((qs, d))
    }

    /// RMSNorm of the rows of `x` (row length `w.len()`) on the device.
    pub fn rms_norm_host(&self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>, CudaError> {
        let n = w.len();
        if n == 0 || !x.len().is_multiple_of(n) {
            return Err(CudaError::Shape(format!("rms_norm of {} by {n}", x.len())));
        }
        let (xb, wb) = (self.upload(x)?, self.upload(w)?);
        let mut out = self.zeros::<f32>(x.len())?;
        self.rms_norm(&xb, &wb, &mut out, x.len() / n, n, eps)?;
        self.read(&out, x.len())
    }

    /// SwiGLU (`silu(g) * u`) on the device.
    pub fn swiglu_host(&self, g: &[f32], u: &[f32]) -> Result<Vec<f32>, CudaError> {
        let (mut gb, ub) = (self.upload(g)?, self.upload(u)?);
        self.swiglu(&mut gb, &ub, g.len().min(u.len()))?;
        self.read(&gb, g.len())
    }

    /// `a + b` on the device.
    pub fn add_host(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>, CudaError> {
        let (mut ab, bb) = (self.upload(a)?, self.upload(b)?);
        self.add_in_place(&mut ab, &bb, a.len().min(b.len()))?;
        self.read(&ab, a.len())
    }

    /// RoPE of the rows of `x` (one position per row) with the table `table`.
    pub fn rope_host(
        &self,
        x: &[f32],
        head_dim: usize,
        positions: &[usize],
        table: &backend_cpu::RopeTable,
        neox: bool,
    ) -> Result<Vec<f32>, CudaError> {
        let rows = positions.len();
        if rows == 0 || !x.len().is_multiple_of(rows) {
            return Err(CudaError::Shape("rope rows".into()));
        }
        let (cos, sin) = rope_tables(table)?;
        let (cb, sb) = (self.upload(&cos)?, self.upload(&sin)?);
        let pos: Vec<i32> = positions
            .iter()
            .map(|&p| i32_of("pos", p))
            .collect::<Result<_, _>>()?;
        let pb = self.upload(&pos)?;
        let mut xb = self.upload(x)?;
        self.rope(
            &mut xb,
            &pb,
            &cb,
            &sb,
            rows,
            x.len() / rows,
            head_dim,
            table.dims(),
            neox,
        )?;
        self.read(&xb, x.len())
    }

    /// Greedy choice of each row of `logits` (rows of `n`) on the device.
    pub fn argmax_host(&self, logits: &[f32], n: usize) -> Result<Vec<u32>, CudaError> {
        if n == 0 || !logits.len().is_multiple_of(n) {
            return Err(CudaError::Shape("argmax rows".into()));
        }
        let rows = logits.len() / n;
        let lb = self.upload(logits)?;
        let mut out = self.zeros::<i32>(rows)?;
        let mut parts = ArgmaxParts::new(self, rows)?;
        self.argmax_rows(&lb, rows, n, &mut parts, &mut out)?;
        Ok(self
            .read(&out, rows)?
            .into_iter()
            .map(|v| v as u32)
            .collect())
    }
}

/// The cos and sin tables of every position of `table`, flattened (`dims / 2` per
/// position).
pub(crate) fn rope_tables(
    table: &backend_cpu::RopeTable,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let half = table.dims() / 2;
    let np = table.n_positions();
    let (mut cos, mut sin) = (Vec::with_capacity(np * half), Vec::with_capacity(np * half));
    for p in 0..np {
        let (c, s) = table
            .row(p)
            .map_err(|e| CudaError::Shape(format!("rope table: {e}")))?;
        cos.extend_from_slice(c);
        sin.extend_from_slice(s);
    }
    Ok((cos, sin))
}

/// Values per row of [`Device::row_summaries`]' output: the 8 lanes, the max, the argmax.
pub(crate) const SUMMARY_STRIDE: usize = sampling::SUMMARY_LANES + 2;

impl Device {
    /// The [`sampling::RowSummary`] parts of `rows` rows of `n` logits whose argmaxes
    /// [`Device::argmax_rows`] left in `ids`: `out[r * SUMMARY_STRIDE..]` = the 8 f64 partial
    /// sums of `exp(l - max)` (NaN when the row holds a NaN), the max, the argmax. Two
    /// launches: the exps into `ex` (`rows * n`), then 256 threads a row sum them in index
    /// order per lane and fold the lanes to 8, as `sampling` does.
    pub(crate) fn row_summaries(
        &self,
        logits: &Buf<f32>,
        rows: usize,
        n: usize,
        ids: &Buf<i32>,
        ex: &mut Buf<f32>,
        out: &mut Buf<f64>,
    ) -> Result<(), CudaError> {
        if rows * n > logits.len()
            || rows * n > ex.len()
            || rows > ids.len()
            || rows * SUMMARY_STRIDE > out.len()
            || n == 0
        {
            return Err(CudaError::Shape(format!("row summaries of {rows}×{n}")));
        }
        let r = u32::try_from(rows).unwrap_or(u32::MAX);
        let p = n.div_ceil(256 * 8).clamp(1, 1024) as u32;
        self.launch(
            "summary_exp",
            (p, r, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(self.ptr(logits, 0)),
                Arg::I32(i32_of("n", n)?),
                Arg::Ptr(self.ptr(ids, 0)),
                Arg::Ptr(self.ptr(ex, 0)),
            ],
        )?;
        self.launch(
            "summary_lanes",
            (r, 1, 1),
            (sampling::NORM_LANES as u32, 1, 1),
            &[
                Arg::Ptr(self.ptr(logits, 0)),
                Arg::I32(i32_of("n", n)?),
                Arg::Ptr(self.ptr(ids, 0)),
                Arg::Ptr(self.ptr(ex, 0)),
                Arg::Ptr(self.ptr(out, 0)),
            ],
        )
    }

    /// [`sampling::RowSummary`] of each row of `logits` (rows of `n`), computed on the
    /// device (argmax, then [`Device::row_summaries`]).
    pub fn row_summaries_host(
        &self,
        logits: &[f32],
        n: usize,
    ) -> Result<Vec<sampling::RowSummary>, CudaError> {
        if n == 0 || !logits.len().is_multiple_of(n) {
            return Err(CudaError::Shape("summary rows".into()));
        }
        let rows = logits.len() / n;
        let lb = self.upload(logits)?;
        let mut ids = self.zeros::<i32>(rows)?;
        let mut parts = ArgmaxParts::new(self, rows)?;
        self.argmax_rows(&lb, rows, n, &mut parts, &mut ids)?;
        let mut ex = self.zeros::<f32>(rows * n)?;
        let mut out = self.zeros::<f64>(rows * SUMMARY_STRIDE)?;
        self.row_summaries(&lb, rows, n, &ids, &mut ex, &mut out)?;
        let raw = self.read(&out, rows * SUMMARY_STRIDE)?;
        Ok(raw.chunks_exact(SUMMARY_STRIDE).map(summary_of).collect())
    }
}

/// A [`sampling::RowSummary`] from one row of [`Device::row_summaries`]' output. A row
/// with a NaN (NaN lanes), a `+inf` or no logit above `-inf` is `fallback`, its other
/// fields as [`sampling::row_summary`] leaves them.
pub(crate) fn summary_of(v: &[f64]) -> sampling::RowSummary {
    let l = sampling::SUMMARY_LANES;
    let mut lanes = [0f64; sampling::SUMMARY_LANES];
    lanes.copy_from_slice(&v[..l]);
    let max = v[l] as f32;
    if !max.is_finite() || lanes.iter().any(|x| x.is_nan()) {
        return sampling::RowSummary {
            argmax: 0,
            max,
            lanes: [0.0; sampling::SUMMARY_LANES],
            fallback: true,
        };
    }
    sampling::RowSummary {
        argmax: v[l + 1] as u32,
        max,
        lanes,
        fallback: false,
    }
}
