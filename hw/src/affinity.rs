//! Pinning a wall-clock GPU run to one CPU.
//!
//! The backend's decode steps are host-bound (eager launches, a host sync per MoE layer), so
//! their CUDA-event durations include how fast the launching thread runs. On the development
//! H200 (a 16-vCPU VM), wall-clock runs with the device thread free to migrate had step times
//! 10–50 % above the same shapes on the virtual clock, in shifts lasting seconds; the same
//! runs under `taskset -c 3` matched within a few percent (step-time median 4.7–5.9 % against
//! 2.4 % for the virtual clock, same profile, same machine). Threads inherit their creator's
//! CPU mask, so pinning the loop thread before it spawns the device thread pins every thread
//! of the run to the CPU the loop was on.

/// Restores the calling thread's previous CPU mask when dropped.
pub struct CpuPin {
    #[cfg(target_os = "linux")]
    previous: libc::cpu_set_t,
    /// The CPU the thread was pinned to.
    pub cpu: usize,
}

/// Pins the calling thread (and the threads it spawns from now on) to the CPU it runs on.
/// `None` where that is not possible (not Linux, or the kernel refused).
#[cfg(target_os = "linux")]
pub fn pin_to_current_cpu() -> Option<CpuPin> {
    // SAFETY: cpu_set_t is plain data; the calls write only into the sets passed by pointer,
    // whose sizes are given, and act on the calling thread (pid 0).
    unsafe {
        let cpu = libc::sched_getcpu();
        if cpu < 0 {
            return None;
        }
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let mut previous: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut previous) != 0 {
            return None;
        }
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut one);
        if libc::sched_setaffinity(0, size, &one) != 0 {
            return None;
        }
        Some(CpuPin {
            previous,
            cpu: cpu as usize,
        })
    }
}

#[cfg(not(target_os = "linux"))]
pub fn pin_to_current_cpu() -> Option<CpuPin> {
    None
}

impl Drop for CpuPin {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: restores the mask read in pin_to_current_cpu, for the calling thread.
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.previous);
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Pinned, a spawned thread runs on the pinned CPU only; dropping the pin restores the mask.
    #[test]
    fn pin_is_inherited_by_spawned_threads_and_undone_on_drop() {
        let before = std::thread::spawn(allowed_cpus).join().unwrap();
        let Some(pin) = pin_to_current_cpu() else {
            println!("skipped: this kernel refused sched_setaffinity");
            return;
        };
        let child = std::thread::spawn(allowed_cpus).join().unwrap();
        assert_eq!(child, vec![pin.cpu]);
        drop(pin);
        assert_eq!(allowed_cpus(), before);
    }

    fn allowed_cpus() -> Vec<usize> {
        // SAFETY: as above.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        }
    }
}
