//! Blocking helpers over a queue handle, for tools, tests and start-up paths.
//! They allocate and wait; the IO hot path uses submit/poll directly.

use std::time::Duration;

use crate::device::{BlockDevice, Completion, QueueHandle, Request, SubmitErrorKind};
use crate::error::{Error, Result};

/// How long the blocking helpers wait for one command before giving up.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Submit `req` on a queue with nothing else in flight and wait for its completion.
/// Submit errors come back as the completion's result, with the buffer.
pub fn execute<Q: QueueHandle>(q: &mut Q, req: Request, timeout: Duration) -> Completion {
    assert_eq!(q.in_flight(), 0, "io::execute needs an idle queue");
    let (tag, op) = (req.tag, req.op);
    if let Err(e) = q.submit(req) {
        let result = match e.kind {
            SubmitErrorKind::Rejected(err) => Err(*err),
            SubmitErrorKind::QueueFull => unreachable!("an idle queue cannot be full"),
        };
        return Completion {
            tag,
            op,
            result,
            buf: e.request.buf,
        };
    }
    let mut out: [Completion; 1] = Default::default();
    match q.wait(&mut out, 1, timeout) {
        Ok(1) => std::mem::take(&mut out[0]),
        Ok(_) => unreachable!("wait returned without the one completion"),
        // The command is still in flight and owns its buffer; the caller gets no buffer back.
        Err(e) => Completion {
            tag,
            op,
            result: Err(e),
            buf: None,
        },
    }
}

/// Read `len` bytes at byte `offset` into a new Vec.
pub fn read_vec<D: BlockDevice>(
    dev: &D,
    q: &mut D::Queue,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>> {
    let (lba, blocks) = dev.geometry().blocks_for(dev.name(), offset, len as u64)?;
    let mut out = vec![0u8; len];
    let max = dev.geometry().max_transfer_bytes as usize;
    let bs = dev.geometry().block_size as u64;
    let mut buf = Some(dev.alloc_buf(len.min(max))?);
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(max);
        let at = lba + (done as u64 / bs);
        let req = Request::read(at, (n as u64 / bs) as u32, buf.take().unwrap(), 0, 0);
        let c = execute(q, req, IO_TIMEOUT);
        c.result?;
        let b = c.buf.expect("read completion returns its buffer");
        b.read_at(0, &mut out[done..done + n]);
        buf = Some(b);
        done += n;
    }
    debug_assert_eq!(blocks as u64 * bs, len as u64);
    Ok(out)
}

/// Write `data` at byte `offset` (both block aligned).
pub fn write_slice<D: BlockDevice>(
    dev: &D,
    q: &mut D::Queue,
    offset: u64,
    data: &[u8],
    fua: bool,
) -> Result<()> {
    let (lba, _) = dev
        .geometry()
        .blocks_for(dev.name(), offset, data.len() as u64)?;
    let max = dev.geometry().max_transfer_bytes as usize;
    let bs = dev.geometry().block_size as u64;
    let mut buf = Some(dev.alloc_buf(data.len().min(max))?);
    for (i, chunk) in data.chunks(max).enumerate() {
        let mut b = buf.take().unwrap();
        b.write_at(0, chunk);
        let at = lba + (i * max) as u64 / bs;
        let req = Request::write(at, (chunk.len() as u64 / bs) as u32, b, 0, fua, 0);
        let c = execute(q, req, IO_TIMEOUT);
        c.result?;
        buf = c.buf;
    }
    Ok(())
}

/// Flush the device's volatile cache.
pub fn flush<Q: QueueHandle>(q: &mut Q) -> Result<()> {
    execute(q, Request::flush(0), IO_TIMEOUT).result
}

/// Map an error-returning completion into a `Result` carrying the buffer.
pub fn into_result(c: Completion) -> Result<Option<crate::DmaBuf>, Error> {
    c.result.map(|()| c.buf)
}
