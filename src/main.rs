use std::process::ExitCode;

fn main() -> ExitCode {
    return_large_buffers_when_freed();
    promptgate::run()
}

/// glibc raises its mmap threshold after each large free (up to 32 MiB), so later
/// response copies come from arenas that never shrink: 8 × 64 MB streams left
/// 315 MB resident once idle; with the threshold pinned, they are mapped and
/// unmapped with their allocation. Pinned at 4 MiB, not lower: every buffer above
/// the threshold is faulted in page by page each time it is made, and request
/// bodies of 256 KiB–1 MB are made several times a request (the arrival, the body
/// sent, its rebuilds). At 256 KiB, 1 MB c64: pass-through 1,551–1,588 → 621–724 µs
/// a request, full 2,634–2,852 → 1,183–1,192; peak RSS 81–89 → 100–104 and
/// 116–118 → 129–138 MB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn return_large_buffers_when_freed() {
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE_BUFFER as libc::c_int);
    }
}

/// The smallest allocation glibc maps on its own (and unmaps when freed).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const LARGE_BUFFER: usize = 4 << 20;

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn return_large_buffers_when_freed() {}
