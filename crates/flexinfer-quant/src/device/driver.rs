//! The CUDA driver API and HIP's module API, loaded at run time with `dlopen`, as one [`Vendor`]: the two
//! APIs have the same shape (allocate, copy, load a code image, get a function, launch with `kernelParams`),
//! so one implementation serves both and only initialisation, reset and error texts differ.
//!
//! Code images: for CUDA, `kernels/gptq.cu` compiled by NVRTC (also loaded at run time, [`Nvrtc`]) to PTX
//! for the device's compute capability; for HIP, the code objects built offline by
//! `scripts/hip/build-code-objects.sh` (`gptq-<gfx>.hsaco`), looked up in `$FLEXINFER_KERNEL_DIR`
//! (default [`DEFAULT_KERNEL_DIR`], where the `rocm-*` worker images put them).
//!
//! Nothing here can be run without a GPU; what is tested without one is the session logic through the
//! host vendor (tests/gpu_session.rs), the NVRTC compile of the same source (tests/kernels.rs) and the HIP
//! code objects (tests/hip_code_objects.rs).

use super::kernel::{Arg, DevPtr, Kernel, Launch, Vendor, KERNEL_SOURCE};
use super::{DevResult, DeviceError, DeviceKind};
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod api;
mod nvrtc;

pub use api::symbol_names;
use api::{Api, Extra, Raw};
pub use nvrtc::Nvrtc;

/// Where the `rocm-*` worker images put the HIP code objects.
pub const DEFAULT_KERNEL_DIR: &str = "/usr/lib/flexinfer/kernels";
/// Environment variable naming another directory of HIP code objects.
pub const KERNEL_DIR_ENV: &str = "FLEXINFER_KERNEL_DIR";
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
}

// SAFETY: the raw handles are the runtime's; every call makes the context current on the calling thread
// first (CUDA) or uses the runtime's per-process device context (HIP), and the session serialises calls
// through a mutex.
unsafe impl Send for DriverVendor {}

impl DriverVendor {
    /// Opens device 0 of `kind`'s runtime and loads the kernels (`describe` names the device in events).
    pub fn open(kind: DeviceKind, libraries: &[&str], describe: &str) -> DevResult<DriverVendor> {
        let api = Arc::new(Api::load(kind, libraries)?);
        let mut v = DriverVendor {
            api,
            device: 0,
            ctx: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            functions: HashMap::new(),
            image: Vec::new(),
            name: format!("{}:0 {describe}", kind.as_str()),
        };
        v.start()?;
        v.image = match kind {
            DeviceKind::Cuda => v.cuda_image()?,
            _ => Vec::new(),
        };
        match kind {
            DeviceKind::Hip => v.load_hip_code_object()?,
            _ => {
                let image = std::mem::take(&mut v.image);
                v.load_module(&image)?;
                v.image = image;
            }
        }
        Ok(v)
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
                .map_err(|e| DeviceError::new(self.name.clone(), "load", e.to_string()))?;
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

    /// PTX of the kernels for this device's compute capability, compiled by NVRTC.
    fn cuda_image(&self) -> DevResult<Vec<u8>> {
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
        let nvrtc = Nvrtc::load().map_err(|e| DeviceError::new(self.name.clone(), "load", e))?;
        let arch = format!("--gpu-architecture=compute_{major}{minor}");
        let ptx = nvrtc
            .compile(KERNEL_SOURCE, "gptq.cu", &[&arch, "--std=c++17"])
            .map_err(|log| DeviceError::new(self.name.clone(), "compile", log))?;
        let mut bytes = ptx.into_bytes();
        bytes.push(0);
        Ok(bytes)
    }

    /// The first code object in the kernel directory that the device loads.
    fn load_hip_code_object(&mut self) -> DevResult<()> {
        let dir = std::env::var_os(KERNEL_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_KERNEL_DIR));
        let mut files = hip_code_objects(&dir);
        files.sort();
        let mut tried = Vec::new();
        for f in files {
            let image = match std::fs::read(&f) {
                Ok(b) => b,
                Err(e) => {
                    tried.push(format!("{}: {e}", f.display()));
                    continue;
                }
            };
            match self.load_module(&image) {
                Ok(()) => {
                    self.image = image;
                    self.name = format!("{} ({})", self.name, f.display());
                    return Ok(());
                }
                Err(e) => tried.push(format!("{}: {}", f.display(), e.message)),
            }
        }
        Err(DeviceError::new(
            self.name.clone(),
            "load",
            if tried.is_empty() {
                format!(
                    "no gptq-<gfx>.hsaco code object in {} (set {KERNEL_DIR_ENV}; the rocm-* worker images ship them)",
                    dir.display()
                )
            } else {
                format!("no code object loads on this device: {}", tried.join("; "))
            },
        ))
    }
}

/// The `gptq-*.hsaco` files of `dir`.
pub fn hip_code_objects(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap_or_default().to_string_lossy();
            n.starts_with("gptq-") && n.ends_with(".hsaco")
        })
        .collect()
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
        // SAFETY: `dst` has at least `src.len()` bytes (the session's allocation); `src` is a live slice.
        let rc = unsafe { (self.api.htod)(dst, src.as_ptr() as *const c_void, src.len()) };
        self.check("memcpyHtoD", "upload", rc)
    }
    fn download(&mut self, src: DevPtr, dst: &mut [u8]) -> DevResult<()> {
        self.current("download")?;
        // SAFETY: `src` has at least `dst.len()` bytes; `dst` is a live, writable slice.
        let rc = unsafe { (self.api.dtoh)(dst.as_mut_ptr() as *mut c_void, src, dst.len()) };
        self.check("memcpyDtoH", "download", rc)
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
    fn reset(&mut self) -> DevResult<()> {
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
