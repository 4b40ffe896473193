//! The CUDA driver API and HIP's module API, loaded at run time with `dlopen`, as one [`Vendor`]: the two
//! APIs have the same shape (allocate, copy, load a code image, get a function, launch with `kernelParams`),
//! so one implementation serves both and only initialisation, reset and error texts differ.
//!
//! Code images: for CUDA, `kernels/gptq.cu` compiled by NVRTC (also loaded at run time, [`Nvrtc`]) to a
//! CUBIN for the device's architecture, or to PTX for its compute capability where the CUBIN does not
//! load; for HIP, the code objects built offline by
//! `scripts/hip/build-code-objects.sh` (`gptq-<gfx>.hsaco`), embedded in the binary at build time or files
//! of `$FLEXINFER_KERNEL_DIR` ([`code_objects`]).
//!
//! Nothing here can be run without a GPU; what is tested without one is the session logic through the
//! host vendor (tests/gpu_session.rs), the NVRTC compile of the same source (tests/kernels.rs) and the HIP
//! code objects (tests/hip_code_objects.rs).

use super::kernel::{
    math_self_test, Arg, DevPtr, Gemm, GemmOp, Kernel, Launch, MathLibs, Syrk, Vendor,
    KERNEL_SOURCE,
};
use super::{DevResult, DeviceError, DeviceKind};
use flexinfer_contract::error::chain;
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod api;
pub mod code_objects;
mod math;
mod nvrtc;

pub use api::symbol_names;
use api::{Api, Extra, Raw};
pub use math::{MathError, MathLibraries};
pub use math::{CUBLAS_LIBRARIES, CUSOLVER_LIBRARIES, ROCBLAS_LIBRARIES, ROCSOLVER_LIBRARIES};
pub use nvrtc::{Nvrtc, NvrtcError, Output as NvrtcOutput};

pub use code_objects::KERNEL_DIR_ENV;
use code_objects::{
    code_object_sources, kfd_targets, DRI_DIR, EMBEDDED_HIP_CODE_OBJECTS, KFD_TOPOLOGY,
};
/// libnvrtc names tried in order after `$FLEXINFER_NVRTC`.
pub const NVRTC_LIBRARIES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
];

/// One device of a CUDA or HIP runtime with the kernels loaded: a [`Vendor`].
pub struct DriverVendor {
    api: Arc<Api>,
    device: c_int,
    /// CUDA context (null for HIP, whose device context is implicit).
    ctx: Raw,
    module: Raw,
    functions: HashMap<Kernel, Raw>,
    /// The code image (PTX or code object), kept to load it again after a reset.
    image: Vec<u8>,
    name: String,
    /// The page-locked staging buffer of large copies (allocated at the first one; gone with a reset).
    staging: Option<Raw>,
    /// The runtime refused page-locked memory once: copies go from pageable memory from then on.
    staging_refused: bool,
    /// The vendor's BLAS and solver libraries that loaded ([`math`]).
    math: MathLibraries,
    /// cuSOLVER's workspace (address, floats), grown as needed; gone with a reset.
    math_work: Option<(DevPtr, usize)>,
}

/// The host side of a staged copy, in pieces of 1 MiB on the rayon pool. One thread copies only about
/// 6.5 GB/s through the staging buffer on the H100 machine, and a destination written for the first time
/// (a new matrix: every download of a checkpoint) pays a page fault per 4 KiB, which one thread took at
/// 1.3–1.6 GB/s there (the card check's `transfer timing`); the faults of several threads proceed together.
fn par_copy(src: &[u8], dst: &mut [u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 20;
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Copies of more than this many bytes go through the page-locked staging buffer.
pub const STAGE_OVER: usize = 1 << 20;
/// Size of the page-locked staging buffer (large copies go through it in chunks of this size).
pub const STAGING_BYTES: usize = 32 << 20;

// SAFETY: the raw handles are the runtime's; every call makes the context current on the calling thread
// first (CUDA) or uses the runtime's per-process device context (HIP), and the session serialises calls
// through a mutex.
unsafe impl Send for DriverVendor {}

impl DriverVendor {
    /// Opens device 0 of `kind`'s runtime and loads the kernels (`describe` names the device in events);
    /// with `vendor_math`, also the runtime's BLAS and solver libraries where they load ([`math`]). The name
    /// ends with the libraries in use, in brackets (`[libcublas.so.12, libcusolver.so.11]` or `[own kernels
    /// only]`).
    pub fn open(
        kind: DeviceKind,
        libraries: &[&str],
        describe: &str,
        vendor_math: bool,
    ) -> DevResult<DriverVendor> {
        let api = Arc::new(Api::load(kind, libraries)?);
        let mut v = DriverVendor {
            api,
            device: 0,
            ctx: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            functions: HashMap::new(),
            image: Vec::new(),
            name: format!("{}:0 {describe}", kind.as_str()),
            staging: None,
            staging_refused: false,
            math: MathLibraries::none("GPTQ_VENDOR_LIBS=off"),
            math_work: None,
        };
        v.start()?;
        match kind {
            DeviceKind::Hip => v.load_hip_code_object()?,
            _ => v.load_cuda_images()?,
        }
        if vendor_math {
            v.math = MathLibraries::load(kind);
            v.self_test_math();
        }
        v.name = format!("{} [{}]", v.name, v.math.describe());
        Ok(v)
    }

    /// Compiles the kernels with NVRTC for this device and loads the first image that the driver takes: a
    /// CUBIN for its architecture (loads on a driver older than NVRTC within the major version), else PTX
    /// (JIT-compiled by the driver; needs a driver at least as new as NVRTC's PTX ISA).
    fn load_cuda_images(&mut self) -> DevResult<()> {
        let (major, minor) = self.compute_capability()?;
        let nvrtc =
            Nvrtc::load().map_err(|e| DeviceError::new(self.name.clone(), "load", chain(&e)))?;
        let mut tried = Vec::new();
        for output in [NvrtcOutput::Cubin, NvrtcOutput::Ptx] {
            let arch = output.arch(major, minor);
            let what = format!(
                "{} {}",
                format!("{output:?}").to_lowercase(),
                arch.trim_start_matches("--gpu-architecture=")
            );
            let image =
                nvrtc.compile_image(KERNEL_SOURCE, "gptq.cu", &[&arch, "--std=c++17"], output);
            let image = match image {
                Ok(image) => image,
                Err(e) => {
                    tried.push(format!("{what}: {}", chain(&e)));
                    continue;
                }
            };
            match self.load_module(&image) {
                Ok(()) => {
                    self.image = image;
                    self.name = format!("{} ({what})", self.name);
                    return Ok(());
                }
                Err(e) => tried.push(format!("{what}: {}", e.message)),
            }
        }
        Err(DeviceError::new(
            self.name.clone(),
            "load",
            format!("no kernel image loads on this device: {}", tried.join("; ")),
        ))
    }

    /// The staging buffer, allocated now if need be; `None` when the runtime has no page-locked memory for
    /// it (then large copies go from pageable memory, slower but the same).
    fn staging(&mut self) -> Option<*mut u8> {
        if let Some(p) = self.staging {
            return Some(p as *mut u8);
        }
        let host = self.api.host?;
        if self.staging_refused || self.current("stage").is_err() {
            return None;
        }
        // SAFETY: the runtime is initialised and (CUDA) this vendor's context is current.
        match unsafe { host.alloc(STAGING_BYTES) } {
            Ok(p) => {
                self.staging = Some(p);
                Some(p as *mut u8)
            }
            Err(_) => {
                self.staging_refused = true;
                None
            }
        }
    }

    /// Whether large copies go through the page-locked staging buffer now (it is allocated at the first
    /// one, so this is `false` before any).
    pub fn staging_active(&self) -> bool {
        self.staging.is_some()
    }

    /// Why each vendor math library that is not used is not (not found, a missing entry point, switched
    /// off); empty when all are used.
    pub fn math_missing(&self) -> &[String] {
        &self.math.missing
    }

    /// [`math_self_test`] of the loaded libraries; the ones that fail are not used, with the reason in
    /// [`DriverVendor::math_missing`]. The test's handles and workspace are kept (the same context).
    fn self_test_math(&mut self) {
        let t = math_self_test(self);
        if let Err(e) = t.blas {
            self.math.drop_blas(format!("self-test failed: {e}"));
        }
        if let Err(e) = t.solver {
            self.math.drop_solver(format!("self-test failed: {e}"));
        }
    }

    /// A library call's outcome as a device error naming the device.
    fn math_result<T>(&self, r: Result<T, MathError>) -> DevResult<T> {
        r.map_err(|e| DeviceError::new(self.name.clone(), "math", chain(&e)))
    }

    /// Frees the staging buffer (before its context goes).
    fn free_staging(&mut self) {
        if let (Some(p), Some(host)) = (self.staging.take(), self.api.host) {
            if self.current("stage").is_ok() {
                // SAFETY: allocated by `staging` in this context; no copy is in flight (copies are synchronous).
                unsafe { host.free(p) };
            }
        }
    }

    fn check(&self, call: &str, op: &str, code: c_int) -> DevResult<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(DeviceError::new(
                self.name.clone(),
                op,
                self.api.describe(call, code),
            ))
        }
    }

    /// Initialises the runtime and (CUDA) creates the context.
    fn start(&mut self) -> DevResult<()> {
        let api = Arc::clone(&self.api);
        // SAFETY: C calls of the runtime with valid out-pointers.
        unsafe {
            self.check("init", "init", (api.init)(0))?;
            match api.extra {
                Extra::Cuda {
                    device_get,
                    ctx_create,
                    ..
                } => {
                    let mut dev: c_int = 0;
                    self.check("cuDeviceGet", "init", device_get(&mut dev, 0))?;
                    self.device = dev;
                    let mut ctx: Raw = std::ptr::null_mut();
                    self.check("cuCtxCreate_v2", "init", ctx_create(&mut ctx, 0, dev))?;
                    self.ctx = ctx;
                }
                Extra::Hip { set_device, .. } => {
                    self.check("hipSetDevice", "init", set_device(0))?;
                }
            }
        }
        Ok(())
    }

    /// Makes the context current on this thread (CUDA; nothing for HIP).
    fn current(&self, op: &str) -> DevResult<()> {
        if let Extra::Cuda {
            ctx_set_current, ..
        } = self.api.extra
        {
            // SAFETY: the context handle was created by this vendor and not destroyed.
            self.check("cuCtxSetCurrent", op, unsafe { ctx_set_current(self.ctx) })?;
        }
        Ok(())
    }

    /// Loads a code image and looks up every kernel in it.
    fn load_module(&mut self, image: &[u8]) -> DevResult<()> {
        self.current("load")?;
        let mut module: Raw = std::ptr::null_mut();
        // SAFETY: `image` is a PTX text (NUL-terminated) or an ELF code object, alive during the call.
        let rc = unsafe { (self.api.load)(&mut module, image.as_ptr() as *const c_void) };
        self.check("moduleLoadData", "load", rc)?;
        let mut functions = HashMap::new();
        for k in Kernel::ALL {
            let name = CString::new(k.entry())
                .map_err(|e| DeviceError::new(self.name.clone(), "load", chain(&e)))?;
            let mut f: Raw = std::ptr::null_mut();
            // SAFETY: a loaded module and a NUL-terminated name.
            let rc = unsafe { (self.api.get_function)(&mut f, module, name.as_ptr()) };
            if let Err(e) = self.check(&format!("moduleGetFunction({})", k.entry()), "load", rc) {
                // SAFETY: the module was loaded just above and nothing uses it.
                unsafe { (self.api.unload)(module) };
                return Err(e);
            }
            functions.insert(k, f);
        }
        self.module = module;
        self.functions = functions;
        Ok(())
    }

    /// The device's compute capability `(major, minor)`.
    fn compute_capability(&self) -> DevResult<(c_int, c_int)> {
        let Extra::Cuda { attribute, .. } = self.api.extra else {
            return Err(DeviceError::new(self.name.clone(), "load", "not CUDA"));
        };
        // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR.
        let (mut major, mut minor) = (0, 0);
        // SAFETY: out-pointers and a device ordinal from cuDeviceGet.
        unsafe {
            self.check(
                "cuDeviceGetAttribute",
                "load",
                attribute(&mut major, 75, self.device),
            )?;
            self.check(
                "cuDeviceGetAttribute",
                "load",
                attribute(&mut minor, 76, self.device),
            )?;
        }
        Ok((major, minor))
    }

    /// The first HIP code object that the device loads, in [`code_object_sources`]' order: the files of
    /// `$FLEXINFER_KERNEL_DIR`, then the embedded ones (the node's own targets first).
    fn load_hip_code_object(&mut self) -> DevResult<()> {
        let dir = std::env::var_os(KERNEL_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        let sources = code_object_sources(
            dir.as_deref(),
            EMBEDDED_HIP_CODE_OBJECTS,
            &kfd_targets(Path::new(KFD_TOPOLOGY), Path::new(DRI_DIR)),
        );
        let mut tried = Vec::new();
        for source in &sources {
            let image = match source.read() {
                Ok(b) => b,
                Err(e) => {
                    tried.push(format!("{}: {e}", source.describe()));
                    continue;
                }
            };
            match self.load_module(&image) {
                Ok(()) => {
                    self.image = image.into_owned();
                    self.name = format!("{} ({})", self.name, source.describe());
                    return Ok(());
                }
                Err(e) => tried.push(format!("{}: {}", source.describe(), e.message)),
            }
        }
        let message = if !tried.is_empty() {
            format!("no code object loads on this device: {}", tried.join("; "))
        } else {
            let dir = match &dir {
                Some(d) => format!("{KERNEL_DIR_ENV}={} holds no gptq-<gfx>.hsaco", d.display()),
                None => format!("{KERNEL_DIR_ENV} is not set"),
            };
            format!(
                "no HIP code object: this worker binary embeds none (it was built without \
                 FLEXINFER_HIP_CODE_OBJECTS; the worker images' binary embeds gfx1100 and gfx906) and {dir}"
            )
        };
        Err(DeviceError::new(self.name.clone(), "load", message))
    }
}

/// Which of `kind`'s vendor math libraries (BLAS, solver) load on this machine with every entry point the
/// session calls, and why the others do not: what a GPU session here would use with `GPTQ_VENDOR_LIBS=auto`.
/// Loads and unloads them; needs no device.
pub fn math_libraries(kind: DeviceKind) -> (MathLibs, Vec<String>) {
    let m = MathLibraries::load(kind);
    (m.libs(), m.missing.clone())
}

impl Vendor for DriverVendor {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn alloc(&mut self, bytes: usize) -> DevResult<DevPtr> {
        self.current("alloc")?;
        let mut p: DevPtr = 0;
        // SAFETY: an out-pointer and a size.
        let rc = unsafe { (self.api.alloc)(&mut p, bytes) };
        self.check("memAlloc", "alloc", rc)?;
        Ok(p)
    }
    fn free(&mut self, ptr: DevPtr) {
        if self.current("free").is_ok() {
            // SAFETY: a pointer from `alloc` of the current context.
            unsafe { (self.api.free)(ptr) };
        }
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) -> DevResult<()> {
        self.current("upload")?;
        let staging = if src.len() > STAGE_OVER {
            self.staging()
        } else {
            None
        };
        let Some(stage) = staging else {
            // SAFETY: `dst` has at least `src.len()` bytes (the session's allocation); `src` is a live slice.
            let rc = unsafe { (self.api.htod)(dst, src.as_ptr() as *const c_void, src.len()) };
            return self.check("memcpyHtoD", "upload", rc);
        };
        for (i, chunk) in src.chunks(STAGING_BYTES).enumerate() {
            // SAFETY: the staging buffer holds STAGING_BYTES ≥ chunk.len() bytes and is not used elsewhere; a
            // copy from page-locked memory returns when it is done, so the buffer is free for the next chunk.
            let rc = unsafe {
                par_copy(chunk, std::slice::from_raw_parts_mut(stage, chunk.len()));
                (self.api.htod)(
                    dst + (i * STAGING_BYTES) as DevPtr,
                    stage as *const c_void,
                    chunk.len(),
                )
            };
            self.check("memcpyHtoD", "upload", rc)?;
        }
        Ok(())
    }
    fn download(&mut self, src: DevPtr, dst: &mut [u8]) -> DevResult<()> {
        self.current("download")?;
        let staging = if dst.len() > STAGE_OVER {
            self.staging()
        } else {
            None
        };
        let Some(stage) = staging else {
            // SAFETY: `src` has at least `dst.len()` bytes; `dst` is a live, writable slice.
            let rc = unsafe { (self.api.dtoh)(dst.as_mut_ptr() as *mut c_void, src, dst.len()) };
            return self.check("memcpyDtoH", "download", rc);
        };
        for (i, chunk) in dst.chunks_mut(STAGING_BYTES).enumerate() {
            // SAFETY: as in `upload`; a device-to-host copy returns when it is complete.
            let rc = unsafe {
                (self.api.dtoh)(
                    stage as *mut c_void,
                    src + (i * STAGING_BYTES) as DevPtr,
                    chunk.len(),
                )
            };
            self.check("memcpyDtoH", "download", rc)?;
            // SAFETY: the staging buffer now holds chunk.len() bytes of the download.
            par_copy(
                unsafe { std::slice::from_raw_parts(stage, chunk.len()) },
                chunk,
            );
        }
        Ok(())
    }
    fn zero(&mut self, dst: DevPtr, bytes: usize) -> DevResult<()> {
        let Some(memset) = self.api.memset else {
            return super::kernel::zero_by_upload(self, dst, bytes);
        };
        self.current("zero")?;
        // SAFETY: `dst` is an allocation of the current context with at least `bytes` bytes.
        let rc = unsafe { memset.zero(dst, bytes) };
        self.check("memset", "zero", rc)
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> DevResult<()> {
        self.current("copy")?;
        // SAFETY: two device buffers of at least `bytes` bytes.
        let rc = unsafe { (self.api.dtod)(dst, src, bytes) };
        self.check("memcpyDtoD", "copy", rc)
    }
    fn launch(&mut self, launch: Launch, args: &[Arg]) -> DevResult<()> {
        let (kernel, grid, block) = (launch.kernel, launch.grid, launch.block);
        self.current("launch")?;
        let f = *self.functions.get(&kernel).ok_or_else(|| {
            DeviceError::new(
                self.name.clone(),
                "launch",
                format!("{} not loaded", kernel.entry()),
            )
        })?;
        // Each argument's value in its own 8-byte slot; `params[i]` points at slot i.
        let mut slots = Arg::slots(args);
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr() as *mut c_void)
            .collect();
        // SAFETY: a function of the loaded module, its arguments in the order and types of its C signature
        // (the session builds them from kernels/gptq.cu), every slot alive during the call.
        let rc = unsafe {
            (self.api.launch)(
                f,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check(&format!("launchKernel({})", kernel.entry()), "launch", rc)
    }
    fn math(&self) -> MathLibs {
        self.math.libs()
    }
    fn syrk_lower(&mut self, op: &Syrk) -> DevResult<()> {
        self.current("math")?;
        // SAFETY: the context was made current just above; the session passes its own allocations of this
        // context, sized for the operation.
        let r = unsafe { self.math.syrk(op) };
        self.math_result(r)
    }
    fn gemm_acc(&mut self, op: &Gemm) -> DevResult<()> {
        self.current("math")?;
        // SAFETY: as in `syrk_lower`.
        let r = unsafe { self.math.gemm(op) };
        self.math_result(r)
    }
    fn gemm(&mut self, op: &GemmOp) -> DevResult<()> {
        self.current("math")?;
        // SAFETY: as in `syrk_lower`.
        let r = unsafe { self.math.gemm_op(op) };
        self.math_result(r)
    }
    fn potrf_lower(&mut self, a: DevPtr, lda: usize, n: usize, info: DevPtr) -> DevResult<()> {
        self.current("math")?;
        // SAFETY: the context is current; `a` is the session's n × n (lda) allocation.
        let need = unsafe { self.math.potrf_workspace(a, lda, n) };
        let need = self.math_result(need)?;
        let work = match self.math_work {
            Some((p, floats)) if floats >= need => (p, floats),
            old => {
                if let Some((p, _)) = old {
                    self.math_work = None;
                    self.free(p);
                }
                let p = self.alloc(need.max(1) * 4)?;
                self.math_work = Some((p, need.max(1)));
                (p, need.max(1))
            }
        };
        // SAFETY: as above; `info` is the session's status word and `work` this vendor's workspace of that
        // many floats, both of this context.
        let r = unsafe { self.math.potrf(a, lda, n, info, work) };
        self.math_result(r)
    }
    fn reset(&mut self) -> DevResult<()> {
        // The library handles and cuSOLVER's workspace belong to the old context: destroyed first.
        if self.current("reset").is_ok() {
            self.math.drop_handles();
        }
        self.math_work = None;
        // The staging buffer goes with the context (freed by its destruction or the device reset).
        self.staging = None;
        let api = Arc::clone(&self.api);
        // SAFETY: the context/device handles of this vendor; buffers of the old context are not used again.
        unsafe {
            match api.extra {
                Extra::Cuda { ctx_destroy, .. } => {
                    if !self.ctx.is_null() {
                        ctx_destroy(self.ctx);
                    }
                    self.ctx = std::ptr::null_mut();
                }
                Extra::Hip { device_reset, .. } => {
                    self.check("hipDeviceReset", "reset", device_reset())?;
                }
            }
        }
        self.module = std::ptr::null_mut();
        self.functions.clear();
        self.start()?;
        let image = std::mem::take(&mut self.image);
        let r = self.load_module(&image);
        self.image = image;
        r
    }
    fn memory(&mut self) -> Option<(u64, u64)> {
        self.current("memory").ok()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two out-pointers.
        let rc = unsafe { (self.api.mem_info)(&mut free, &mut total) };
        (rc == 0).then_some((free as u64, total as u64))
    }
}

impl Drop for DriverVendor {
    fn drop(&mut self) {
        if self.current("drop").is_ok() {
            self.math.drop_handles();
        }
        self.free_staging();
        if let Extra::Cuda { ctx_destroy, .. } = self.api.extra {
            if !self.ctx.is_null() && self.current("drop").is_ok() {
                // SAFETY: waits for the context's work, then destroys the context this vendor created, once.
                unsafe {
                    (self.api.synchronize)();
                    ctx_destroy(self.ctx);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::par_copy;

    #[test]
    fn par_copy_copies_every_byte_of_any_length() {
        for len in [0usize, 1, 4095, 1 << 20, (1 << 20) + 7, 3 * (1 << 20) - 1] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0xAAu8; len];
            par_copy(&src, &mut dst);
            assert!(src == dst, "length {len}");
        }
    }
}
