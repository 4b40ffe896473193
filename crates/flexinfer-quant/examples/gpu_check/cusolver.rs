//! cuSOLVER's `potrf`, loaded at run time, on the device's own context and buffers.

use faer::Mat;
use flexinfer_quant::device::driver::DriverVendor;
use flexinfer_quant::device::kernel::Vendor;
use libloading::Library;
use std::ffi::{c_int, c_void};
use std::time::Instant;

type Handle = *mut c_void;
type CreateFn = unsafe extern "C" fn(*mut Handle) -> c_int;
type BufferSizeFn =
    unsafe extern "C" fn(Handle, c_int, c_int, *mut f32, c_int, *mut c_int) -> c_int;
type PotrfFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    *mut f32,
    c_int,
    *mut f32,
    c_int,
    *mut c_int,
) -> c_int;
type DestroyFn = unsafe extern "C" fn(Handle) -> c_int;
/// `CUBLAS_FILL_MODE_LOWER`.
const LOWER: c_int = 0;

pub struct Solver {
    lib: Library,
}

impl Solver {
    pub fn load() -> Result<Solver, String> {
        let mut names: Vec<String> = std::env::var("FLEXINFER_CUSOLVER").into_iter().collect();
        names
            .extend(["libcusolver.so.12", "libcusolver.so.11", "libcusolver.so"].map(String::from));
        let mut errors = Vec::new();
        for n in &names {
            // SAFETY: loading the vendor's solver library runs its initialisers, as any application does.
            match unsafe { Library::new(n) } {
                Ok(lib) => return Ok(Solver { lib }),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(errors.join("; "))
    }

    /// Seconds of one `cusolverDnSpotrf` (lower) of the attempt's matrix `A` (the reversed `h` with the
    /// diagonal `diag`, as the engine factors it), after one warm-up on a copy.
    pub fn potrf_seconds(
        &self,
        v: &mut DriverVendor,
        h: &Mat<f32>,
        diag: &[f32],
    ) -> Result<f64, String> {
        let n = h.nrows();
        let a: Vec<f32> = (0..n * n)
            .map(|k| {
                let (i, j) = (k % n, k / n);
                if i == j {
                    diag[n - 1 - j]
                } else {
                    h[(n - 1 - i, n - 1 - j)]
                }
            })
            .collect();
        let bytes: &[u8] = bytemuck::cast_slice(&a);
        let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
        let da = v.alloc(bytes.len()).map_err(e)?;
        let info = v.alloc(4).map_err(e)?;
        let result = self.run(v, da, info, bytes, n);
        v.free(da);
        v.free(info);
        result
    }

    fn run(
        &self,
        v: &mut DriverVendor,
        da: u64,
        info: u64,
        a: &[u8],
        n: usize,
    ) -> Result<f64, String> {
        let e = |e: flexinfer_quant::device::DeviceError| e.to_string();
        // SAFETY: cuSOLVER's C API with its documented signatures; the buffers are device allocations of
        // the context that the vendor's last call made current on this thread.
        unsafe {
            let create = *self
                .lib
                .get::<CreateFn>(b"cusolverDnCreate\0")
                .map_err(|e| e.to_string())?;
            let size = *self
                .lib
                .get::<BufferSizeFn>(b"cusolverDnSpotrf_bufferSize\0")
                .map_err(|e| e.to_string())?;
            let potrf = *self
                .lib
                .get::<PotrfFn>(b"cusolverDnSpotrf\0")
                .map_err(|e| e.to_string())?;
            let destroy = *self
                .lib
                .get::<DestroyFn>(b"cusolverDnDestroy\0")
                .map_err(|e| e.to_string())?;
            v.upload(da, a).map_err(e)?;
            let mut h: Handle = std::ptr::null_mut();
            let rc = create(&mut h);
            if rc != 0 {
                return Err(format!("cusolverDnCreate: status {rc}"));
            }
            let (ni, pa) = (n as c_int, da as usize as *mut f32);
            let mut lwork: c_int = 0;
            let rc = size(h, LOWER, ni, pa, ni, &mut lwork);
            if rc != 0 {
                destroy(h);
                return Err(format!("cusolverDnSpotrf_bufferSize: status {rc}"));
            }
            let work = v.alloc(lwork.max(1) as usize * 4).map_err(e)?;
            let mut times = Vec::new();
            let mut status = 0;
            for _ in 0..2 {
                v.upload(da, a).map_err(e)?;
                let t = Instant::now();
                status = potrf(
                    h,
                    LOWER,
                    ni,
                    pa,
                    ni,
                    work as usize as *mut f32,
                    lwork,
                    info as usize as *mut c_int,
                );
                let mut dev_info = [0i32];
                v.download(info, bytemuck::cast_slice_mut(&mut dev_info))
                    .map_err(e)?;
                times.push(t.elapsed().as_secs_f64());
                if status == 0 && dev_info[0] != 0 {
                    status = -dev_info[0];
                }
            }
            v.free(work);
            destroy(h);
            if status != 0 {
                return Err(format!("cusolverDnSpotrf: status {status}"));
            }
            Ok(times[1])
        }
    }
}
