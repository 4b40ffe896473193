//! The entry points of the CUDA driver API and of HIP's module API, read from the runtime library by name
//! ([`symbol_names`]); their C signatures are the type aliases here.

use super::super::kernel::DevPtr;
use super::super::{DevResult, DeviceError, DeviceKind};
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

pub(super) type Raw = *mut c_void;
pub(super) type AllocFn = unsafe extern "C" fn(*mut DevPtr, usize) -> c_int;
pub(super) type FreeFn = unsafe extern "C" fn(DevPtr) -> c_int;
pub(super) type HtoDFn = unsafe extern "C" fn(DevPtr, *const c_void, usize) -> c_int;
pub(super) type DtoHFn = unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> c_int;
pub(super) type DtoDFn = unsafe extern "C" fn(DevPtr, DevPtr, usize) -> c_int;
pub(super) type LoadFn = unsafe extern "C" fn(*mut Raw, *const c_void) -> c_int;
pub(super) type UnloadFn = unsafe extern "C" fn(Raw) -> c_int;
pub(super) type GetFnFn = unsafe extern "C" fn(*mut Raw, Raw, *const c_char) -> c_int;
pub(super) type LaunchFn = unsafe extern "C" fn(
    Raw,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Raw,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
pub(super) type SyncFn = unsafe extern "C" fn() -> c_int;
pub(super) type MemInfoFn = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
pub(super) type InitFn = unsafe extern "C" fn(c_uint) -> c_int;

/// The entry points of one runtime (names in [`Flavor::names`]).
pub(super) struct Api {
    _lib: Library,
    pub(super) init: InitFn,
    pub(super) alloc: AllocFn,
    pub(super) free: FreeFn,
    pub(super) htod: HtoDFn,
    pub(super) dtoh: DtoHFn,
    pub(super) dtod: DtoDFn,
    pub(super) load: LoadFn,
    pub(super) unload: UnloadFn,
    pub(super) get_function: GetFnFn,
    pub(super) launch: LaunchFn,
    pub(super) synchronize: SyncFn,
    pub(super) mem_info: MemInfoFn,
    /// CUDA: cuDeviceGet, cuCtxCreate_v2, cuCtxDestroy_v2, cuCtxSetCurrent, cuGetErrorString,
    /// cuDeviceGetAttribute. HIP: hipSetDevice, hipDeviceReset, hipGetErrorString.
    pub(super) extra: Extra,
    /// Page-locked host memory for staging large copies ([`host_symbol_names`]); `None` when the runtime
    /// lacks the entry points (the copies then go from pageable memory).
    pub(super) host: Option<HostMemory>,
    /// The runtime's memset ([`memset_symbol_name`]); `None` when missing (zeros are uploaded then).
    pub(super) memset: Option<Memset>,
}

/// A device memset of bytes.
#[derive(Clone, Copy)]
pub(super) enum Memset {
    /// cuMemsetD8_v2(dst, value, count).
    Cuda(unsafe extern "C" fn(DevPtr, u8, usize) -> c_int),
    /// hipMemset(dst, value, count).
    Hip(unsafe extern "C" fn(Raw, c_int, usize) -> c_int),
}

impl Memset {
    /// Zeroes `bytes` at `dst`.
    ///
    /// # Safety
    /// `dst` is a device allocation of at least `bytes` bytes of the current context.
    pub(super) unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> c_int {
        match self {
            Memset::Cuda(f) => f(dst, 0, bytes),
            Memset::Hip(f) => f(dst as usize as Raw, 0, bytes),
        }
    }
}

/// The memset entry point of each runtime (optional).
fn memset_symbol_name(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::Cuda => "cuMemsetD8_v2",
        DeviceKind::Hip => "hipMemset",
        DeviceKind::Cpu => "",
    }
}

/// Page-locked ("pinned") host allocation: the DMA engine copies from and to it directly, where a copy from
/// pageable memory goes through the driver's own bounce buffers (seen on an H200 VM: 0.6 GB/s pageable).
#[derive(Clone, Copy)]
pub(super) enum HostMemory {
    /// cuMemAllocHost_v2, cuMemFreeHost.
    Cuda {
        alloc: unsafe extern "C" fn(*mut Raw, usize) -> c_int,
        free: unsafe extern "C" fn(Raw) -> c_int,
    },
    /// hipHostMalloc (flags 0: default), hipHostFree.
    Hip {
        alloc: unsafe extern "C" fn(*mut Raw, usize, c_uint) -> c_int,
        free: unsafe extern "C" fn(Raw) -> c_int,
    },
}

impl HostMemory {
    /// A page-locked buffer of `bytes`, or the runtime's error code.
    ///
    /// # Safety
    /// The runtime must be initialised (and, for CUDA, a context current on this thread).
    pub(super) unsafe fn alloc(&self, bytes: usize) -> Result<Raw, c_int> {
        let mut p: Raw = std::ptr::null_mut();
        let rc = match self {
            HostMemory::Cuda { alloc, .. } => alloc(&mut p, bytes),
            HostMemory::Hip { alloc, .. } => alloc(&mut p, bytes, 0),
        };
        if rc == 0 && !p.is_null() {
            Ok(p)
        } else {
            Err(rc)
        }
    }

    /// Frees a buffer from [`HostMemory::alloc`].
    ///
    /// # Safety
    /// `p` came from `alloc` of the same runtime and context, and nothing uses it any more.
    pub(super) unsafe fn free(&self, p: Raw) {
        match self {
            HostMemory::Cuda { free, .. } | HostMemory::Hip { free, .. } => {
                free(p);
            }
        }
    }
}

/// The optional entry points of `kind`'s runtime in `lib`: page-locked host memory and memset (`None` where
/// the library lacks them).
fn optional(
    kind: DeviceKind,
    lib: &Library,
    library: &str,
) -> (Option<HostMemory>, Option<Memset>) {
    fn f<T: Copy>(lib: &Library, library: &str, name: &str) -> Option<T> {
        sym(lib, library, name).ok()
    }
    let h = host_symbol_names(kind);
    let memset = memset_symbol_name(kind);
    match kind {
        DeviceKind::Cuda => (
            f(lib, library, h[0])
                .zip(f(lib, library, h[1]))
                .map(|(alloc, free)| HostMemory::Cuda { alloc, free }),
            f(lib, library, memset).map(Memset::Cuda),
        ),
        DeviceKind::Hip => (
            f(lib, library, h[0])
                .zip(f(lib, library, h[1]))
                .map(|(alloc, free)| HostMemory::Hip { alloc, free }),
            f(lib, library, memset).map(Memset::Hip),
        ),
        DeviceKind::Cpu => (None, None),
    }
}

/// The optional host-memory entry points of each runtime (`[alloc, free]`).
fn host_symbol_names(kind: DeviceKind) -> &'static [&'static str] {
    match kind {
        DeviceKind::Cuda => &["cuMemAllocHost_v2", "cuMemFreeHost"],
        DeviceKind::Hip => &["hipHostMalloc", "hipHostFree"],
        DeviceKind::Cpu => &[],
    }
}

pub(super) enum Extra {
    Cuda {
        device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
        ctx_create: unsafe extern "C" fn(*mut Raw, c_uint, c_int) -> c_int,
        ctx_destroy: unsafe extern "C" fn(Raw) -> c_int,
        ctx_set_current: unsafe extern "C" fn(Raw) -> c_int,
        error_string: unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int,
        attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int,
    },
    Hip {
        set_device: unsafe extern "C" fn(c_int) -> c_int,
        device_reset: unsafe extern "C" fn() -> c_int,
        error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    },
}

/// The symbol names of each runtime, in the order [`Api::load`] reads them.
pub fn symbol_names(kind: DeviceKind) -> &'static [&'static str] {
    match kind {
        DeviceKind::Cuda => &[
            "cuInit",
            "cuMemAlloc_v2",
            "cuMemFree_v2",
            "cuMemcpyHtoD_v2",
            "cuMemcpyDtoH_v2",
            "cuMemcpyDtoD_v2",
            "cuModuleLoadData",
            "cuModuleUnload",
            "cuModuleGetFunction",
            "cuLaunchKernel",
            "cuCtxSynchronize",
            "cuMemGetInfo_v2",
            "cuDeviceGet",
            "cuCtxCreate_v2",
            "cuCtxDestroy_v2",
            "cuCtxSetCurrent",
            "cuGetErrorString",
            "cuDeviceGetAttribute",
        ],
        DeviceKind::Hip => &[
            "hipInit",
            "hipMalloc",
            "hipFree",
            "hipMemcpyHtoD",
            "hipMemcpyDtoH",
            "hipMemcpyDtoD",
            "hipModuleLoadData",
            "hipModuleUnload",
            "hipModuleGetFunction",
            "hipModuleLaunchKernel",
            "hipDeviceSynchronize",
            "hipMemGetInfo",
            "hipSetDevice",
            "hipDeviceReset",
            "hipGetErrorString",
        ],
        DeviceKind::Cpu => &[],
    }
}

pub(super) fn sym<T: Copy>(lib: &Library, library: &str, name: &str) -> DevResult<T> {
    let c = CString::new(name).map_err(|e| DeviceError::new(library, "load", e.to_string()))?;
    // SAFETY: `T` is the C signature of `name` in the vendor's API (the type aliases above, from the CUDA
    // driver API and HIP runtime headers); the library stays loaded as long as `Api` holds it.
    unsafe { lib.get::<T>(c.as_bytes_with_nul()) }
        .map(|s| *s)
        .map_err(|e| DeviceError::new(library, "load", format!("{name}: {e}")))
}

impl Api {
    pub(super) fn load(kind: DeviceKind, names: &[&str]) -> DevResult<Api> {
        let mut errors = Vec::new();
        for name in names {
            // SAFETY: loading a vendor runtime runs its initialisers; it is made to be loaded at run time.
            match unsafe { Library::new(name) } {
                Ok(lib) => return Api::from_library(kind, lib, name),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(DeviceError::new(kind.as_str(), "load", errors.join("; ")))
    }

    fn from_library(kind: DeviceKind, lib: Library, library: &str) -> DevResult<Api> {
        let n = symbol_names(kind);
        let s = |i: usize| n[i];
        let extra = match kind {
            DeviceKind::Cuda => Extra::Cuda {
                device_get: sym(&lib, library, s(12))?,
                ctx_create: sym(&lib, library, s(13))?,
                ctx_destroy: sym(&lib, library, s(14))?,
                ctx_set_current: sym(&lib, library, s(15))?,
                error_string: sym(&lib, library, s(16))?,
                attribute: sym(&lib, library, s(17))?,
            },
            DeviceKind::Hip => Extra::Hip {
                set_device: sym(&lib, library, s(12))?,
                device_reset: sym(&lib, library, s(13))?,
                error_string: sym(&lib, library, s(14))?,
            },
            DeviceKind::Cpu => {
                return Err(DeviceError::new("cpu", "load", "not a GPU runtime"));
            }
        };
        let (host, memset) = optional(kind, &lib, library);
        Ok(Api {
            host,
            memset,
            init: sym(&lib, library, s(0))?,
            alloc: sym(&lib, library, s(1))?,
            free: sym(&lib, library, s(2))?,
            htod: sym(&lib, library, s(3))?,
            dtoh: sym(&lib, library, s(4))?,
            dtod: sym(&lib, library, s(5))?,
            load: sym(&lib, library, s(6))?,
            unload: sym(&lib, library, s(7))?,
            get_function: sym(&lib, library, s(8))?,
            launch: sym(&lib, library, s(9))?,
            synchronize: sym(&lib, library, s(10))?,
            mem_info: sym(&lib, library, s(11))?,
            extra,
            _lib: lib,
        })
    }

    /// `call returned <code> (<text>)`.
    pub(super) fn describe(&self, call: &str, code: c_int) -> String {
        let text = match self.extra {
            Extra::Cuda { error_string, .. } => {
                let mut p: *const c_char = std::ptr::null();
                // SAFETY: an out-pointer to a static string owned by the driver.
                let rc = unsafe { error_string(code, &mut p) };
                (rc == 0 && !p.is_null()).then(|| {
                    // SAFETY: the driver returns a NUL-terminated static string.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                })
            }
            Extra::Hip { error_string, .. } => {
                // SAFETY: returns a NUL-terminated static string for any code.
                let p = unsafe { error_string(code) };
                (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            }
        };
        format!("{call} returned {code} ({})", text.unwrap_or_default())
    }
}
