//! Kernel selection (once per process, from CPU features) and the matmul entry points.

use crate::{Format, PackedMatrix, QuantError, QuantizedActs, scalar};
use std::ops::Range;
use std::sync::OnceLock;

/// One implementation of every kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Portable scalar reference (`f32::mul_add`).
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL with VNNI (`vpdpbusd`) for the int8 products.
    Avx512Vnni,
}

impl Path {
    /// All paths, fastest last.
    pub const ALL: [Path; 3] = [Path::Scalar, Path::Avx2, Path::Avx512Vnni];

    /// "scalar", "avx2" or "avx512vnni".
    pub fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            Path::Avx2 => "avx2",
            Path::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Path::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Vnni => {
                Path::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel set: every format's dot/matmul and the activation quantizer of one [`Path`].
/// Values exist only for paths the CPU supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    path: Path,
}

static KERNELS: OnceLock<Kernels> = OnceLock::new();

/// The process-wide kernel set, chosen once: the fastest available path, unless the
/// environment variable `LOCKSTEP_KERNELS` names an available one ("scalar", "avx2",
/// "avx512vnni").
pub fn kernels() -> &'static Kernels {
    KERNELS.get_or_init(|| {
        let forced = std::env::var("LOCKSTEP_KERNELS").ok().and_then(|name| {
            Path::ALL
                .into_iter()
                .find(|p| p.name() == name.trim())
                .and_then(Kernels::new)
        });
        forced.unwrap_or_else(|| {
            Kernels::all_available()
                .pop()
                .unwrap_or(Kernels { path: Path::Scalar })
        })
    })
}

impl Kernels {
    /// The kernel set of `path`, if this CPU supports it.
    pub fn new(path: Path) -> Option<Kernels> {
        path.is_available().then_some(Kernels { path })
    }

    /// The scalar reference set (always available).
    pub fn scalar() -> Kernels {
        Kernels { path: Path::Scalar }
    }

    /// Every kernel set this CPU supports, scalar first, fastest last.
    pub fn all_available() -> Vec<Kernels> {
        Path::ALL.into_iter().filter_map(Kernels::new).collect()
    }

    /// The path.
    pub fn path(&self) -> Path {
        self.path
    }

    /// "avx512vnni", "avx2" or "scalar".
    pub fn name(&self) -> &'static str {
        self.path.name()
    }

    /// Whether `format` runs SIMD code on this path (false: the scalar reference).
    pub fn is_simd(&self, format: Format) -> bool {
        let _ = format;
        self.path != Path::Scalar
    }

    /// `dot(W row, A row m)` for one weight row of `acts.k()` weights.
    pub fn dot(
        &self,
        format: Format,
        w_row: &[u8],
        acts: &QuantizedActs,
        m: usize,
    ) -> Result<f32, QuantError> {
        if m >= acts.m {
            return Err(QuantError::Row {
                row: m,
                rows: acts.m,
            });
        }
        let mut out = [0.0f32];
        self.run(format, w_row, 1, 0..1, acts, m..m + 1, &mut out, 1)?;
        Ok(out[0])
    }

    /// `out[m·N + n] = dot(W row n, A row m)` for all M activation rows and N weight rows.
    /// `w` is N rows of K weights, row-major (K contiguous, as in GGUF).
    pub fn matmul(
        &self,
        format: Format,
        w: &[u8],
        n: usize,
        acts: &QuantizedActs,
        out: &mut [f32],
    ) -> Result<(), QuantError> {
        let m = acts.m;
        expect_len("matmul output (M·N)", m.checked_mul(n), out.len())?;
        self.run(format, w, n, 0..n, acts, 0..m, out, n)
    }

    /// The weight rows `n_range` of a matmul: `out[m·ldo + (n − n_range.start)] = dot(W row
    /// n, A row m)`. `w` and `n` describe the whole matrix, so callers can split N between
    /// threads; `out` needs `(M − 1)·ldo + n_range.len()` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_n_range(
        &self,
        format: Format,
        w: &[u8],
        n: usize,
        acts: &QuantizedActs,
        n_range: Range<usize>,
        out: &mut [f32],
        ldo: usize,
    ) -> Result<(), QuantError> {
        self.run(format, w, n, n_range, acts, 0..acts.m, out, ldo)
    }

    /// [`Kernels::matmul`] with N split into `threads` contiguous ranges, one scoped thread
    /// each. Results do not depend on `threads`.
    pub fn matmul_threaded(
        &self,
        format: Format,
        w: &[u8],
        n: usize,
        acts: &QuantizedActs,
        out: &mut [f32],
        threads: usize,
    ) -> Result<(), QuantError> {
        let m = acts.m;
        expect_len("matmul output (M·N)", m.checked_mul(n), out.len())?;
        let threads = threads.clamp(1, n.max(1));
        if threads == 1 || m == 0 {
            return self.run(format, w, n, 0..n, acts, 0..m, out, n);
        }
        let chunk = n.div_ceil(threads);
        let ranges: Vec<Range<usize>> = (0..threads)
            .map(|t| (t * chunk).min(n)..((t + 1) * chunk).min(n))
            .filter(|r| !r.is_empty())
            .collect();
        let mut bufs: Vec<Vec<f32>> = ranges.iter().map(|r| vec![0.0; m * r.len()]).collect();
        let results: Vec<Result<(), QuantError>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranges
                .iter()
                .zip(bufs.iter_mut())
                .map(|(r, buf)| {
                    let r = r.clone();
                    s.spawn(move || self.run(format, w, n, r.clone(), acts, 0..m, buf, r.len()))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        for res in results {
            res?;
        }
        for (r, buf) in ranges.iter().zip(&bufs) {
            for mi in 0..m {
                out[mi * n + r.start..mi * n + r.end]
                    .copy_from_slice(&buf[mi * r.len()..(mi + 1) * r.len()]);
            }
        }
        Ok(())
    }

    /// The weight rows `n_range` of a matmul with a [`PackedMatrix`]: `out[m·ldo + (n −
    /// n_range.start)] = dot(W row n, A row m)` for every activation row m, bit-identical
    /// to [`Kernels::matmul_n_range`] on the original bytes. Ranges that start at a multiple
    /// of [`PackedMatrix::TILE`] avoid recomputing a shared tile; `out` needs
    /// `(M − 1)·ldo + n_range.len()` elements.
    pub fn matmul_packed(
        &self,
        w: &PackedMatrix,
        acts: &QuantizedActs,
        n_range: Range<usize>,
        out: &mut [f32],
        ldo: usize,
    ) -> Result<(), QuantError> {
        let format = w.format();
        if let Some(bytes) = w.plain_bytes() {
            if acts.k != w.k() {
                return Err(QuantError::Length {
                    what: "activation row length (the matrix's K)",
                    expected: w.k(),
                    got: acts.k,
                });
            }
            return self.matmul_n_range(format, bytes, w.n(), acts, n_range, out, ldo);
        }
        self.check_packed(w, acts, &n_range, out.len(), ldo)?;
        if n_range.is_empty() || acts.m == 0 {
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if self.path != Path::Scalar {
            // SAFETY: `Kernels` for this path exists only after feature detection; the
            // matrix is tiled and shapes were validated by `check_packed`.
            unsafe {
                crate::x86::packed::matmul_packed(
                    self.path == Path::Avx512Vnni,
                    w,
                    acts,
                    n_range,
                    out,
                    ldo,
                );
            }
            return Ok(());
        }
        for m in 0..acts.m {
            for n in n_range.clone() {
                out[m * ldo + n - n_range.start] =
                    scalar::dot_blocks(format, acts, m, |b| w.decode_block(n, b));
            }
        }
        Ok(())
    }

    /// [`Kernels::matmul_packed`] over all N (`out` is M·N), with N split into `threads`
    /// contiguous tile-aligned ranges, one scoped thread each. Results do not depend on
    /// `threads`.
    pub fn matmul_packed_threaded(
        &self,
        w: &PackedMatrix,
        acts: &QuantizedActs,
        out: &mut [f32],
        threads: usize,
    ) -> Result<(), QuantError> {
        let (m, n) = (acts.m, w.n());
        expect_len("matmul output (M·N)", m.checked_mul(n), out.len())?;
        let tiles = n.div_ceil(PackedMatrix::TILE);
        let threads = threads.clamp(1, tiles.max(1));
        if threads == 1 || m == 0 {
            return self.matmul_packed(w, acts, 0..n, out, n);
        }
        let chunk = tiles.div_ceil(threads) * PackedMatrix::TILE;
        let ranges: Vec<Range<usize>> = (0..threads)
            .map(|t| (t * chunk).min(n)..((t + 1) * chunk).min(n))
            .filter(|r| !r.is_empty())
            .collect();
        let mut bufs: Vec<Vec<f32>> = ranges.iter().map(|r| vec![0.0; m * r.len()]).collect();
        let results: Vec<Result<(), QuantError>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranges
                .iter()
                .zip(bufs.iter_mut())
                .map(|(r, buf)| {
                    let r = r.clone();
                    s.spawn(move || self.matmul_packed(w, acts, r.clone(), buf, r.len()))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        for res in results {
            res?;
        }
        for (r, buf) in ranges.iter().zip(&bufs) {
            for mi in 0..m {
                out[mi * n + r.start..mi * n + r.end]
                    .copy_from_slice(&buf[mi * r.len()..(mi + 1) * r.len()]);
            }
        }
        Ok(())
    }

    /// Shape checks of a packed matmul.
    fn check_packed(
        &self,
        w: &PackedMatrix,
        acts: &QuantizedActs,
        n_range: &Range<usize>,
        out_len: usize,
        ldo: usize,
    ) -> Result<(), QuantError> {
        let format = w.format();
        if format.act_layout() != acts.layout {
            return Err(QuantError::ActLayout {
                format,
                needed: format.act_layout(),
                got: acts.layout,
            });
        }
        if acts.k != w.k() {
            return Err(QuantError::Length {
                what: "activation row length (the matrix's K)",
                expected: w.k(),
                got: acts.k,
            });
        }
        if n_range.start > n_range.end || n_range.end > w.n() {
            return Err(QuantError::NRange {
                start: n_range.start,
                end: n_range.end,
                n: w.n(),
            });
        }
        let rows = n_range.len();
        if rows == 0 || acts.m == 0 {
            return Ok(());
        }
        if ldo < rows {
            return Err(QuantError::Length {
                what: "output row stride (at least the range length)",
                expected: rows,
                got: ldo,
            });
        }
        let needed = (acts.m - 1)
            .checked_mul(ldo)
            .and_then(|v| v.checked_add(rows))
            .ok_or(QuantError::TooLarge)?;
        if out_len < needed {
            return Err(QuantError::Length {
                what: "output",
                expected: needed,
                got: out_len,
            });
        }
        Ok(())
    }

    /// Validate and run weight rows `n_range` against activation rows `ms`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        format: Format,
        w: &[u8],
        n: usize,
        n_range: Range<usize>,
        acts: &QuantizedActs,
        ms: Range<usize>,
        out: &mut [f32],
        ldo: usize,
    ) -> Result<(), QuantError> {
        if format.act_layout() != acts.layout {
            return Err(QuantError::ActLayout {
                format,
                needed: format.act_layout(),
                got: acts.layout,
            });
        }
        let row_bytes = format.row_bytes(acts.k)?;
        expect_len("weight bytes (N rows)", n.checked_mul(row_bytes), w.len())?;
        if n_range.start > n_range.end || n_range.end > n {
            return Err(QuantError::NRange {
                start: n_range.start,
                end: n_range.end,
                n,
            });
        }
        let rows = n_range.len();
        let mrows = ms.len();
        if rows == 0 || mrows == 0 {
            return Ok(());
        }
        if ldo < rows {
            return Err(QuantError::Length {
                what: "output row stride (at least the range length)",
                expected: rows,
                got: ldo,
            });
        }
        let needed = (mrows - 1)
            .checked_mul(ldo)
            .and_then(|v| v.checked_add(rows))
            .ok_or(QuantError::TooLarge)?;
        if out.len() < needed {
            return Err(QuantError::Length {
                what: "output",
                expected: needed,
                got: out.len(),
            });
        }
        let w = &w[n_range.start * row_bytes..n_range.end * row_bytes];
        #[cfg(target_arch = "x86_64")]
        {
            let mut job = crate::x86::Job {
                w,
                rows,
                row_bytes,
                acts,
                ms: ms.clone(),
                out: &mut *out,
                ldo,
            };
            if self.path != Path::Scalar && crate::x86::supports(format, &job) {
                match self.path {
                    // SAFETY: `Kernels` for this path exists only after feature detection;
                    // the job's shapes were validated above.
                    Path::Avx512Vnni => unsafe { crate::x86::matmul_avx512(format, &mut job) },
                    // SAFETY: as above.
                    Path::Avx2 => unsafe { crate::x86::matmul_avx2(format, &mut job) },
                    Path::Scalar => {}
                }
                return Ok(());
            }
        }
        for (mi, m) in ms.enumerate() {
            for (r, row) in w.chunks_exact(row_bytes).enumerate() {
                out[mi * ldo + r] = scalar::dot(format, row, acts, m);
            }
        }
        Ok(())
    }
}

fn expect_len(what: &'static str, expected: Option<usize>, got: usize) -> Result<(), QuantError> {
    let expected = expected.ok_or(QuantError::TooLarge)?;
    if expected != got {
        return Err(QuantError::Length {
            what,
            expected,
            got,
        });
    }
    Ok(())
}
