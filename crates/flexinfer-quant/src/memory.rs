//! Process memory housekeeping shared by the job and the devices (a leaf: it imports nothing of the crate).

/// Hands memory the allocator holds after frees back to the system. The calibration forward allocates and
/// frees many activation-sized buffers from several threads; glibc keeps the freed space in per-thread
/// arenas, so without this the resident set only ever grows (docs/benchmarks.md). Called between stages,
/// where little is live.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the kernel; it does not touch live allocations.
    unsafe {
        libc::malloc_trim(0);
    }
}
