//! One CUDA device: its context and stream, the kernel module compiled by NVRTC (cached on
//! disk per device and source hash), typed buffers, and kernel launches.

use crate::CudaError;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
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
    _module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    name: String,
    cc: (i32, i32),
    ordinal: usize,
    compile_cached: bool,
    unordered: std::sync::atomic::AtomicBool,
    profile: std::sync::Mutex<Option<Vec<(String, f64)>>>,
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
    "argmax_rows",
];

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
        let module = ctx
            .load_module(Ptx::from_src(ptx_src))
            .map_err(|e| drv("loading the kernel module", e))?;
        let mut funcs = HashMap::new();
        for &k in KERNELS {
            let f = module
                .load_function(k)
                .map_err(|e| drv(&format!("kernel {k}"), e))?;
            funcs.insert(k.to_string(), f);
        }
        Ok(Device {
            ctx,
            stream,
            _module: module,
            funcs,
            name,
            cc,
            ordinal,
            compile_cached,
            unordered: std::sync::atomic::AtomicBool::new(false),
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
    /// the amount every device grants without an opt-in).
    pub(crate) fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        if smem > 48 * 1024 {
            return Err(CudaError::Shape(format!(
                "{name}: {smem} bytes of shared memory (at most 48 KiB)"
            )));
        }
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::Driver(format!("unknown kernel {name}")))?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let mut b = self.stream.launch_builder(f);
        let mut p = Vec::with_capacity(args.len());
        let mut i = Vec::with_capacity(args.len());
        let mut l = Vec::with_capacity(args.len());
        let mut fl = Vec::with_capacity(args.len());
        for a in args {
            match *a {
                Arg::Ptr(v) => p.push(v),
                Arg::I32(v) => i.push(v),
                Arg::I64(v) => l.push(v),
                Arg::F32(v) => fl.push(v),
            }
        }
        let (mut pi, mut ii, mut li, mut fi) = (0, 0, 0, 0);
        for a in args {
            match a {
                Arg::Ptr(_) => {
                    b.arg(&p[pi]);
                    pi += 1;
                }
                Arg::I32(_) => {
                    b.arg(&i[ii]);
                    ii += 1;
                }
                Arg::I64(_) => {
                    b.arg(&l[li]);
                    li += 1;
                }
                Arg::F32(_) => {
                    b.arg(&fl[fi]);
                    fi += 1;
                }
            }
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: smem,
        };
        let profiling = self.profile.lock().is_ok_and(|p| p.is_some());
        let t0 = if profiling {
            self.sync()?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        // SAFETY: every kernel's parameter list is the sequence of `args` given by the
        // typed wrappers in `ops.rs`, whose buffers are sized by the same wrappers.
        unsafe { b.launch(cfg) }.map_err(|e| drv(&format!("launching {name}"), e))?;
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
