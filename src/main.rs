use std::process::ExitCode;

fn main() -> ExitCode {
    return_large_buffers_when_freed();
    promptgate::run()
}

/// glibc raises its mmap threshold after each large free (up to 32 MiB), so later
/// response copies come from arenas that never shrink: 8 × 64 MB streams left
/// 315 MB resident once idle; with the threshold pinned at 256 KiB, 41 MB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn return_large_buffers_when_freed() {
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn return_large_buffers_when_freed() {}
