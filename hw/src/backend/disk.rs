//! The SSD tier: fixed-size KV blocks in one preallocated file, written and read by a background
//! thread. Writes are fire-and-forget (the caller hands over a copy of the block and goes on);
//! reads are queued together and awaited together, so a step's disk reads overlap each other
//! and whatever the caller issued before waiting. The worker takes jobs in order, so a read of
//! a slot sees every write to it queued before the read.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

enum Job {
    Write {
        slot: u32,
        data: Vec<u8>,
    },
    Read {
        slot: u32,
        index: usize,
        reply: Sender<(usize, io::Result<Vec<u8>>)>,
    },
}

/// Block slots `0..blocks` of `block_bytes` each in a file that is removed on drop.
pub struct DiskTier {
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    /// First write error of the worker, reported by the next call.
    write_error: Arc<Mutex<Option<io::Error>>>,
    path: PathBuf,
    block_bytes: usize,
    blocks: usize,
}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

impl DiskTier {
    /// Creates (and sizes) a new file in `dir` for `blocks` blocks of `block_bytes`.
    pub fn create(dir: &Path, blocks: usize, block_bytes: usize) -> io::Result<Self> {
        let path = dir.join(format!(
            "servelab-kv-{}-{}.bin",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        file.set_len((blocks * block_bytes) as u64)?;
        let (tx, rx) = channel();
        let write_error = Arc::new(Mutex::new(None));
        let errs = write_error.clone();
        let worker = std::thread::Builder::new()
            .name("servelab-kv-disk".into())
            .spawn(move || worker(file, block_bytes, rx, errs))?;
        Ok(Self {
            tx: Some(tx),
            worker: Some(worker),
            write_error,
            path,
            block_bytes,
            blocks,
        })
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn send(&self, job: Job) -> io::Result<()> {
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(job).ok())
            .ok_or_else(|| io::Error::other("the disk tier's worker has stopped"))
    }

    fn take_write_error(&self) -> io::Result<()> {
        match self.write_error.lock().map(|mut e| e.take()) {
            Ok(Some(e)) => Err(e),
            Ok(None) => Ok(()),
            Err(_) => Err(io::Error::other("the disk tier's worker panicked")),
        }
    }

    fn check(&self, slot: u32, len: usize) -> io::Result<()> {
        if slot as usize >= self.blocks || len != self.block_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "disk slot {slot} of {} / {len} bytes (blocks are {} bytes)",
                    self.blocks, self.block_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Queues a write of one block to `slot` and returns at once.
    pub fn write(&self, slot: u32, data: Vec<u8>) -> io::Result<()> {
        self.take_write_error()?;
        self.check(slot, data.len())?;
        self.send(Job::Write { slot, data })
    }

    /// Reads `slots` (after every write queued before this call) and waits for all of them.
    pub fn read_blocks(&self, slots: &[u32]) -> io::Result<Vec<Vec<u8>>> {
        self.take_write_error()?;
        for &slot in slots {
            self.check(slot, self.block_bytes)?;
        }
        let (reply, answers) = channel();
        for (index, &slot) in slots.iter().enumerate() {
            self.send(Job::Read {
                slot,
                index,
                reply: reply.clone(),
            })?;
        }
        drop(reply);
        let mut out = vec![Vec::new(); slots.len()];
        for _ in 0..slots.len() {
            let (i, r) = answers
                .recv()
                .map_err(|_| io::Error::other("the disk tier's worker stopped mid-read"))?;
            out[i] = r?;
        }
        self.take_write_error()?;
        Ok(out)
    }
}

fn worker(file: File, block_bytes: usize, rx: Receiver<Job>, errs: Arc<Mutex<Option<io::Error>>>) {
    for job in rx {
        match job {
            Job::Write { slot, data } => {
                if let Err(e) = file.write_all_at(&data, slot as u64 * block_bytes as u64)
                    && let Ok(mut first) = errs.lock()
                {
                    first.get_or_insert(e);
                }
            }
            Job::Read { slot, index, reply } => {
                let mut buf = vec![0u8; block_bytes];
                let r = file
                    .read_exact_at(&mut buf, slot as u64 * block_bytes as u64)
                    .map(|_| buf);
                // the reader may have given up after an earlier error
                let _ = reply.send((index, r));
            }
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // closing the channel ends the worker once it has drained its queue
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(seed: u8, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn blocks_read_back_what_was_written_last_and_the_file_goes_away() {
        let dir = std::env::temp_dir();
        let d = DiskTier::create(&dir, 4, 1000).unwrap();
        let path = d.path().to_path_buf();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4000);
        d.write(2, block(1, 1000)).unwrap();
        d.write(0, block(2, 1000)).unwrap();
        d.write(2, block(3, 1000)).unwrap(); // overwritten before the read: FIFO order
        let got = d.read_blocks(&[2, 0, 2]).unwrap();
        assert_eq!(got, vec![block(3, 1000), block(2, 1000), block(3, 1000)]);
        drop(d);
        assert!(!path.exists());
    }

    #[test]
    fn out_of_range_slots_and_wrong_sizes_are_errors() {
        let d = DiskTier::create(&std::env::temp_dir(), 2, 64).unwrap();
        assert!(d.write(2, vec![0; 64]).is_err());
        assert!(d.write(0, vec![0; 63]).is_err());
        assert!(d.read_blocks(&[5]).is_err());
        assert_eq!(d.read_blocks(&[]).unwrap(), Vec::<Vec<u8>>::new());
    }
}
