//! Where the hashed n-gram (PLE) table lives: the file's memory map (no placement), a copy in locked RAM, or the
//! SSD, read a row at a time.
//!
//! A token's table rows depend only on the token and the ones before it ([`crate::model::ple::ngram_rows`]),
//! all known before the forward pass starts; so with the table on SSD the forward pass computes the rows first
//! and hands their reads to the I/O threads ([`NgramTable::fetch`]), runs the layers before the PLE layer
//! meanwhile, and only waits for the rows when the PLE layer needs them ([`NgramTable::gather`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, channel};

use crate::quant::Matrix;

use super::memory::AlignedBuf;
use super::reader::{ReadError, Span, WeightReader, read_span};
use super::ssd::IoPool;
use super::stats::PlacementStats;

/// Rows per I/O job: enough to amortise the queue, few enough to spread one token's 16 rows over the threads.
const ROWS_PER_JOB: usize = 4;

/// The table on SSD: where its rows start and how they decode.
pub(crate) struct SsdTable {
    /// Part and offset of row 0.
    pub(crate) base: Span,
    /// Bytes per row.
    pub(crate) row_bytes: usize,
    /// The mapped table (shape, type and kernels; its bytes are never touched).
    pub(crate) layout: Matrix,
    pub(crate) reader: Arc<dyn WeightReader>,
    pub(crate) io: Arc<IoPool>,
    pub(crate) stats: Arc<PlacementStats>,
}

/// The n-gram table as placed.
pub(crate) enum NgramTable {
    /// A copy in RAM (locked when permitted).
    Ram(Matrix),
    /// Read per row from SSD.
    Ssd(SsdTable),
}

/// Rows being read for one forward call.
pub(crate) enum RowFetch {
    /// The rows are in a RAM matrix: nothing to wait for.
    Ram,
    /// Reads in flight: `jobs` answers on `rx`, each `(first row index, bytes of its rows)`.
    Ssd { rx: Receiver<(usize, Result<Vec<u8>, ReadError>)>, jobs: usize, rows: usize, row_bytes: usize },
}

impl NgramTable {
    /// Starts reading `rows` (absolute table rows, in the order the PLE layer wants them).
    pub(crate) fn fetch(&self, rows: &[u64]) -> RowFetch {
        let NgramTable::Ssd(t) = self else { return RowFetch::Ram };
        let (tx, rx) = channel();
        let mut jobs = 0;
        for (j, chunk) in rows.chunks(ROWS_PER_JOB).enumerate() {
            let chunk = chunk.to_vec();
            let (tx, reader, stats) = (tx.clone(), t.reader.clone(), t.stats.clone());
            let (base, rb) = (t.base, t.row_bytes);
            let job = Box::new(move || {
                let out = read_rows(reader.as_ref(), base, rb, &chunk);
                match &out {
                    Ok(bytes) => {
                        stats.ngram_rows.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        stats.ngram_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    }
                    Err(_) => {
                        stats.ssd_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let _ = tx.send((j * ROWS_PER_JOB, out));
            });
            if let Err(job) = t.io.submit(job) {
                // The I/O threads are gone: read here rather than fail.
                job();
            }
            jobs += 1;
        }
        RowFetch::Ssd { rx, jobs, rows: rows.len(), row_bytes: t.row_bytes }
    }

    /// Decodes the fetched rows into `out` (`[rows.len(), cols]`), waiting for the reads when on SSD.
    ///
    /// Errors: a row read failed (the first failure, naming the file and offset).
    pub(crate) fn gather(&self, fetch: RowFetch, rows: &[u64], out: &mut [f32]) -> Result<(), ReadError> {
        match (self, fetch) {
            (NgramTable::Ram(m), _) => {
                let cols = m.cols();
                for (r, o) in rows.iter().zip(out.chunks_exact_mut(cols)) {
                    m.dequantize_row(*r as usize, o);
                }
                Ok(())
            }
            (NgramTable::Ssd(t), RowFetch::Ssd { rx, jobs, rows: n, row_bytes }) => {
                let mut bytes = vec![0u8; n * row_bytes];
                let mut first_error = None;
                for _ in 0..jobs {
                    match rx.recv() {
                        Ok((start, Ok(b))) => bytes[start * row_bytes..start * row_bytes + b.len()].copy_from_slice(&b),
                        Ok((_, Err(e))) => {
                            first_error.get_or_insert(e);
                        }
                        Err(_) => {
                            first_error.get_or_insert(ReadError {
                                file: t.reader.part_name(t.base.part),
                                offset: t.base.offset,
                                len: 0,
                                detail: "an n-gram row read was lost (the I/O thread stopped)".into(),
                            });
                        }
                    }
                }
                if let Some(e) = first_error {
                    return Err(e);
                }
                let cols = t.layout.cols();
                let dequantize = t.layout.kernels().dequantize_row;
                for (b, o) in bytes.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)) {
                    dequantize(b, o);
                }
                Ok(())
            }
            (NgramTable::Ssd(_), RowFetch::Ram) => {
                // Not fetched ahead: read now.
                let f = self.fetch(rows);
                self.gather(f, rows, out)
            }
        }
    }
}

/// Reads `rows` of `row_bytes` each, row 0 at `base`, one aligned read per row.
fn read_rows(reader: &dyn WeightReader, base: Span, row_bytes: usize, rows: &[u64]) -> Result<Vec<u8>, ReadError> {
    let mut out = Vec::with_capacity(rows.len() * row_bytes);
    let align = reader.alignment().max(1);
    let mut scratch = AlignedBuf::new(row_bytes + 2 * align).map_err(|e| ReadError {
        file: reader.part_name(base.part),
        offset: base.offset,
        len: row_bytes,
        detail: format!("no memory for a row buffer: {e}"),
    })?;
    for &r in rows {
        let span = Span { part: base.part, offset: base.offset + r * row_bytes as u64, len: row_bytes };
        let at = read_span(reader, span, scratch.as_mut_slice())?;
        out.extend_from_slice(&scratch.as_slice()[at]);
    }
    Ok(out)
}
