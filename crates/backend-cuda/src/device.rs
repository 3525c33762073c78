//! One CUDA device: its context and stream, the kernel module compiled by NVRTC (cached on
//! disk per device and source hash), typed buffers, and kernel launches.

use crate::CudaError;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use cudarc::nvrtc::CompileOptions;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// The kernel source (CUDA C++ without headers), compiled at run time.
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");

/// Options NVRTC compiles [`KERNEL_SOURCE`] with: IEEE division and square root, no
/// flush-to-zero, and no contraction of `a * b + c` (only explicit `fmaf` fuses).
const NVRTC_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
];

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long` (64-bit).
    I64(i64),
    /// `float`.
    F32(f32),
}

/// A typed device buffer (device memory from `cuMemAlloc`, never managed memory).
#[derive(Debug)]
pub struct Buf<T> {
    s: CudaSlice<T>,
}

impl<T> Buf<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.s.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.s.len() == 0
    }
}

/// One GPU with the lockstep kernels loaded.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The kernel module (loaded through the driver API directly, so launches can carry
    /// launch attributes), unloaded on drop.
    module: sys::CUmodule,
    funcs: HashMap<String, sys::CUfunction>,
    /// Whether launches of the [`PDL`] kernels may overlap the kernel before them
    /// (programmatic dependent launch, compute capability 9.0 and newer).
    pdl: std::sync::atomic::AtomicBool,
    name: String,
    cc: (i32, i32),
    ordinal: usize,
    compile_cached: bool,
    sm_count: usize,
    smem_optin: usize,
    unordered: std::sync::atomic::AtomicBool,
    /// Whether prefill matmuls of the formats with a tensor-core kernel use it
    /// ([`Device::set_mma`]).
    mma: std::sync::atomic::AtomicBool,
    mmq_wide: std::sync::atomic::AtomicBool,
    /// The fewest rows (0: none) a matmul of Q4_K / Q6_K takes the tensor-core matvec
    /// kernels for, up to [`Device::tc_max_rows`] ([`Device::set_tc_min_rows`]).
    tc_min_rows: std::sync::atomic::AtomicUsize,
    /// Whether those matmuls split a row group's blocks over a CTA's warps (`_tcs8`)
    /// instead of giving a warp whole groups (`_tc8`) ([`Device::set_tc_split`]).
    tc_split: std::sync::atomic::AtomicBool,
    /// The most rows a matmul takes those kernels for ([`Device::tc_max_rows`]).
    tc_max_rows: usize,
    /// The fewest rows a matmul takes the tensor-core kernels for ([`Device::set_mma_min_rows`]).
    mma_min_rows: std::sync::atomic::AtomicUsize,
    profile: std::sync::Mutex<Option<Vec<(String, f64)>>>,
}

// SAFETY: the module and function handles are plain driver handles, valid in any thread
// once the device's context is bound (every use binds it first); the driver API is
// thread-safe. cudarc's own module type is Send and Sync for the same reason.
unsafe impl Send for Device {}
// SAFETY: as above; launches go through the one stream, which the driver serializes.
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // Nothing may still run kernels of the module: wait, then unload.
            let _ = self.stream.synchronize();
            // SAFETY: loaded in `Device::new`, unloaded once; no function of it is used
            // after this.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Device(cuda:{} {} sm_{}{})",
            self.ordinal, self.name, self.cc.0, self.cc.1
        )
    }
}

const KERNELS: &[&str] = &[
    "quantize_acts",
    "matmul_q4_0",
    "matmul_q4_0_m1",
    "matmul_q4_0_m16",
    "matmul_q4_1",
    "matmul_q4_1_m1",
    "matmul_q4_1_m16",
    "matmul_q5_0",
    "matmul_q5_0_m1",
    "matmul_q5_0_m16",
    "matmul_q5_1",
    "matmul_q5_1_m1",
    "matmul_q5_1_m16",
    "matmul_q8_0",
    "matmul_q8_0_m1",
    "matmul_q8_0_m16",
    "matmul_q2_k",
    "matmul_q2_k_m1",
    "matmul_q2_k_m16",
    "matmul_q3_k",
    "matmul_q3_k_m1",
    "matmul_q3_k_m16",
    "matmul_q4_k",
    "matmul_q4_k_m1",
    "matmul_q4_k_m16",
    "matmul_q5_k",
    "matmul_q5_k_m1",
    "matmul_q5_k_m16",
    "matmul_q6_k",
    "matmul_q6_k_m1",
    "matmul_q6_k_m16",
    "mmq_q4_k",
    "mmqw_q4_k",
    "mmqw_q6_k",
    "mmq_q6_k",
    "mmq_q4_0",
    "mmq_q4_1",
    "mmq_q5_0",
    "mmq_q5_1",
    "mmq_q8_0",
    "mmqw_q4_0",
    "mmqw_q4_1",
    "mmqw_q5_0",
    "mmqw_q5_1",
    "mmqw_q8_0",
    "matmul_float",
    "rms_norm",
    "add_in_place",
    "add_bias",
    "swiglu",
    "rope",
    "norm_quant",
    "rope_kv",
    "copy_u16",
    "attention",
    "attention_tiled",
    "attention_tiled_pre",
    "attention_compact_64",
    "attention_compact_128",
    "att_scores",
    "argmax_part",
    "argmax_rows",
    "matvec_q4_0",
    "matvec_q4_0_rows",
    "matvec_q4_1",
    "matvec_q4_1_rows",
    "matvec_q5_0",
    "matvec_q5_0_rows",
    "matvec_q5_1",
    "matvec_q5_1_rows",
    "matvec_q8_0",
    "matvec_q8_0_rows",
    "matvec_q2_k",
    "matvec_q2_k_rows",
    "matvec_q3_k",
    "matvec_q3_k_rows",
    "matvec_q4_k",
    "matvec_q4_k_rows",
    "matvec_q5_k",
    "matvec_q5_k_rows",
    "matvec_q6_k",
    "matvec_q6_k_rows",
    "matvec_q4_k_q6_k",
    "matvec_q4_k_q6_k_rows",
    "matvec_q4_k_tc",
    "matvec_q6_k_tc",
    "matvec_q4_k_q6_k_tc",
    "matvec_q4_k_tc8",
    "matvec_q6_k_tc8",
    "matvec_q4_k_q6_k_tc8",
    "matvec_q4_k_tcs8",
    "matvec_q6_k_tcs8",
    "matvec_q4_k_q6_k_tcs8",
    "matvec_q5_k_q6_k",
    "matvec_q5_k_q6_k_rows",
    "summary_exp",
    "summary_lanes",
];

/// Kernels that may take more than 48 KiB of dynamic shared memory (the device's opt-in
/// limit is raised for them at load).
const LARGE_SMEM: &[&str] = &[
    "attention_tiled",
    "attention_tiled_pre",
    "attention_compact_64",
    "attention_compact_128",
    "att_scores",
    "mmqw_q4_k",
    "mmqw_q6_k",
    "mmqw_q4_0",
    "mmqw_q4_1",
    "mmqw_q5_0",
    "mmqw_q5_1",
    "mmqw_q8_0",
    "matvec_q4_0",
    "matvec_q4_0_rows",
    "matvec_q4_1",
    "matvec_q4_1_rows",
    "matvec_q5_0",
    "matvec_q5_0_rows",
    "matvec_q5_1",
    "matvec_q5_1_rows",
    "matvec_q8_0",
    "matvec_q8_0_rows",
    "matvec_q2_k",
    "matvec_q2_k_rows",
    "matvec_q3_k",
    "matvec_q3_k_rows",
    "matvec_q4_k",
    "matvec_q4_k_rows",
    "matvec_q5_k",
    "matvec_q5_k_rows",
    "matvec_q6_k",
    "matvec_q6_k_rows",
    "matvec_q4_k_q6_k",
    "matvec_q4_k_q6_k_rows",
    "matvec_q4_k_tc",
    "matvec_q6_k_tc",
    "matvec_q4_k_q6_k_tc",
    "matvec_q4_k_tc8",
    "matvec_q6_k_tc8",
    "matvec_q4_k_q6_k_tc8",
    "matvec_q4_k_tcs8",
    "matvec_q6_k_tcs8",
    "matvec_q4_k_q6_k_tcs8",
    "matvec_q5_k_q6_k",
    "matvec_q5_k_q6_k_rows",
];

/// Kernels that wait for the kernel before them with `griddepcontrol.wait` before reading
/// anything it wrote (and read nothing but weights before that): they may be launched with
/// programmatic dependent launch.
const PDL: &[&str] = &[
    "attention_tiled",
    "attention_tiled_pre",
    "attention_compact_64",
    "attention_compact_128",
    "att_scores",
    "rope_kv",
    "argmax_part",
    "argmax_rows",
    "summary_exp",
    "summary_lanes",
    "matvec_q4_0",
    "matvec_q4_0_rows",
    "matvec_q4_1",
    "matvec_q4_1_rows",
    "matvec_q5_0",
    "matvec_q5_0_rows",
    "matvec_q5_1",
    "matvec_q5_1_rows",
    "matvec_q8_0",
    "matvec_q8_0_rows",
    "matvec_q2_k",
    "matvec_q2_k_rows",
    "matvec_q3_k",
    "matvec_q3_k_rows",
    "matvec_q4_k",
    "matvec_q4_k_rows",
    "matvec_q5_k",
    "matvec_q5_k_rows",
    "matvec_q6_k",
    "matvec_q6_k_rows",
    "matvec_q4_k_q6_k",
    "matvec_q4_k_q6_k_rows",
    "matvec_q4_k_tc",
    "matvec_q6_k_tc",
    "matvec_q4_k_q6_k_tc",
    "matvec_q4_k_tc8",
    "matvec_q6_k_tc8",
    "matvec_q4_k_q6_k_tc8",
    "matvec_q4_k_tcs8",
    "matvec_q6_k_tcs8",
    "matvec_q4_k_q6_k_tcs8",
    "matvec_q5_k_q6_k",
    "matvec_q5_k_q6_k_rows",
];

/// Whether kernel `name` may take more than 48 KiB of dynamic shared memory: the
/// [`LARGE_SMEM`] kernels and the many-row attention kernels.
fn large_smem(name: &str) -> bool {
    LARGE_SMEM.contains(&name) || name.starts_with("attention_rows_")
}

/// The default [`Device::tc_min_rows`]: the split tensor-core matvec (`_tcs8`, a CTA per
/// 16-row group, its blocks over the CTA's warps) from two rows. Measured on an H100
/// (2026-12-08, 1.5B shape, verify blocks after 512 tokens, `lockstep bench --verify
/// --device cuda -r 3`), ms with `_tcs8` from two rows / the warp kernels below eight rows
/// and `_tc8` from eight: 2 rows 3.24 / 3.98, 4 rows 3.36 / 4.82, 8 rows 3.77 / 6.44,
/// 12 rows 5.92 / 10.28, 16 rows 6.33 / 11.29. The unsplit `_tc8` (one warp per 16-row
/// group) was slower than the warp kernels below eight rows (seventh session: 2 rows 4.91
/// / 4.01).
pub(crate) const TC_MIN_ROWS: usize = 2;

/// Static shared memory the [`LARGE_SMEM`] kernels declare themselves, at most (bytes):
/// their dynamic share is the opt-in limit less this.
const LARGE_SMEM_STATIC: usize = 8 * 1024;

fn drv(what: &str, e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(format!("{what}: {e}"))
}

/// Where compiled PTX is cached: `$LOCKSTEP_HOME/cuda`, else `$XDG_CACHE_HOME/lockstep/cuda`,
/// else `~/.cache/lockstep/cuda`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("LOCKSTEP_HOME") {
        return Some(PathBuf::from(h).join("cuda"));
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(x).join("lockstep").join("cuda"));
    }
    std::env::var_os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("lockstep")
            .join("cuda")
    })
}

/// Whether the CUDA driver library can be loaded at all (no panic when it cannot).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Number of CUDA devices (0 when the driver is missing or reports none).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
}

/// The fewest rows a matmul takes the tensor-core kernels for unless
/// `LOCKSTEP_CUDA_MMA_MIN_ROWS` or [`Device::set_mma_min_rows`] says otherwise.
///
/// 9: Q4_K and Q6_K matmuls of up to 16 rows take the tensor-core matvec kernels
/// ([`Device::tc_min_rows`]) first, so this threshold moves only the other formats (the
/// 32-element blocks that small models' `*_K_M` files use where a row is no multiple of 256).
/// Measured on an H100 (2026-12-08, `lockstep bench --verify --device cuda -r 3`, verify
/// blocks after 512 tokens), ms at 9 / 14: qwen2.5-0.5b shape, 9 rows 5.29 / 10.84, 13 rows
/// 5.24 / 11.64; smollm2-135m shape, 9 rows 5.42 / 6.09, 13 rows 5.50 / 6.84; eight rows
/// and fewer stay on the warp kernels (4.36 ms at 8 rows against ~5.2 for a 32-row tile on
/// the 0.5B shape). The 1.5B shape (Q4_K and Q6_K only) is the same either way.
pub const MMA_MIN_ROWS_DEFAULT: usize = 9;

/// The tensor-core prefill matmuls' default: on unless `LOCKSTEP_CUDA_MMA=0`.
fn mma_default() -> bool {
    std::env::var("LOCKSTEP_CUDA_MMA").map_or(true, |v| v != "0")
}

/// Compiles [`KERNEL_SOURCE`] with NVRTC for compute capability `cc` and returns the
/// PTX text (needs the NVRTC library, not a GPU).
pub fn compile_ptx(cc: (i32, i32)) -> Result<String, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::Unavailable(
            "the NVRTC library (libnvrtc.so) could not be loaded; it compiles the kernels at \
             run time"
                .into(),
        ));
    }
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture=compute_{}{}", cc.0, cc.1));
    let opts = CompileOptions {
        options,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts)
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

impl Device {
    /// Opens device `ordinal`, compiles (or loads from the cache) the kernels. A clear
    /// error when the driver, NVRTC or the device is missing.
    pub fn new(ordinal: usize) -> Result<Device, CudaError> {
        if !driver_present() {
            return Err(CudaError::Unavailable(
                "the CUDA driver library (libcuda.so) could not be loaded".into(),
            ));
        }
        let count = device_count();
        if ordinal >= count {
            return Err(CudaError::Unavailable(format!(
                "CUDA device {ordinal} requested but {count} device(s) found"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| drv("creating the CUDA context", e))?;
        // One stream: no per-buffer event tracking is needed.
        // SAFETY: every buffer of this context is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own (the legacy default stream cannot be captured in a graph).
        let stream = ctx.new_stream().map_err(|e| drv("creating a stream", e))?;
        let name = ctx.name().map_err(|e| drv("device name", e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| drv("compute capability", e))?;
        if cc < (8, 0) {
            return Err(CudaError::Unavailable(format!(
                "{name} has compute capability {}.{}; lockstep's CUDA kernels need 8.0 or \
                 newer (Ampere, Ada, Hopper: they stage weights with cp.async)",
                cc.0, cc.1
            )));
        }
        let arch = format!("--gpu-architecture=compute_{}{}", cc.0, cc.1);
        let mut h = Sha256::new();
        h.update(KERNEL_SOURCE.as_bytes());
        for o in NVRTC_OPTIONS {
            h.update(o.as_bytes());
        }
        h.update(arch.as_bytes());
        h.update(name.as_bytes());
        let key: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let cached = cache_dir().map(|d| d.join(format!("{key}.ptx")));
        let (ptx_src, compile_cached) = match cached
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
        {
            Some(s) => (s, true),
            None => {
                let src = compile_ptx(cc)?;
                if let Some(p) = &cached {
                    if let Some(dir) = p.parent() {
                        let _ = std::fs::create_dir_all(dir);
                    }
                    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                    if std::fs::write(&tmp, &src).is_ok() {
                        let _ = std::fs::rename(&tmp, p);
                    }
                }
                (src, false)
            }
        };
        ctx.bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let ptx_c = std::ffi::CString::new(ptx_src)
            .map_err(|_| CudaError::Compile("PTX with a NUL byte".into()))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `ptx_c` is a NUL-terminated PTX image; the context is bound.
        unsafe { sys::cuModuleLoadData(&mut module, ptx_c.as_ptr().cast()) }
            .result()
            .map_err(|e| drv("loading the kernel module", e))?;
        let attr = |a: sys::CUdevice_attribute| -> Result<usize, CudaError> {
            ctx.attribute(a)
                .map(|v| usize::try_from(v).unwrap_or(0))
                .map_err(|e| drv("device attribute", e))
        };
        use sys::CUdevice_attribute as A;
        let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1);
        let optin = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let smem_optin = optin.saturating_sub(LARGE_SMEM_STATIC).max(48 * 1024);
        let mut funcs = HashMap::new();
        let attention_rows = crate::forward::ATTENTION_ROWS_64
            .iter()
            .chain(&crate::forward::ATTENTION_ROWS_128);
        for &k in KERNELS.iter().chain(attention_rows) {
            let name_c = std::ffi::CString::new(k).map_err(|_| CudaError::Driver(k.into()))?;
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `module` is loaded; `name_c` is NUL-terminated.
            let got = unsafe { sys::cuModuleGetFunction(&mut f, module, name_c.as_ptr()) }
                .result()
                .map_err(|e| drv(&format!("kernel {k}"), e))
                .and_then(|()| {
                    if large_smem(k) && smem_optin > 48 * 1024 {
                        // SAFETY: `f` is a function of the loaded module.
                        unsafe {
                            sys::cuFuncSetAttribute(
                                f,
                                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                i32::try_from(smem_optin).unwrap_or(i32::MAX),
                            )
                        }
                        .result()
                        .map_err(|e| drv(&format!("shared memory limit of {k}"), e))
                    } else {
                        Ok(())
                    }
                });
            if let Err(e) = got {
                // SAFETY: unloaded once, nothing of it is used after.
                unsafe { sys::cuModuleUnload(module) };
                return Err(e);
            }
            funcs.insert(k.to_string(), f);
        }
        let pdl = cc >= (9, 0) && std::env::var("LOCKSTEP_CUDA_PDL").map_or(true, |v| v != "0");
        Ok(Device {
            ctx,
            stream,
            module,
            funcs,
            pdl: std::sync::atomic::AtomicBool::new(pdl),
            name,
            cc,
            ordinal,
            compile_cached,
            sm_count,
            smem_optin,
            unordered: std::sync::atomic::AtomicBool::new(false),
            mma: std::sync::atomic::AtomicBool::new(cc >= (8, 0) && mma_default()),
            mmq_wide: std::sync::atomic::AtomicBool::new(
                std::env::var("LOCKSTEP_CUDA_MMQW").map_or(true, |v| v != "0"),
            ),
            tc_min_rows: std::sync::atomic::AtomicUsize::new(
                std::env::var("LOCKSTEP_CUDA_TC_ROWS")
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(TC_MIN_ROWS),
            ),
            tc_split: std::sync::atomic::AtomicBool::new(
                std::env::var("LOCKSTEP_CUDA_TCS").map_or(true, |v| v != "0"),
            ),
            tc_max_rows: std::env::var("LOCKSTEP_CUDA_TC_MAX")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(crate::ops::TC_CHUNKED_ROWS),
            mma_min_rows: std::sync::atomic::AtomicUsize::new(
                std::env::var("LOCKSTEP_CUDA_MMA_MIN_ROWS")
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok())
                    .map_or(MMA_MIN_ROWS_DEFAULT, |n| n.max(1)),
            ),
            profile: std::sync::Mutex::new(None),
        })
    }

    /// Benchmark hook: with `on`, quantized matmuls sum their blocks in an order of their own
    /// (each lane group its blocks, then a tree) instead of the canonical block order, to
    /// measure what the fixed order costs. Results then differ from the CPU's and depend on
    /// the kernel; the engine never turns this on.
    pub fn set_unordered_matmul(&self, on: bool) {
        self.unordered
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Profiling hook: with `on`, every launch waits for the stream before and after and
    /// records its kernel's name and wall time (host clock), so a step run without graphs
    /// shows where its time goes. Slow; for `cuda_bench --profile` only.
    pub fn set_profile(&self, on: bool) {
        if let Ok(mut p) = self.profile.lock() {
            *p = on.then(Vec::new);
        }
    }

    /// The launches recorded since [`Device::set_profile`] turned profiling on (emptied).
    pub fn take_profile(&self) -> Vec<(String, f64)> {
        self.profile
            .lock()
            .ok()
            .and_then(|mut p| p.as_mut().map(std::mem::take))
            .unwrap_or_default()
    }

    /// Turns the tensor-core prefill matmuls (`mmq_*`: Q4_K, Q6_K and the 32-element block
    /// formats over [`Device::mma_min_rows`] or more rows, [`MMA_MIN_ROWS_DEFAULT`] by default) on or off. They compute the same bits as the other matmul kernels (the
    /// same exact integer block sums, the same float steps in block order), so this only
    /// changes speed; on by default (`LOCKSTEP_CUDA_MMA=0` turns them off), and never on
    /// below compute capability 8.0 (no int8 `mma` instruction there).
    pub fn set_mma(&self, on: bool) {
        self.mma.store(
            on && self.cc >= (8, 0),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Whether the tensor-core prefill matmuls are on ([`Device::set_mma`]).
    pub fn mma(&self) -> bool {
        self.mma.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns the wide tensor-core tiles (`mmqw_*` for Q4_K and the 32-element block
    /// formats: 64 rows by 64 columns, one m16n8k32 step per 32 values, weight fragments
    /// decoded straight from the staged raw blocks) on or off for matmuls over more than 32
    /// rows; off, those take the 32-row `mmq_*` kernels. The same bits either way; on by
    /// default (`LOCKSTEP_CUDA_MMQW=0` turns them off). Only matters while [`Device::mma`]
    /// is on.
    pub fn set_mmq_wide(&self, on: bool) {
        self.mmq_wide
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the fewest rows a matmul takes the tensor-core kernels for (at least 1; fewer go
    /// to the warp kernels, which read each weight block once per 16 rows). The same bits
    /// either way, so this only changes speed; `LOCKSTEP_CUDA_MMA_MIN_ROWS` sets it at start.
    pub fn set_mma_min_rows(&self, rows: usize) {
        self.mma_min_rows
            .store(rows.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The fewest rows a matmul takes the tensor-core kernels for
    /// ([`Device::set_mma_min_rows`]).
    pub fn mma_min_rows(&self) -> usize {
        self.mma_min_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the fewest rows (0: never) from which matmuls of up to 16 rows of Q4_K and Q6_K
    /// matrices (verify blocks, batched decode steps) take the tensor-core matvec kernels:
    /// sixteen weight rows at a time, up to eight activation rows' sub-block dot products
    /// from one int8 tensor-core step, each weight block read once per eight rows
    /// ([`Device::set_tc_split`] says how the work is spread). The same bits
    /// either way; `TC_MIN_ROWS` by default, `LOCKSTEP_CUDA_TC_ROWS=N` sets it at start.
    /// Only matters while [`Device::mma`] is on.
    pub fn set_tc_min_rows(&self, rows: usize) {
        self.tc_min_rows
            .store(rows, std::sync::atomic::Ordering::Relaxed);
    }

    /// [`Device::set_tc_min_rows`] with 1 (every row count up to 16) or 0 (never).
    pub fn set_tc_rows(&self, on: bool) {
        self.set_tc_min_rows(usize::from(on));
    }

    /// The fewest rows a matmul takes the tensor-core matvec kernels for (0: never).
    pub fn tc_min_rows(&self) -> usize {
        self.tc_min_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets how the tensor-core matvec kernels of [`Device::set_tc_min_rows`] spread their
    /// work: `true` (the default; `LOCKSTEP_CUDA_TCS=0` turns it off at start) a CTA per
    /// 16-row group at a time with the group's blocks over its warps and the float steps in
    /// block order after a barrier (`_tcs8`), `false` a warp per 16-row group (`_tc8`). The
    /// same bits either way.
    pub fn set_tc_split(&self, on: bool) {
        self.tc_split
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The most rows a matmul takes the tensor-core matvec kernels for, in launches of up to
    /// eight rows: `TC_CHUNKED_ROWS`, or `LOCKSTEP_CUDA_TC_MAX=N` at start (for measuring;
    /// more rows take the tensor-core tiles).
    pub fn tc_max_rows(&self) -> usize {
        self.tc_max_rows
    }

    /// Whether the tensor-core matvec kernels split a group's blocks over a CTA's warps.
    pub fn tc_split(&self) -> bool {
        self.tc_split.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the wide Q4_K tiles are on ([`Device::set_mmq_wide`]).
    pub fn mmq_wide(&self) -> bool {
        self.mmq_wide.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`Device::set_unordered_matmul`] is on.
    pub(crate) fn unordered_matmul(&self) -> bool {
        self.unordered.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The device's name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Dynamic shared memory one CTA of a large-tile kernel (matvec, tiled attention) may
    /// take (bytes; 48 KiB on devices without an opt-in above that).
    pub(crate) fn smem_limit(&self) -> usize {
        self.smem_optin
    }

    /// CTAs of `threads` threads with `smem` bytes of dynamic shared memory that fit on one
    /// multiprocessor at once for kernel `name` (at least 1).
    pub(crate) fn occupancy(&self, name: &str, threads: u32, smem: usize) -> usize {
        let Some(&f) = self.funcs.get(name) else {
            return 1;
        };
        if self.ctx.bind_to_thread().is_err() {
            return 1;
        }
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `f` is a function of this device's loaded module.
        let ok = unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                f,
                i32::try_from(threads).unwrap_or(i32::MAX),
                smem,
            )
        }
        .result()
        .is_ok();
        if ok {
            usize::try_from(n).unwrap_or(1).max(1)
        } else {
            1
        }
    }

    /// Turns programmatic dependent launch off or on (on by default on compute capability
    /// 9.0 and newer unless `LOCKSTEP_CUDA_PDL=0`): with it, a [`PDL`] kernel's launch may
    /// begin while the kernel before it still runs, and it waits for that kernel's results
    /// (`griddepcontrol.wait`) before reading them. Results are the same either way.
    /// Graphs captured before keep the choice they were captured with.
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(
            on && self.cc >= (9, 0),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Whether programmatic dependent launch is on.
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the kernels came from the on-disk PTX cache (no NVRTC run).
    pub fn kernels_from_cache(&self) -> bool {
        self.compile_cached
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.bind_to_thread().map_err(|e| drv("bind", e))?;
        cudarc::driver::result::mem_get_info().map_err(|e| drv("memory info", e))
    }

    /// The stream every launch and copy goes to.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for every queued launch and copy.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(|e| drv("synchronize", e))
    }

    /// A zeroed buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<Buf<T>, CudaError> {
        let s = self
            .stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| drv(&format!("allocating {len} elements"), e))?;
        Ok(Buf { s })
    }

    /// A buffer holding a copy of `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<Buf<T>, CudaError> {
        if host.is_empty() {
            return Err(CudaError::Driver("upload of an empty slice".into()));
        }
        let s = self
            .stream
            .memcpy_stod(host)
            .map_err(|e| drv(&format!("uploading {} elements", host.len()), e))?;
        Ok(Buf { s })
    }

    /// Copies `host` into the start of `dst`.
    pub fn write<T: DeviceRepr>(&self, host: &[T], dst: &mut Buf<T>) -> Result<(), CudaError> {
        if host.len() > dst.len() {
            return Err(CudaError::Driver(format!(
                "write of {} elements into a buffer of {}",
                host.len(),
                dst.len()
            )));
        }
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.s.slice_mut(0..host.len());
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| drv("host-to-device copy", e))
    }

    /// Copies `host` into `dst` from element `off` on (asynchronous on the stream).
    pub fn write_at<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut Buf<T>,
        off: usize,
    ) -> Result<(), CudaError> {
        if off + host.len() > dst.len() {
            return Err(CudaError::Driver(format!(
                "write of {}..{} into a buffer of {}",
                off,
                off + host.len(),
                dst.len()
            )));
        }
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.s.slice_mut(off..off + host.len());
        self.stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| drv("host-to-device copy", e))
    }

    /// Copies the first `n` elements of `src` to a new host vector (synchronizes).
    pub fn read<T: DeviceRepr + Default + Clone>(
        &self,
        src: &Buf<T>,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); n];
        self.read_into(src, 0, &mut out)?;
        Ok(out)
    }

    /// Copies `out.len()` elements of `src` from element `off` into `out` (synchronizes).
    pub fn read_into<T: DeviceRepr>(
        &self,
        src: &Buf<T>,
        off: usize,
        out: &mut [T],
    ) -> Result<(), CudaError> {
        if off + out.len() > src.len() {
            return Err(CudaError::Driver(format!(
                "read of {}..{} from a buffer of {}",
                off,
                off + out.len(),
                src.len()
            )));
        }
        if out.is_empty() {
            return Ok(());
        }
        let view = src.s.slice(off..off + out.len());
        self.stream
            .memcpy_dtoh(&view, out)
            .map_err(|e| drv("device-to-host copy", e))?;
        self.sync()
    }

    /// The raw device address of `b` (plus `off` elements).
    pub(crate) fn ptr<T>(&self, b: &Buf<T>, off: usize) -> u64 {
        let (p, _sync) = b.s.device_ptr(&self.stream);
        p + (off * std::mem::size_of::<T>()) as u64
    }

    /// Launches kernel `name`.
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), CudaError> {
        self.launch_smem(name, grid, block, 0, args)
    }

    /// Launches kernel `name` with `smem` bytes of dynamic shared memory (at most 48 KiB,
    /// the amount every device grants without an opt-in, except for the kernels whose limit
    /// was raised at load: [`Device::smem_limit`]).
    pub(crate) fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        let limit = if large_smem(name) {
            self.smem_optin
        } else {
            48 * 1024
        };
        if smem as usize > limit {
            return Err(CudaError::Shape(format!(
                "{name}: {smem} bytes of shared memory (at most {limit})"
            )));
        }
        let f = *self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::Driver(format!("unknown kernel {name}")))?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // The argument values, then a pointer to each in parameter order.
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(v) => v,
                Arg::I32(v) => u64::from(v as u32),
                Arg::I64(v) => v as u64,
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = vals
            .iter_mut()
            .map(|v| (v as *mut u64).cast::<std::ffi::c_void>())
            .collect();
        // SAFETY: a zeroed attribute is a valid value of this plain C struct.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let use_pdl = self.pdl() && PDL.contains(&name);
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: if use_pdl {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(use_pdl),
        };
        let profiling = self.profile.lock().is_ok_and(|p| p.is_some());
        let t0 = if profiling {
            self.sync()?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        // SAFETY: every kernel's parameter list is the sequence of `args` given by the
        // typed wrappers in `ops.rs`, whose buffers are sized by the same wrappers; each
        // parameter is read from the start of its 8-byte slot (little-endian: an `int` or
        // `float` argument is the low 4 bytes); `vals`, `params` and `attr` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| drv(&format!("launching {name}"), e))?;
        if let Some(t0) = t0 {
            self.sync()?;
            let dt = t0.elapsed().as_secs_f64();
            if let Ok(mut p) = self.profile.lock()
                && let Some(v) = p.as_mut()
            {
                v.push((name.to_string(), dt));
            }
        }
        Ok(())
    }
}
