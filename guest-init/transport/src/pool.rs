//! The buffer pool the pump borrows from.
//!
//! A buffer is taken only while one chunk is in flight and returns here when dropped, so
//! a burst of thousands of mostly idle connections costs their sockets and task state,
//! not 2 x 64 KiB each (see [`crate::pump`]). The pool keeps at most [`POOL_KEEP`] free
//! buffers; more are freed, so memory goes back to the system after a burst of bulk
//! traffic.

use std::sync::Mutex;

/// Size of one pooled buffer: large enough for bulk transfers to run at memory speed,
/// and the largest single chunk the pump ever forwards.
pub const CHUNK: usize = 64 * 1024;

/// How many free buffers the pool keeps for reuse.
pub const POOL_KEEP: usize = 64;

static POOL: Mutex<Vec<Box<[u8]>>> = Mutex::new(Vec::new());

/// A buffer on loan from the pool; it returns there when dropped.
#[derive(Debug)]
pub struct PooledBuf {
    buf: Option<Box<[u8]>>,
    len: usize,
}

impl PooledBuf {
    /// Takes a free buffer from the pool, or allocates one.
    pub fn take() -> Self {
        let reused = POOL.lock().ok().and_then(|mut p| p.pop());
        PooledBuf {
            buf: Some(reused.unwrap_or_else(|| vec![0u8; CHUNK].into_boxed_slice())),
            len: 0,
        }
    }

    /// The whole buffer, to read into.
    pub fn spare_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().unwrap_or_default()
    }

    /// Records how many bytes the read filled.
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(CHUNK);
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf.as_deref().unwrap_or_default()[..self.len]
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let (Some(buf), Ok(mut pool)) = (self.buf.take(), POOL.lock()) {
            if pool.len() < POOL_KEEP {
                pool.push(buf);
            }
        }
    }
}

/// Number of free buffers in the pool now (for tests and diagnostics).
pub fn pooled_free() -> usize {
    POOL.lock().map(|p| p.len()).unwrap_or(0)
}
